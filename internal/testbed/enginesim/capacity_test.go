package enginesim

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// testCapacity is an engine as fast as the machine allows, with 4-token
// blocks; tests slow down the part they look at.
func testCapacity(edit func(*Capacity)) *Capacity {
	c := Capacity{MaxRunning: 64, BlockTokens: 4, KVBlocks: 10000, PrefillTokensPerSec: 1e9}
	if edit != nil {
		edit(&c)
	}
	return &c
}

// tokensText is n simulator tokens (4 bytes each), distinct for each tag.
func tokensText(tag byte, n int) string {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "%c%03d", tag, i%1000)
	}
	return b.String()
}

// plain is a plain completion of prompt, generating maxTokens tokens.
func plain(prompt string, maxTokens int) body {
	return completionBody(prompt).with("max_tokens", maxTokens)
}

// timed posts and returns how long the answer took.
func timed(t *testing.T, s *Server, requestID string, b body) time.Duration {
	t.Helper()
	start := time.Now()
	post(t, s, pathFor(b), requestID, b).decode(t)
	return time.Since(start)
}

// requireIdle waits for s to run and queue nothing, and checks that the
// requests gone left no KV held.
func requireIdle(t *testing.T, s *Server) {
	t.Helper()
	require.Eventually(t, func() bool {
		u := s.Usage()
		return u.Running == 0 && u.Waiting == 0
	}, 10*time.Second, 5*time.Millisecond, "usage: %+v", s.Usage())
	m := s.load
	m.mu.Lock()
	defer m.mu.Unlock()
	require.Zero(t, m.cache.private, "private blocks held")
	for h, b := range m.cache.blocks {
		require.Zero(t, b.refs, "block %x pinned", h)
		require.NotNil(t, b.elem, "block %x not in the LRU list", h)
	}
	require.Equal(t, len(m.cache.blocks), m.cache.lru.Len())
	require.Empty(t, m.prefillQ)
	require.Empty(t, m.decodeQ)
}

func TestPrefixCacheShortensPrefill(t *testing.T) {
	const tokens = 100
	const perToken = 2 * time.Millisecond
	first := tokensText('a', tokens)
	tests := []struct {
		name     string
		second   string
		wantHits int // tokens
	}{
		// vLLM computes the last prompt token whatever the cache holds.
		{"identical prompt", first, (tokens - 1) / 4 * 4},
		{"shared prefix", first[:60*4] + tokensText('b', 40), 60},
		{"prefix ends mid-block", first[:62*4] + tokensText('b', 38), 60},
		{"no common prefix", tokensText('b', tokens), 0},
	}
	legs := []struct {
		name string
		role Role
		run  func(t *testing.T, s *Server, id, prompt string) time.Duration
	}{
		{"plain request", RoleBoth, func(t *testing.T, s *Server, id, prompt string) time.Duration {
			return timed(t, s, id, plain(prompt, 1))
		}},
		{"nixl prefill leg", RolePrefill, func(t *testing.T, s *Server, id, prompt string) time.Duration {
			return timed(t, s, id, completionBody(prompt).asPrefill())
		}},
	}
	for _, leg := range legs {
		for _, tt := range tests {
			t.Run(leg.name+"/"+tt.name, func(t *testing.T) {
				s := startSim(t, Config{Role: leg.role, Capacity: testCapacity(func(c *Capacity) {
					c.PrefillTokensPerSec = float64(time.Second / perToken)
				})})
				d1 := leg.run(t, s, "req-1", first)
				u1 := s.Usage()
				require.EqualValues(t, tokens, u1.PrefixQueryTokens)
				require.Zero(t, u1.PrefixHitTokens)
				require.EqualValues(t, tokens, u1.PrefillTokens)
				require.GreaterOrEqual(t, d1, tokens*perToken)

				d2 := leg.run(t, s, "req-2", tt.second)
				u2 := s.Usage()
				require.EqualValues(t, 2*tokens, u2.PrefixQueryTokens)
				require.EqualValues(t, tt.wantHits, u2.PrefixHitTokens)
				require.EqualValues(t, 2*tokens-tt.wantHits, u2.PrefillTokens)
				require.EqualValues(t, 2, u2.Prefills)
				require.GreaterOrEqual(t, d2, time.Duration(tokens-tt.wantHits)*perToken)
				if tokens-tt.wantHits <= tokens/10 {
					require.Less(t, d2, d1/2, "a prompt mostly cached prefills faster")
				}
				require.GreaterOrEqual(t, u2.PrefillBusy, d1/2+time.Duration(tokens-tt.wantHits)*perToken/2,
					"PrefillBusy adds up the prefills")
				requireIdle(t, s)
			})
		}
	}
}

