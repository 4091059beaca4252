package picker

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/endpoint"
)

// The contract every policy keeps, whatever it prefers: the rules a pick
// shares (group, subset hint, tried, health, saturation, panic mode) and
// the fallback successor's (distinct endpoints, usable ones first). It runs
// over every registered policy, for both roles.

// contractEndpoints: x1..x3 in group x, y4 and y5 in group y, z6 in none.
var contractEndpoints = []endpoint.Endpoint{
	{Address: "10.0.0.1:8000", Group: "x"}, {Address: "10.0.0.2:8000", Group: "x"}, {Address: "10.0.0.3:8000", Group: "x"},
	{Address: "10.0.0.4:8000", Group: "y"}, {Address: "10.0.0.5:8000", Group: "y"},
	{Address: "10.0.0.6:8000"},
}

// contractLeg is a policy's leg, as the contract drives it.
type contractLeg struct {
	Leg
	clk *fakeClock
}

func newContractLeg(t *testing.T, policy string, role Role) contractLeg {
	t.Helper()
	clk := newFakeClock()
	set := NewSet(contractEndpoints, Options{
		FailureThreshold: 1, CoolDown: time.Minute, Now: clk.Now, StaleAfter: time.Hour,
		Saturation: Saturation{QueueDepth: 5, KVUsage: 0.8},
	})
	l, err := NewLeg(set, &configv1.Picker{Policy: policy}, role)
	require.NoError(t, err)
	return contractLeg{Leg: l, clk: clk}
}

// pick is a request's pick, its lease ended at once.
func (l contractLeg) pick(req Request) (endpoint.Endpoint, bool) {
	lease, ok := l.Pick(req)
	lease.End(Released)
	return lease.Endpoint(), ok
}

// next is a decode fallback's pick: the successor of req.Tried's last.
func (l contractLeg) next(req Request) (endpoint.Endpoint, bool) { return l.Next(req) }

// eject ejects the endpoints at is, one second apart: the first one's
// ejection ends first.
func (l contractLeg) eject(is ...int) {
	for _, i := range is {
		l.Report(contractEndpoints[i], false)
		l.clk.Advance(time.Second)
	}
}

// saturate makes the engines at is say their KV cache is full: every
// policy passes over that (a full queue, the policies that weigh queues
// weigh instead: TestQueueDepthWeighed).
func (l contractLeg) saturate(is ...int) {
	for _, i := range is {
		l.Observe(contractEndpoints[i].Address, Load{KVUsage: 0.9, At: l.clk.Now()})
	}
}

func addressesOf(is ...int) []string {
	out := []string{}
	for _, i := range is {
		out = append(out, contractEndpoints[i].Address)
	}
	return out
}

func endpointsOf(is ...int) []endpoint.Endpoint {
	var out []endpoint.Endpoint
	for _, i := range is {
		out = append(out, contractEndpoints[i])
	}
	return out
}

