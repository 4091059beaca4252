package picker

import (
	"sync/atomic"

	"github.com/pdx-router/pdx/internal/endpoint"
)

// LoadAwarePolicy names LoadAware in the config.
const LoadAwarePolicy = "load_aware"

// Weights weigh LoadAware's scores. Each score is in [0, 1], higher is
// better; an endpoint's total is their weighted sum.
type Weights struct {
	// Prefix scores the share of the prompt's blocks this pdx has sent the
	// endpoint (its approximate prefix cache).
	Prefix float64
	// Queue scores the engine's waiting requests (by its fresh metrics,
	// else pdx's in-flight count), least best, scaled between the
	// candidates' least and most.
	Queue float64
	// KVUsage scores the engine's free KV cache (1 - usage; 0.5 when it
	// does not say).
	KVUsage float64
	// InFlight scores pdx's own in-flight count, scaled like Queue.
	InFlight float64
}

// DefaultWeights are load_aware's weights for a role: prefill placement
// favours prefix hits and short queues (the prefill's time is the prompt's
// uncached part, after what is queued before it), decode placement favours
// KV headroom (a decode holds its KV for the whole generation) and its
// batch's size.
func DefaultWeights(r Role) Weights {
	if r == RoleDecode {
		return Weights{Prefix: 1, Queue: 1, KVUsage: 2, InFlight: 1}
	}
	return Weights{Prefix: 3, Queue: 2, InFlight: 1}
}

// LoadAware scores every candidate endpoint on prefix match, queue, KV
// usage and in-flight requests and picks the best, like the llm-d router's
// weighted scorers. Ties go round: the scan starts one endpoint further each
// pick.
type LoadAware struct {
	set *Set
	w   Weights
	_   [64]byte
	// next is where the next pick starts its scan.
	next atomic.Uint64
	_    [56]byte
}

var _ Picker = (*LoadAware)(nil)

// NewLoadAware returns a load-aware policy over set with weights w.
func NewLoadAware(set *Set, w Weights) *LoadAware { return &LoadAware{set: set, w: w} }

// Pick returns the usable endpoint with the best score that the request
// has not tried, falling back like RoundRobin when none is usable. It does
// not allocate for sets of up to 64 endpoints.
func (p *LoadAware) Pick(req Request) (endpoint.Endpoint, bool) {
	v := p.set.view.Load()
	members, _, ok := v.candidates(req.Group)
	n := v.count(members)
	if !ok || n == 0 {
		return endpoint.Endpoint{}, false
	}
	var depths [64]int32
	var depth []int32
	if p.w.Prefix > 0 {
		depth = v.depths(req.Blocks, depths[:])
	}
	now := p.set.clock()
	var buf [64]signal
	signals, usable := now.looks(v, members, req, buf[:])
	start := int(p.next.Add(1) % uint64(n))
	if usable == 0 {
		return v.soonest(members, start, req, &now)
	}
	var queue, flight span
	for k := range signals {
		if g := &signals[k]; g.usable {
			queue.add(g.queued())
			flight.add(g.inFlight)
		}
	}
	best, bestScore := -1, 0.0
	for j := range n {
		k := (start + j) % n
		g := &signals[k]
		if !g.usable {
			continue
		}
		i := position(members, k)
		score := p.w.Queue*queue.score(g.queued()) + p.w.InFlight*flight.score(g.inFlight)
		if len(depth) > 0 {
			score += p.w.Prefix * float64(depth[i]) / float64(len(req.Blocks))
		}
		if p.w.KVUsage != 0 {
			free := 0.5
			if g.kvUsage >= 0 {
				free = 1 - min(g.kvUsage, 1)
			}
			score += p.w.KVUsage * free
		}
		if best < 0 || score > bestScore {
			best, bestScore = i, score
		}
	}
	return v.endpoints[best], true
}

// Report does nothing: loads come from Begin, End and Observe.
func (p *LoadAware) Report(endpoint.Endpoint, bool) {}

// queued is the queue LoadAware scores: the engine's waiting requests when
// its metrics are fresh, else pdx's in-flight count.
func (g *signal) queued() int {
	if g.fresh {
		return g.waiting
	}
	return g.inFlight
}

// span is the range of a load among candidates, to score one in it.
type span struct {
	lo, hi int
	seen   bool
}

func (s *span) add(x int) {
	if !s.seen {
		s.lo, s.hi, s.seen = x, x, true
		return
	}
	s.lo, s.hi = min(s.lo, x), max(s.hi, x)
}

// score is 1 for the least, 0 for the most, linear between; 1 when all
// are equal.
func (s *span) score(x int) float64 {
	if s.hi == s.lo {
		return 1
	}
	return float64(s.hi-x) / float64(s.hi-s.lo)
}
