package picker

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/endpoint"
)

// endpoints returns n endpoints 127.0.0.1:1..n.
func endpoints(n int) []endpoint.Endpoint {
	eps := make([]endpoint.Endpoint, n)
	for i := range eps {
		eps[i] = endpoint.Endpoint{Address: fmt.Sprintf("127.0.0.1:%d", i+1)}
	}
	return eps
}

// prompt returns a prompt of blocks 64-token blocks (256 bytes each), the
// k-th block's text being ids[k]'s.
func prompt(ids ...int) []byte {
	var b []byte
	for _, id := range ids {
		b = append(b, fmt.Appendf(nil, "%-256d", id)...)
	}
	return b
}

func blocksOf(ids ...int) []uint64 { return Blocks(nil, prompt(ids...), 64) }

func TestBlocks(t *testing.T) {
	a, b := blocksOf(1, 2, 3), blocksOf(1, 2, 4)
	require.Len(t, a, 3)
	require.Equal(t, a[:2], b[:2], "equal prefixes hash alike")
	require.NotEqual(t, a[2], b[2])
	require.NotEqual(t, blocksOf(2, 2)[1], blocksOf(1, 2)[1], "a block's hash covers the blocks before it")
	require.Len(t, Blocks(nil, prompt(1)[:255], 64), 0, "only full blocks count")
	require.Len(t, Blocks(nil, make([]byte, 256*(MaxBlocks+5)), 64), MaxBlocks)
}

func TestIndexForgetsOldestFirst(t *testing.T) {
	x := newIndex(2, 4) // two generations of two blocks
	depth := make([]int32, 2)
	x.add(0, []uint64{1, 2})
	require.Equal(t, int32(2), x.matches([]uint64{1, 2, 3}, depth))
	require.Equal(t, []int32{2, 0}, depth)
	x.add(1, []uint64{7}) // the generation is full: 1, 2 become the old one
	require.Equal(t, 2, x.matched(0, []uint64{1, 2}, false), "the older generation still counts")
	x.add(0, []uint64{1}) // sent again: 1 is new again
	x.add(1, []uint64{8}) // and 2 goes with the old generation
	require.Equal(t, 1, x.matched(0, []uint64{1, 2}, false))
	require.Equal(t, 2, x.matched(1, []uint64{7, 8}, false), "7 in the old generation, 8 in the new")
	require.Equal(t, int32(1), x.matches([]uint64{8}, depth))
	require.Equal(t, []int32{0, 1}, depth)
}

// TestIndexEvicts: with the KV an engine holds known, a block counts as
// held there only while an LRU of that many blocks, replayed on what was
// sent there, has it: a prompt's tail goes first, and a prefix sent again
// takes no more room.
func TestIndexEvicts(t *testing.T) {
	a, b, c := []uint64{1, 2, 3}, []uint64{11, 12, 13}, []uint64{21}
	for _, tc := range []struct {
		name   string
		blocks int64 // the KV of endpoint 0's engine
		sends  [][]uint64
		want   [3]int // held of a, b, c
	}{
		{"not said: everything sent", 0, [][]uint64{a, b, c}, [3]int{3, 3, 1}},
		{"room for all", 7, [][]uint64{a, b, c}, [3]int{3, 3, 1}},
		{"a's tail evicted first", 4, [][]uint64{a, b}, [3]int{1, 3, 0}},
		{"a's head sent again outlives b's tail", 4, [][]uint64{a, b, a[:1], c}, [3]int{1, 2, 1}},
		{"all of a evicted", 3, [][]uint64{a, b}, [3]int{0, 3, 0}},
		{"a sent again is held whole", 3, [][]uint64{a, b, a}, [3]int{3, 0, 0}},
		{"a sent again takes no more room", 6, [][]uint64{a, b, a, a, a, c}, [3]int{3, 2, 1}},
		{"more than a generation: not modelled", 65, [][]uint64{a, b, c, a}, [3]int{3, 3, 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x := newIndex(2, 128)
			x.setKVBlocks(0, tc.blocks)
			x.setKVBlocks(1, 1) // endpoint 1's engine changes nothing of 0's
			for _, s := range tc.sends {
				x.add(0, s)
			}
			for i, p := range [][]uint64{a, b, c} {
				require.Equal(t, tc.want[i], x.matched(0, p, true), "held of prompt %d", i)
				depth := make([]int32, 2)
				x.matches(p, depth)
				require.Equal(t, []int32{int32(tc.want[i]), 0}, depth)
			}
			require.Equal(t, 3, x.matched(0, a, false), "what was sent, held or not")
		})
	}
	t.Run("the engine says less", func(t *testing.T) {
		x := newIndex(1, 128)
		x.setKVBlocks(0, 6)
		x.add(0, a)
		x.add(0, b)
		x.setKVBlocks(0, 2)
		x.add(0, c) // b's head is left, beside c
		require.Equal(t, []int{0, 1, 1}, []int{x.matched(0, a, true), x.matched(0, b, true), x.matched(0, c, true)})
		x.setKVBlocks(0, 4)
		x.add(0, a)
		require.Equal(t, []int{3, 0, 1}, []int{x.matched(0, a, true), x.matched(0, b, true), x.matched(0, c, true)})
	})
}

