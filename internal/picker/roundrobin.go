package picker

import (
	"sync"
	"sync/atomic"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
)

// RoundRobinPolicy names RoundRobin in the config.
const RoundRobinPolicy = "round_robin"

func roundRobinSpec() Spec {
	return Spec{
		Name: RoundRobinPolicy,
		New:  func(*configv1.Picker, Role) Policy { return new(RoundRobin) },
	}
}

// RoundRobin hands out the candidates in turn, passing over those that are
// not usable. A request with a group takes turns among that group's
// endpoints, each group with a turn counter of its own.
//
// It is safe for concurrent use and holds no per-request state: the turn
// counters belong to no request.
type RoundRobin struct {
	// mu serializes growing groups.
	mu sync.Mutex
	// groups are the groups' turn counters, indexed by the Set's group
	// numbers. The slice is replaced whole when a new group needs a
	// counter; the counters themselves are kept, so no turn is lost.
	groups atomic.Pointer[[]*atomic.Uint64]

	// next is the turn counter of requests without a group. Every pick adds
	// to it, from every goroutine; the padding keeps that write traffic off
	// the cache line holding the read-only fields above.
	_    [64]byte
	next atomic.Uint64
	_    [56]byte
}

var (
	_ Policy    = (*RoundRobin)(nil)
	_ Successor = (*RoundRobin)(nil)
)

// Choose implements [Policy]: the next usable candidate in turn, or, for a
// pick made again (Request.Stay), the earlier pick's while usable. It reads
// only the candidates it passes over, and takes no lock once the request's
// group has a counter.
func (r *RoundRobin) Choose(c *Candidates) int {
	if k := c.stay; k >= 0 && c.Usable(k) {
		return k // a pick made again keeps its turn's endpoint
	}
	counter := &r.next
	if c.group >= 0 {
		counter = r.groupCounter(c.group)
	}
	n := uint64(c.Len())
	var turn uint64
	// Each candidate passed over uses up a turn rather than handing its
	// turn to its successor in the list: otherwise the endpoint after an
	// ejected one would get twice the share of the others.
	for range n {
		turn = counter.Add(1) - 1
		if k := int(turn % n); c.Usable(k) {
			return k
		}
	}
	// The n turns drawn above need not be n different candidates when
	// other goroutines draw turns concurrently, so look at every one, from
	// the one after the last turn.
	return c.next(int((turn + 1) % n))
}

// Next implements [Successor]: the first usable candidate after the last
// one the request tried, in the Set's order.
func (r *RoundRobin) Next(c *Candidates) int { return c.next(c.after) }

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
