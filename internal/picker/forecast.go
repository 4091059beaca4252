package picker

import (
	"slices"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
)

// ForecastPolicy names Forecast in the config.
const ForecastPolicy = "forecast"

func forecastSpec() Spec {
	return Spec{
		Name: ForecastPolicy,
		New:  func(*configv1.Picker, Role) Policy { return Forecast{} },
	}
}

// Forecast picks the prefill endpoint where the request's prefill is
// forecast to answer first (below), and the decode endpoint where its
// sequence is forecast to start soonest and cost least (forecastDecode).
//
// On a prefill leg it weighs each engine's learned service model
// (service.forecast) of the uncached tokens queued there, the part of
// them the prompt would wait for before the engine takes it, and this
// prompt's tokens it does not hold. It is least_work in seconds, with each
// engine's own overhead and rates, and with a queued token weighing what
// it costs: an engine that computes several prompts at once takes a new
// one as soon as a slot frees, so waiting behind its queue for a prompt's
// cache beats computing the prompt elsewhere more often than least_work
// says. What is queued is pdx's prefills in flight in the engine's
// first-come-first-served slots (fifo), then the mean prompt for each
// request the engine's fresh metrics count and pdx did not send; what is
// held is the deeper of what pdx sent and, with KV events, what the engine
// reports.
//
// The overhead is the candidates' mean, not each engine's own: a call's
// fixed cost (the round trip, the engine's step around the prompt) is
// alike across a pool's engines, and the fit tells it apart from the
// rates poorly (most calls' prompts are alike), so one engine's overhead
// learned high by a few slow calls would keep prompts from its cache.
//
// A forecast less than the best one's usual error (its model's mean
// absolute residual) behind the best is not told apart from it: among
// those, the candidate holding the most of the prompt wins. Otherwise a
// prompt rate learned a little low, which is noise, would send a prompt
// away from an idle engine that holds it whenever computing it costs less
// than that (a short prompt, a fast engine), and the hit would save every
// later request that engine's work. Ties go round.
//
// The prompt's own uncached tokens weigh more as the pool gets busy (see
// poolWeight), the more at the pool's mean prompt rate: a prompt computed
// away from its cache takes the pool's slots for tokens a hit would not
// have cost, and on a busy pool every later prompt waits for them. The
// least forecast for this request alone (greedy on its TTFT) overlooks
// that; vLLM's cache_aware, which keeps a prompt with its cache whatever
// the queue, found more hits at high load.
type Forecast struct{}

var _ Policy = Forecast{}

func (Forecast) weighsQueue() {}

// Choose implements [Policy]: the usable candidate with the least
// forecast time to answer; on a decode leg, forecastDecode's.
func (Forecast) Choose(c *Candidates) int {
	if !c.prefill {
		return forecastDecode(c)
	}
	gs := c.all()
	mean, usable := meanInFlight(gs, c.tokens)
	if !usable {
		return -1
	}
	start, now := c.Start(), c.now.read()
	d := c.depths()
	n := len(gs)
	var peers peerModel
	busy, slots := 0, 0
	for k := range gs {
		h := c.health(k)
		peers.add(h.service)
		if gs[k].usable {
			s := h.service.slotsSeen()
			busy += min(gs[k].requests(), s)
			slots += s
		}
	}
	peers.mean()
	weight := 1 + poolWeight*float64(busy)/float64(max(slots, 1))
	// Each usable candidate's forecast, once: reading an engine's queue
	// takes its lock.
	fs := slices.Grow(c.forecasts[:0], n)[:n]
	c.forecasts = fs
	best, least := -1, 0.0
	// k goes round from start without a division a candidate.
	for j, k := 0, start; j < n; j, k = j+1, k+1 {
		if k == n {
			k = 0
		}
		g := &gs[k]
		if !g.usable {
			continue
		}
		h := c.health(k)
		q := h.service.queueNow(now, g.foreign+g.pending, mean)
		fs[k] = h.service.forecast(q, c.tokens-d.cachedTokens(k), weight, &peers)
		if best < 0 || fs[k] < least {
			best, least = k, fs[k]
		}
	}
	if best < 0 {
		return best
	}
	band := c.health(best).service.noiseSeen()
	if band == 0 {
		return best
	}
	pick, held, at := best, d.cachedTokens(best), least
	for j, k := 0, start; j < n; j, k = j+1, k+1 {
		if k == n {
			k = 0
		}
		if k == best || !gs[k].usable {
			continue
		}
		cached := d.cachedTokens(k)
		if cached < held || cached == held && pick == best {
			continue
		}
		if t := fs[k]; t <= least+band && (cached > held || t < at) {
			pick, held, at = k, cached, t
		}
	}
	return pick
}

// poolWeight is how much more a prompt's own uncached token weighs in a
// forecast on a pool all of whose slots are busy than on an idle one,
// in proportion to the busy share of the candidates' slots between.
// Chosen on the cache-bound rig (docs/placement.md, forecast): at 85% load
// weights from 1 to 8 gained goodput and hits over none, and 8 and 16
// lengthened the TTFT tail at 70%. Re-swept at the pool's rate (2, 4,
// 4 × busy², none), no weight did better than 4 beyond the runs' spread.
const poolWeight = 4

// meanInFlight is the mean prompt of pdx's requests in flight on the
// candidates (tokens when there are none), which stands for a request pdx
// did not send; and whether some candidate is usable.
func meanInFlight(gs []signal, tokens int) (int, bool) {
	requests, sum, usable := 0, 0, false
	for k := range gs {
		requests += gs[k].inFlight
		sum += gs[k].inFlightTokens
		usable = usable || gs[k].usable
	}
	if requests > 0 {
		return sum / requests, usable
	}
	return tokens, usable
}

// queuedAhead is the work queued on a candidate before a new request, in
// tokens: what remains of pdx's in-flight requests there (of a prefill
// leg's, as the fluid model says; a decode leg's count whole), and mean
// tokens for each of the engine's requests pdx does not count.
func queuedAhead(c *Candidates, g *signal, h *health, mean int) int {
	queued := g.inFlightTokens
	if c.prefill && g.inFlight > 0 {
		queued = h.work.remaining(g, &c.now)
	}
	return queued + (g.foreign+g.pending)*mean
}

// ahead is what is queued on h before a prefill of tokens leased now, as
// Forecast counts it (the endpoint's own mean prompt standing for the
// requests pdx did not send), and the time, for the service model to
// learn from the prefill's answer.
func (s *Set) ahead(h *health, tokens int) (queue, int64) {
	t := s.clock()
	var g signal
	t.look(h, &g, false, 0, 0)
	mean := tokens
	if g.inFlight > 0 {
		mean = g.inFlightTokens / g.inFlight
	}
	now := t.read()
	return h.service.queueNow(now, g.foreign+g.pending, mean), now
}