func TestLeastRequest(t *testing.T) {
	eps := endpoints(3)
	for _, tc := range []struct {
		name     string
		inFlight [3]int
		loads    map[int]Load // by endpoint index; At is set relative to now
		age      time.Duration
		tried    []int
		want     int
	}{
		{name: "fewest in flight", inFlight: [3]int{2, 0, 1}, want: 1},
		{name: "tried is passed over", inFlight: [3]int{2, 0, 1}, tried: []int{1}, want: 2},
		{name: "engine's word when it says more", inFlight: [3]int{2, 0, 1},
			loads: map[int]Load{1: {Waiting: 4, Running: 2}}, want: 2},
		{name: "a stale word does not count", inFlight: [3]int{2, 0, 1},
			loads: map[int]Load{1: {Waiting: 4, Running: 2}}, age: 3 * time.Second, want: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := newFakeClock()
			set := NewSet(eps, Options{Now: clk.Now})
			for i, n := range tc.inFlight {
				for range n {
					hold(t, set, eps[i], nil, 0)
				}
			}
			for i, l := range tc.loads {
				l.At = clk.Now()
				set.Observe(eps[i].Address, l)
			}
			clk.Advance(tc.age)
			var tried []endpoint.Endpoint
			for _, i := range tc.tried {
				tried = append(tried, eps[i])
			}
			got, ok := choose(set, LeastRequest{}, Request{Tried: tried})
			require.True(t, ok)
			require.Equal(t, eps[tc.want], got)
		})
	}
}

func TestLeastRequestTiesGoRound(t *testing.T) {
	eps := endpoints(3)
	set := NewSet(eps, Options{})
	seen := map[endpoint.Endpoint]int{}
	for range 30 {
		seen[must(choose(set, LeastRequest{}, Request{}))]++
	}
	require.Equal(t, map[endpoint.Endpoint]int{eps[0]: 10, eps[1]: 10, eps[2]: 10}, seen)
}

func TestInFlightCounts(t *testing.T) {
	set := NewSet(abc, Options{})
	first := hold(t, set, epA, nil, 0)
	hold(t, set, epA, nil, 0).End(Released)
	require.Equal(t, 1, set.InFlight(epA))
	require.Equal(t, 0, set.InFlight(epB))
	hold(t, set, epB, nil, 0).Move(endpoint.Endpoint{Address: "10.0.0.1:1"}) // not the set's: counted nowhere
	require.Equal(t, 0, set.InFlight(epB))
	next := NewSet(abc, Options{Inherit: set})
	require.Equal(t, 1, next.InFlight(epA), "a rebuilt set shares the counts, so that an End after a reload finds its lease")
	first.End(Released)
	require.Equal(t, 0, next.InFlight(epA))
	require.Equal(t, 0, set.InFlight(epA))
}