func TestPrefixCacheLRU(t *testing.T) {
	type step struct {
		op     string // "insert", "pin", "unpin", "match", "fits"
		hashes []uint64
		n      int  // private blocks (pin, unpin, fits) or wanted match length
		want   bool // fits
	}
	tests := []struct {
		name      string
		capacity  int
		steps     []step
		wantUsed  int
		wantEvict int64
	}{
		{
			name: "least recently used prompt goes first, its tail before its head", capacity: 4,
			steps: []step{
				{op: "insert", hashes: []uint64{1, 2}},
				{op: "insert", hashes: []uint64{3, 4}},
				{op: "insert", hashes: []uint64{5}},
				{op: "match", hashes: []uint64{1, 2}, n: 1},
				{op: "match", hashes: []uint64{3, 4}, n: 2},
				{op: "insert", hashes: []uint64{6}},
				{op: "match", hashes: []uint64{1}, n: 0},
			},
			wantUsed: 4, wantEvict: 2,
		},
		{
			name: "a lookup's reuse makes a prompt recent", capacity: 4,
			steps: []step{
				{op: "insert", hashes: []uint64{1, 2}},
				{op: "insert", hashes: []uint64{3, 4}},
				{op: "insert", hashes: []uint64{1, 2}},
				{op: "insert", hashes: []uint64{5, 6}},
				{op: "match", hashes: []uint64{1, 2}, n: 2},
				{op: "match", hashes: []uint64{3}, n: 0},
			},
			wantUsed: 4, wantEvict: 2,
		},
		{
			name: "pinned blocks are not evicted", capacity: 4,
			steps: []step{
				{op: "pin", hashes: []uint64{1, 2}},
				{op: "insert", hashes: []uint64{3, 4}},
				{op: "insert", hashes: []uint64{5, 6}},
				{op: "match", hashes: []uint64{1, 2}, n: 2},
				{op: "match", hashes: []uint64{3}, n: 0},
				{op: "match", hashes: []uint64{5, 6}, n: 2},
			},
			wantUsed: 4, wantEvict: 2,
		},
		{
			name: "a cache full of pinned blocks caches no more", capacity: 2,
			steps: []step{
				{op: "pin", hashes: []uint64{1}, n: 1},
				{op: "insert", hashes: []uint64{3, 4}},
				{op: "match", hashes: []uint64{3}, n: 0},
				{op: "unpin", hashes: []uint64{1}, n: 1},
				{op: "insert", hashes: []uint64{3, 4}},
				{op: "match", hashes: []uint64{3, 4}, n: 2},
			},
			wantUsed: 2, wantEvict: 1,
		},
		{
			name: "fits counts evictable blocks, not pinned ones", capacity: 4,
			steps: []step{
				{op: "insert", hashes: []uint64{1, 2, 3, 4}},
				{op: "fits", hashes: []uint64{9}, n: 3, want: true},
				// Pinning 1 keeps it from eviction: 3 blocks can go.
				{op: "fits", hashes: []uint64{1, 9}, n: 2, want: true},
				{op: "fits", hashes: []uint64{1, 9}, n: 3, want: false},
				{op: "fits", hashes: []uint64{9}, n: 4, want: false},
				{op: "pin", hashes: []uint64{1}},
				{op: "fits", hashes: []uint64{9}, n: 3, want: false},
				{op: "fits", hashes: []uint64{9}, n: 2, want: true},
			},
			wantUsed: 4,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newPrefixCache(tt.capacity)
			for i, st := range tt.steps {
				switch st.op {
				case "insert":
					c.insert(st.hashes, nil)
				case "pin":
					c.pin(st.hashes, nil, st.n)
				case "unpin":
					c.unpin(st.hashes, st.n)
				case "match":
					require.Equal(t, st.n, c.match(st.hashes), "step %d", i)
				case "fits":
					require.Equal(t, st.want, c.fits(st.hashes, st.n), "step %d", i)
				}
				require.LessOrEqual(t, c.used(), tt.capacity, "step %d", i)
			}
			require.Equal(t, tt.wantUsed, c.used())
			require.Equal(t, tt.wantEvict, c.evictions)
		})
	}
}

