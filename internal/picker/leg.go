package picker

import (
	"google.golang.org/protobuf/proto"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/endpoint"
)

// Leg is one side of a pool, prefill or decode: its Set, and the policy
// that picks among the Set's endpoints.
type Leg struct {
	*Set
	policy Policy
	// successor is policy's, when it has one.
	successor Successor
	role      Role
	// ownQueue: policy weighs each engine's queue itself (queueWeigher).
	ownQueue bool
}

// NewLeg returns the leg of role over set picked by the policy p names (""
// or nil p: DefaultPolicy of role), its fields' defaults applied. It fails
// on a policy that is not registered.
func NewLeg(set *Set, p *configv1.Picker, role Role) (Leg, error) {
	pc := &configv1.Picker{}
	if p != nil {
		pc = proto.CloneOf(p)
	}
	pc = WithDefaults(pc, role)
	spec, err := Lookup(pc.Policy)
	if err != nil {
		return Leg{}, err
	}
	return newLeg(set, spec.New(pc, role), role), nil
}

func newLeg(set *Set, p Policy, role Role) Leg {
	s, _ := p.(Successor)
	_, own := p.(queueWeigher)
	return Leg{Set: set, policy: p, successor: s, role: role, ownQueue: own}
}

// Pick leases the endpoint the request goes to: the policy's choice among
// the usable candidates, else (panic mode) an admitted but saturated one,
// else the one whose ejection ends first. It reports false only when the
// request's group has no endpoint, or every one is tried or outside its
// subset hint.
//
// Pick does not allocate when the request's slices are on the heap (its
// Blocks stay with the lease).
func (l *Leg) Pick(req Request) (Lease, bool) {
	v, i, held, o, ok := l.pick(&req, false)
	if !ok {
		return Lease{}, false
	}
	lease := l.lease(v, i, held, &req, l.role)
	if req.Session != 0 {
		lease.session = v.sessionOutcome(&req, i)
	}
	lease.lora = o
	return lease, true
}

// PickAgain picks the endpoint of a request that holds lease, its earlier
// pick on the leg (req.Tentative's), again: with req.Stay set to lease's
// endpoint, within req.Group. When another endpoint is picked, lease ends
// (Released) and becomes the new pick's; else it stands, its prompt
// recorded as sent (Confirm). It reports whether lease moved. A lease
// already ended stays so.
func (l *Leg) PickAgain(req Request, lease *Lease) bool {
	if !lease.Open() {
		return false
	}
	req.Stay, req.Tentative = lease.Endpoint(), false
	v, i, held, o, ok := l.pick(&req, false)
	if !ok || v.endpoints[i] == req.Stay {
		lease.Confirm()
		return false
	}
	next := l.lease(v, i, held, &req, l.role)
	if req.Session != 0 {
		next.session = v.sessionOutcome(&req, i)
	}
	next.lora = o
	lease.End(Released)
	*lease = next
	return true
}

// Next returns the endpoint a decode fallback after the last of req.Tried
// goes to, in the policy's order of preference (round robin: the Set's
// order, its turns left as they are), with Pick's rules. It leases nothing:
// a fallback that serves takes the request's lease (Lease.Move).
func (l *Leg) Next(req Request) (endpoint.Endpoint, bool) {
	v, i, _, _, ok := l.pick(&req, true)
	if !ok {
		return endpoint.Endpoint{}, false
	}
	return v.endpoints[i], true
}

// pick chooses req's endpoint (a fallback's when fallback) and returns its
// position in the view it chose from, and how many of the prompt's token
// blocks its engine reports holding when the policy asked (-1: not asked),
// so that the lease need not match them again, and how the preference for
// the request's adapter went.
func (l *Leg) pick(req *Request, fallback bool) (*view, int, int, LoRAOutcome, bool) {
	c := l.candidates(req, l.role, l.ownQueue)
	if c == nil {
		return nil, 0, -1, LoRANone, false
	}
	o := c.preferAdapter(req.Adapter)
	var k int
	switch {
	case req.Session != 0:
		// A fallback's too: the next in the session's order.
		k = c.session(req.Session)
	case fallback && l.successor != nil:
		k = l.successor.Next(c)
	default:
		k = l.policy.Choose(c)
	}
	if k < 0 || k >= c.n || !c.Usable(k) && req.Session == 0 {
		// None is usable, or the policy broke its contract: the shared
		// rules hold all the same. A fallback's order goes on from the
		// last endpoint tried. (A session's saturated pick is its
		// panic mode: see session.go.)
		from := c.after
		if !fallback {
			from = c.Start()
		}
		if k = c.next(from); k < 0 {
			k = c.fallback(from)
		}
	}
	v, i, held := c.v, 0, -1
	if k >= 0 {
		i = position(c.members, k)
		if c.heldRead {
			held = int(c.held[i])
		}
	}
	c.release()
	return v, i, held, o, k >= 0
}
