// Package picker chooses the engine endpoint for each leg of a request.
//
// A leg's endpoints and their passive health are a Set; a Picker is the
// policy that chooses among a Set's endpoints. Every policy picks over a Set,
// so that health (outlier detection) works the same whatever the policy.
package picker

import (
	"fmt"
	"slices"
	"strings"

	"github.com/pdx-router/pdx/internal/endpoint"
)

// Request is what a pick knows of the request it picks for.
type Request struct {
	// Group, when set, restricts the pick to the endpoints of that
	// Endpoint.Group: a prefill engine must be in its decode engine's group
	// to hand the KV over.
	Group string
	// Tried are the endpoints the request has already tried on this leg;
	// the pick does not return them.
	Tried []endpoint.Endpoint
	// Subset, when not nil, restricts the pick to the endpoints whose
	// Address it lists: the gateway's subset hint (the endpoint-picker
	// protocol). Empty and not nil, nothing may be picked.
	Subset []string
	// Blocks are the chained hashes of the prompt's leading blocks (see
	// Blocks) of BlockTokens tokens each; nil when the request has no
	// prompt. Tokens is the prompt's length in tokens (BytesPerToken).
	Blocks              []uint64
	BlockTokens, Tokens int
}

// Picker is a picking policy for one leg (prefill or decode) of a pool.
//
// Pick and Report are called from every stream at once, so implementations
// are safe for concurrent use. They keep no per-request state: what a
// request has tried comes with each Pick. Pick is on every request's path
// and should not allocate (see BenchmarkPick).
type Picker interface {
	// Pick returns the endpoint the request goes to. It prefers endpoints
	// the Set's health admits and reports false only when no endpoint
	// matches the request's group and is untried.
	Pick(req Request) (endpoint.Endpoint, bool)
	// Report tells the outcome of a call to ep, an endpoint Pick returned.
	// The Set's health has already counted it (routing reports to both).
	Report(ep endpoint.Endpoint, ok bool)
}

// Successor is implemented by policies whose Pick changes their own state
// (round robin's turns), which a request's fallback picks must not: Next
// returns the endpoint after the last of req.Tried in the policy's order,
// leaving the state as it is. Other policies' fallbacks are Picks with the
// endpoints before them tried.
type Successor interface {
	Next(req Request) (endpoint.Endpoint, bool)
}

// Role is the leg a policy picks for; policies' defaults differ by role.
type Role int

const (
	RolePrefill Role = iota
	RoleDecode
)

func (r Role) String() string {
	if r == RoleDecode {
		return "decode"
	}
	return "prefill"
}

// Params configure a policy. The zero value is each policy's defaults for
// the prefill leg.
type Params struct {
	Role Role
	// Weights are load_aware's; nil means DefaultWeights(Role).
	Weights *Weights
	// LoadFactor is prefix_affinity's bound on an endpoint's load relative
	// to the mean; 0 or less means DefaultLoadFactor.
	LoadFactor float64
}

// policies lists every picking policy by the name pools[].*_picker.policy
// gives it. Adding one is a file with its type and a line here.
var policies = []struct {
	name string
	new  func(*Set, Params) Picker
}{
	{RoundRobinPolicy, func(s *Set, _ Params) Picker { return NewRoundRobin(s) }},
	{LeastRequestPolicy, func(s *Set, _ Params) Picker { return NewLeastRequest(s) }},
	{LeastWorkPolicy, func(s *Set, _ Params) Picker { return NewLeastWork(s) }},
	{PrefixAffinityPolicy, func(s *Set, p Params) Picker { return NewPrefixAffinity(s, p.LoadFactor) }},
	{LoadAwarePolicy, func(s *Set, p Params) Picker {
		w := DefaultWeights(p.Role)
		if p.Weights != nil {
			w = *p.Weights
		}
		return NewLoadAware(s, w)
	}},
}

// DefaultPolicy returns the policy of a leg whose config names none:
// prefill engines by the work queued on them and what they have cached,
// decode engines by their load.
func DefaultPolicy(r Role) string {
	if r == RoleDecode {
		return LoadAwarePolicy
	}
	return LeastWorkPolicy
}

// New returns the policy named policy ("" is DefaultPolicy of params'
// role), picking over set.
func New(policy string, set *Set, params Params) (Picker, error) {
	if policy == "" {
		policy = DefaultPolicy(params.Role)
	}
	for _, p := range policies {
		if p.name == policy {
			return p.new(set, params), nil
		}
	}
	return nil, fmt.Errorf("unknown picking policy %q (known: %s)", policy, strings.Join(Policies(), ", "))
}

// Policies lists the names of the picking policies, sorted.
func Policies() []string {
	names := make([]string, len(policies))
	for i, p := range policies {
		names[i] = p.name
	}
	slices.Sort(names)
	return names
}

// skips reports whether the request may not use ep: it has tried it, or
// ep is outside its subset.
func (req *Request) skips(ep endpoint.Endpoint) bool {
	if req.Subset != nil && !slices.Contains(req.Subset, ep.Address) {
		return true
	}
	return tried(ep, req.Tried)
}

// narrowed reports whether the request excludes any endpoint at all, so
// that loops over candidates can skip the check when it does not.
func (req *Request) narrowed() bool { return len(req.Tried) > 0 || req.Subset != nil }