func TestPrefixCacheEvictsAtCapacity(t *testing.T) {
	// Four prompts of 4 blocks in a cache of 10: the oldest is gone, the
	// latest is still there.
	s := startSim(t, Config{Capacity: testCapacity(func(c *Capacity) { c.KVBlocks = 10 })})
	prompts := []string{tokensText('a', 16), tokensText('b', 16), tokensText('c', 16), tokensText('d', 16)}
	for i, p := range prompts {
		timed(t, s, "req-"+itoa(i), plain(p, 1))
	}
	u := s.Usage()
	require.Zero(t, u.PrefixHitTokens)
	require.Positive(t, u.Evictions)
	require.Zero(t, u.KVUsage, "cached blocks no request holds count as free, as in vLLM's block pool")

	timed(t, s, "latest", plain(prompts[3], 1))
	require.EqualValues(t, 12, s.Usage().PrefixHitTokens, "the latest prompt hits but for its last block")
	timed(t, s, "oldest", plain(prompts[0], 1))
	require.EqualValues(t, 12, s.Usage().PrefixHitTokens, "the oldest prompt was evicted")
	requireIdle(t, s)
}

// metricValue scrapes s and returns the value of the metric name (with any
// labels), failing if it is absent.
func metricValue(t *testing.T, s *Server, name string) float64 {
	t.Helper()
	fams := scrape(t, s, "/metrics")
	f, ok := fams[name]
	require.True(t, ok, "metric %s missing", name)
	require.Len(t, f.GetMetric(), 1)
	m := f.GetMetric()[0]
	if g := m.GetGauge(); g != nil {
		return g.GetValue()
	}
	return m.GetCounter().GetValue()
}

// requireGauges waits until the running and waiting gauges read want.
func requireGauges(t *testing.T, s *Server, runningName, waitingName string, running, waiting int) {
	t.Helper()
	require.Eventually(t, func() bool {
		return metricValue(t, s, runningName) == float64(running) && metricValue(t, s, waitingName) == float64(waiting)
	}, 10*time.Second, 5*time.Millisecond, "want %s %d and %s %d, usage %+v", runningName, running, waitingName, waiting, s.Usage())
}

func TestPrefillFIFOQueues(t *testing.T) {
	// Each prompt takes a second to prefill: one runs, the others wait.
	s := startSim(t, Config{Capacity: testCapacity(func(c *Capacity) { c.PrefillTokensPerSec = 100 })})
	ctx, cancel := context.WithCancel(t.Context())
	var replies []<-chan asyncReply
	for i := range 3 {
		replies = append(replies, goPostCtx(t, ctx, s, "/v1/completions", "req-"+itoa(i), plain(tokensText(byte('a'+i), 100), 1)))
	}
	requireGauges(t, s, "vllm:num_requests_running", "vllm:num_requests_waiting", 1, 2)
	require.Equal(t, 2, s.Usage().PeakWaiting)
	require.Positive(t, metricValue(t, s, "vllm:kv_cache_usage_perc"), "the running prefill holds blocks")
	cancel()
	for _, r := range replies {
		<-r
	}
	requireIdle(t, s)
	requireGauges(t, s, "vllm:num_requests_running", "vllm:num_requests_waiting", 0, 0)
}

