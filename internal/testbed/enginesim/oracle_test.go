package enginesim

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestForecastPrefillIdle: on an idle engine a prompt waits for nothing
// and computes its uncached tokens; what the cache holds counts, and
// forecasting counts no prefix-cache query.
func TestForecastPrefillIdle(t *testing.T) {
	const perToken = time.Millisecond
	const overhead = 5 * time.Millisecond
	a := tokensText('a', 100)
	tests := []struct {
		name       string
		prompt     string
		wantCached int // tokens
	}{
		{"nothing shared", tokensText('z', 100), 0},
		{"a shared prefix", a[:60*4] + tokensText('b', 40), 60},
		{"the cached prompt again: its last token is computed", a, 96},
	}
	s := startSim(t, Config{Role: RolePrefill, Capacity: testCapacity(func(c *Capacity) {
		c.PrefillTokensPerSec = float64(time.Second / perToken)
		c.PrefillOverhead = overhead
	})})
	require.Equal(t, PrefillForecast{PromptTokens: 100, Compute: overhead + 100*perToken}, s.ForecastPrefill(a), "empty cache")
	post(t, s, "/v1/completions", "warm", completionBody(a).asPrefill()).decode(t)
	requireIdle(t, s)
	queries := s.Usage().PrefixQueryTokens
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := s.ForecastPrefill(tt.prompt)
			require.Equal(t, PrefillForecast{CachedTokens: tt.wantCached, PromptTokens: 100, Compute: overhead + time.Duration(100-tt.wantCached)*perToken}, f)
			require.Equal(t, f.Compute, f.TTFT())
			require.Equal(t, tt.wantCached, s.CachedPrefixTokens(tt.prompt))
		})
	}
	require.Equal(t, queries, s.Usage().PrefixQueryTokens, "forecasts are not prefix-cache queries")
}

// TestForecastPrefillQueue: a prompt waits for the rest of the prefill
// being computed and for the queued ones, each needing only what the
// prompts ahead of it leave uncached; it finds cached what they compute.
func TestForecastPrefillQueue(t *testing.T) {
	const perToken = 5 * time.Millisecond
	const overhead = 2 * time.Millisecond
	s := startSim(t, Config{Role: RolePrefill, Capacity: testCapacity(func(c *Capacity) {
		c.PrefillTokensPerSec = float64(time.Second / perToken)
		c.PrefillOverhead = overhead
	})})
	running := tokensText('x', 200)                // 1 s
	queued := running[:192*4] + tokensText('y', 8) // 8 tokens after running's: 40 ms
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	r1 := goPostCtx(t, ctx, s, "/v1/completions", "running", completionBody(running).asPrefill())
	requireGauges(t, s, "vllm:num_requests_running", "vllm:num_requests_waiting", 1, 0)
	r2 := goPostCtx(t, ctx, s, "/v1/completions", "queued", completionBody(queued).asPrefill())
	requireGauges(t, s, "vllm:num_requests_running", "vllm:num_requests_waiting", 1, 1)

	f := s.ForecastPrefill(queued)
	queuedWork := overhead + 8*perToken
	require.GreaterOrEqual(t, f.Wait, queuedWork, "the queued prompt's own work, its prefix computed ahead of it")
	require.LessOrEqual(t, f.Wait, queuedWork+overhead+200*perToken, "and at most the whole running prefill")
	require.Equal(t, 196, f.CachedTokens, "the queued prompt computes every block but the one holding the last token")
	require.Equal(t, overhead+4*perToken, f.Compute)
	require.Zero(t, s.CachedPrefixTokens(queued), "nothing is cached yet")

	later := s.ForecastPrefill(tokensText('z', 4))
	require.Less(t, later.Wait, f.Wait, "the running prefill's rest shrinks")
	cancel()
	<-r1
	<-r2
	requireIdle(t, s)
	require.Equal(t, PrefillForecast{PromptTokens: 4, Compute: overhead + 4*perToken}, s.ForecastPrefill(tokensText('z', 4)))
}

