package picker

import configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"

// LeastWorkPolicy names LeastWork in the config.
const LeastWorkPolicy = "least_work"

func leastWorkSpec() Spec {
	return Spec{
		Name: LeastWorkPolicy,
		New:  func(*configv1.Picker, Role) Policy { return LeastWork{} },
	}
}

// LeastWork picks the endpoint that would finish the request's prompt
// first: the fewest prompt tokens queued before it plus the tokens of this
// prompt it does not have cached. It is NVIDIA Dynamo's KV router cost
// (overlap weight × prefill blocks + queued blocks) in tokens, and what
// makes a prefill's time to first token short: a prefill engine computes
// prompts one after another, each in time proportional to its uncached
// tokens.
//
// Queued tokens are what remains of pdx's own in-flight prompts on the
// endpoint, plus, when the engine's fresh metrics count more requests than
// pdx had on it when they were read (other replicas' or routers' traffic),
// that many more of the mean in-flight prompt, as do requests pdx detached
// there since the metrics were read (Lease.Detach). Comparing with pdx's
// count at the sample, not now, keeps a request that ended since from
// counting as another's for a scrape, and one sent since from hiding
// another's. What remains of a prefill leg's prompts is their uncached
// tokens less what the engine has computed of them, by the rate it has
// shown computing pdx's prefills, since it last had none of pdx's
// (fluid.remaining): a 12k-token prompt sent 0.7 s ago to an engine that
// computes 15k tokens a second is nearly done. The model counts at most one
// prefill's worth as done, and nothing before the rate is learned, when
// each prompt counts whole until it answers, as a decode leg's always do.
// Cached tokens are the leading blocks of the prompt this pdx has sent the
// endpoint, or, for a precise pick, the more of those and what the engine
// reports holding (depths.cachedTokens). Ties go round.
type LeastWork struct{}

var _ Policy = LeastWork{}

func (LeastWork) weighsQueue() {}

// Choose implements [Policy]: the usable candidate with the least work.
func (LeastWork) Choose(c *Candidates) int {
	gs := c.all()
	// The mean prompt in flight stands for requests pdx did not send,
	// whole: how far their engine is with them pdx cannot tell.
	mean, usable := meanInFlight(gs, c.tokens)
	if !usable {
		return -1
	}
	start := c.Start()
	d := c.depths()
	n := len(gs)
	best, least := -1, 0
	// k goes round from start without a division a candidate.
	for j, k := 0, start; j < n; j, k = j+1, k+1 {
		if k == n {
			k = 0
		}
		g := &gs[k]
		if !g.usable {
			continue
		}
		// A decode lease lasts its whole generation: it counts whole.
		work := queuedAhead(c, g, c.health(k), mean) + c.tokens - d.cachedTokens(k)
		if best < 0 || work < least {
			best, least = k, work
		}
	}
	return best
}
