package picker

import (
	"fmt"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
)

// LoadAwarePolicy names LoadAware in the config.
const LoadAwarePolicy = "load_aware"

func loadAwareSpec() Spec {
	return Spec{
		Name:   LoadAwarePolicy,
		Fields: []string{"weights"},
		Defaults: func(p *configv1.Picker, role Role) {
			if p.Weights == nil {
				w := DefaultWeights(role)
				p.Weights = &configv1.Weights{Prefix: w.Prefix, Queue: w.Queue, KvUsage: w.KVUsage, InFlight: w.InFlight}
			}
		},
		Validate: func(p *configv1.Picker, path string) []error {
			var errs []error
			w := p.GetWeights()
			for _, f := range []struct {
				name string
				w    float64
			}{{"prefix", w.GetPrefix()}, {"queue", w.GetQueue()}, {"kv_usage", w.GetKvUsage()}, {"in_flight", w.GetInFlight()}} {
				if f.w < 0 || f.w > 100 {
					errs = append(errs, fmt.Errorf("%s.weights.%s: %v is not in [0, 100]", path, f.name, f.w))
				}
			}
			return errs
		},
		New: func(p *configv1.Picker, _ Role) Policy {
			w := p.GetWeights()
			return &LoadAware{w: Weights{Prefix: w.GetPrefix(), Queue: w.GetQueue(), KVUsage: w.GetKvUsage(), InFlight: w.GetInFlight()}}
		},
	}
}

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
	// InFlight scores the requests on the engine: pdx's in-flight count
	// and, by the engine's fresh metrics, those pdx does not count (other
	// replicas' and routers', and pdx's own detached decodes), scaled like
	// Queue.
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
// weighted scorers. Ties go round: the scan starts one candidate further
// each pick.
type LoadAware struct {
	w Weights
}

var _ Policy = (*LoadAware)(nil)

// Choose implements [Policy]: the usable candidate with the best score.
func (p *LoadAware) Choose(c *Candidates) int {
	gs := c.all()
	n := len(gs)
	var queue, flight span
	for k := range gs {
		if g := &gs[k]; g.usable {
			queue.add(g.queued())
			flight.add(g.requests())
		}
	}
	prefix := p.w.Prefix > 0 && c.hasPrompt()
	start := c.Start()
	if !queue.seen {
		return -1 // none usable
	}
	var d depths
	if prefix {
		d = c.depths()
	}
	best, bestScore := -1, 0.0
	// k goes round from start without a division a candidate.
	for j, k := 0, start; j < n; j, k = j+1, k+1 {
		if k == n {
			k = 0
		}
		g := &gs[k]
		if !g.usable {
			continue
		}
		score := p.w.Queue*queue.score(g.queued()) + p.w.InFlight*flight.score(g.requests())
		if prefix {
			score += p.w.Prefix * d.prefixShare(k)
		}
		if p.w.KVUsage != 0 {
			free := 0.5
			if g.kvUsage >= 0 {
				free = 1 - min(g.kvUsage, 1)
			}
			score += p.w.KVUsage * free
		}
		if best < 0 || score > bestScore {
			best, bestScore = k, score
		}
	}
	return best
}

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