// TestPrefillSlots: with two prefill slots two prompts compute at once,
// each as fast as alone, and a third waits for a slot; the busy time
// counts each slot's share.
func TestPrefillSlots(t *testing.T) {
	const perToken = 10 * time.Millisecond // a 100-token prompt takes a second
	s := startSim(t, Config{Role: RolePrefill, Capacity: testCapacity(func(c *Capacity) {
		c.PrefillTokensPerSec = float64(time.Second / perToken)
		c.PrefillSlots = 2
	})})
	ctx, cancel := context.WithCancel(t.Context())
	var replies []<-chan asyncReply
	for i := range 3 {
		replies = append(replies, goPostCtx(t, ctx, s, "/v1/completions", "req-"+itoa(i), completionBody(tokensText(byte('a'+i), 100)).asPrefill()))
		if i < 2 {
			requireGauges(t, s, "vllm:num_requests_running", "vllm:num_requests_waiting", i+1, 0)
		}
	}
	requireGauges(t, s, "vllm:num_requests_running", "vllm:num_requests_waiting", 2, 1)
	// The queued prompt takes the first slot free, the next prompt the
	// other: it waits for about a running prompt's rest, not two prompts.
	f := s.ForecastPrefill(tokensText('z', 10))
	require.LessOrEqual(t, f.Wait, 100*perToken)
	require.Positive(t, f.Wait)
	require.Equal(t, 10*perToken, f.Compute)
	cancel()
	for _, r := range replies {
		<-r
	}
	requireIdle(t, s)

	// One 50 ms prompt on two slots keeps the engine half busy.
	busy := s.Usage().PrefillBusy
	took := timed(t, s, "alone", completionBody(tokensText('y', 5)).asPrefill())
	got := s.Usage().PrefillBusy - busy
	require.GreaterOrEqual(t, got, 5*perToken/2)
	require.Less(t, got, took)
}

func TestSlotClock(t *testing.T) {
	t0 := time.Unix(1000, 0)
	var c slotClock
	c.update(1, t0)
	c.update(2, t0.Add(time.Second))
	require.Equal(t, 3*time.Second, c.total(t0.Add(2*time.Second)), "a slot for 1 s, then two for 1 s")
	c.update(0, t0.Add(3*time.Second))
	require.Equal(t, 5*time.Second, c.total(t0.Add(10*time.Second)))
}

func TestDecodeBatchLimit(t *testing.T) {
	tests := []struct {
		connector        string
		running, waiting string
	}{
		{ConnectorNIXL, "vllm:num_requests_running", "vllm:num_requests_waiting"},
		{ConnectorSGLang, "sglang:num_running_reqs", "sglang:num_queue_reqs"},
		{ConnectorTRTLLM, "trtllm_num_requests_running", "trtllm_num_requests_waiting"},
	}
	for _, tt := range tests {
		t.Run(tt.connector, func(t *testing.T) {
			s := startSim(t, Config{Connector: tt.connector, DisconnectCheckInterval: 5 * time.Millisecond,
				Capacity: testCapacity(func(c *Capacity) {
					c.MaxRunning = 2
					c.DecodeStep = 20 * time.Millisecond
				})})
			ctx, cancel := context.WithCancel(t.Context())
			var replies []<-chan asyncReply
			for i := range 3 {
				replies = append(replies, goPostCtx(t, ctx, s, "/v1/completions", "req-"+itoa(i), plain(tokensText(byte('a'+i), 8), 500)))
			}
			// The third sequence waits for a place in the batch.
			requireGauges(t, s, tt.running, tt.waiting, 2, 1)
			cancel()
			for _, r := range replies {
				<-r
			}
			requireIdle(t, s)
			requireGauges(t, s, tt.running, tt.waiting, 0, 0)
		})
	}
}

func TestDecodeWaitsForKV(t *testing.T) {
	// A sequence needs 1 + 8 blocks (prompt and output) of the 12: a second
	// one waits although the batch has places.
	s := startSim(t, Config{Capacity: testCapacity(func(c *Capacity) {
		c.KVBlocks = 12
		c.DecodeStep = 20 * time.Millisecond
	})})
	ctx, cancel := context.WithCancel(t.Context())
	a := goPostCtx(t, ctx, s, "/v1/completions", "a", plain(tokensText('a', 4), 32))
	requireGauges(t, s, "vllm:num_requests_running", "vllm:num_requests_waiting", 1, 0)
	b := goPostCtx(t, ctx, s, "/v1/completions", "b", plain(tokensText('b', 4), 32))
	requireGauges(t, s, "vllm:num_requests_running", "vllm:num_requests_waiting", 1, 1)
	r := await(t, a)
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	require.Equal(t, http.StatusOK, await(t, b).status, "the second runs once the first is done")
	cancel()
	requireIdle(t, s)
}

