// Package picker chooses the engine endpoint for each leg of a request.
//
// A leg's endpoints with their passive health and load are a Set. For each
// pick the Set reads the Candidates the request may use, and a Policy
// chooses among them; a Leg is a Set with its policy. Picking on a Leg
// returns a Lease, which counts the request on the endpoint until it ends
// with an outcome. The rules every pick shares (group, subset hint, tried,
// health, saturation, panic mode) are the Set's, so that they hold whatever
// the policy; policies are registered by name (Spec). A request of a
// session is the session's, not the policy's (session.go).
package picker

import (
	"slices"

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
	// TokenBlocks, when not nil, are the chained hashes of the prompt's
	// token ids as the engine tokenized them, in blocks of TokenBlockSize
	// (kvcache.HashTokens): a Set with a PrefixCache matches them against
	// what the engines report holding instead of Blocks against what pdx
	// sent. Tokens is then the exact count.
	TokenBlocks    []uint64
	TokenBlockSize int
	// PromptBytes, with TokenBlocks, is the length of the text Blocks were
	// cut from: a block pdx sent counts as its share of those bytes in
	// Tokens, not as BlockTokens (escapes and the request's JSON make the
	// byte estimate run ahead of the engine's count).
	PromptBytes int
	// NeedCached makes a decode lease tell what its endpoint had cached
	// (Lease.Cached), which costs an index lookup; a prefill lease always
	// does, since it counts the uncached tokens.
	NeedCached bool
	// NoRank: the request names no DP rank (a pass-through path), so its
	// lease counts it on none.
	NoRank bool
	// Tentative: the pick may be made again before the request is sent
	// (a decode picked again once its prefill has answered): its lease
	// counts the request but records neither its prompt nor its adapter
	// as sent to the endpoint, which the final pick's lease does.
	Tentative bool
	// Stay, when set, is the endpoint of the request's earlier pick on the
	// leg, still leased (Leg.PickAgain): the pick does not count that
	// lease against it, ties go to it (the policy's scans start there,
	// and the Set's turn does not advance), and round robin keeps it.
	Stay endpoint.Endpoint
	// Session, when not 0, is the key of the request's session
	// (SessionKey): the pick is the first endpoint in the session's order
	// that the shared rules admit, whatever the policy (see session.go).
	Session uint64
	// Adapter is the LoRA adapter the request is for, "" for the base
	// model: the pick prefers endpoints that have it loaded, then those
	// with a free adapter slot (lora.go).
	Adapter string
}

// PrefixCache is what the engines report their KV caches hold, learned
// from their KV events (package kvcache). It is read on every pick, from
// every stream at once.
type PrefixCache interface {
	// Register is the number under which the cache keeps the engine at
	// address, given it if it has none; -1 when the cache has no room. A
	// Set resolves its endpoints' slots once per view.
	Register(address string) int32
	// Match sets depth[i] to how many leading blocks of blocks the engine
	// of slots[i] holds (0 for a slot below 0) and returns the deepest. It
	// must not allocate.
	Match(blocks []uint64, slots, depth []int32) int32
	// Held is how many leading blocks of blocks the engine of slot holds.
	Held(slot int32, blocks []uint64) int
	// Fresh reports whether slots, as Register gave them, still name
	// their engines: the cache frees an engine's slot when it leaves.
	Fresh(slots []int32) bool
}

// Policy is a picking policy: it chooses, among the candidates the Set
// admits for a pick, the one the request goes to.
//
// Choose is called from every stream at once, so implementations are safe
// for concurrent use; they keep no per-request state (what a request has
// tried is the Set's business). It is on every request's path and should
// not allocate (see BenchmarkPolicies).
type Policy interface {
	// Choose returns the index of a usable candidate (c.Usable), or -1 when
	// it finds none; the Set then falls back on an unusable one (panic
	// mode). For an index that is not usable the Set takes the first
	// usable candidate, so that a policy's bug cannot break the rules.
	Choose(c *Candidates) int
}

// queueWeigher is implemented by policies that weigh the work queued on
// each engine themselves (least_work, forecast: on a decode leg, a
// waiting request is no room for the sequence). The pool's queue_depth
// saturation does not pass an engine over for them: its waiting requests
// are in their count already, and their engine word a scrape old, so the
// bound would pass over the engines that were busy then and send a burst
// to the few that were not, past what the policy itself weighs
// (docs/placement.md, Saturation and shedding). Their picks still wait
// for room when every engine of the leg is saturated, and pass over those
// at kv_usage or max_in_flight.
type queueWeigher interface{ weighsQueue() }

// Successor is implemented by policies whose Choose changes their own
// state (round robin's turns), which a request's decode fallbacks must
// not: Next chooses the candidate a fallback after the last of the
// request's tried endpoints goes to, leaving the state as it is. Other
// policies' fallbacks are Chooses with the endpoints before them tried.
type Successor interface {
	Next(c *Candidates) int
}

// Role is the leg a policy picks for; policies' defaults, and what a lease
// counts, differ by role.
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

// skips reports whether the request may not use ep: it has tried it, or
// ep is outside its subset.
func (req *Request) skips(ep endpoint.Endpoint) bool {
	if req.Subset != nil && !slices.Contains(req.Subset, ep.Address) {
		return true
	}
	return slices.Contains(req.Tried, ep)
}

// narrowed reports whether the request excludes any endpoint at all, so
// that loops over candidates can skip the check when it does not.
func (req *Request) narrowed() bool { return len(req.Tried) > 0 || req.Subset != nil }
