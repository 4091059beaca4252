package picker

import (
	"sync/atomic"

	"github.com/pdx-router/pdx/internal/endpoint"
)

// Candidates are the endpoints one pick may return: the members of the
// request's group (every endpoint when it has none), in the Set's order,
// as the Set reads them for the pick. A candidate is usable when the
// request may use it (not tried, within its subset hint) and it is
// admitted (not ejected) and not saturated (for a policy that weighs
// queues, not saturated but by its queue: queueWeigher). A policy
// chooses among the usable ones by their signals; which are not, and why,
// is the Set's business.
//
// A candidate's state is read at most once per pick, when first asked:
// round robin asks about the one whose turn it is, scoring policies about
// all. Candidates belong to one pick, on one goroutine.
type Candidates struct {
	v *view
	// members are the candidates' positions in v; nil: all of v.
	members []int
	// group is the number of the request's group in the Set, -1 without
	// one: policies may keep per-group state.
	group int
	n     int
	now   instant
	// prefill: the pick is a prefill leg's, whose endpoints' fluid model
	// counts (fluid.remaining).
	prefill bool
	// ownQueue: the pick's policy weighs each engine's queue itself
	// (queueWeigher), and an engine's waiting requests leave it usable.
	ownQueue bool
	// blocks, blockTokens and tokens are the request's prompt (Request).
	blocks              []uint64
	blockTokens, tokens int
	// tokenBlocks and tokenBlockSize are the request's TokenBlocks when
	// the view has a cache (precise: the engines' word counts too), else
	// nil.
	tokenBlocks    []uint64
	tokenBlockSize int
	promptBytes    int // the request's PromptBytes, with tokenBlocks
	// after is where a fallback's order goes on: the candidate after the
	// last one the request tried (0 when it tried none of them).
	after int
	// signals are the candidates' states, by index; those of another gen
	// are not read yet.
	signals []signal
	gen     uint32
	// sent and held, once read, are depths' (its sent and held).
	sent, held         []int32
	sentRead, heldRead bool
	// start is Start's answer, -1 until asked; stay is the candidate of
	// the request's earlier pick (Request.Stay), -1 for none.
	start, stay int
	// tiers are the candidates' adapter tiers (preferAdapter), by index.
	tiers []uint8
	// forecasts are Forecast's, by index.
	forecasts []float64
}

// freeCandidates keeps Candidates and their buffers between picks: a
// Candidates goes through the Policy interface, so it cannot live on the
// picking goroutine's stack. It is a few slots rather than a sync.Pool,
// which drops what it holds at every other GC (and at random under the
// race detector): a pick must not allocate. Picks beyond its size at once
// allocate, and their Candidates go to the garbage.
var freeCandidates [64]atomic.Pointer[Candidates]

// getCandidates takes a kept Candidates, or a new one.
func getCandidates() *Candidates {
	for i := range freeCandidates {
		if c := freeCandidates[i].Swap(nil); c != nil {
			return c
		}
	}
	return new(Candidates)
}

// putCandidates keeps c for a later pick, if a slot is free.
func putCandidates(c *Candidates) {
	for i := range freeCandidates {
		if freeCandidates[i].CompareAndSwap(nil, c) {
			return
		}
	}
}

// candidates returns the candidates of a pick of role for req, nil when
// req's group has no endpoint; the pick releases them. The request's tried
// endpoints and subset are applied here, once.
func (s *Set) candidates(req *Request, role Role, ownQueue bool) *Candidates {
	v := s.view.Load()
	members, id, ok := v.members(req.Group)
	n := v.count(members)
	if !ok || n == 0 {
		return nil
	}
	c := getCandidates()
	c.v, c.members, c.group, c.n, c.now = v, members, id, n, s.clock()
	c.prefill, c.ownQueue = role == RolePrefill, ownQueue
	c.blocks, c.blockTokens, c.tokens = req.Blocks, req.BlockTokens, req.Tokens
	c.tokenBlocks, c.tokenBlockSize, c.promptBytes = nil, 0, 0
	if v.cache != nil && req.TokenBlocks != nil {
		c.tokenBlocks, c.tokenBlockSize, c.promptBytes = req.TokenBlocks, req.TokenBlockSize, req.PromptBytes
	}
	c.after, c.sentRead, c.heldRead, c.start, c.stay = 0, false, false, -1, -1
	if req.Stay != (endpoint.Endpoint{}) {
		for k := range n {
			if v.endpoints[position(members, k)] == req.Stay {
				c.start, c.stay = k, k
				break
			}
		}
	}
	if c.gen++; c.gen == 0 {
		// Wrapped around: an old signal could pass for a current one.
		clear(c.signals)
		c.gen = 1
	}
	if cap(c.signals) < n {
		c.signals = make([]signal, n)
	}
	c.signals = c.signals[:n]
	if req.narrowed() {
		last := -1
		for k := range n {
			ep := v.endpoints[position(members, k)]
			if last < 0 && len(req.Tried) > 0 && ep == req.Tried[len(req.Tried)-1] {
				last = k
			}
			if req.skips(ep) {
				c.signals[k] = signal{gen: c.gen, excluded: true}
			}
		}
		c.after = (last + 1) % n
	}
	return c
}