func TestDecodeStepGrowsWithBatch(t *testing.T) {
	const steps = 20
	s := startSim(t, Config{Capacity: testCapacity(func(c *Capacity) {
		c.DecodeStep = 2 * time.Millisecond
		c.DecodeStepPerSeq = 30 * time.Millisecond
	})})
	// The first token comes with the prefill; steps tokens follow.
	solo := timed(t, s, "solo", plain(tokensText('s', 8), steps+1))
	require.GreaterOrEqual(t, solo, steps*2*time.Millisecond)

	const batch = 4
	start := time.Now()
	var replies []<-chan asyncReply
	for i := range batch {
		replies = append(replies, goPost(t, s, "/v1/completions", "b-"+itoa(i), plain(tokensText(byte('a'+i), 8), steps+1)))
	}
	for _, r := range replies {
		require.Equal(t, http.StatusOK, await(t, r).status)
	}
	together := time.Since(start)
	// At 4 running a step takes 2 + 3 × 30 ms, 46 times the solo step.
	require.Greater(t, together, 5*solo, "solo %v, batch of %d %v", solo, batch, together)
	require.GreaterOrEqual(t, s.Usage().PeakRunning, 2)
	require.EqualValues(t, (batch+1)*steps, s.Usage().DecodeTokens)
	requireIdle(t, s)
}

func TestDecodeStreamsAtStepTime(t *testing.T) {
	s := startSim(t, Config{Capacity: testCapacity(func(c *Capacity) { c.DecodeStep = 10 * time.Millisecond })})
	start := time.Now()
	r := post(t, s, "/v1/completions", "req-1", plain(tokensText('a', 8), 11).streaming(true))
	require.GreaterOrEqual(t, time.Since(start), 100*time.Millisecond)
	text, finish := sseText(t, r)
	require.Equal(t, "length", finish)
	require.True(t, strings.HasSuffix(text, " t10"), text)
	requireIdle(t, s)
}

func TestKVPullTimeFollowsUncachedBlocks(t *testing.T) {
	const perBlock = 4 * time.Millisecond
	p := startSim(t, Config{Role: RolePrefill, Capacity: testCapacity(nil)})
	d := startSim(t, Config{Role: RoleDecode, Capacity: testCapacity(func(c *Capacity) { c.KVPullPerBlock = perBlock })})
	a := tokensText('a', 120) // 30 blocks
	tests := []struct {
		name       string
		prompt     string
		wantPulled int64
	}{
		{"nothing cached pulls every block", a, 30},
		// A local hit never covers the last prompt token.
		{"the same prompt again pulls its last block", a, 1},
		{"a shared prefix pulls the rest", a[:80*4] + tokensText('b', 40), 10},
		{"a partial last block is pulled too", tokensText('c', 41), 11},
	}
	var first time.Duration
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			id := "req-" + itoa(i)
			b := completionBody(tt.prompt).with("max_tokens", 2)
			kv := prefill(t, p, id, b)
			before := d.Usage().PulledBlocks
			took := timed(t, d, id, b.with("kv_transfer_params", kv))
			require.Equal(t, tt.wantPulled, d.Usage().PulledBlocks-before)
			require.GreaterOrEqual(t, took, time.Duration(tt.wantPulled)*perBlock)
			require.Equal(t, KVPulled, lastRecord(t, d).KV)
			if i == 0 {
				first = took
			}
			if tt.wantPulled == 1 {
				require.Less(t, took, first/2)
			}
		})
	}
	requireIdle(t, p)
	requireIdle(t, d)
}

