// Package picker chooses the engine endpoint for each leg of a request.
package picker

import (
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdx-router/pdx/internal/endpoint"
)

// Defaults for the zero Options.
const (
	DefaultFailureThreshold = 3
	DefaultCoolDown         = 10 * time.Second
)

// Options configure a RoundRobin's passive outlier detection.
type Options struct {
	// FailureThreshold is how many consecutive failures eject an endpoint;
	// 0 or less means DefaultFailureThreshold.
	FailureThreshold int
	// CoolDown is how long an ejected endpoint stays out; 0 or less means
	// DefaultCoolDown.
	CoolDown time.Duration
	// Now tells the time; nil means time.Now. Tests pass a fake clock.
	Now func() time.Time
	// Inherit, when set, is a picker whose endpoints' health the new one
	// shares: an endpoint both have keeps its failures and ejection, and
	// Reports to either count for both. A rebuilt routing table passes its
	// predecessor's picker, so that passive health survives a config
	// reload. Inherit must use the same clock (Now).
	Inherit *RoundRobin
}

// RoundRobin hands out its endpoints in turn, passing over those that passive
// outlier detection has ejected: an endpoint whose calls fail
// FailureThreshold times in a row (as told by Report) is left out for
// CoolDown, then tried again.
//
// Its endpoints can be replaced while it is in use (SetEndpoints, as
// Kubernetes discovery does): every Pick, Report or Healthy sees either the
// old set or the new one, and endpoints in both keep their health.
//
// It is safe for concurrent use and holds no per-request state: the turn
// counter and the endpoints' health belong to no request, and what a request
// has already tried is passed to Pick by the caller.
type RoundRobin struct {
	// set is the current endpoint set. It is replaced whole, never changed,
	// so that a Pick reads one consistent set without locking.
	set atomic.Pointer[endpointSet]
	// mu serializes SetEndpoints, so that each builds on the set before it.
	mu sync.Mutex

	threshold int32
	coolDown  int64 // nanoseconds
	now       func() time.Time
	// base is the clock reading at construction. Times are stored as
	// nanoseconds since base, so they fit in an atomic int64 and, with
	// time.Now, are measured on the monotonic clock (immune to wall-clock
	// steps).
	base time.Time

	// next is the turn counter. Every Pick adds to it, from every
	// goroutine; the padding keeps that write traffic off the cache line
	// holding the read-only fields above.
	_    [64]byte
	next atomic.Uint64
	_    [56]byte
}

// endpointSet is one immutable set of endpoints with their health.
type endpointSet struct {
	// endpoints is the turn order, as configured; it may name an endpoint
	// twice. health[i] is endpoints[i]'s health; repeats share one, since
	// health is a property of the engine, not of its place in the list.
	endpoints []endpoint.Endpoint
	health    []*health
	// byEP finds an endpoint's health for Report and Healthy in large
	// pools; small ones are scanned (see lookup). nil when small.
	byEP map[endpoint.Endpoint]*health
	// groups holds, per Endpoint.Group, the positions of the group's
	// endpoints and the group's own turn counter (PickGroup). nil when no
	// endpoint has a group.
	groups map[string]*group
}

// group is the endpoints of one Endpoint.Group, in turn order.
type group struct {
	members []int
	next    atomic.Uint64
}

// health is one endpoint's outlier-detection state.
//
// Pick only reads until, atomically and without locking, so picking never
// waits for a Report. Report changes failures and until together under mu, so
// that the invariant "ejected implies failures >= threshold" holds and
// concurrent Reports cannot leave an ejection behind a reset counter.
type health struct {
	mu sync.Mutex
	// failures counts consecutive failures. Written only under mu; read
	// atomically by Report's lock-free success path.
	failures atomic.Int32
	// until is when the current ejection ends, in nanoseconds since
	// RoundRobin.base; 0 means not ejected (admitted).
	until atomic.Int64
	// Pad to a cache line: endpoints' health is allocated together, and
	// Reports on one must not slow Picks reading another.
	_ [64 - 8 - 4 - 4 - 8]byte
}

