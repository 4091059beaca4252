package picker

import (
	"sync/atomic"

	"github.com/pdx-router/pdx/internal/endpoint"
)

// LeastRequestPolicy names LeastRequest in the config.
const LeastRequestPolicy = "least_request"

// LeastRequest picks the endpoint with the fewest requests: pdx's own
// in-flight count, or the engine's waiting and running requests when its
// fresh metrics say more (they count other routers' and replicas' traffic
// too). Ties go round: the scan starts one endpoint further each pick.
type LeastRequest struct {
	set *Set
	_   [56]byte // keep next's write traffic off set's cache line
	// next is where the next pick starts its scan.
	next atomic.Uint64
	_    [56]byte
}

var _ Picker = (*LeastRequest)(nil)

// NewLeastRequest returns a least-request policy over set.
func NewLeastRequest(set *Set) *LeastRequest { return &LeastRequest{set: set} }

// Pick returns the usable endpoint with the fewest requests that the
// request has not tried, falling back like RoundRobin when none is usable.
// It does not allocate.
func (p *LeastRequest) Pick(req Request) (endpoint.Endpoint, bool) {
	v := p.set.view.Load()
	members, _, ok := v.candidates(req.Group)
	n := v.count(members)
	if !ok || n == 0 {
		return endpoint.Endpoint{}, false
	}
	now := p.set.clock()
	start := int(p.next.Add(1) % uint64(n))
	best, least := -1, 0
	var g signal
	for k := range n {
		i := position(members, (start+k)%n)
		if req.narrowed() && req.skips(v.endpoints[i]) {
			continue
		}
		if now.look(v.states[i], &g); !g.usable {
			continue
		}
		if q := g.queue(); best < 0 || q < least {
			best, least = i, q
		}
	}
	if best >= 0 {
		return v.endpoints[best], true
	}
	return v.soonest(members, start, req, &now)
}

// Report does nothing: the counts come from Begin and End.
func (p *LeastRequest) Report(endpoint.Endpoint, bool) {}
