package picker

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/endpoint"
)

// What a lease counts, by role: a prefill the prompt's uncached tokens, a
// decode the whole prompt; both take the prompt as cached there from then
// on, and Cached is what was cached before.
func TestLeaseCounts(t *testing.T) {
	sent := blocksOf(1, 2, 3) // what pdx sent epA before
	for _, tc := range []struct {
		name       string
		role       Role
		prompt     []uint64
		needCached bool
		// wantTokens is what the lease counts, wantCached what it tells.
		wantTokens, wantCached int
	}{
		{name: "prefill: the uncached part", role: RolePrefill, prompt: blocksOf(1, 2, 9, 9), wantTokens: 256 - 128, wantCached: 128},
		{name: "prefill: all cached", role: RolePrefill, prompt: blocksOf(1, 2, 3), wantTokens: 0, wantCached: 192},
		{name: "prefill: nothing cached", role: RolePrefill, prompt: blocksOf(7, 8, 9, 9), wantTokens: 256},
		{name: "decode: the whole prompt", role: RoleDecode, prompt: blocksOf(1, 2, 9, 9), wantTokens: 256},
		{name: "decode: cached when asked", role: RoleDecode, prompt: blocksOf(1, 2, 9, 9), needCached: true, wantTokens: 256, wantCached: 128},
	} {
		t.Run(tc.name, func(t *testing.T) {
			set := NewSet(abc, Options{})
			hold(t, set, epA, sent, 0).End(Released)
			l := newLeg(set, new(RoundRobin), tc.role)
			req := Request{Subset: []string{epA.Address}, Blocks: tc.prompt, BlockTokens: 64, Tokens: 64 * len(tc.prompt), NeedCached: tc.needCached}
			lease, ok := l.Pick(req)
			require.True(t, ok)
			require.Equal(t, epA, lease.Endpoint())
			require.Equal(t, tc.wantTokens, lease.Tokens())
			require.Equal(t, tc.wantCached, lease.Cached())
			require.Equal(t, 1, set.InFlight(epA))
			require.EqualValues(t, tc.wantTokens, set.view.Load().lookup(epA).inFlightTokens.Load())

			req.NeedCached = true
			again, _ := l.Pick(req)
			require.Equal(t, 64*len(tc.prompt), again.Cached(), "the first lease's prompt counts as cached on epA")
			again.End(Released)
			lease.End(Released)
			require.Zero(t, set.InFlight(epA))
			require.Zero(t, set.view.Load().lookup(epA).inFlightTokens.Load())
		})
	}
}

// A lease ends once whatever calls End, and its outcome is what the
// endpoint's passive health hears.
func TestLeaseEnd(t *testing.T) {
	for _, tc := range []struct {
		name        string
		outcomes    []Outcome
		wantHealthy bool
	}{
		{name: "released says nothing", outcomes: []Outcome{Released}, wantHealthy: true},
		{name: "failed ejects (threshold 1)", outcomes: []Outcome{Failed}, wantHealthy: false},
		{name: "succeeded re-admits", outcomes: []Outcome{Failed, Succeeded}, wantHealthy: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			set := NewSet(abc, Options{FailureThreshold: 1})
			for _, o := range tc.outcomes {
				lease := hold(t, set, epB, nil, 10)
				lease.End(o)
				require.False(t, lease.Open())
				lease.End(Failed) // a second End does nothing
			}
			require.Equal(t, tc.wantHealthy, set.Healthy(epB))
			require.Zero(t, set.InFlight(epB))
		})
	}
	var zero Lease
	require.False(t, zero.Open())
	zero.End(Failed) // the zero lease is ended
	zero.DropRank()
	zero.Move(epA)
}