// TestPrefillArrivals: the channel closes when the next prompt enters the
// prefill queue, and the count moves on.
func TestPrefillArrivals(t *testing.T) {
	s := startSim(t, Config{Role: RolePrefill, Capacity: testCapacity(nil)})
	n, next := s.PrefillArrivals()
	require.Zero(t, n)
	select {
	case <-next:
		t.Fatal("closed before any prompt arrived")
	default:
	}
	r := goPost(t, s, "/v1/completions", "one", completionBody(tokensText('a', 8)).asPrefill())
	select {
	case <-next:
	case <-time.After(10 * time.Second):
		t.Fatal("no arrival signalled")
	}
	require.Equal(t, http.StatusOK, await(t, r).status)
	n, _ = s.PrefillArrivals()
	require.EqualValues(t, 1, n)
}

// TestObservePrefills: the observer hears each prefill leg's prompt
// before the engine queues it (its forecast then is an idle engine's for
// a prompt it does not hold), and nothing once removed.
func TestObservePrefills(t *testing.T) {
	const perToken = time.Millisecond
	s := startSim(t, Config{Role: RolePrefill, Capacity: testCapacity(func(c *Capacity) { c.PrefillTokensPerSec = 1000 })})
	prompt := tokensText('a', 8)
	var (
		mu       sync.Mutex
		observed []string
		seen     []PrefillForecast
	)
	s.ObservePrefills(func(p string) {
		f := s.ForecastPrefill(p)
		mu.Lock()
		defer mu.Unlock()
		observed, seen = append(observed, p), append(seen, f)
	})
	require.Equal(t, http.StatusOK, await(t, goPost(t, s, "/v1/completions", "one", completionBody(prompt).asPrefill())).status)
	s.ObservePrefills(nil)
	require.Equal(t, http.StatusOK, await(t, goPost(t, s, "/v1/completions", "two", completionBody(prompt).asPrefill())).status)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []string{prompt}, observed)
	require.Equal(t, []PrefillForecast{{PromptTokens: 8, Compute: 8 * perToken}}, seen)
}

// TestForecastDecode: a sequence pulls the blocks the decode engine's
// cache lacks, steps with the batch it joins, and fits unless the KV it
// needs is held by others.
func TestForecastDecode(t *testing.T) {
	const perBlock = time.Millisecond
	const step, perSeq = 20 * time.Millisecond, 10 * time.Millisecond
	d := startSim(t, Config{Role: RoleDecode, Capacity: testCapacity(func(c *Capacity) {
		c.KVPullPerBlock = perBlock
		c.DecodeStep, c.DecodeStepPerSeq = step, perSeq
		c.KVBlocks = 60
	})})
	a := tokensText('a', 120) // 30 blocks
	require.Equal(t, DecodeForecast{Pull: 30 * perBlock, Step: step, Fits: true}, d.ForecastDecode(a, 8), "idle, empty cache")

	// A plain request computes a's blocks on the decode engine: a later
	// pull of a reads only the block holding its last token.
	post(t, d, "/v1/completions", "warm", plain(a, 1)).decode(t)
	requireIdle(t, d)
	require.Equal(t, DecodeForecast{CachedTokens: 116, Pull: perBlock, Step: step, Fits: true}, d.ForecastDecode(a, 8))

	// A long sequence of 40 blocks (8 prompt, 32 output) runs: the next
	// step is slower, and a sequence of 30 more blocks no longer fits in
	// the 60 (a's cached blocks are evictable but b's own 30 are not).
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	long := goPostCtx(t, ctx, d, "/v1/completions", "long", plain(tokensText('l', 32), 128))
	requireGauges(t, d, "vllm:num_requests_running", "vllm:num_requests_waiting", 1, 0)
	f := d.ForecastDecode(tokensText('b', 120), 1)
	require.Equal(t, 1, f.Running)
	require.Equal(t, step+perSeq, f.Step)
	require.False(t, f.Fits, "%+v", f)
	require.True(t, d.ForecastDecode(tokensText('c', 8), 1).Fits, "a short one fits")
	cancel()
	<-long
	requireIdle(t, d)
}

// TestForecastWithoutCapacity: an engine of fixed latencies has no queue
// or cache to forecast from.
func TestForecastWithoutCapacity(t *testing.T) {
	s := startSim(t, Config{})
	require.Zero(t, s.ForecastPrefill("abcd"))
	require.Zero(t, s.ForecastDecode("abcd", 4))
	require.Zero(t, s.CachedPrefixTokens("abcd"))
}

