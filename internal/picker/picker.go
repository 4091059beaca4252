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

// policies lists every picking policy by the name pools[].*_picker.policy
// gives it. Adding one is a file with its type and a line here.
var policies = []struct {
	name string
	new  func(*Set) Picker
}{
	{RoundRobinPolicy, func(s *Set) Picker { return NewRoundRobin(s) }},
}

// DefaultPolicy picks a leg whose config names no policy.
const DefaultPolicy = RoundRobinPolicy

// New returns the policy named policy ("" is DefaultPolicy), picking over
// set.
func New(policy string, set *Set) (Picker, error) {
	if policy == "" {
		policy = DefaultPolicy
	}
	for _, p := range policies {
		if p.name == policy {
			return p.new(set), nil
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