// DropRank ends the rank's count alone; Move takes the lease, but its
// rank, to the endpoint that served, prompt and all.
func TestLeaseDropRankAndMove(t *testing.T) {
	a := endpoint.Endpoint{Address: "127.0.0.1:1", DPSize: 2}
	b := endpoint.Endpoint{Address: "127.0.0.1:2", DPSize: 2}
	set := NewSet([]endpoint.Endpoint{a, b}, Options{})
	l := newLeg(set, new(RoundRobin), RoleDecode)
	prompt := blocksOf(4, 5)
	lease, ok := l.Pick(Request{Subset: []string{a.Address}, Blocks: prompt, BlockTokens: 64, Tokens: 128})
	require.True(t, ok)
	r, ok := lease.Rank().Get()
	require.True(t, ok)
	require.Equal(t, 1, set.RankInFlight(a, r))

	lease.DropRank()
	require.Zero(t, set.RankInFlight(a, r), "the rank's count ends")
	require.Equal(t, 1, set.InFlight(a), "the endpoint's stays")
	require.Equal(t, endpoint.Rank{}, lease.Rank())

	lease.Move(b)
	require.Equal(t, b, lease.Endpoint())
	require.Zero(t, set.InFlight(a))
	require.Equal(t, 1, set.InFlight(b))
	require.EqualValues(t, 128, set.view.Load().lookup(b).inFlightTokens.Load())
	require.Equal(t, []int{0, 0}, rankCounts(set, b), "on none of its ranks")
	cached, _ := l.Pick(Request{Subset: []string{b.Address}, Blocks: prompt, BlockTokens: 64, NeedCached: true})
	require.Equal(t, 128, cached.Cached(), "b holds the prompt now")
	cached.End(Released)

	lease.End(Released)
	require.Zero(t, set.InFlight(b))
	require.Zero(t, set.view.Load().lookup(b).inFlightTokens.Load())
}

// TestDetach: a detached decode stops counting as pdx's in-flight request
// and counts as pending on its endpoint until the engine's next sample,
// which shows it among the engine's own requests; without a fresh sample,
// or with a saturation bound on pdx's own count, a lease stays as it was.
func TestDetach(t *testing.T) {
	for _, tc := range []struct {
		name     string
		sample   bool          // the engine's load is observed before the pick
		age      time.Duration // how old it is at the detach
		opts     Options
		detached bool
	}{
		{name: "fresh sample", sample: true, detached: true},
		{name: "no sample", sample: false},
		{name: "stale sample", sample: true, age: 3 * time.Second},
		{name: "saturation counts pdx's own", sample: true, opts: Options{Saturation: Saturation{MaxInFlight: 8}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			eps := endpoints(2)
			clk := newFakeClock()
			tc.opts.Now = clk.Now
			set := NewSet(eps, tc.opts)
			leg, err := NewLeg(set, &configv1.Picker{Policy: LeastRequestPolicy}, RoleDecode)
			require.NoError(t, err)
			if tc.sample {
				for _, ep := range eps {
					set.Observe(ep.Address, Load{Running: 2, At: clk.Now()})
				}
			}
			clk.Advance(tc.age)

			l, ok := leg.Pick(Request{Tokens: 100})
			require.True(t, ok)
			on := l.Endpoint()
			require.Equal(t, tc.detached, l.Detach())
			require.Equal(t, !tc.detached, l.Open())
			if !tc.detached {
				require.Equal(t, 1, set.InFlight(on), "the lease still counts")
				l.End(Released)
				return
			}
			l.End(Released) // ended already: uncounts nothing more
			require.Zero(t, set.InFlight(on))

			// picks picks four times, each lease ended at once.
			picks := func() []endpoint.Endpoint {
				var out []endpoint.Endpoint
				for range 4 {
					next, ok := leg.Pick(Request{Tokens: 100})
					require.True(t, ok)
					out = append(out, next.Endpoint())
					next.End(Released)
				}
				return out
			}
			// Pending until the next sample: the other endpoint is lighter.
			require.NotContains(t, picks(), on, "the detached request still counts on its endpoint")
			// The engine's next sample stops it pending: by this one it
			// has ended, and the endpoints tie again.
			set.Observe(on.Address, Load{Running: 2, At: clk.Now()})
			require.Contains(t, picks(), on, "after the engine's next sample, the endpoint is picked again")
		})
	}
}

