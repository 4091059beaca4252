package picker

import configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"

// LeastRequestPolicy names LeastRequest in the config.
const LeastRequestPolicy = "least_request"

func leastRequestSpec() Spec {
	return Spec{
		Name: LeastRequestPolicy,
		New:  func(*configv1.Picker, Role) Policy { return LeastRequest{} },
	}
}

// LeastRequest picks the endpoint with the fewest requests: pdx's own
// in-flight count, or the engine's waiting and running requests when its
// fresh metrics say more (they count other routers' and replicas' traffic
// too). Ties go round: the scan starts one candidate further each pick.
type LeastRequest struct{}

var _ Policy = LeastRequest{}

// Choose implements [Policy]: the usable candidate with the fewest
// requests.
func (LeastRequest) Choose(c *Candidates) int { return leastRequest(c) }

func leastRequest(c *Candidates) int {
	gs, start := c.all(), c.Start()
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
		if q := g.queue(); best < 0 || q < least {
			best, least = k, q
		}
	}
	return best
}
