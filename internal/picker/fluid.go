package picker

import (
	"math"
	"sync/atomic"
)

// fluid is a prefill endpoint's fluid model: how much of the prompt
// tokens pdx has in flight there its engine has computed, for least_work
// to count what remains rather than every prompt whole until it answers.
//
// An engine computes its queue at some rate R, so over a busy period (pdx
// has had a prefill on it ever since busyStart) it has computed
// R × (now − busyStart) tokens: those of the prefills that ended since, and
// the rest of the ones in flight (remaining). R is learned from pdx's own
// prefills (learn). Only prefill leases write it, so a decode Set never
// touches it; a Set's endpoints are all of one role.
//
// Starts, ends and picks run concurrently without locking: a race can make
// the model approximate for a moment or, in the window between a busy
// period's first count and its start being stored, for one rate sample;
// the orders below are chosen so that it then errs toward counting more
// remaining, today's count.
type fluid struct {
	// busyStart is when pdx's in-flight count on the endpoint last went
	// from 0 to 1, in nanoseconds since Set.base.
	busyStart atomic.Int64
	// ended counts the tokens of every prefill lease that has ended
	// (never reset), served those of the ones that succeeded; endedAt and
	// servedAt are what they were when the busy period started.
	ended, served, endedAt, servedAt atomic.Int64
	// rate is R in tokens per nanosecond (float64 bits); 0 until the
	// first sample.
	rate atomic.Uint64
}

// rateWeight is the weight of a rate sample in the learned rate, an EWMA:
// samples late in a busy period are close to R, early ones noisy (see
// learn), and a few tens of prefills follow a change of the engine's pace.
const rateWeight = 1.0 / 8

// count counts a lease of tokens on h, a prefill's in the fluid model.
func (s *Set) count(h *health, tokens int, prefill bool) {
	if !prefill {
		h.inFlight.Add(1)
		h.inFlightTokens.Add(int64(tokens))
		return
	}
	// Read before the count, as ends add before they uncount: a previous
	// busy period's last end that this misses counts as ended in this one,
	// which errs toward less computed.
	ended, served := h.work.ended.Load(), h.work.served.Load()
	if h.inFlight.Add(1) == 1 {
		h.work.busyStart.Store(s.elapsed())
		h.work.endedAt.Store(ended)
		h.work.servedAt.Store(served)
	}
	h.inFlightTokens.Add(int64(tokens))
}

// end records a prefill lease of tokens ending, before it stops counting
// in flight: a pick in between counts it as both, computing less. Every
// end counts as computed (a request cancelled before the engine got to it
// was not, but counting it errs toward more remaining); only a success,
// an answer, says the engine is that far, and teaches the rate.
func (f *fluid) end(s *Set, tokens int, succeeded bool) {
	f.ended.Add(int64(tokens))
	if !succeeded {
		return
	}
	served := f.served.Add(int64(tokens)) - f.servedAt.Load()
	busy := s.elapsed() - f.busyStart.Load()
	if served > 0 && busy > 0 {
		f.learn(float64(served) / float64(busy))
	}
}

// learn takes a sample of the rate: at a prefill's answer, the tokens
// answered in the busy period so far over its time so far. Under FCFS that
// is R less the answers' latency and any foreign work (other routers'
// prefills, which pdx's busy period may not start with), and so a slight
// underestimate, more so early in a busy period: a rate too low counts
// more remaining, toward today's count. It is too high only when prompts
// pdx counts as uncached were cached after all, which remaining bounds.
func (f *fluid) learn(sample float64) {
	for {
		old := f.rate.Load()
		r := math.Float64frombits(old)
		next := sample
		if r > 0 {
			next = r + rateWeight*(sample-r)
		}
		if f.rate.CompareAndSwap(old, math.Float64bits(next)) {
			return
		}
	}
}

// remaining is how many of the tokens of pdx's prefills in flight (g, as
// the pick read them) the engine has yet to compute at t: all of them until
// the rate R is learned, else
//
//	inFlightTokens − clamp(R × (now − busyStart) − ended since, 0, inFlightTokens / inFlight)
//
// The bound is one lease's worth, the mean lease standing for the one the
// engine is on: under FCFS the engine computes one prefill at a time and
// the others wait whole, so with one prefill in flight the model counts
// what it says, and with more it never counts more than one of them done.
// A rate too high, or an engine that stopped answering, then makes an
// endpoint look one prefill lighter than pdx counts, not idle; engines
// that batch several prefills at once are undercounted toward today's.
func (f *fluid) remaining(g *signal, t *instant) int {
	r := math.Float64frombits(f.rate.Load())
	if r == 0 || g.inFlightTokens <= 0 || g.inFlight <= 0 {
		return g.inFlightTokens
	}
	computed := r*float64(t.read()-f.busyStart.Load()) - float64(f.ended.Load()-f.endedAt.Load())
	switch tokens := float64(g.inFlightTokens); {
	case computed <= 0:
		return g.inFlightTokens
	case computed*float64(g.inFlight) > tokens:
		// Divided only here: a division costs more than the rest.
		computed = tokens / float64(g.inFlight)
	}
	return g.inFlightTokens - int(computed)
}