// release returns c to the pool, keeping no view or prompt alive.
func (c *Candidates) release() {
	c.v, c.members, c.blocks, c.tokenBlocks = nil, nil, nil, nil
	putCandidates(c)
}

// Len is the number of candidates; they are indexed from 0.
func (c *Candidates) Len() int { return c.n }

// Usable reports whether the request may go to candidate k without panic
// mode: allowed, admitted and not saturated (see Candidates).
func (c *Candidates) Usable(k int) bool { return c.signal(k).usable }

// Start is where this pick's scans start, one further each pick of the
// Set, so that ties go round.
func (c *Candidates) Start() int {
	if c.start < 0 {
		c.start = int((c.now.set.turn.Add(1) - 1) % uint64(c.n))
	}
	return c.start
}

// signal returns candidate k's state, reading it the first time.
func (c *Candidates) signal(k int) *signal {
	g := &c.signals[k]
	if g.gen != c.gen {
		c.read(k, g)
	}
	return g
}

// read reads candidate k's state into g: signal's first time, out of line
// so that signal inlines.
func (c *Candidates) read(k int, g *signal) {
	own, ownTokens := c.own(k)
	c.now.look(c.v.states[position(c.members, k)], g, c.ownQueue, own, ownTokens)
	g.gen = c.gen
}

// own is the request's own count on candidate k: its earlier pick's
// lease, when k is that pick's endpoint (Request.Stay).
func (c *Candidates) own(k int) (int, int) {
	if k == c.stay {
		return 1, c.tokens
	}
	return 0, 0
}

// all returns every candidate's state, by index, reading those not read
// yet: for policies that score them all, which then index the slice rather
// than ask candidate by candidate.
func (c *Candidates) all() []signal {
	gs, states, gen := c.signals[:c.n], c.v.states, c.gen
	for k := range gs {
		// look directly, not through read: one call a candidate, not two.
		if g := &gs[k]; g.gen != gen {
			own, ownTokens := c.own(k)
			c.now.look(states[position(c.members, k)], g, c.ownQueue, own, ownTokens)
			g.gen = gen
		}
	}
	return gs
}

// health is candidate k's state, for what a policy reads that signal
// does not (fluid.remaining).
func (c *Candidates) health(k int) *health { return c.v.states[position(c.members, k)] }

// depths are how many of the prompt's leading blocks each candidate holds,
// read once for a pick whose policy counts them for every candidate.
type depths struct {
	members []int
	// sent are by position in the view how many leading blocks this pdx
	// sent each endpoint: the prefix its engine is likely to hold; held,
	// for a precise pick, how many leading token blocks each engine
	// reports holding. nil when the pick has no such prompt.
	sent, held []int32
	// precise: the pick has TokenBlocks (Candidates.tokenBlocks).
	precise                                             bool
	blocks, blockTokens, blockSize, tokens, promptBytes int
}

