package picker

import (
	"math"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/pdx-router/pdx/internal/endpoint"
)

// health is one endpoint's outlier-detection state and load signals, and
// for a prefill endpoint the fluid model of its work.
//
// Picks only read until, atomically and without locking, so picking never
// waits for a Report. Report changes failures and until together under mu, so
// that the invariant "ejected implies failures >= threshold" holds and
// concurrent Reports cannot leave an ejection behind a reset counter.
type health struct {
	mu sync.Mutex
	// failures counts consecutive failures. Written only under mu; read
	// atomically by Report's lock-free success path.
	failures atomic.Int32
	// detached counts the leases ended by Detach (mod 2^32): the load
	// stored with each sample says how many there were then, so a pick
	// counts those since, which the sample cannot show.
	detached atomic.Uint32
	// until is when the current ejection ends, in nanoseconds since
	// Set.base; 0 means not ejected (admitted).
	until atomic.Int64
	// inFlight counts the requests leased the endpoint that have not
	// ended, inFlightTokens the tokens their leases count.
	inFlight, inFlightTokens atomic.Int64
	// load is the engine's latest Load (Observe), nil before the first.
	load atomic.Pointer[load]
	// seed is the hash of the endpoint's address: every pdx replica
	// computes the same, for prefix affinity to agree without talking.
	seed uint64
	// ranks counts pdx's requests per DP rank of the endpoint (see
	// Lease.Rank); nil without DP ranks (Endpoint.DPSize <= 1).
	ranks *ranks

	// work is a prefill endpoint's fluid model, on a line of its own that
	// decode Sets never touch.
	work fluid
	// sent is what pdx sent the endpoint of the Set's adapters (lora.go),
	// nil without Options.Adapters; on the second line, read only by picks
	// for an adapter.
	sent atomic.Pointer[adapterMemory]
	// service is a prefill endpoint's learned service model (forecast
	// policy), set when the health is made.
	service *service
}

// health fills two cache lines exactly (this fails to compile otherwise):
// endpoints' health is allocated together, and Reports on one must not slow
// picks reading another. The first line is what every pick reads and every
// lease counts, the second the fluid model, which only prefill Sets use.
var _ [0]struct{} = [unsafe.Sizeof(health{}) - 128]struct{}{}

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
// Reports about endpoints the set does not have are ignored. A lease's
// End reports its outcome itself.
func (s *Set) Report(ep endpoint.Endpoint, ok bool) {
	if h := s.view.Load().lookup(ep); h != nil {
		s.report(h, ok)
	}
}

// report is Report on an endpoint's health.
func (s *Set) report(h *health, ok bool) {
	if ok {
		// The common case, a success on a healthy endpoint, writes
		// nothing: no lock, no cache-line traffic for picks. failures == 0
		// implies not ejected (see health).
		if h.failures.Load() == 0 {
			return
		}
		h.mu.Lock()
		h.failures.Store(0)
		h.until.Store(0)
		h.mu.Unlock()
		s.room.wake() // a re-admitted endpoint may have room
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	f := h.failures.Load()
	if f < 1<<30 { // saturate rather than wrap on an endless failure streak
		f++
		h.failures.Store(f)
	}
	if f < s.threshold {
		return
	}
	now := s.elapsed()
	if u := h.until.Load(); u != 0 && now < u {
		return // already ejected
	}
	until := now + s.coolDown
	if until < now { // overflow: a cool-down of "forever"
		until = math.MaxInt64
	}
	// At least 1: 0 means admitted, and a fake clock standing at base with a
	// tiny cool-down must still eject.
	h.until.Store(max(until, 1))
}

// Healthy reports whether ep is currently admitted: a known endpoint that is
// not ejected, or whose cool-down is over.
func (s *Set) Healthy(ep endpoint.Endpoint) bool {
	h := s.view.Load().lookup(ep)
	if h == nil {
		return false
	}
	now := s.clock()
	return now.admits(h)
}