// NewRoundRobin returns a picker over endpoints. It keeps its own copy of
// endpoints. An empty picker's Pick fails until SetEndpoints gives it some.
func NewRoundRobin(endpoints []endpoint.Endpoint, opts Options) *RoundRobin {
	if opts.FailureThreshold <= 0 {
		opts.FailureThreshold = DefaultFailureThreshold
	}
	if opts.CoolDown <= 0 {
		opts.CoolDown = DefaultCoolDown
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	r := &RoundRobin{
		threshold: int32(min(opts.FailureThreshold, 1<<30)),
		coolDown:  int64(opts.CoolDown),
		now:       opts.Now,
	}
	var prev *endpointSet
	if opts.Inherit != nil {
		// Shared health holds times relative to base, so share that too.
		r.base = opts.Inherit.base
		prev = opts.Inherit.set.Load()
	} else {
		r.base = r.now()
	}
	r.set.Store(newEndpointSet(endpoints, prev))
	return r
}

// SetEndpoints replaces the picker's endpoints with a copy of endpoints, at
// once for every caller: a Pick running concurrently returns an endpoint of
// the old set or of the new one. Endpoints in both keep their health;
// endpoints that leave lose it (one that comes back starts afresh).
func (r *RoundRobin) SetEndpoints(endpoints []endpoint.Endpoint) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.set.Store(newEndpointSet(endpoints, r.set.Load()))
}

// newEndpointSet builds a set of endpoints, taking the health of those that
// prev (which may be nil) has.
func newEndpointSet(endpoints []endpoint.Endpoint, prev *endpointSet) *endpointSet {
	s := &endpointSet{
		endpoints: slices.Clone(endpoints),
		health:    make([]*health, len(endpoints)),
	}
	// A new picker allocates its health together. A replacing set keeps
	// most of its predecessor's and allocates each new one alone: one array
	// would stay alive as long as any of its elements does.
	var states []health
	if prev == nil {
		states = make([]health, len(endpoints))
	}
	byEP := make(map[endpoint.Endpoint]*health, len(endpoints))
	for i, ep := range s.endpoints {
		h, ok := byEP[ep]
		if !ok {
			switch h = prev.lookup(ep); {
			case h != nil:
			case states != nil:
				h = &states[i]
			default:
				h = new(health)
			}
			byEP[ep] = h
		}
		s.health[i] = h
		if ep.Group != "" {
			if s.groups == nil {
				s.groups = map[string]*group{}
			}
			g := s.groups[ep.Group]
			if g == nil {
				g = &group{}
				s.groups[ep.Group] = g
			}
			g.members = append(g.members, i)
		}
	}
	if len(s.endpoints) > scanMax {
		s.byEP = byEP
	}
	return s
}

// scanMax is the pool size up to which lookup scans rather than hashes. The
// endpoint a caller reports is normally the one Pick returned, sharing its
// strings, so comparing is a pointer check per field; hashing the strings
// costs more than scanning a few of those.
const scanMax = 16

// lookup returns ep's health, or nil if ep is not one of s's endpoints (or
// s is nil).
func (s *endpointSet) lookup(ep endpoint.Endpoint) *health {
	if s == nil {
		return nil
	}
	if s.byEP != nil {
		return s.byEP[ep]
	}
	for i, e := range s.endpoints {
		if e == ep {
			return s.health[i]
		}
	}
	return nil
}

// Pick returns the next admitted endpoint in turn that is not in exclude
// (the endpoints this request has already tried).
//
// When every endpoint not in exclude is ejected, Pick returns the one whose
// cool-down ends first rather than failing: like Envoy's panic mode, it
// assumes the detector is wrong sooner than that the whole pool is down. Only
// when every endpoint is excluded does it return ok=false.
//
// Pick does not allocate, and takes no lock.
func (r *RoundRobin) Pick(exclude ...endpoint.Endpoint) (ep endpoint.Endpoint, ok bool) {
	return r.pick(r.set.Load(), nil, &r.next, exclude)
}

// PickGroup is Pick among the endpoints whose Group is group, in turn: a
// request pairs its prefill with its decode endpoint's group. It returns
// ok=false when the group has no endpoint, or all of them are excluded.
//
// PickGroup does not allocate, and takes no lock.
func (r *RoundRobin) PickGroup(group string, exclude ...endpoint.Endpoint) (ep endpoint.Endpoint, ok bool) {
	s := r.set.Load()
	g := s.groups[group]
	if g == nil {
		return endpoint.Endpoint{}, false
	}
	return r.pick(s, g.members, &g.next, exclude)
}

// pick picks among the positions members of s (all of them when members is
// nil), drawing turns from counter.
func (r *RoundRobin) pick(s *endpointSet, members []int, counter *atomic.Uint64, exclude []endpoint.Endpoint) (endpoint.Endpoint, bool) {
	n := uint64(len(s.endpoints))
	if members != nil {
		n = uint64(len(members))
	}
	if n == 0 {
		return endpoint.Endpoint{}, false
	}
	// The clock is read only when an ejected endpoint is met, so the common
	// case, all admitted, costs one atomic add and one atomic load.
	now := int64(-1)
	var turn uint64
	// Each endpoint passed over uses up a turn rather than handing its turn
	// to its successor in the list: otherwise the endpoint after an ejected
	// one would get twice the share of the others.
	for range n {
		turn = counter.Add(1) - 1
		i := position(members, turn%n)
		if !excluded(s.endpoints[i], exclude) && r.admitted(s.health[i], &now) {
			return s.endpoints[i], true
		}
	}
	// The n turns drawn above need not be n different positions when other
	// goroutines draw turns concurrently, so look at every position before
	// going into panic mode.
	return r.fallback(s, members, turn, exclude, now)
}

