package picker

import (
	"testing"

	"github.com/stretchr/testify/require"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
)

// On a decode leg forecast picks where the sequence's KV has room now,
// then the endpoint holding the most of its prompt, then the one with the
// fewest requests.
func TestForecastDecode(t *testing.T) {
	const kv = 1000 // every engine's KV, in tokens, when it says
	type engine struct {
		sample           bool // a fresh sample of its load
		waiting, running int
		usage            float64
		kvTokens         int
		sent             int // leading blocks of the prompt pdx sent it
		detached         int // decodes of 100 tokens pdx detached there since the sample
	}
	room := engine{sample: true, kvTokens: kv}
	for _, tc := range []struct {
		name    string
		engines [3]engine
		blocks  int // the request's prompt, in 64-token blocks
		want    int
	}{
		{name: "the fewest requests",
			engines: [3]engine{{sample: true, running: 3, kvTokens: kv}, {sample: true, running: 1, kvTokens: kv}, {sample: true, running: 2, kvTokens: kv}},
			blocks:  2, want: 1},
		{name: "the prefix before the fewest requests",
			engines: [3]engine{room, {sample: true, running: 5, kvTokens: kv, sent: 2}, room},
			blocks:  4, want: 1},
		{name: "room before the prefix",
			engines: [3]engine{{sample: true, usage: 0.9, kvTokens: kv, sent: 2}, {sample: true, running: 5, kvTokens: kv}, {sample: true, running: 6, kvTokens: kv}},
			blocks:  4, want: 1},
		{name: "a waiting request leaves no room",
			engines: [3]engine{{sample: true, waiting: 1, kvTokens: kv, sent: 4}, {sample: true, running: 4, kvTokens: kv}, {sample: true, running: 5, kvTokens: kv}},
			blocks:  4, want: 1},
		{name: "the blocks held need no room",
			// 4 blocks of 64 tokens: engine 0 holds 3, so needs 64 of its
			// 100 free; engine 1 needs all 256 of its 200.
			engines: [3]engine{{sample: true, usage: 0.9, running: 9, kvTokens: kv, sent: 3}, {sample: true, usage: 0.8, kvTokens: kv}, {sample: true, waiting: 2, kvTokens: kv}},
			blocks:  4, want: 0},
		{name: "decodes detached since the sample take room",
			// 100 tokens each: engine 0's 350 free become 150, less than the
			// 256 the prompt needs.
			engines: [3]engine{{sample: true, usage: 0.65, kvTokens: kv, detached: 2}, {sample: true, usage: 0.7, running: 9, kvTokens: kv}, {sample: true, waiting: 1, kvTokens: kv}},
			blocks:  4, want: 1},
		{name: "no fresh sample counts as room",
			engines: [3]engine{{sample: true, waiting: 1, kvTokens: kv}, {}, {sample: true, waiting: 2, kvTokens: kv}},
			blocks:  1, want: 1},
		{name: "a KV of unknown size counts as room",
			engines: [3]engine{{sample: true, usage: 0.99, running: 1}, {sample: true, usage: 0.99, kvTokens: kv}, {sample: true, waiting: 1, kvTokens: kv}},
			blocks:  1, want: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			eps := endpoints(3)
			clk := newFakeClock()
			set := NewSet(eps, Options{Now: clk.Now})
			leg, err := NewLeg(set, &configv1.Picker{Policy: ForecastPolicy}, RoleDecode)
			require.NoError(t, err)
			req := Request{Blocks: blocksOf(1, 2, 3, 4)[:tc.blocks], BlockTokens: 64, Tokens: 64 * tc.blocks}
			for i, e := range tc.engines {
				if e.sample {
					set.Observe(eps[i].Address, Load{Waiting: e.waiting, Running: e.running, KVUsage: e.usage, KVTokens: e.kvTokens, At: clk.Now()})
				}
				if e.sent > 0 {
					l, ok := leg.Pick(Request{Subset: []string{eps[i].Address}, Blocks: req.Blocks[:e.sent], BlockTokens: 64, Tokens: 64 * e.sent})
					require.True(t, ok)
					l.End(Released)
				}
				for range e.detached {
					l, ok := leg.Pick(Request{Subset: []string{eps[i].Address}, Tokens: 100})
					require.True(t, ok)
					require.True(t, l.Detach())
				}
			}
			for range 3 { // whatever the turn
				l, ok := leg.Pick(req)
				require.True(t, ok)
				require.Equal(t, eps[tc.want], l.Endpoint())
				l.End(Released)
			}
		})
	}
}

// PickAgain counts the request's own earlier pick not against its
// endpoint, keeps it on a tie (round robin keeps it whatever), and moves
// the lease, its count and its prompt, when another endpoint is better.
func TestPickAgain(t *testing.T) {
	for _, policy := range []string{ForecastPolicy, LeastRequestPolicy, LoadAwarePolicy, RoundRobinPolicy} {
		t.Run(policy, func(t *testing.T) {
			eps := endpoints(2)
			set := NewSet(eps, Options{})
			leg, err := NewLeg(set, &configv1.Picker{Policy: policy}, RoleDecode)
			require.NoError(t, err)
			blocks := blocksOf(1, 2)
			req := Request{Blocks: blocks, BlockTokens: 64, Tokens: 128, Tentative: true}
			first, ok := leg.Pick(req)
			require.True(t, ok)
			on := first.Endpoint()
			require.Zero(t, set.view.Load().index.matched(set.view.Load().position(on), blocks, false),
				"a tentative pick records no prompt")

			// Nothing changed: the pick stands, now recorded.
			for range 3 {
				require.False(t, leg.PickAgain(req, &first))
			}
			require.Equal(t, on, first.Endpoint())
			require.Equal(t, 1, set.InFlight(on))
			require.Equal(t, 2, set.view.Load().index.matched(set.view.Load().position(on), blocks, false))
			first.End(Released)

			// Two more requests on the first pick's endpoint since: the
			// policies that read the load move it, round robin keeps it.
			second, ok := leg.Pick(Request{Blocks: blocksOf(9), BlockTokens: 64, Tokens: 64, Tentative: true})
			require.True(t, ok)
			on = second.Endpoint()
			var others []Lease
			for range 2 {
				l, ok := leg.Pick(Request{Subset: []string{on.Address}, Tokens: 64})
				require.True(t, ok)
				others = append(others, l)
			}
			moved := leg.PickAgain(Request{Blocks: blocksOf(9), BlockTokens: 64, Tokens: 64}, &second)
			require.Equal(t, policy != RoundRobinPolicy, moved)
			if moved {
				require.NotEqual(t, on, second.Endpoint())
				require.Equal(t, 2, set.InFlight(on), "the first pick no longer counts there")
				require.Equal(t, 1, set.InFlight(second.Endpoint()))
				require.Zero(t, set.view.Load().index.matched(set.view.Load().position(on), blocksOf(9), false))
				require.Equal(t, 1, set.view.Load().index.matched(set.view.Load().position(second.Endpoint()), blocksOf(9), false))
			}
			second.End(Released)
			for _, l := range others {
				l.End(Released)
			}
			for _, ep := range eps {
				require.Zero(t, set.InFlight(ep))
			}
		})
	}
}
