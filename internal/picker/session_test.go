package picker

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/endpoint"
)

// replica is one pdx replica's leg over the same engines as the others',
// built on its own: nothing is shared but the engines' addresses (in an
// order of its own, as each replica's discovery lists them) and what the
// engines report.
type replica struct {
	Leg
	clk *fakeClock
}

func newReplica(t testing.TB, eps []endpoint.Endpoint, policy string, role Role, seed uint64) replica {
	t.Helper()
	eps = slices.Clone(eps)
	rand.New(rand.NewPCG(seed, seed)).Shuffle(len(eps), func(i, j int) { eps[i], eps[j] = eps[j], eps[i] })
	clk := newFakeClock()
	set := NewSet(eps, Options{FailureThreshold: 1, CoolDown: time.Minute, Now: clk.Now, StaleAfter: time.Hour,
		Saturation: Saturation{QueueDepth: 5, MaxInFlight: 2}})
	l, err := NewLeg(set, &configv1.Picker{Policy: policy}, role)
	require.NoError(t, err)
	return replica{Leg: l, clk: clk}
}

// pick is the session's pick, its lease ended at once, and its outcome.
func (r replica) pick(t testing.TB, req Request) (endpoint.Endpoint, SessionOutcome) {
	t.Helper()
	lease, ok := r.Pick(req)
	require.True(t, ok, "session %x", req.Session)
	lease.End(Released)
	return lease.Endpoint(), lease.Session()
}

// report tells the replica what the engine at address says of its queue.
func (r replica) report(address string, waiting int) {
	r.Observe(address, Load{Waiting: waiting, At: r.clk.Now()})
}

func sessionKeys(n int) []uint64 {
	keys := make([]uint64, n)
	for i := range keys {
		keys[i] = SessionKey(fmt.Appendf(nil, "session-%d", i))
	}
	return keys
}

func TestSessionKey(t *testing.T) {
	require.Zero(t, SessionKey(nil), "no value, no session")
	require.Zero(t, SessionKey([]byte{}))
	require.Equal(t, SessionKey([]byte("a")), SessionKey([]byte("a")))
	require.NotEqual(t, SessionKey([]byte("a")), SessionKey([]byte("b")))
	require.NotZero(t, SessionKey([]byte("a")))
}

// Two replicas, built apart with their endpoints in other orders, send
// each session to the same endpoint, pick after pick, whatever their
// policy and however loaded the engines are (short of saturation); the
// sessions spread over the endpoints.
func TestSessionSameOnEveryReplica(t *testing.T) {
	eps := endpoints(5)
	for _, policy := range Policies() {
		for _, role := range []Role{RolePrefill, RoleDecode} {
			t.Run(fmt.Sprintf("%s/%s", policy, role), func(t *testing.T) {
				a, b := newReplica(t, eps, policy, role, 1), newReplica(t, eps, policy, role, 2)
				for i, ep := range eps {
					a.report(ep.Address, i%4)
					b.report(ep.Address, i%4)
				}
				spread := map[endpoint.Endpoint]int{}
				for n, key := range sessionKeys(200) {
					req := Request{Session: key, Blocks: blocksOf(n, 1), BlockTokens: 64, Tokens: 128}
					first, outcome := a.pick(t, req)
					require.Equal(t, SessionKept, outcome)
					for range 3 {
						ep, outcome := a.pick(t, req)
						require.Equal(t, first, ep, "session %d, again on replica a", n)
						require.Equal(t, SessionKept, outcome)
						ep, outcome = b.pick(t, req)
						require.Equal(t, first, ep, "session %d on replica b", n)
						require.Equal(t, SessionKept, outcome)
					}
					spread[first]++
				}
				require.Len(t, spread, len(eps), "every endpoint has sessions: %v", spread)
				for ep, n := range spread {
					require.Greater(t, n, 10, "%v has few of 200 sessions: %v", ep, spread)
				}
			})
		}
	}
}