func TestSaturation(t *testing.T) {
	sat := Saturation{QueueDepth: 5, KVUsage: 0.8, MaxInFlight: 3}
	for _, tc := range []struct {
		name      string
		loads     [3]*Load
		inFlight  int // on epA
		age       time.Duration
		saturated bool
		pick      endpoint.Endpoint // round robin's first pick
	}{
		{name: "no signals", pick: epA},
		{name: "one queue full", loads: [3]*Load{{Waiting: 5}}, pick: epB},
		{name: "all full", loads: [3]*Load{{Waiting: 5}, {KVUsage: 0.8}, {Waiting: 9, KVUsage: 0.9}}, saturated: true, pick: epA},
		{name: "all full but stale", loads: [3]*Load{{Waiting: 5}, {KVUsage: 0.8}, {Waiting: 9}}, age: 3 * time.Second, pick: epA},
		{name: "pdx's own bound", loads: [3]*Load{nil, {KVUsage: 0.9}, {Waiting: 5}}, inFlight: 3, saturated: true, pick: epA},
		{name: "below every bound", loads: [3]*Load{{Waiting: 4, KVUsage: 0.79}}, inFlight: 2, pick: epA},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := newFakeClock()
			set := NewSet(abc, Options{Now: clk.Now, Saturation: sat})
			for i, l := range tc.loads {
				if l != nil {
					l.At = clk.Now()
					set.Observe(abc[i].Address, *l)
				}
			}
			for range tc.inFlight {
				hold(t, set, epA, nil, 0)
			}
			clk.Advance(tc.age)
			require.Equal(t, tc.saturated, set.Saturated(""))
			require.Equal(t, tc.pick, must(choose(set, new(RoundRobin), Request{})), "picks pass over saturated endpoints while some are not")
		})
	}
	require.False(t, NewSet(abc, Options{}).Saturated(""), "no thresholds, never saturated")
}

// TestQueueDepthWeighed: a burst sent while two engines' last word said
// their queues were full and the third's said it had room. Policies that
// weigh each engine's queue (least_work, forecast) count the waiting
// requests as work and spread the burst as that work says; the others
// pass the two over and send it all to the third. Saturation as the leg's
// admission reads it is the same for both.
func TestQueueDepthWeighed(t *testing.T) {
	const burst = 10
	for _, policy := range []string{RoundRobinPolicy, LeastRequestPolicy, LeastWorkPolicy, ForecastPolicy} {
		t.Run(policy, func(t *testing.T) {
			clk := newFakeClock()
			set := NewSet(abc, Options{Now: clk.Now, Saturation: Saturation{QueueDepth: 5}})
			set.Observe(epA.Address, Load{Waiting: 5, Running: 1, At: clk.Now()})
			set.Observe(epB.Address, Load{Waiting: 5, Running: 1, At: clk.Now()})
			set.Observe(epC.Address, Load{Running: 1, At: clk.Now()})
			require.False(t, set.Saturated(""), "the third has room")
			l, err := NewLeg(set, &configv1.Picker{Policy: policy}, RolePrefill)
			require.NoError(t, err)
			sent := map[endpoint.Endpoint]int{}
			for range burst {
				lease, ok := l.Pick(Request{Tokens: 1000})
				require.True(t, ok)
				sent[lease.Endpoint()]++
			}
			if _, ok := l.policy.(queueWeigher); ok {
				require.Less(t, sent[epC], burst-2, "the full queues are work to weigh, not a bar: %v", sent)
				require.Positive(t, sent[epA], sent)
				require.Positive(t, sent[epB], sent)
			} else {
				require.Equal(t, burst, sent[epC], "the full queues are passed over: %v", sent)
			}
			set.Observe(epC.Address, Load{Waiting: 5, Running: 1, At: clk.Now()})
			require.True(t, set.Saturated(""), "every queue full: the leg waits for room, whatever the policy")
		})
	}
}