func TestClientAbortFreesItsPlace(t *testing.T) {
	slow := func(c *Capacity) {
		c.MaxRunning = 1
		c.PrefillTokensPerSec = 50 // a 100-token prompt takes 2 s
		c.DecodeStep = 50 * time.Millisecond
		c.KVPullPerBlock = 100 * time.Millisecond
	}
	tests := []struct {
		name string
		// start sends a request that is held where the test looks and
		// returns how to see it there.
		start func(t *testing.T, s *Server, ctx context.Context, id string) <-chan asyncReply
		// prefill, when set, serves the prefills of a decode engine.
		prefill bool
	}{
		{"waiting for and in the prefill server", func(t *testing.T, s *Server, ctx context.Context, id string) <-chan asyncReply {
			return goPostCtx(t, ctx, s, "/v1/completions", id, plain(tokensText(id[0], 100), 1))
		}, false},
		{"waiting for and in the decode batch", func(t *testing.T, s *Server, ctx context.Context, id string) <-chan asyncReply {
			return goPostCtx(t, ctx, s, "/v1/completions", id, plain(tokensText(id[0], 1), 1000))
		}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := startSim(t, Config{Capacity: testCapacity(slow)})
			ctxA, cancelA := context.WithCancel(t.Context())
			defer cancelA()
			ctxB, cancelB := context.WithCancel(t.Context())
			defer cancelB()
			a := tt.start(t, s, ctxA, "a")
			requireGauges(t, s, "vllm:num_requests_running", "vllm:num_requests_waiting", 1, 0)
			b := tt.start(t, s, ctxB, "b")
			requireGauges(t, s, "vllm:num_requests_running", "vllm:num_requests_waiting", 1, 1)
			cancelB()
			<-b
			requireGauges(t, s, "vllm:num_requests_running", "vllm:num_requests_waiting", 1, 0)
			cancelA()
			<-a
			requireIdle(t, s)
			// Each reply is the client's own cancellation; the handlers
			// record after their requests leave the queues.
			require.Eventually(t, func() bool { return len(s.Records()) == 2 }, 10*time.Second, 5*time.Millisecond)
			recs := s.Records()
			for _, rec := range recs {
				require.Equal(t, statusClientGone, rec.Status)
			}
			// The places are free: a short request goes through.
			timed(t, s, "c", plain("c", 1))
			requireIdle(t, s)
		})
	}

	t.Run("in the KV pull", func(t *testing.T) {
		p := startSim(t, Config{Role: RolePrefill, Capacity: testCapacity(nil)})
		d := startSim(t, Config{Role: RoleDecode, Capacity: testCapacity(slow)})
		b := completionBody(tokensText('a', 100)).with("max_tokens", 2)
		kv := prefill(t, p, "a", b)
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		r := goPostCtx(t, ctx, d, "/v1/completions", "a", b.with("kv_transfer_params", kv))
		requireGauges(t, d, "vllm:num_requests_running", "vllm:num_requests_waiting", 0, 1)
		cancel()
		<-r
		requireIdle(t, d)
		// The client's reply is its own cancellation, and the request
		// leaves the queue before its handler records it.
		require.Eventually(t, func() bool { return len(d.Records()) > 0 }, 10*time.Second, 5*time.Millisecond)
		require.Equal(t, statusClientGone, lastRecord(t, d).Status)
	})
}

func TestReferenceCapacity(t *testing.T) {
	tests := []struct {
		name                  string
		tokenScale, timeScale float64
		wantBlock, wantKV     int
	}{
		{"unscaled", 1, 1, 16, 27000},
		{"time only", 1, 0.1, 16, 27000},
		{"tokens divided by 16", 16, 1, 1, 27000},
		{"tokens divided by 4, ten times faster", 4, 0.1, 4, 27000},
		{"tokens divided by 100", 100, 1, 1, 4320},
		{"non-positive scales count as 1", 0, -1, 16, 27000},
	}
	ref := ReferenceCapacity(1, 1)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := ReferenceCapacity(tt.tokenScale, tt.timeScale)
			require.NoError(t, c.validate())
			require.Equal(t, tt.wantBlock, c.BlockTokens)
			require.Equal(t, tt.wantKV, c.KVBlocks)
			require.Equal(t, 1024, c.MaxRunning)
			ts, ms := tt.tokenScale, tt.timeScale
			if ts <= 0 {
				ts = 1
			}
			if ms <= 0 {
				ms = 1
			}
			// A scaled workload takes timeScale times the real time.
			const realPrompt, realOutput = 16000.0, 1600.0
			want := realPrompt / ref.PrefillTokensPerSec * ms
			require.InEpsilon(t, want, realPrompt/ts/c.PrefillTokensPerSec, 1e-9)
			require.InEpsilon(t, float64(ref.DecodeStep)*realOutput*ms, float64(c.DecodeStep)*realOutput/ts, 1e-6)
			realBlocks := realPrompt / 16
			scaledBlocks := realPrompt / ts / float64(c.BlockTokens)
			require.InEpsilon(t, float64(ref.KVPullPerBlock)*realBlocks*ms, float64(c.KVPullPerBlock)*scaledBlocks, 1e-6)
			require.InEpsilon(t, float64(ref.PrefillOverhead)*ms, float64(c.PrefillOverhead), 1e-6)

			// The step budget is tokens per step, and a scaled step stands
			// for tokenScale real ones: it is not scaled, so that a prompt
			// computed beside a batch also takes timeScale times as long.
			require.Equal(t, 8192, c.MaxBatchedTokens)
			const batch = 32
			refLoad, scaledLoad := newEngineLoad(&ref, nil), newEngineLoad(&c, nil)
			want = float64(refLoad.promptTime(0, realPrompt, batch, true)) * ms
			require.InEpsilon(t, want, float64(scaledLoad.promptTime(0, int(realPrompt/ts), batch, true)), 1e-6)
			require.Greater(t, refLoad.promptTime(0, realPrompt, batch, true), refLoad.promptTime(0, realPrompt, 0, true), "a batch slows the prompt down")
		})
	}
	// The reference figures themselves.
	require.Equal(t, 15000.0, ref.PrefillTokensPerSec)
	require.Equal(t, 8*time.Millisecond, ref.DecodeStep)
	require.Equal(t, 50*time.Microsecond, ref.KVPullPerBlock)
	require.Equal(t, 8192, ref.MaxBatchedTokens)
}