// sessionOrder is the session's endpoints, first first, as a replica
// ranks them: each pick with the ones before it tried.
func sessionOrder(t testing.TB, r replica, req Request) []endpoint.Endpoint {
	t.Helper()
	var order []endpoint.Endpoint
	req.Tried = nil
	for {
		lease, ok := r.Pick(req)
		if !ok {
			return order
		}
		lease.End(Released)
		order = append(order, lease.Endpoint())
		req.Tried = append(req.Tried, lease.Endpoint())
	}
}

// A session whose first endpoint is saturated (by the engine's word, which
// every replica reads alike) or ejected yields to its second, on every
// replica, and returns when the first has room again; one whose first two
// are saturated goes to its third. Whatever the leg's policy: one that
// weighs queues (least_work, forecast) does not for a session.
func TestSessionYieldsAndReturns(t *testing.T) {
	eps := endpoints(4)
	for _, leg := range []struct {
		role   Role
		policy string
	}{{RolePrefill, LoadAwarePolicy}, {RolePrefill, ForecastPolicy}, {RolePrefill, LeastWorkPolicy}, {RoleDecode, LoadAwarePolicy}, {RoleDecode, LeastWorkPolicy}} {
		role := leg.role
		t.Run(role.String()+"/"+leg.policy, func(t *testing.T) {
			a, b := newReplica(t, eps, leg.policy, role, 1), newReplica(t, eps, leg.policy, role, 2)
			for n, key := range sessionKeys(20) {
				req := Request{Session: key}
				order := sessionOrder(t, a, req)
				require.Len(t, order, len(eps))
				require.Equal(t, order, sessionOrder(t, b, req), "session %d: the replicas' orders", n)

				// Saturated by the engine's word: both replicas yield.
				a.report(order[0].Address, 5)
				b.report(order[0].Address, 5)
				for _, r := range []replica{a, b} {
					ep, outcome := r.pick(t, req)
					require.Equal(t, order[1], ep, "session %d yields to its second", n)
					require.Equal(t, SessionMoved, outcome)
				}
				a.report(order[1].Address, 7)
				ep, outcome := a.pick(t, req)
				require.Equal(t, order[2], ep, "session %d: first two saturated", n)
				require.Equal(t, SessionMoved, outcome)
				a.report(order[0].Address, 0)
				b.report(order[0].Address, 0)
				a.report(order[1].Address, 0)
				for _, r := range []replica{a, b} {
					ep, outcome := r.pick(t, req)
					require.Equal(t, order[0], ep, "session %d returns", n)
					require.Equal(t, SessionKept, outcome)
				}

				// Saturated by this replica's own requests in flight
				// (max_in_flight 2): it yields until they end.
				held := []Lease{leased(t, a, req), leased(t, a, req)}
				require.Equal(t, order[0], held[1].Endpoint())
				ep, _ = a.pick(t, req)
				require.Equal(t, order[1], ep, "session %d yields while its first is full", n)
				held[0].End(Succeeded)
				ep, _ = a.pick(t, req)
				require.Equal(t, order[0], ep, "session %d returns when a request ends", n)
				held[1].End(Succeeded)

				// Ejected: it yields until the cool-down ends.
				a.Report(order[0], false)
				ep, outcome = a.pick(t, req)
				require.Equal(t, order[1], ep, "session %d yields while its first is ejected", n)
				require.Equal(t, SessionMoved, outcome)
				a.clk.Advance(time.Minute)
				ep, outcome = a.pick(t, req)
				require.Equal(t, order[0], ep, "session %d returns after the cool-down", n)
				require.Equal(t, SessionKept, outcome)
				a.Report(order[0], true)
			}
		})
	}
}

// leased is the session's lease on r, left open.
func leased(t testing.TB, r replica, req Request) Lease {
	t.Helper()
	l, ok := r.Pick(req)
	require.True(t, ok)
	return l
}

