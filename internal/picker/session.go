package picker

import "github.com/cespare/xxhash/v2"

// Session affinity keeps the requests of a session (Request.Session) on
// the endpoints its earlier requests used, without any state: the
// session's endpoints are ranked by rendezvous hashing of its key over
// their addresses (mix of the key and the endpoint's seed, as
// PrefixAffinity ranks a prompt's), which every pdx replica computes
// alike. Removing an endpoint moves only the sessions it ranked first for;
// adding one takes only those it now ranks first for.
//
// A session's pick is the first endpoint in its order that the pick's
// shared rules admit (group, subset hint, tried, health, saturation), in
// place of the leg's policy: the order is what every replica agrees on,
// where a policy's choice among the others (by load, or by what each
// replica sent where) is not. A session whose first endpoint is saturated
// or ejected thus yields to its second, on every replica, and returns
// once the first has room again. When no endpoint is usable the session's
// order still decides among the admitted (saturated) ones; only when every
// one is ejected does the Set's panic mode choose.

// SessionKey is the key of the session that value (a request header's)
// names, for Request.Session: 0, none, when value is empty. Every replica
// computes the same key for the same value.
func SessionKey(value []byte) uint64 {
	if len(value) == 0 {
		return 0
	}
	// 0 says "no session": the one value that hashes to it takes 1's
	// place.
	return max(xxhash.Sum64(value), 1)
}

// SessionOutcome is what became of a session's pick (Lease.Session).
type SessionOutcome uint8

const (
	// NoSession: the request named no session.
	NoSession SessionOutcome = iota
	// SessionKept: the pick is the session's first endpoint among those
	// the request's group has.
	SessionKept
	// SessionMoved: the session's first endpoint could not take it
	// (saturated, ejected, tried or outside the subset hint), and one
	// further down its order did.
	SessionMoved
)

func (o SessionOutcome) String() string {
	switch o {
	case SessionKept:
		return "kept"
	case SessionMoved:
		return "moved"
	}
	return ""
}

// sessionWeight is candidate k's rendezvous weight for the session key:
// the higher, the earlier in the session's order.
func sessionWeight(key, seed uint64) uint64 { return mix(key ^ seed) }

// session returns the usable candidate first in the order of the session
// key, else the admitted one first in it (every one saturated), else -1
// (every one the request may use is ejected: panic mode's to choose).
func (c *Candidates) session(key uint64) int {
	best, admitted := -1, -1
	var bestW, admittedW uint64
	for k := range c.n {
		g := c.signal(k)
		if !g.admitted { // excluded ones are not admitted either
			continue
		}
		w := sessionWeight(key, c.seed(k))
		switch {
		case g.usable && !g.saturated: // a session does not weigh queues
			if best < 0 || w > bestW {
				best, bestW = k, w
			}
		case best < 0 && (admitted < 0 || w > admittedW):
			admitted, admittedW = k, w
		}
	}
	if best >= 0 {
		return best
	}
	return admitted
}

// sessionOutcome is whether the endpoint at position i of v, a session's
// pick for req, is the session's first among the endpoints of req's group
// (those the request may not use too: a session outside its subset hint
// has moved all the same).
func (v *view) sessionOutcome(req *Request, i int) SessionOutcome {
	members, _, _ := v.members(req.Group)
	first, firstW := -1, uint64(0)
	for k := range v.count(members) {
		p := position(members, k)
		if w := sessionWeight(req.Session, v.states[p].seed); first < 0 || w > firstW {
			first, firstW = p, w
		}
	}
	// An endpoint listed twice shares its health, and so its seed.
	if first >= 0 && v.states[first] == v.states[i] {
		return SessionKept
	}
	return SessionMoved
}