// An engine whose metrics say how much KV it holds counts as caching only
// what fits it of what pdx sent there since (the index's LRU), from its
// first sample on, through a sample that does not say, and in a view of
// other endpoints; another engine, which has not said, keeps all it was
// sent.
func TestLeaseCachedWithinTheEnginesRoom(t *testing.T) {
	p1, p2 := blocksOf(1, 2, 3), blocksOf(7, 8, 9)
	cached := func(set *Set, ep endpoint.Endpoint, prompt []uint64) int {
		l := newLeg(set, new(RoundRobin), RolePrefill)
		lease, ok := l.Pick(Request{Subset: []string{ep.Address}, Blocks: prompt, BlockTokens: 64, Tokens: 64 * len(prompt)})
		require.True(t, ok)
		lease.End(Released)
		return lease.Cached()
	}
	send := func(set *Set) {
		for _, ep := range []endpoint.Endpoint{epA, epB} {
			hold(t, set, ep, p1, 0).End(Released)
			hold(t, set, ep, p2, 0).End(Released)
		}
	}
	set := NewSet(abc, Options{BlockTokens: 64})
	send(set)
	require.Equal(t, 192, cached(set, epA, p1), "before the engine says: everything sent")
	set.Observe(epA.Address, Load{KVTokens: 4 * 64, At: time.Now()})
	set.Observe(epA.Address, Load{At: time.Now()}) // says nothing of its KV
	require.Equal(t, 192, cached(set, epB, p1))
	send(set)
	require.Equal(t, 64, cached(set, epA, p1), "room for four blocks: p1's first of three, behind p2's")
	// That pick sent p1 again: its three blocks are the newest, and only
	// p2's first fits beside them.
	require.Equal(t, 64, cached(set, epA, p2))

	set.SetEndpoints([]endpoint.Endpoint{epB, epA})
	send(set)
	require.Equal(t, 64, cached(set, epA, p1), "a new view keeps the engine's room")
	require.Equal(t, 192, cached(set, epB, p1))
}

// With Options.EngineBlocks a Set's prompt blocks are the least KV block
// its endpoints' engines said, at least MinEngineBlockTokens, and
// Options.BlockTokens while none has said; the engines' KV is counted in
// them (KVBlocks).
func TestEngineBlocks(t *testing.T) {
	for _, tc := range []struct {
		name         string
		engineBlocks bool
		said         []int // the KV block of epA, epB, epC's engines; 0: not said
		want         int
	}{
		{name: "none said", engineBlocks: true, said: []int{0, 0, 0}, want: 64},
		{name: "one said", engineBlocks: true, said: []int{32, 0, 0}, want: 32},
		{name: "the least", engineBlocks: true, said: []int{128, 32, 0}, want: 32},
		{name: "finer than vLLM's default on GPUs", engineBlocks: true, said: []int{1, 128, 0}, want: MinEngineBlockTokens},
		{name: "not followed without EngineBlocks", said: []int{32, 0, 0}, want: 64},
	} {
		t.Run(tc.name, func(t *testing.T) {
			set := NewSet(abc, Options{BlockTokens: 64, EngineBlocks: tc.engineBlocks})
			for i, ep := range abc {
				if tc.said[i] > 0 {
					set.Observe(ep.Address, Load{KVTokens: 6400, KVBlockTokens: tc.said[i], At: time.Now()})
				}
			}
			require.Equal(t, tc.want, set.BlockTokens())
			if tc.said[0] > 0 {
				n, ok := set.KVBlocks(epA)
				require.True(t, ok)
				require.Equal(t, 6400/tc.want, n, "the engine's KV in the Set's blocks")
			}
		})
	}
}

// The engines' block is followed as it changes: a sample that does not
// say it keeps it, an engine with a smaller one lowers it, the endpoint
// that had the least leaving raises it again, and a Set that inherits
// the endpoints has it from the start.
func TestEngineBlocksFollowed(t *testing.T) {
	set := NewSet(abc, Options{BlockTokens: 64, EngineBlocks: true})
	set.Observe(epA.Address, Load{KVTokens: 6400, KVBlockTokens: 32, At: time.Now()})
	set.Observe(epA.Address, Load{At: time.Now()})
	require.Equal(t, 32, set.BlockTokens(), "a sample that does not say keeps it")
	set.Observe(epB.Address, Load{KVTokens: 6400, KVBlockTokens: 16, At: time.Now()})
	require.Equal(t, 16, set.BlockTokens())
	n, _ := set.KVBlocks(epA)
	require.Equal(t, 400, n, "every engine's KV counted anew in the new block")

	set.SetEndpoints([]endpoint.Endpoint{epA, epC})
	require.Equal(t, 32, set.BlockTokens(), "epB, which had the least, left")
	n, _ = set.KVBlocks(epA)
	require.Equal(t, 200, n)

	next := NewSet([]endpoint.Endpoint{epA, epC}, Options{BlockTokens: 64, EngineBlocks: true, Inherit: set})
	require.Equal(t, 32, next.BlockTokens(), "inherited")
	n, _ = next.KVBlocks(epA)
	require.Equal(t, 200, n)
}