// Every endpoint saturated: the session's order still decides among them
// (the replicas agree on panic mode too); every one ejected: the one whose
// ejection ends first.
func TestSessionPanic(t *testing.T) {
	eps := endpoints(3)
	r := newReplica(t, eps, LeastRequestPolicy, RoleDecode, 1)
	req := Request{Session: SessionKey([]byte("s"))}
	order := sessionOrder(t, r, req)
	for _, ep := range eps {
		r.report(ep.Address, 9)
	}
	require.True(t, r.Saturated(""))
	ep, outcome := r.pick(t, req)
	require.Equal(t, order[0], ep)
	require.Equal(t, SessionKept, outcome)
	r.Report(order[0], false)
	ep, outcome = r.pick(t, req)
	require.Equal(t, order[1], ep, "saturated over ejected")
	require.Equal(t, SessionMoved, outcome)
	r.clk.Advance(time.Second)
	r.Report(order[2], false)
	r.clk.Advance(time.Second)
	r.Report(order[1], false)
	ep, _ = r.pick(t, req)
	require.Equal(t, order[0], ep, "all ejected: the first ejected comes back first")
}

// Removing an endpoint moves only the sessions it had, each to its
// second; the others stay where they were. Adding it back takes back
// those and no others.
func TestSessionRemovalMovesOnlyItsSessions(t *testing.T) {
	eps := endpoints(6)
	r := newReplica(t, eps, LoadAwarePolicy, RoleDecode, 1)
	keys := sessionKeys(300)
	before := make([]endpoint.Endpoint, len(keys))
	second := make([]endpoint.Endpoint, len(keys))
	for n, key := range keys {
		req := Request{Session: key}
		before[n], _ = r.pick(t, req)
		req.Tried = []endpoint.Endpoint{before[n]}
		second[n], _ = r.pick(t, req)
	}
	gone := eps[2]
	r.SetEndpoints(slices.DeleteFunc(slices.Clone(eps), func(e endpoint.Endpoint) bool { return e == gone }))
	moved := 0
	for n, key := range keys {
		ep, outcome := r.pick(t, Request{Session: key})
		require.Equal(t, SessionKept, outcome, "the removed endpoint ranks no more")
		if before[n] == gone {
			require.Equal(t, second[n], ep, "session %d moves to its second", n)
			moved++
			continue
		}
		require.Equal(t, before[n], ep, "session %d stays", n)
	}
	require.Greater(t, moved, 20, "the removed endpoint had sessions")
	r.SetEndpoints(eps)
	for n, key := range keys {
		ep, _ := r.pick(t, Request{Session: key})
		require.Equal(t, before[n], ep, "session %d, the endpoint back", n)
	}
}

// A session's pick keeps the shared rules: within the request's group
// (a prefill's: its decode's) and subset hint, never a tried endpoint.
// Its first endpoint is ranked within the group, so that a session kept
// on its group's first counts as kept, and one the subset hint sends
// elsewhere as moved.
func TestSessionGroupAndSubset(t *testing.T) {
	for _, role := range []Role{RolePrefill, RoleDecode} {
		t.Run(role.String(), func(t *testing.T) {
			r := newReplica(t, contractEndpoints, LeastWorkPolicy, role, 1)
			inGroup := map[string][]endpoint.Endpoint{"x": endpointsOf(0, 1, 2), "y": endpointsOf(3, 4)}
			for n, key := range sessionKeys(40) {
				for group, members := range inGroup {
					req := Request{Session: key, Group: group}
					order := sessionOrder(t, r, req)
					require.ElementsMatch(t, members, order, "session %d, group %s", n, group)
					ep, outcome := r.pick(t, req)
					require.Equal(t, order[0], ep)
					require.Equal(t, SessionKept, outcome, "the group's first")

					req.Subset = []string{order[len(order)-1].Address, contractEndpoints[5].Address}
					ep, outcome = r.pick(t, req)
					require.Equal(t, order[len(order)-1], ep, "session %d: the group within the subset hint", n)
					require.Equal(t, SessionMoved, outcome, "its first is outside the subset hint")

					req.Subset, req.Tried = nil, order[:1]
					ep, outcome = r.pick(t, req)
					require.Equal(t, order[1], ep, "session %d: a retry goes to the second", n)
					require.Equal(t, SessionMoved, outcome)
				}
				_, ok := r.Pick(Request{Session: key, Group: "y", Subset: addressesOf(0, 1, 2, 5)})
				require.False(t, ok, "none of the group in the subset")
			}
		})
	}
}