func TestPrefixAffinity(t *testing.T) {
	eps := endpoints(8)
	conversation := func(c, turn int) []uint64 {
		ids := []int{0} // every prompt starts with the same system prompt
		for k := range 2 + turn {
			ids = append(ids, 1000*c+k)
		}
		return blocksOf(ids...)
	}
	// Two replicas: sets and policies of their own, the same endpoints.
	one := newLeg(NewSet(eps, Options{}), newPrefixAffinity(0), RolePrefill)
	two := newLeg(NewSet(eps, Options{}), newPrefixAffinity(0), RolePrefill)
	spread := map[endpoint.Endpoint]int{}
	for c := range 200 {
		first := must(one.peek(Request{Blocks: conversation(c, 0)}))
		require.Equal(t, first, must(two.peek(Request{Blocks: conversation(c, 0)})), "replicas agree without sharing state")
		for turn := 1; turn < 4; turn++ {
			require.Equal(t, first, must(one.peek(Request{Blocks: conversation(c, turn)})), "a conversation's turns stay together")
		}
		spread[first]++
	}
	require.Len(t, spread, 8, "the shared system prompt does not pull every conversation to one endpoint")
	for ep, n := range spread {
		require.Greater(t, n, 8, "%s gets a fair share", ep.Address)
	}
}

func TestPrefixAffinityBoundsLoad(t *testing.T) {
	eps := endpoints(4)
	set := NewSet(eps, Options{})
	p := newLeg(set, newPrefixAffinity(1.25), RolePrefill)
	b := blocksOf(1, 2, 3)
	home := must(p.peek(Request{Blocks: b}))
	// The same prompt again and again, each still running: the home
	// endpoint takes at most 1.25 times the mean, then others help.
	for range 40 {
		_, ok := p.Pick(Request{Blocks: b})
		require.True(t, ok)
	}
	total := 0
	for _, ep := range eps {
		total += set.InFlight(ep)
	}
	require.LessOrEqual(t, set.InFlight(home), 13, "1.25 × the mean of 10, rounded up")
	require.Greater(t, set.InFlight(home), 10, "the home endpoint fills to its bound first")
	require.Equal(t, 40, total)
}

func TestPrefixAffinityMovesFewKeysOnResize(t *testing.T) {
	before := newLeg(NewSet(endpoints(8), Options{}), newPrefixAffinity(0), RolePrefill)
	after := newLeg(NewSet(endpoints(9), Options{}), newPrefixAffinity(0), RolePrefill)
	moved := 0
	const n = 900
	for c := range n {
		b := blocksOf(c)
		if must(before.peek(Request{Blocks: b})) != must(after.peek(Request{Blocks: b})) {
			moved++
		}
	}
	// Rendezvous hashing moves the keys the new endpoint wins, 1/9 of them.
	require.InDelta(t, n/9, moved, n/20)
}

func TestPrefixAffinityWithoutPromptIsLeastRequest(t *testing.T) {
	set := NewSet(abc, Options{})
	hold(t, set, epA, nil, 0)
	hold(t, set, epC, nil, 0)
	require.Equal(t, epB, must(choose(set, newPrefixAffinity(0), Request{})))
}

func TestLoadAware(t *testing.T) {
	eps := endpoints(3)
	for _, tc := range []struct {
		name     string
		w        Weights
		sent     map[int][]uint64 // what pdx sent each endpoint
		inFlight [3]int
		loads    [3]*Load
		blocks   []uint64
		want     int
	}{
		{name: "prefix match wins", w: Weights{Prefix: 2, Queue: 1}, sent: map[int][]uint64{2: blocksOf(1, 2, 3)},
			blocks: blocksOf(1, 2, 3, 4), want: 2},
		{name: "longest match wins", w: Weights{Prefix: 2}, sent: map[int][]uint64{0: blocksOf(1), 1: blocksOf(1, 2, 3)},
			blocks: blocksOf(1, 2, 3, 4), want: 1},
		{name: "a long queue outweighs a short match", w: Weights{Prefix: 2, Queue: 1},
			sent:   map[int][]uint64{2: blocksOf(1)},
			loads:  [3]*Load{{Waiting: 0}, {Waiting: 10}, {Waiting: 10}},
			blocks: blocksOf(1, 2, 3, 4), want: 0},
		{name: "queue without metrics is in flight", w: Weights{Queue: 1}, inFlight: [3]int{3, 1, 2}, want: 1},
		{name: "KV headroom", w: Weights{KVUsage: 1, InFlight: 0.1}, loads: [3]*Load{{KVUsage: 0.9}, {KVUsage: 0.2}, {KVUsage: 0.5}}, want: 1},
		{name: "unknown KV usage is middling", w: Weights{KVUsage: 1}, loads: [3]*Load{{KVUsage: 0.9}, {KVUsage: -1}, {KVUsage: 0.7}}, want: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := newFakeClock()
			set := NewSet(eps, Options{Now: clk.Now})
			for i, b := range tc.sent {
				hold(t, set, eps[i], b, 0).End(Released)
			}
			for i, n := range tc.inFlight {
				for range n {
					hold(t, set, eps[i], nil, 0)
				}
			}
			for i, l := range tc.loads {
				if l != nil {
					l.At = clk.Now()
					set.Observe(eps[i].Address, *l)
				}
			}
			require.Equal(t, eps[tc.want], must(choose(set, &LoadAware{w: tc.w}, Request{Blocks: tc.blocks})))
		})
	}
}

