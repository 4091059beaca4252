// Package picker chooses the engine endpoint for each leg of a request.
package picker

import (
	"sync/atomic"

	"github.com/pdx-router/pdx/connectors"
)

// RoundRobin hands out its endpoints in turn. It is safe for concurrent use;
// its only mutable state is the turn counter, which belongs to no request.
type RoundRobin struct {
	endpoints []connectors.Endpoint
	next      atomic.Uint64
}

// NewRoundRobin returns a picker over endpoints, which must not be empty.
func NewRoundRobin(endpoints []connectors.Endpoint) *RoundRobin {
	return &RoundRobin{endpoints: endpoints}
}

// Pick returns the next endpoint.
func (r *RoundRobin) Pick() connectors.Endpoint {
	n := r.next.Add(1) - 1
	return r.endpoints[n%uint64(len(r.endpoints))]
}

// Contains reports whether ep is one of the picker's endpoints.
func (r *RoundRobin) Contains(ep connectors.Endpoint) bool {
	for _, e := range r.endpoints {
		if e == ep {
			return true
		}
	}
	return false
}
