package picker

import "sync/atomic"

// Candidates are the endpoints one pick may return: the members of the
// request's group (every endpoint when it has none), in the Set's order,
// as the Set reads them for the pick. A candidate is usable when the
// request may use it (not tried, within its subset hint) and it is
// admitted (not ejected) and not saturated. A policy chooses among the
// usable ones by their signals; which are not, and why, is the Set's
// business.
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
	// blocks, blockTokens and tokens are the request's prompt (Request).
	blocks              []uint64
	blockTokens, tokens int
	// matched and matchTokens are the blocks prefix matches read, and
	// their size: the request's TokenBlocks when the view has a cache and
	// the request has them (precise), else blocks.
	matched     []uint64
	matchTokens int
	precise     bool
	// after is where a fallback's order goes on: the candidate after the
	// last one the request tried (0 when it tried none of them).
	after int
	// signals are the candidates' states, by index; those of another gen
	// are not read yet.
	signals []signal
	gen     uint32
	// depths, once depthsRead, are by position in v how many leading
	// blocks this pdx sent each endpoint.
	depths     []int32
	depthsRead bool
	// start is Start's answer, -1 until asked.
	start int
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

// candidates returns the candidates of a pick for req, nil when req's group
// has no endpoint; the pick releases them. The request's tried endpoints
// and subset are applied here, once.
func (s *Set) candidates(req *Request) *Candidates {
	v := s.view.Load()
	members, id, ok := v.members(req.Group)
	n := v.count(members)
	if !ok || n == 0 {
		return nil
	}
	c := getCandidates()
	c.v, c.members, c.group, c.n, c.now = v, members, id, n, s.clock()
	c.blocks, c.blockTokens, c.tokens = req.Blocks, req.BlockTokens, req.Tokens
	c.matched, c.matchTokens, c.precise = req.Blocks, req.BlockTokens, false
	if v.cache != nil && req.TokenBlocks != nil {
		c.matched, c.matchTokens, c.precise = req.TokenBlocks, req.TokenBlockSize, true
	}
	c.after, c.depthsRead, c.start = 0, false, -1
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
	c.v, c.members, c.blocks, c.matched = nil, nil, nil, nil
	putCandidates(c)
}

// Len is the number of candidates; they are indexed from 0.
func (c *Candidates) Len() int { return c.n }

// Usable reports whether the request may go to candidate k without panic
// mode: allowed, admitted and not saturated.
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
		c.now.look(c.v.states[position(c.members, k)], g)
		g.gen = c.gen
	}
	return g
}

// depth is how many of the prompt's leading blocks (of matchedBlocks)
// candidate k's engine holds: as it reports them when the pick is precise,
// else as far as this pdx sent them there.
func (c *Candidates) depth(k int) int {
	if len(c.matched) == 0 {
		return 0
	}
	if !c.depthsRead {
		if n := len(c.v.endpoints); cap(c.depths) < n {
			c.depths = make([]int32, n)
		}
		c.depths = c.depths[:len(c.v.endpoints)]
		if c.precise {
			c.v.cache.Match(c.matched, c.v.slots, c.depths)
		} else {
			c.v.index.matches(c.matched, c.depths)
		}
		c.depthsRead = true
	}
	return int(c.depths[position(c.members, k)])
}

// matchedBlocks is how many blocks depth counts in: the prompt's.
func (c *Candidates) matchedBlocks() int { return len(c.matched) }

// cachedTokens is how many of the prompt's tokens candidate k holds.
func (c *Candidates) cachedTokens(k int) int { return min(c.depth(k)*c.matchTokens, c.tokens) }

// seed is candidate k's rendezvous seed (the hash of its address).
func (c *Candidates) seed(k int) uint64 { return c.v.states[position(c.members, k)].seed }

// next returns the first usable candidate at or after from, in the Set's
// order and round; -1 when none is.
func (c *Candidates) next(from int) int {
	for j := range c.n {
		if k := (from + j) % c.n; c.Usable(k) {
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
	for j := range c.n {
		k := (from + j) % c.n
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
