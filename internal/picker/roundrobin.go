package picker

import (
	"sync"
	"sync/atomic"

	"github.com/pdx-router/pdx/internal/endpoint"
)

// RoundRobinPolicy names RoundRobin in the config.
const RoundRobinPolicy = "round_robin"

// RoundRobin hands out a Set's endpoints in turn, passing over those the
// Set's health has ejected and those the request has tried. A request with a
// group takes turns among that group's endpoints, each group with a turn
// counter of its own.
//
// It is safe for concurrent use and holds no per-request state: the turn
// counters belong to no request.
type RoundRobin struct {
	set *Set
	// mu serializes growing groups.
	mu sync.Mutex
	// groups are the groups' turn counters, indexed by the Set's group
	// numbers. The slice is replaced whole when a new group needs a
	// counter; the counters themselves are kept, so no turn is lost.
	groups atomic.Pointer[[]*atomic.Uint64]

	// next is the turn counter of requests without a group. Every Pick adds
	// to it, from every goroutine; the padding keeps that write traffic off
	// the cache line holding the read-only fields above.
	_    [64]byte
	next atomic.Uint64
	_    [56]byte
}

var _ Picker = (*RoundRobin)(nil)

// NewRoundRobin returns a round robin over set.
func NewRoundRobin(set *Set) *RoundRobin {
	return &RoundRobin{set: set}
}

// Pick returns the next admitted endpoint in turn that the request has not
// tried.
//
// When every endpoint not tried is ejected, Pick returns the one whose
// cool-down ends first rather than failing (see view.soonest). Only when
// every endpoint is tried, or the request's group has none, does it return
// ok=false.
//
// Pick does not allocate, and takes no lock once the request's group has a
// counter.
func (r *RoundRobin) Pick(req Request) (endpoint.Endpoint, bool) {
	v := r.set.view.Load()
	members, id, ok := v.candidates(req.Group)
	n := v.count(members)
	if !ok || n == 0 {
		return endpoint.Endpoint{}, false
	}
	counter := &r.next
	if id >= 0 {
		counter = r.groupCounter(id)
	}
	now := r.set.clock()
	var turn uint64
	// Each endpoint passed over uses up a turn rather than handing its turn
	// to its successor in the list: otherwise the endpoint after an ejected
	// one would get twice the share of the others.
	for range n {
		turn = counter.Add(1) - 1
		i := position(members, int(turn%uint64(n)))
		if !req.skips(v.endpoints[i]) && now.usable(v.states[i]) {
			return v.endpoints[i], true
		}
	}
	// The n turns drawn above need not be n different positions when other
	// goroutines draw turns concurrently, so look at every position, from
	// the one after the last turn, before going into panic mode.
	return v.soonest(members, int((turn+1)%uint64(n)), req, &now)
}

var _ Successor = (*RoundRobin)(nil)

// Next implements [Successor]: the first admitted endpoint after the last
// one req tried, in the Set's order, that req may use (untried, in its
// subset); the cool-down that ends first when all are ejected.
func (r *RoundRobin) Next(req Request) (endpoint.Endpoint, bool) {
	v := r.set.view.Load()
	members, _, ok := v.candidates(req.Group)
	n := v.count(members)
	if !ok || n == 0 {
		return endpoint.Endpoint{}, false
	}
	start := 0
	if len(req.Tried) > 0 {
		last := req.Tried[len(req.Tried)-1]
		for k := range n {
			if v.endpoints[position(members, k)] == last {
				start = k + 1
				break
			}
		}
	}
	now := r.set.clock()
	for k := range n {
		i := position(members, (start+k)%n)
		if !req.skips(v.endpoints[i]) && now.usable(v.states[i]) {
			return v.endpoints[i], true
		}
	}
	return v.soonest(members, start%n, req, &now)
}

// groupCounter returns the turn counter of group number id.
func (r *RoundRobin) groupCounter(id int) *atomic.Uint64 {
	if g := r.groups.Load(); g != nil && id < len(*g) {
		return (*g)[id]
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	var counters []*atomic.Uint64
	if g := r.groups.Load(); g != nil {
		counters = *g
	}
	if id < len(counters) {
		return counters[id]
	}
	grown := make([]*atomic.Uint64, id+1)
	copy(grown, counters)
	for i := len(counters); i <= id; i++ {
		grown[i] = new(atomic.Uint64)
	}
	r.groups.Store(&grown)
	return grown[id]
}

// Report does nothing: taking turns learns nothing from outcomes, and the
// Set's health has counted them.
func (r *RoundRobin) Report(endpoint.Endpoint, bool) {}