func TestCapacityValidation(t *testing.T) {
	tests := []struct {
		name string
		edit func(*Capacity)
		want string
	}{
		{"no batch", func(c *Capacity) { c.MaxRunning = 0 }, "MaxRunning"},
		{"no block size", func(c *Capacity) { c.BlockTokens = 0 }, "BlockTokens"},
		{"no KV", func(c *Capacity) { c.KVBlocks = 0 }, "KVBlocks"},
		{"no prefill rate", func(c *Capacity) { c.PrefillTokensPerSec = 0 }, "PrefillTokensPerSec"},
		{"negative step", func(c *Capacity) { c.DecodeStep = -1 }, "DecodeStep"},
		{"negative step budget", func(c *Capacity) { c.MaxBatchedTokens = -1 }, "MaxBatchedTokens"},
		{"negative prefill slots", func(c *Capacity) { c.PrefillSlots = -1 }, "PrefillSlots"},
		{"prefill slots and a step budget", func(c *Capacity) { c.PrefillSlots, c.MaxBatchedTokens = 2, 8192 }, "needs MaxBatchedTokens 0"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Start(t.Context(), "127.0.0.1:0", Config{Capacity: testCapacity(tt.edit)})
			require.ErrorContains(t, err, tt.want)
		})
	}
}

func TestUsageWithoutCapacity(t *testing.T) {
	s := startSim(t, Config{PrefillLatency: 20 * time.Millisecond})
	timed(t, s, "req-1", plain(tokensText('a', 10), 2))
	u := s.Usage()
	require.EqualValues(t, 1, u.Prefills)
	require.EqualValues(t, 10, u.PrefixQueryTokens)
	require.Zero(t, u.PrefixHitTokens)
	require.GreaterOrEqual(t, u.PrefillBusy, 20*time.Millisecond)
	require.Equal(t, 1, u.PeakRunning)
	require.Zero(t, u.KVUsage)
	require.Zero(t, u.Running)
}

func TestBlockHashesChain(t *testing.T) {
	a, b := tokensText('a', 4), tokensText('b', 4)
	tests := []struct {
		name      string
		x, y      string
		wantShare int // leading blocks with equal hashes
	}{
		{"equal prompts", a + b, a + b, 2},
		{"equal first block", a + b, a + a, 1},
		// The same block after another prefix is another block.
		{"equal block at another position", a + b, b + b, 0},
		{"partial blocks are not hashed", a + "xy", a + "zw", 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x, y := blocksOf(tt.x, 4), blocksOf(tt.y, 4)
			c := newPrefixCache(100)
			c.insert(x.hashes, nil)
			require.Equal(t, tt.wantShare, c.match(y.hashes))
			require.Equal(t, x.hashes, blocksOf(tt.x, 4).hashes, "hashes are deterministic")
		})
	}
	p := blocksOf(a+b+"xy", 4)
	require.Equal(t, 9, p.tokens)
	require.Len(t, p.hashes, 2)
	require.Equal(t, 3, p.blocks)
}
