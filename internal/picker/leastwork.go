package picker

import (
	"sync/atomic"

	"github.com/pdx-router/pdx/internal/endpoint"
)

// LeastWorkPolicy names LeastWork in the config.
const LeastWorkPolicy = "least_work"

// LeastWork picks the endpoint that would finish the request's prompt
// first: the fewest prompt tokens queued before it plus the tokens of this
// prompt it does not have cached. It is NVIDIA Dynamo's KV router cost
// (overlap weight × prefill blocks + queued blocks) in tokens, and what
// makes a prefill's time to first token short: a prefill engine computes
// prompts one after another, each in time proportional to its uncached
// tokens.
//
// Queued tokens are pdx's own in-flight prompt tokens on the endpoint,
// plus, when the engine's fresh metrics count more requests than pdx has on
// it (other replicas' or routers' traffic), that many more of the mean
// in-flight prompt. Cached tokens are the leading blocks of the prompt this
// pdx has sent the endpoint. Ties go round.
type LeastWork struct {
	set *Set
	_   [56]byte
	// next is where the next pick starts its scan.
	next atomic.Uint64
	_    [56]byte
}

var _ Picker = (*LeastWork)(nil)

// NewLeastWork returns a least-work policy over set.
func NewLeastWork(set *Set) *LeastWork { return &LeastWork{set: set} }

// Pick returns the usable endpoint with the least work that the request
// has not tried, falling back like RoundRobin when none is usable. It does
// not allocate for sets of up to 64 endpoints.
func (p *LeastWork) Pick(req Request) (endpoint.Endpoint, bool) {
	v := p.set.view.Load()
	members, _, ok := v.candidates(req.Group)
	n := v.count(members)
	if !ok || n == 0 {
		return endpoint.Endpoint{}, false
	}
	var depths [64]int32
	depth := v.depths(req.Blocks, depths[:])
	now := p.set.clock()
	var buf [64]signal
	signals, usable := now.looks(v, members, req, buf[:])
	start := int(p.next.Add(1) % uint64(n))
	if usable == 0 {
		return v.soonest(members, start, req, &now)
	}
	// The mean prompt in flight stands for requests pdx did not send.
	requests, tokens := 0, 0
	for k := range signals {
		requests += signals[k].inFlight
		tokens += signals[k].inFlightTokens
	}
	mean := req.Tokens
	if requests > 0 {
		mean = tokens / requests
	}
	best, least := -1, 0
	for j := range n {
		k := (start + j) % n
		g := &signals[k]
		if !g.usable {
			continue
		}
		i := position(members, k)
		work := g.inFlightTokens + max(g.waiting+g.running-g.inFlight, 0)*mean + req.Tokens
		if len(depth) > 0 {
			work -= min(int(depth[i])*req.BlockTokens, req.Tokens)
		}
		if best < 0 || work < least {
			best, least = i, work
		}
	}
	return v.endpoints[best], true
}

// Report does nothing: loads come from Begin, End and Observe.
func (p *LeastWork) Report(endpoint.Endpoint, bool) {}
