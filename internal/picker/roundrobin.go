// Package picker chooses the engine endpoint for each leg of a request.
package picker

import (
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdx-router/pdx/connectors"
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
}

// RoundRobin hands out its endpoints in turn, passing over those that passive
// outlier detection has ejected: an endpoint whose calls fail
// FailureThreshold times in a row (as told by Report) is left out for
// CoolDown, then tried again.
//
// It is safe for concurrent use and holds no per-request state: the turn
// counter and the endpoints' health belong to no request, and what a request
// has already tried is passed to Pick by the caller.
type RoundRobin struct {
	// endpoints is the turn order, as configured; it may name an endpoint
	// twice. health[i] is endpoints[i]'s health; repeats share one, since
	// health is a property of the engine, not of its place in the list.
	endpoints []connectors.Endpoint
	health    []*health
	// byEP finds an endpoint's health for Report and Healthy in large
	// pools; small ones are scanned (see lookup). nil when small.
	byEP map[connectors.Endpoint]*health

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

// NewRoundRobin returns a picker over endpoints, which should not be empty
// (an empty picker's Pick always fails). It keeps its own copy of endpoints.
func NewRoundRobin(endpoints []connectors.Endpoint, opts Options) *RoundRobin {
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
		endpoints: slices.Clone(endpoints),
		health:    make([]*health, len(endpoints)),
		threshold: int32(min(opts.FailureThreshold, 1<<30)),
		coolDown:  int64(opts.CoolDown),
		now:       opts.Now,
	}
	r.base = r.now()
	states := make([]health, len(endpoints))
	byEP := make(map[connectors.Endpoint]*health, len(endpoints))
	for i, ep := range r.endpoints {
		h, ok := byEP[ep]
		if !ok {
			h = &states[i]
			byEP[ep] = h
		}
		r.health[i] = h
	}
	if len(r.endpoints) > scanMax {
		r.byEP = byEP
	}
	return r
}

// scanMax is the pool size up to which lookup scans rather than hashes. The
// endpoint a caller reports is normally the one Pick returned, sharing its
// strings, so comparing is a pointer check per field; hashing the strings
// costs more than scanning a few of those.
const scanMax = 16

// lookup returns ep's health, or nil if ep is not one of r's endpoints.
func (r *RoundRobin) lookup(ep connectors.Endpoint) *health {
	if r.byEP != nil {
		return r.byEP[ep]
	}
	return r.scan(ep)
}

func (r *RoundRobin) scan(ep connectors.Endpoint) *health {
	for i, e := range r.endpoints {
		if e == ep {
			return r.health[i]
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
func (r *RoundRobin) Pick(exclude ...connectors.Endpoint) (ep connectors.Endpoint, ok bool) {
	n := uint64(len(r.endpoints))
	if n == 0 {
		return connectors.Endpoint{}, false
	}
	// The clock is read only when an ejected endpoint is met, so the common
	// case, all admitted, costs one atomic add and one atomic load.
	now := int64(-1)
	var turn uint64
	// Each endpoint passed over uses up a turn rather than handing its turn
	// to its successor in the list: otherwise the endpoint after an ejected
	// one would get twice the share of the others.
	for range n {
		turn = r.next.Add(1) - 1
		i := turn % n
		if !excluded(r.endpoints[i], exclude) && r.admitted(r.health[i], &now) {
			return r.endpoints[i], true
		}
	}
	// The n turns drawn above need not be n different positions when other
	// goroutines draw turns concurrently, so look at every position before
	// going into panic mode.
	return r.fallback(turn, exclude, now)
}

// fallback scans all positions after turn for an admitted endpoint not in
// exclude; failing that, it returns the non-excluded one whose ejection ends
// first, ties going to the earliest in turn order.
func (r *RoundRobin) fallback(turn uint64, exclude []connectors.Endpoint, now int64) (connectors.Endpoint, bool) {
	n := uint64(len(r.endpoints))
	best, bestUntil := -1, int64(0)
	for k := uint64(1); k <= n; k++ {
		i := int((turn + k) % n)
		if excluded(r.endpoints[i], exclude) {
			continue
		}
		h := r.health[i]
		if r.admitted(h, &now) {
			return r.endpoints[i], true
		}
		if u := h.until.Load(); best < 0 || u < bestUntil {
			best, bestUntil = i, u
		}
	}
	if best < 0 {
		return connectors.Endpoint{}, false
	}
	return r.endpoints[best], true
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

func excluded(ep connectors.Endpoint, exclude []connectors.Endpoint) bool {
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
func (r *RoundRobin) Report(ep connectors.Endpoint, ok bool) {
	h := r.lookup(ep)
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
func (r *RoundRobin) Healthy(ep connectors.Endpoint) bool {
	h := r.lookup(ep)
	if h == nil {
		return false
	}
	now := int64(-1)
	return r.admitted(h, &now)
}

// Contains reports whether ep is one of the picker's endpoints.
func (r *RoundRobin) Contains(ep connectors.Endpoint) bool {
	return r.lookup(ep) != nil
}

// Endpoints returns a copy of the picker's endpoints, in turn order.
func (r *RoundRobin) Endpoints() []connectors.Endpoint {
	return slices.Clone(r.endpoints)
}