// A lease tells how much of its prompt the endpoint had cached, in blocks
// here (BlockTokens 1).
func TestLeaseCached(t *testing.T) {
	set := NewSet(abc, Options{})
	hold(t, set, epB, blocksOf(1, 2, 3), 0)
	matched := func(ep endpoint.Endpoint) int {
		l := newLeg(set, new(RoundRobin), RolePrefill)
		lease, ok := l.Pick(Request{Subset: []string{ep.Address}, Blocks: blocksOf(1, 2, 9), BlockTokens: 1})
		require.True(t, ok)
		lease.End(Released)
		return lease.Cached()
	}
	require.Equal(t, 2, matched(epB))
	require.Equal(t, 0, matched(epA))
	set.SetEndpoints([]endpoint.Endpoint{epB, epA})
	require.Equal(t, 0, matched(epB), "other endpoints, positions and index start afresh")
}

// benchPrompts are 256 prompts of 32 blocks sharing their first block,
// for picks to take in turn.
func benchPrompts() [][]uint64 {
	var prompts [][]uint64
	for c := range 256 {
		ids := []int{0}
		for k := range 31 {
			ids = append(ids, c*100+k)
		}
		prompts = append(prompts, blocksOf(ids...))
	}
	return prompts
}

// BenchmarkPolicies is a pick at 64 endpoints with fresh engine metrics
// and a prompt of 32 blocks, for every policy.
func BenchmarkPolicies(b *testing.B) { benchPolicies(b, RolePrefill, 0, Request{}) }

// BenchmarkDecodePolicies is BenchmarkPolicies on a decode leg, whose
// engines say their KV's size (forecast's room for a decode).
func BenchmarkDecodePolicies(b *testing.B) {
	benchPolicies(b, RoleDecode, 1<<16, Request{BlockTokens: 64, Tokens: 32 * 64})
}

// benchPolicies picks on a leg of role for req with each of the prompts
// in turn, the engines' KV kvTokens (0: not said).
func benchPolicies(b *testing.B, role Role, kvTokens int, req Request) {
	eps := endpoints(64)
	prompts := benchPrompts()
	for _, policy := range Policies() {
		b.Run(policy, func(b *testing.B) {
			set := NewSet(eps, Options{Saturation: Saturation{QueueDepth: 5, KVUsage: 0.8}})
			for i, ep := range eps {
				set.Observe(ep.Address, Load{Waiting: i % 3, Running: i % 7, KVUsage: 0.5, KVTokens: kvTokens, At: time.Now()})
				hold(b, set, ep, prompts[i], 0)
			}
			l, err := NewLeg(set, &configv1.Picker{Policy: policy}, role)
			require.NoError(b, err)
			b.ReportAllocs()
			b.ResetTimer()
			i := 0
			for b.Loop() {
				req.Blocks = prompts[i%len(prompts)]
				l.peek(req)
				i++
			}
		})
	}
}

// BenchmarkBlocks hashes a 12k-token prompt in blocks of vLLM's default
// on GPUs (16 tokens), the cache-bound rig's engines' (32) and pdx's
// default without the engines' word (64).
func BenchmarkBlocks(b *testing.B) {
	p := make([]byte, 48<<10)
	for _, bt := range []int{16, 32, 64} {
		b.Run(fmt.Sprintf("block=%d", bt), func(b *testing.B) {
			dst := make([]uint64, 0, MaxBlocks)
			b.SetBytes(int64(len(p)))
			for b.Loop() {
				dst = Blocks(dst[:0], p, bt)
			}
		})
	}
}