// pdx counts a prompt's tokens as its bytes over BytesPerToken; the
// engines count theirs. Once the engines' answers say how many of pdx's
// tokens make one of theirs, an engine's KV is that many more of pdx's
// blocks, and a Set that inherits the endpoints knows it from the start.
// The scale is of the bytes the blocks are cut from, for a rendered prompt
// too.
func TestTokenScale(t *testing.T) {
	eps := endpoints(2)
	set := NewSet(eps, Options{BlockTokens: 64})
	set.Observe(eps[0].Address, Load{KVTokens: 6400, At: time.Now()})
	n, _ := set.KVBlocks(eps[0])
	require.Equal(t, 100, n, "before any answer: one of pdx's tokens an engine token")
	require.InDelta(t, 1.0, set.TokenScale(), 1e-9)

	l := newLeg(set, Forecast{}, RolePrefill)
	prompt := blocksOf(1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
	cached := 0
	for range 400 {
		// The same prompt each time: after the first, pdx counts most of
		// it cached, and learns from the whole prompt, not the rest.
		lease, ok := l.Pick(Request{Subset: []string{eps[0].Address}, Blocks: prompt, BlockTokens: 64, Tokens: 1250})
		require.True(t, ok)
		lease.Observe(1000, 800)
		lease.Observe(0, 0) // an answer without usage says nothing
		lease.End(Succeeded)
		cached = lease.Cached()
	}
	require.Equal(t, 640, cached, "the prompt's ten blocks sent before")
	require.InDelta(t, 1.25, set.TokenScale(), 0.01)
	set.Observe(eps[0].Address, Load{KVTokens: 6400, At: time.Now()})
	n, _ = set.KVBlocks(eps[0])
	require.Equal(t, 125, n, "the engine's 6,400 tokens are 8,000 of pdx's")

	next := NewSet(eps, Options{BlockTokens: 64, Inherit: set})
	require.InDelta(t, 1.25, next.TokenScale(), 0.01, "inherited")

	// A rendered prompt's Tokens are the engine's count: the scale is of
	// the bytes its blocks are cut from.
	rendered := NewSet(eps, Options{BlockTokens: 64})
	lr := newLeg(rendered, Forecast{}, RolePrefill)
	lease, ok := lr.Pick(Request{Blocks: prompt, BlockTokens: 64, Tokens: 1000, PromptBytes: 5200})
	require.True(t, ok)
	lease.Observe(1000, 0)
	lease.End(Succeeded)
	require.InDelta(t, 1.3, rendered.TokenScale(), 1e-9)

	// The scale is of the tokens: short prompts, whose ratio is mostly
	// what each count adds around the text, weigh as little as they are.
	mixed := NewSet(eps, Options{BlockTokens: 64})
	lm := newLeg(mixed, Forecast{}, RolePrefill)
	for i := range 400 {
		ours, theirs := 1250, 1000
		if i%2 == 1 {
			ours, theirs = 40, 10
		}
		lease, ok := lm.Pick(Request{Blocks: blocksOf(i), BlockTokens: 64, Tokens: ours})
		require.True(t, ok)
		lease.Observe(theirs, 0)
		lease.End(Succeeded)
	}
	require.InDelta(t, 1290.0/1010, mixed.TokenScale(), 0.01, "not the prompts' mean ratio, 2.6")
	lease, ok = lm.Pick(Request{Blocks: prompt, BlockTokens: 64, Tokens: 1250})
	require.True(t, ok)
	require.Zero(t, testing.AllocsPerRun(100, func() { lease.Observe(1000, 0) }), "learning allocates nothing")
	lease.End(Succeeded)

	decodeSet := NewSet(eps, Options{BlockTokens: 64})
	decode := newLeg(decodeSet, Forecast{}, RoleDecode)
	lease, ok = decode.Pick(Request{Tokens: 1250})
	require.True(t, ok)
	lease.Observe(100, 0)
	lease.End(Succeeded)
	require.InDelta(t, 1.0, decodeSet.TokenScale(), 1e-9, "a decode lease learns nothing")
}