// depths reads how deep the candidates hold the prompt.
func (c *Candidates) depths() depths {
	d := depths{members: c.members, precise: c.tokenBlocks != nil, blocks: len(c.blocks), blockTokens: c.blockTokens, blockSize: c.tokenBlockSize, tokens: c.tokens, promptBytes: c.promptBytes}
	if len(c.blocks) > 0 {
		if !c.sentRead {
			c.sent = sized(c.sent, len(c.v.endpoints))
			c.v.index.matches(c.blocks, c.sent)
			c.sentRead = true
		}
		d.sent = c.sent
	}
	if len(c.tokenBlocks) > 0 {
		if !c.heldRead {
			c.held = sized(c.held, len(c.v.endpoints))
			c.v.cache.Match(c.tokenBlocks, c.v.slots, c.held)
			c.heldRead = true
		}
		d.held = c.held
	}
	return d
}

// sized is buf with n elements, grown if it must be.
func sized(buf []int32, n int) []int32 {
	if cap(buf) < n {
		return make([]int32, n)
	}
	return buf[:n]
}

// cachedTokens is how many of the prompt's tokens candidate k is taken to
// hold. A precise pick counts what the engine reports or, when that is
// less, what pdx sent it (and, where the engine said its KV's size, what
// fits it: index): the engine's events of a prefill pdx sent may not have
// arrived yet, and a prompt whose KV the engine evicted early (its
// running requests took the room) is best sent there again, keeping a
// conversation or a tenant on one engine rather than on whichever is idle
// (which would spread every tenant over every cache). Where the engines
// report more than pdx sent (another replica's or router's traffic, a
// prefix pdx sent under other bytes), their word counts.
func (d *depths) cachedTokens(k int) int {
	i, n := position(d.members, k), 0
	if d.sent != nil {
		n = sentTokens(int(d.sent[i]), d.blockTokens, d.tokens, d.promptBytes, d.precise)
	}
	if d.precise {
		held := 0
		if d.held != nil {
			held = int(d.held[i])
		}
		n = max(n, held*d.blockSize)
	}
	return min(n, d.tokens)
}

// sentTokens is how many of a prompt's tokens its first blocks cover,
// blocks of blockTokens by the byte estimate: as many, or for a precise
// pick (tokens the engine's count of a prompt of promptBytes) their share
// of the prompt's bytes in tokens.
func sentTokens(blocks, blockTokens, tokens, promptBytes int, precise bool) int {
	n := blocks * blockTokens
	if precise && promptBytes > 0 {
		n = int(int64(n) * BytesPerToken * int64(tokens) / int64(promptBytes))
	}
	return n
}

// prefixShare is the share of the prompt candidate k holds, in [0, 1].
// Most candidates hold none: their 0 is had without dividing.
func (d *depths) prefixShare(k int) float64 {
	if !d.precise {
		if d.sent == nil {
			return 0
		}
		s := d.sent[position(d.members, k)]
		if s == 0 {
			return 0
		}
		return float64(s) / float64(d.blocks)
	}
	if d.tokens <= 0 {
		return 0
	}
	n := d.cachedTokens(k)
	if n == 0 {
		return 0
	}
	return float64(n) / float64(d.tokens)
}

// hasPrompt reports whether the pick knows anything of the prompt to
// match.
func (c *Candidates) hasPrompt() bool { return len(c.blocks) > 0 || len(c.tokenBlocks) > 0 }

// seed is candidate k's rendezvous seed (the hash of its address).
func (c *Candidates) seed(k int) uint64 { return c.v.states[position(c.members, k)].seed }

// next returns the first usable candidate at or after from, in the Set's
// order and round; -1 when none is.
func (c *Candidates) next(from int) int {
	for j, k := 0, from; j < c.n; j, k = j+1, k+1 {
		if k == c.n {
			k = 0
		}
		if c.Usable(k) {
			return k
		}
	}
	return -1
}

// fallback is the candidate of a pick none of whose candidates is usable:
// an admitted one (saturated) if there is one, else the one whose ejection
// ends first, ties going to the first at or after from. Like Envoy's panic
// mode, it assumes the detector is wrong sooner than that the whole leg is
// down. It is -1 only when the request may use no candidate at all.
func (c *Candidates) fallback(from int) int {
	best, bestUntil := -1, int64(0)
	for j, k := 0, from; j < c.n; j, k = j+1, k+1 {
		if k == c.n {
			k = 0
		}
		g := c.signal(k)
		switch {
		case g.excluded:
			continue
		case g.admitted:
			return k
		}
		if u := c.v.states[position(c.members, k)].until.Load(); best < 0 || u < bestUntil {
			best, bestUntil = k, u
		}
	}
	return best
}