// TestForecastPlain: a plain request on a decode engine computes what its
// cache lacks on the engine's own prefill server, in chunks riding the
// steps of the sequences decoding there, and its first token comes with
// that prefill. The forecast is what the engine then takes: the tokens it
// computes, the time beyond their compute and the overhead (Usage's
// PrefillSharedDelay), and about the client's wait.
func TestForecastPlain(t *testing.T) {
	const (
		rate     = 10000 // tokens a second: 100 take 10 ms
		overhead = 2 * time.Millisecond
		step     = 30 * time.Millisecond
		perToken = time.Second / rate
		// slack is what the client's wait may exceed the forecast by: HTTP
		// and a timer waking late, under -race on a shared machine.
		slack = 100 * time.Millisecond
	)
	prefix := tokensText('p', 600) // cached first: 150 blocks
	tests := []struct {
		name        string
		prompt      string
		batch       bool // a sequence decodes meanwhile
		maxRunning  int  // 0: 64
		wantCached  int
		wantCompute time.Duration
		wantFits    bool
	}{
		{
			name: "alone, its prefix cached", prompt: prefix + tokensText('q', 400), wantCached: 600,
			wantCompute: overhead + 400*perToken, wantFits: true,
		},
		{
			// The budget of 101 leaves 100 tokens a step: 4 chunks of 10 ms
			// compute, each riding a 30 ms step.
			name: "beside a decoding sequence", prompt: prefix + tokensText('q', 400), batch: true, wantCached: 600,
			wantCompute: 400*perToken + 4*step, wantFits: true,
		},
		{
			// All but the block holding its last token: one chunk of 4
			// tokens, riding a 25th of a step but at least the overhead.
			name: "the whole prompt cached, beside a decoding sequence", prompt: prefix, batch: true, wantCached: 596,
			wantCompute: 4*perToken + overhead, wantFits: true,
		},
		{
			name: "nothing cached, no place free", prompt: tokensText('z', 200), batch: true, maxRunning: 1,
			wantCompute: 200*perToken + 2*step, wantFits: false,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := startSim(t, Config{Role: RoleDecode, Capacity: testCapacity(func(c *Capacity) {
				c.PrefillTokensPerSec = rate
				c.PrefillOverhead = overhead
				c.DecodeStep = step
				c.MaxBatchedTokens = 101
				if tt.maxRunning > 0 {
					c.MaxRunning = tt.maxRunning
				}
			})})
			post(t, s, "/v1/completions", "warm", plain(prefix, 1)).decode(t)
			requireIdle(t, s)

			var decode <-chan asyncReply
			if tt.batch {
				// 30 steps of at least 30 ms: it outlasts the prompt.
				decode = goPost(t, s, "/v1/completions", "decode", plain(tokensText('d', 4), 31))
				require.Eventually(t, func() bool { return s.Usage().DecodeTokens > 0 }, 10*time.Second, time.Millisecond)
			}
			f := s.ForecastPlain(tt.prompt, 8)
			require.Zero(t, f.Wait)
			require.Equal(t, tt.wantCached, f.CachedTokens)
			require.InDelta(t, tt.wantCompute, f.Compute, float64(time.Microsecond))
			require.Equal(t, tt.wantFits, f.Fits)
			require.Equal(t, f.PrefillForecast, s.ForecastPrefill(tt.prompt), "its prompt phase is a prefill's")

			before := s.Usage()
			start := time.Now()
			post(t, s, "/v1/completions", "plain", plain(tt.prompt, 1)).decode(t)
			took := time.Since(start)
			u := s.Usage()
			uncached := promptTokens(tt.prompt) - tt.wantCached
			require.EqualValues(t, uncached, u.PrefillTokens-before.PrefillTokens)
			require.EqualValues(t, tt.wantCached, u.PrefixHitTokens-before.PrefixHitTokens)
			took0 := overhead + time.Duration(uncached)*perToken + u.PrefillSharedDelay - before.PrefillSharedDelay
			require.InDelta(t, f.Compute, took0, float64(time.Microsecond), "the engine's prompt time")
			require.GreaterOrEqual(t, took, f.TTFT())
			if f.Fits {
				require.Less(t, took, f.TTFT()+slack)
			} else {
				require.Greater(t, took, f.TTFT()+step, "it waited for the place")
			}
			if tt.batch {
				require.Equal(t, http.StatusOK, await(t, decode).status)
			}
			requireIdle(t, s)
		})
	}
}