// position is the k-th position of members, or k when members is nil (all).
func position(members []int, k uint64) int {
	if members == nil {
		return int(k)
	}
	return members[k]
}

// fallback scans all positions after turn for an admitted endpoint not in
// exclude; failing that, it returns the non-excluded one whose ejection ends
// first, ties going to the earliest in turn order.
func (r *RoundRobin) fallback(s *endpointSet, members []int, turn uint64, exclude []endpoint.Endpoint, now int64) (endpoint.Endpoint, bool) {
	n := uint64(len(s.endpoints))
	if members != nil {
		n = uint64(len(members))
	}
	best, bestUntil := -1, int64(0)
	for k := uint64(1); k <= n; k++ {
		i := position(members, (turn+k)%n)
		if excluded(s.endpoints[i], exclude) {
			continue
		}
		h := s.health[i]
		if r.admitted(h, &now) {
			return s.endpoints[i], true
		}
		if u := h.until.Load(); best < 0 || u < bestUntil {
			best, bestUntil = i, u
		}
	}
	if best < 0 {
		return endpoint.Endpoint{}, false
	}
	return s.endpoints[best], true
}

// admitted reports whether h is not ejected. *now caches the clock for one
// Pick; negative means not read yet.
func (r *RoundRobin) admitted(h *health, now *int64) bool {
	u := h.until.Load()
	if u == 0 {
		return true
	}
	if *now < 0 {
		*now = r.elapsed()
	}
	return *now >= u
}

func excluded(ep endpoint.Endpoint, exclude []endpoint.Endpoint) bool {
	for _, e := range exclude {
		if e == ep {
			return true
		}
	}
	return false
}

// elapsed is the time since r.base in nanoseconds, never negative (a fake
// clock may go back before base).
func (r *RoundRobin) elapsed() int64 {
	return max(int64(r.now().Sub(r.base)), 0)
}

// Report records the outcome of a call to ep. Success resets ep's
// consecutive failures and re-admits it. Failure counts; the
// FailureThreshold-th consecutive failure ejects ep until now+CoolDown.
// Once the cool-down is over ep is admitted again but keeps its count
// (half-open), so one more failure ejects it again at once, while a success
// clears it.
//
// Failures reported while ep is ejected are counted but do not extend the
// ejection: they are mostly calls picked before it, and would otherwise keep
// an endpoint out for as long as its in-flight requests keep failing.
//
// Reports about endpoints the picker does not have are ignored.
func (r *RoundRobin) Report(ep endpoint.Endpoint, ok bool) {
	h := r.set.Load().lookup(ep)
	if h == nil {
		return
	}
	if ok {
		// The common case, a success on a healthy endpoint, writes
		// nothing: no lock, no cache-line traffic for Pick. failures == 0
		// implies not ejected (see health).
		if h.failures.Load() == 0 {
			return
		}
		h.mu.Lock()
		h.failures.Store(0)
		h.until.Store(0)
		h.mu.Unlock()
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	f := h.failures.Load()
	if f < 1<<30 { // saturate rather than wrap on an endless failure streak
		f++
		h.failures.Store(f)
	}
	if f < r.threshold {
		return
	}
	now := r.elapsed()
	if u := h.until.Load(); u != 0 && now < u {
		return // already ejected
	}
	until := now + r.coolDown
	if until < now { // overflow: a cool-down of "forever"
		until = math.MaxInt64
	}
	// At least 1: 0 means admitted, and a fake clock standing at base with a
	// tiny cool-down must still eject.
	h.until.Store(max(until, 1))
}

// Healthy reports whether ep is currently admitted: a known endpoint that is
// not ejected, or whose cool-down is over.
func (r *RoundRobin) Healthy(ep endpoint.Endpoint) bool {
	h := r.set.Load().lookup(ep)
	if h == nil {
		return false
	}
	now := int64(-1)
	return r.admitted(h, &now)
}

// Contains reports whether ep is one of the picker's endpoints.
func (r *RoundRobin) Contains(ep endpoint.Endpoint) bool {
	return r.set.Load().lookup(ep) != nil
}

// Endpoints returns a copy of the picker's endpoints, in turn order.
func (r *RoundRobin) Endpoints() []endpoint.Endpoint {
	return slices.Clone(r.set.Load().endpoints)
}
