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
}

// regretLog judges a replay's prefills as they arrive (see Regret).
type regretLog struct {
	engines []*enginesim.Server
	tie     time.Duration

	mu                          sync.Mutex
	prefills, misplaced         int
	excess, misWait, misCompute time.Duration
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
	l.add(fs, at)
}

// add counts a prefill that came to engine at, with every engine's
// forecast fs. l.mu is held.
func (l *regretLog) add(fs []enginesim.PrefillForecast, at int) {
	best := 0
	for i, f := range fs {
		if f.TTFT() < fs[best].TTFT() {
			best = i
		}
	}
	excess := fs[at].TTFT() - fs[best].TTFT()
	l.prefills++
	l.excess += excess
	if excess > l.tie {
		l.misplaced++
		l.misWait += fs[at].Wait - fs[best].Wait
		l.misCompute += fs[at].Compute - fs[best].Compute
	}
}

// stop ends the watch and returns what it judged.
func (l *regretLog) stop() Regret {
	for _, e := range l.engines {
		e.ObservePrefills(nil)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	r := Regret{Prefills: l.prefills}
	if l.prefills > 0 {
		r.Misplaced = float64(l.misplaced) / float64(l.prefills)
		r.MeanExcessMs = ms(l.excess) / float64(l.prefills)
	}
	if l.misplaced > 0 {
		r.WaitMs, r.ComputeMs = ms(l.misWait)/float64(l.misplaced), ms(l.misCompute)/float64(l.misplaced)
	}
	return r
}

// pooledRegret is the regret of samples pooled, each weighed by its
// prefills; nil when none judged any.
func pooledRegret(samples []sample) *Regret {
	var r Regret
	misplaced := 0.0
	for _, s := range samples {
		n := float64(s.regret.Prefills)
		if n == 0 {
			continue
		}
		r.Prefills += s.regret.Prefills
		r.MeanExcessMs += n * s.regret.MeanExcessMs
		m := n * s.regret.Misplaced
		misplaced += m
		r.Misplaced += m
		r.WaitMs += m * s.regret.WaitMs
		r.ComputeMs += m * s.regret.ComputeMs
	}
	if r.Prefills == 0 {
		return nil
	}
	r.MeanExcessMs /= float64(r.Prefills)
	r.Misplaced /= float64(r.Prefills)
	if misplaced > 0 {
		r.WaitMs, r.ComputeMs = r.WaitMs/misplaced, r.ComputeMs/misplaced
	}
	return &r
}