func TestContract(t *testing.T) {
	for _, tc := range []struct {
		name string
		// ejected are ejected in this order (the first comes back first),
		// saturated say their queue is full.
		ejected, saturated []int
		group              string
		subset             []string
		tried              []int
		// picks are the endpoints a pick may return; none: it fails.
		picks []int
		// usable are the endpoints the request may use that are neither
		// ejected nor saturated: its fallbacks name them before the others.
		usable []int
		// others are the rest of the endpoints the request may use.
		others []int
	}{
		{name: "any", picks: []int{0, 1, 2, 3, 4, 5}, usable: []int{0, 1, 2, 3, 4, 5}},
		{name: "subset hint", subset: addressesOf(1, 3, 5), picks: []int{1, 3, 5}, usable: []int{1, 3, 5}},
		{name: "subset hint and group", group: "x", subset: addressesOf(0, 2, 3), picks: []int{0, 2}, usable: []int{0, 2}},
		{name: "subset hint naming others", subset: []string{"10.9.9.9:1"}},
		{name: "empty subset hint", subset: []string{}},
		{name: "tried", tried: []int{0, 2, 5}, picks: []int{1, 3, 4}, usable: []int{1, 3, 4}},
		{name: "all tried", tried: []int{5, 4, 3, 2, 1, 0}},
		{name: "group", group: "y", picks: []int{3, 4}, usable: []int{3, 4}},
		{name: "group tried", group: "x", tried: []int{1}, picks: []int{0, 2}, usable: []int{0, 2}},
		{name: "group all tried", group: "y", tried: []int{3, 4}},
		{name: "unknown group", group: "w"},
		{name: "ejected avoided", ejected: []int{0, 3}, picks: []int{1, 2, 4, 5}, usable: []int{1, 2, 4, 5}, others: []int{0, 3}},
		{name: "saturated avoided", saturated: []int{1, 4, 5}, picks: []int{0, 2, 3}, usable: []int{0, 2, 3}, others: []int{1, 4, 5}},
		{name: "ejected and saturated avoided in the subset", ejected: []int{1}, saturated: []int{3}, subset: addressesOf(1, 3, 5),
			picks: []int{5}, usable: []int{5}, others: []int{1, 3}},
		{name: "panic: the ejection that ends first", ejected: []int{4, 2, 0, 1, 3, 5}, picks: []int{4}, others: []int{0, 1, 2, 3, 4, 5}},
		{name: "panic: the ejection that ends first, untried", ejected: []int{4, 2, 0, 1, 3, 5}, tried: []int{4},
			picks: []int{2}, others: []int{0, 1, 2, 3, 5}},
		{name: "panic: in the subset", ejected: []int{4, 2, 0, 1, 3, 5}, subset: addressesOf(0, 1, 3), picks: []int{0}, others: []int{0, 1, 3}},
		{name: "panic: in the group", ejected: []int{4, 2, 0, 1, 3, 5}, group: "x", picks: []int{2}, others: []int{0, 1, 2}},
		{name: "panic: saturated over ejected", ejected: []int{0}, saturated: []int{1, 2, 3, 4, 5},
			picks: []int{1, 2, 3, 4, 5}, others: []int{0, 1, 2, 3, 4, 5}},
		{name: "panic: saturated in the group", ejected: []int{3}, saturated: []int{4}, group: "y", picks: []int{4}, others: []int{3, 4}},
	} {
		for _, policy := range Policies() {
			for _, role := range []Role{RolePrefill, RoleDecode} {
				t.Run(fmt.Sprintf("%s/%s/%s", tc.name, policy, role), func(t *testing.T) {
					l := newContractLeg(t, policy, role)
					l.eject(tc.ejected...)
					l.saturate(tc.saturated...)
					tried := endpointsOf(tc.tried...)
					for k := range 12 {
						req := Request{Group: tc.group, Subset: tc.subset, Tried: tried, Blocks: blocksOf(k%4, k), BlockTokens: 64, Tokens: 128,
							Session: uint64(k%2) * SessionKey([]byte{byte(k)})} // every other pick a session's
						ep, ok := l.pick(req)
						if tc.picks == nil {
							require.False(t, ok, "pick %d: %v", k, ep)
							f, ok := l.next(req)
							require.False(t, ok, "fallback %d: %v", k, f)
							continue
						}
						require.True(t, ok, "pick %d", k)
						require.Contains(t, endpointsOf(tc.picks...), ep, "pick %d", k)

						// The fallbacks after ep: every other endpoint the
						// request may use, once each, usable ones first.
						req.Tried = append(slices.Clone(tried), ep)
						mayUse := append(endpointsOf(tc.usable...), endpointsOf(tc.others...)...)
						var fallbacks []endpoint.Endpoint
						for {
							f, ok := l.next(req)
							if !ok {
								break
							}
							require.NotContains(t, req.Tried, f, "fallback after %v", req.Tried)
							require.Contains(t, mayUse, f, "fallback after %v: one the request may use", req.Tried)
							fallbacks = append(fallbacks, f)
							req.Tried = append(req.Tried, f)
						}
						usable := slices.DeleteFunc(endpointsOf(tc.usable...), func(e endpoint.Endpoint) bool { return e == ep })
						others := slices.DeleteFunc(endpointsOf(tc.others...), func(e endpoint.Endpoint) bool { return e == ep })
						require.Len(t, fallbacks, len(usable)+len(others), "fallbacks after %v: %v", ep, fallbacks)
						require.ElementsMatch(t, usable, fallbacks[:len(usable)], "usable fallbacks first, after %v: %v", ep, fallbacks)
						require.ElementsMatch(t, others, fallbacks[len(usable):], "then the others, after %v: %v", ep, fallbacks)
					}
				})
			}
		}
	}
}

// TestPoliciesDoNotAllocate: a pick, its lease's end and a fallback's pick
// allocate nothing at 64 endpoints with fresh engine metrics and a prompt,
// whatever the policy and role.
func TestPoliciesDoNotAllocate(t *testing.T) {
	eps := endpoints(64)
	b := blocksOf(1, 2, 3, 4, 5, 6, 7, 8)
	for _, policy := range Policies() {
		for _, role := range []Role{RolePrefill, RoleDecode} {
			t.Run(fmt.Sprintf("%s/%s", policy, role), func(t *testing.T) {
				set := NewSet(eps, Options{Saturation: Saturation{QueueDepth: 5, KVUsage: 0.8}})
				for i, ep := range eps {
					set.Observe(ep.Address, Load{Waiting: i % 3, Running: i % 7, KVUsage: 0.5, At: time.Now()})
				}
				hold(t, set, eps[3], b, 0)
				l, err := NewLeg(set, &configv1.Picker{Policy: policy}, role)
				require.NoError(t, err)
				tried := []endpoint.Endpoint{eps[3]}
				subset := []string{eps[3].Address, eps[7].Address, eps[9].Address}
				require.Zero(t, testing.AllocsPerRun(200, func() { l.peek(Request{Blocks: b}) }), "choose")
				require.Zero(t, testing.AllocsPerRun(200, func() {
					lease, _ := l.Pick(Request{Blocks: b, BlockTokens: 64, Tokens: 600, NeedCached: true})
					lease.End(Succeeded)
				}), "pick and end")
				require.Zero(t, testing.AllocsPerRun(200, func() { l.Next(Request{Blocks: b, Subset: subset, Tried: tried}) }), "fallback")
			})
		}
	}
}

// peek is a pick that leases nothing: what a policy's tests look at.
func (l *Leg) peek(req Request) (endpoint.Endpoint, bool) {
	v, i, _, _, ok := l.pick(&req, false)
	if !ok {
		return endpoint.Endpoint{}, false
	}
	return v.endpoints[i], true
}

// choose is what policy p picks over set for req, leasing nothing.
func choose(set *Set, p Policy, req Request) (endpoint.Endpoint, bool) {
	l := newLeg(set, p, RolePrefill)
	return l.peek(req)
}

// hold leases ep for a request with a prompt of blocks and tokens tokens,
// as one sent there and still running; the caller may end it.
func hold(t testing.TB, set *Set, ep endpoint.Endpoint, blocks []uint64, tokens int) *Lease {
	t.Helper()
	// Round robin: it leaves the Set's turn (Candidates.Start) alone.
	l := newLeg(set, new(RoundRobin), RoleDecode)
	lease, ok := l.Pick(Request{Subset: []string{ep.Address}, Blocks: blocks, Tokens: tokens})
	require.True(t, ok)
	require.Equal(t, ep, lease.Endpoint())
	return &lease
}
