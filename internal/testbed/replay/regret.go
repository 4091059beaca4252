package replay

import (
	"sync"
	"time"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

// Regret is how far a run's prefill placements were from the best the
// engines' true state allowed. As each prefill leg reaches its engine,
// before the engine queues it, the harness forecasts its prompt on every
// prefill engine (enginesim's forecasts, which the oracle places by) and
// compares the engine it came to with the one forecast to answer first.
// It is judged at the arrival, not at the pick: of prefills placed at
// once (a burst), the one that arrives first finds the idle engine.
type Regret struct {
	// Prefills is how many prefill legs were judged.
	Prefills int `json:"prefills"`
	// Misplaced is the share of them whose engine's forecast TTFT was
	// more than the oracle's tie (a trace block's prefill) above the
	// least.
	Misplaced float64 `json:"misplaced"`
	// MeanExcessMs is the mean excess over all prefills judged, in ms.
	MeanExcessMs float64 `json:"mean_excess_ms"`
	// WaitMs and ComputeMs split the misplaced prefills' mean excess into
	// what they waited for more than on the best engine (its queue) and
	// what they computed more (its cache): negative when it was less.
	WaitMs    float64 `json:"wait_ms"`
	ComputeMs float64 `json:"compute_ms"`
	// HitTaken and HitBest are the prompt tokens the prefills would find
	// cached on the engine each came to and on the engine holding the
	// most of it, as shares of their prompt tokens (as each arrived,
	// counting what the prompts ahead of it compute): HitBest − HitTaken
	// is the hit placement left on other engines, and HitBest what the
	// run's history left to take. LeftCache is the share of prefills that
	// came to an engine holding less of their prompt than another, and
	// LeftMisplaced the share that did and were misplaced too: what they
	// gave up bought them no time.
	HitTaken      float64 `json:"hit_taken"`
	HitBest       float64 `json:"hit_best"`
	LeftCache     float64 `json:"left_cache"`
	LeftMisplaced float64 `json:"left_misplaced"`
}

// judged counts a replay's prefills as judged: each replay's are summed
// to pool them, and the figures are taken once (regret).
type judged struct {
	prefills, misplaced int
	// excess is over every prefill; wait and compute over the misplaced.
	excess, wait, compute time.Duration
	// tokens, taken and held are the prompt tokens, those cached where
	// each prefill came and where the most were; left counts the prefills
	// that came where less was, leftMisplaced those of them misplaced.
	tokens, taken, held int64
	left, leftMisplaced int
}

// add counts a prefill that came to engine at, with every engine's
// forecast fs; tie is how much above the least still counts as well
// placed.
func (j *judged) add(fs []enginesim.PrefillForecast, at int, tie time.Duration) {
	best, most := 0, 0
	for i, f := range fs {
		if f.TTFT() < fs[best].TTFT() {
			best = i
		}
		most = max(most, f.CachedTokens)
	}
	excess := fs[at].TTFT() - fs[best].TTFT()
	j.tokens += int64(fs[at].PromptTokens)
	j.taken += int64(fs[at].CachedTokens)
	j.held += int64(most)
	left := fs[at].CachedTokens < most
	if left {
		j.left++
	}
	j.prefills++
	j.excess += excess
	if excess > tie {
		if left {
			j.leftMisplaced++
		}
		j.misplaced++
		j.wait += fs[at].Wait - fs[best].Wait
		j.compute += fs[at].Compute - fs[best].Compute
	}
}

// plus is j and o together.
func (j judged) plus(o judged) judged {
	return judged{
		prefills: j.prefills + o.prefills, misplaced: j.misplaced + o.misplaced,
		excess: j.excess + o.excess, wait: j.wait + o.wait, compute: j.compute + o.compute,
		tokens: j.tokens + o.tokens, taken: j.taken + o.taken, held: j.held + o.held,
		left: j.left + o.left, leftMisplaced: j.leftMisplaced + o.leftMisplaced,
	}
}

// regret is what j judged; nil when it judged no prefill.
func (j judged) regret() *Regret {
	if j.prefills == 0 {
		return nil
	}
	r := &Regret{
		Prefills:      j.prefills,
		Misplaced:     float64(j.misplaced) / float64(j.prefills),
		MeanExcessMs:  ms(j.excess) / float64(j.prefills),
		LeftCache:     float64(j.left) / float64(j.prefills),
		LeftMisplaced: float64(j.leftMisplaced) / float64(j.prefills),
	}
	if j.tokens > 0 {
		r.HitTaken, r.HitBest = float64(j.taken)/float64(j.tokens), float64(j.held)/float64(j.tokens)
	}
	if j.misplaced > 0 {
		r.WaitMs, r.ComputeMs = ms(j.wait)/float64(j.misplaced), ms(j.compute)/float64(j.misplaced)
	}
	return r
}

// regretLog judges a replay's prefills as they arrive (see Regret).
type regretLog struct {
	engines []*enginesim.Server
	tie     time.Duration

	mu     sync.Mutex
	judged judged
}

// watchRegret judges every prefill leg that reaches engines from now on,
// until stop; tie is how much above the least forecast still counts as
// well placed.
func watchRegret(engines []*enginesim.Server, tie time.Duration) *regretLog {
	l := &regretLog{engines: engines, tie: tie}
	for i, e := range engines {
		e.ObservePrefills(func(prompt string) { l.observe(i, prompt) })
	}
	return l
}

// observe judges a prefill of prompt arriving at engine at.
func (l *regretLog) observe(at int, prompt string) {
	fs := make([]enginesim.PrefillForecast, len(l.engines))
	for i, e := range l.engines {
		fs[i] = e.ForecastPrefill(prompt)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.judged.add(fs, at, l.tie)
}

// stop ends the watch and returns what it judged.
func (l *regretLog) stop() judged {
	for _, e := range l.engines {
		e.ObservePrefills(nil)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.judged
}

// pooledRegret is the regret of samples pooled; nil when none judged any.
func pooledRegret(samples []sample) *Regret {
	var all judged
	for _, s := range samples {
		all = all.plus(s.judged)
	}
	return all.regret()
}