// BenchmarkPromptSent is a prefill's pick and end for a 12k-token prompt
// the endpoint was sent before, in blocks of each size, its engine having
// said its KV (so the pick reads and the lease replays the LRU): what
// the finer blocks cost a request beyond their hashing.
func BenchmarkPromptSent(b *testing.B) {
	p := make([]byte, 48<<10)
	for i := range p {
		p[i] = byte(i)
	}
	for _, bt := range []int{16, 32, 64} {
		b.Run(fmt.Sprintf("block=%d", bt), func(b *testing.B) {
			set := NewSet(abc, Options{BlockTokens: bt})
			set.Observe(epA.Address, Load{KVTokens: 1 << 20, At: time.Now()})
			l := newLeg(set, new(RoundRobin), RolePrefill)
			req := Request{Subset: []string{epA.Address}, Tokens: 12 << 10, Blocks: Blocks(nil, p, bt), BlockTokens: bt}
			b.ReportAllocs()
			for b.Loop() {
				lease, _ := l.Pick(req)
				lease.End(Succeeded)
			}
		})
	}
}

func TestLeastWork(t *testing.T) {
	eps := endpoints(3)
	for _, tc := range []struct {
		name   string
		tokens [3]int        // in-flight prompt tokens, one request each
		sent   map[int][]int // block ids pdx sent each endpoint
		loads  [3]*Load
		prompt []int // the request's block ids (64 tokens each)
		want   int
	}{
		{name: "least queued work, not fewest requests", tokens: [3]int{5000, 300, 900}, prompt: []int{1, 2}, want: 1},
		{name: "a cached prompt outweighs a short queue", tokens: [3]int{500, 300, 900},
			sent: map[int][]int{0: {1, 2, 3, 4, 5, 6, 7, 8}}, prompt: []int{1, 2, 3, 4, 5, 6, 7, 8, 9}, want: 0},
		{name: "a cached prompt does not outweigh a long queue", tokens: [3]int{5000, 300, 900},
			sent: map[int][]int{0: {1, 2, 3, 4, 5, 6, 7, 8}}, prompt: []int{1, 2, 3, 4, 5, 6, 7, 8, 9}, want: 1},
		{name: "requests the engine has that pdx did not send count", tokens: [3]int{1000, 300, 900},
			loads: [3]*Load{nil, {Waiting: 8, Running: 1}}, prompt: []int{1}, want: 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			set := NewSet(eps, Options{})
			for i, ids := range tc.sent {
				hold(t, set, eps[i], blocksOf(ids...), 0).End(Released)
			}
			for i, n := range tc.tokens {
				hold(t, set, eps[i], nil, n)
			}
			for i, l := range tc.loads {
				if l != nil {
					l.At = time.Now()
					set.Observe(eps[i].Address, *l)
				}
			}
			req := Request{Blocks: blocksOf(tc.prompt...), BlockTokens: 64, Tokens: 64 * len(tc.prompt)}
			require.Equal(t, eps[tc.want], must(choose(set, LeastWork{}, req)))
		})
	}
}

// An engine's sample counts pdx's own requests of the moment it was taken
// as pdx's: one that ended since is not another router's still running
// there, and one sent since does not hide another's.
func TestLeastWorkCountsForeignRequestsAtTheSample(t *testing.T) {
	eps := endpoints(2)
	clk := newFakeClock()
	set := NewSet(eps, Options{Now: clk.Now})
	leg, err := NewLeg(set, &configv1.Picker{Policy: LeastWorkPolicy}, RolePrefill)
	require.NoError(t, err)
	mine := hold(t, set, eps[0], nil, 1000)
	set.Observe(eps[0].Address, Load{Running: 1, At: clk.Now()}) // pdx's own
	set.Observe(eps[1].Address, Load{At: clk.Now()})
	mine.End(Succeeded)
	for range 4 {
		l, ok := leg.Pick(Request{Tokens: 1000})
		require.True(t, ok)
		l.End(Succeeded)
		if l.Endpoint() == eps[0] {
			return // a tie, gone round to the engine whose only request was pdx's
		}
	}
	t.Fatal("the engine whose running request was pdx's, now ended, was never picked")
}