// A decode's fallbacks (Next) follow the session's order: the second
// first, then the third, the session's pick left as it is.
func TestSessionFallbacksFollowItsOrder(t *testing.T) {
	eps := endpoints(5)
	r := newReplica(t, eps, RoundRobinPolicy, RoleDecode, 1)
	for n, key := range sessionKeys(20) {
		req := Request{Session: key}
		order := sessionOrder(t, r, req)
		req.Tried = order[:1]
		for _, want := range order[1:] {
			ep, ok := r.Next(req)
			require.True(t, ok)
			require.Equal(t, want, ep, "session %d", n)
			req.Tried = append(req.Tried, ep)
		}
		ep, _ := r.pick(t, Request{Session: key})
		require.Equal(t, order[0], ep, "session %d: fallbacks leave the pick alone", n)
	}
}

// Without a session a pick is the policy's: a request of no session on
// round robin goes round, one of a session stays.
func TestSessionOverridesThePolicy(t *testing.T) {
	eps := endpoints(3)
	r := newReplica(t, eps, RoundRobinPolicy, RoleDecode, 1)
	seen := map[endpoint.Endpoint]bool{}
	for range 3 {
		ep, outcome := r.pick(t, Request{})
		require.Equal(t, NoSession, outcome)
		seen[ep] = true
	}
	require.Len(t, seen, 3, "round robin goes round")
	key := SessionKey([]byte("s"))
	first, _ := r.pick(t, Request{Session: key})
	for range 3 {
		ep, _ := r.pick(t, Request{Session: key})
		require.Equal(t, first, ep)
	}
}

func TestSessionPicksDoNotAllocate(t *testing.T) {
	eps := endpoints(64)
	b := blocksOf(1, 2, 3, 4, 5, 6, 7, 8)
	for _, role := range []Role{RolePrefill, RoleDecode} {
		set := NewSet(eps, Options{Saturation: Saturation{QueueDepth: 5, KVUsage: 0.8}})
		for i, ep := range eps {
			set.Observe(ep.Address, Load{Waiting: i % 3, Running: i % 7, KVUsage: 0.5, At: time.Now()})
		}
		l, err := NewLeg(set, nil, role)
		require.NoError(t, err)
		key := SessionKey([]byte("s"))
		tried := []endpoint.Endpoint{eps[3]}
		require.Zero(t, testing.AllocsPerRun(200, func() {
			lease, _ := l.Pick(Request{Session: key, Blocks: b, BlockTokens: 64, Tokens: 600, NeedCached: true})
			lease.End(Succeeded)
		}), "%s: pick and end", role)
		require.Zero(t, testing.AllocsPerRun(200, func() { l.Next(Request{Session: key, Blocks: b, Tried: tried}) }), "%s: fallback", role)
	}
}

// BenchmarkSession is a session's pick at 64 endpoints with fresh engine
// metrics, on the decode leg's default policy (which the session
// overrides).
func BenchmarkSession(b *testing.B) {
	eps := endpoints(64)
	set := NewSet(eps, Options{Saturation: Saturation{QueueDepth: 5, KVUsage: 0.8}})
	for i, ep := range eps {
		set.Observe(ep.Address, Load{Waiting: i % 3, Running: i % 7, KVUsage: 0.5, At: time.Now()})
	}
	l, err := NewLeg(set, nil, RoleDecode)
	require.NoError(b, err)
	keys := sessionKeys(64)
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		lease, _ := l.Pick(Request{Session: keys[i%len(keys)]})
		lease.End(Released)
		i++
	}
}
