package kvcache

import (
	"bytes"
	"slices"

	"github.com/pdx-router/pdx/internal/kvevents"
)

// Orphans. A BlockStored whose parent the index does not know (stored
// before the subscription began, or before a reset) has blocks whose
// prefix is unknown: their pdx hashes cannot be computed, so no prompt
// matches them. An index that dropped them would lose their descendants
// too (each stored under a dropped parent) and count their removals as
// unknown, until the engine evicted the whole chain; a publisher that
// joins late, or an engine whose long-lived prefix (a system prompt) was
// cached before pdx started, would be placed blind.
//
// So an orphan is kept, apart from the tables Match reads, with its own
// tokens: its children become orphans under it, its removal resolves, and
// when the engine stores its parent (or a block it waits for, down its
// chain) under a known prefix, the orphans waiting for it get their pdx
// hashes from the parent's and join the index, their descendants with
// them. Publishers that may evict a parent before its children
// (llm-d-inference-sim evicts the oldest unused block) store the parent
// again on its next use, which joins the children still cached. vLLM and
// SGLang evict a chain from its end, so their orphans mostly leave before
// their parent comes back: kept, they cost memory and match nothing, but
// keep the engine's accounting exact.
//
// An engine keeps at most maxOrphanTokens tokens of orphans; orphans
// beyond are dropped, counted, and so are then their children.

// maxOrphanTokens bounds the tokens of an engine's orphans (4 MiB):
// 65,536 blocks of 16 tokens, 8,192 of vLLM's 128 on CPU.
const maxOrphanTokens = 1 << 20

// orphan is an engine block stored under a parent the index does not know.
type orphan struct {
	// parent is the key of the block it was stored under: unknown, or
	// another orphan.
	parent uint64
	// tokens are the engine block's.
	tokens []uint32
	// extra is the extra keys of the stored run it starts (taint), nil
	// for the blocks after the first.
	extra []byte
	// copies counts the copies stored beyond the first (see store.dups).
	copies uint32
}

// joinItem is a block whose waiting orphans join: its key and pdx hash.
type joinItem struct{ key, pdx uint64 }

// orphan returns the orphan of key k in rank's stores of any tier, nil if
// none.
func (e *engine) orphan(rank int, k uint64) *orphan {
	if e.orphans == 0 {
		return nil
	}
	for _, s := range e.stores {
		if s.rank == rank {
			if o := s.orphans[k]; o != nil {
				return o
			}
		}
	}
	return nil
}

// adopt keeps the blocks of ev, whose parent e's rank does not know, as
// orphans in its store of tier t, counting them; dropped when e's orphans
// hold maxOrphanTokens tokens already.
func (x *Index) adopt(e *engine, rank int, t tier, ratio int, ev *kvevents.Event) {
	n, bs := len(ev.Hashes), ev.BlockSize
	x.stats.orphans += uint64(n)
	if e.orphanTokens+len(ev.TokenIDs) > x.maxOrphanTokens {
		x.stats.orphansDropped += uint64(n)
		return
	}
	s := e.store(rank, t, true)
	s.ratio = ratio
	if s.orphans == nil {
		s.orphans, s.waiting = make(map[uint64]*orphan), make(map[uint64][]uint64)
	}
	// One array for the run's tokens; the Sink's caller reuses the batch.
	tokens, extra := slices.Clone(ev.TokenIDs), bytes.Clone(ev.ExtraKeys)
	parent := key(ev.Parent)
	for i, h := range ev.Hashes {
		k := key(h)
		switch o := s.orphans[k]; {
		case o != nil:
			o.copies++
		case s.blocks.find(k) != nil:
			// Held under a known parent already: the engine's hash is the
			// same, its parent not; keep what the index knows.
			x.stats.conflicts++
		default:
			o = &orphan{parent: parent, tokens: tokens[i*bs : (i+1)*bs : (i+1)*bs]}
			if i == 0 {
				o.extra = extra
			}
			s.orphans[k] = o
			s.waiting[parent] = append(s.waiting[parent], k)
			e.orphans++
			e.orphanTokens += bs
			e.entries += ratio
		}
		parent = k
	}
}

// unadopt drops a copy of the orphan of key k from s, reporting whether
// there was one.
func (x *Index) unadopt(e *engine, s *store, k uint64) bool {
	o := s.orphans[k]
	switch {
	case o == nil:
		return false
	case o.copies > 0:
		o.copies--
	default:
		x.dropOrphan(e, s, k, o)
	}
	return true
}

// dropOrphan drops the orphan o of key k from s. The orphans waiting for it
// wait on: the engine may store it again.
func (x *Index) dropOrphan(e *engine, s *store, k uint64, o *orphan) {
	delete(s.orphans, k)
	kids := s.waiting[o.parent]
	if i := slices.Index(kids, k); i >= 0 {
		kids[i] = kids[len(kids)-1]
		kids = kids[:len(kids)-1]
	}
	if len(kids) == 0 {
		delete(s.waiting, o.parent)
	} else {
		s.waiting[o.parent] = kids
	}
	e.orphans--
	e.orphanTokens -= len(o.tokens)
	e.entries -= s.ratio
}

// disown drops the orphans of s, whose blocks are being dropped.
func (x *Index) disown(e *engine, s *store) {
	for _, o := range s.orphans {
		e.orphans--
		e.orphanTokens -= len(o.tokens)
		e.entries -= s.ratio
	}
	s.orphans, s.waiting = nil, nil
}

// joinRun joins the orphans waiting for the blocks of hashes, just stored
// in s under a known prefix (their pdx hashes in x.scratch): an orphan of
// one of those keys was a copy of the block stored again, and becomes one
// of its copies.
func (x *Index) joinRun(e *engine, s *store, hashes []kvevents.Hash) {
	x.joins = x.joins[:0]
	ratio := s.ratio
	for i, h := range hashes {
		k, pdx := key(h), x.scratch[i*ratio:(i+1)*ratio]
		if o := s.orphans[k]; o != nil {
			x.dropOrphan(e, s, k, o)
			// Copies of the block just added: counted as its duplicates
			// (the parent is read only for a first copy).
			for range 1 + o.copies {
				for j := range ratio - 1 {
					x.add(e, s, subKey(k, j), pdx[j], 0)
				}
				x.add(e, s, k, pdx[ratio-1], 0)
			}
			x.stats.joined++
		}
		x.joins = append(x.joins, joinItem{k, pdx[ratio-1]})
	}
	x.join(e, s.rank)
}

// join joins, for each block of x.joins (of rank), the orphans of the
// rank waiting for it, then those waiting for them, and so on: their pdx
// hashes chain from the block's.
func (x *Index) join(e *engine, rank int) {
	for len(x.joins) > 0 && e.orphans > 0 {
		j := x.joins[len(x.joins)-1]
		x.joins = x.joins[:len(x.joins)-1]
		for _, s := range e.stores {
			if s.rank != rank || len(s.waiting) == 0 {
				continue
			}
			kids := s.waiting[j.key]
			if len(kids) == 0 {
				continue
			}
			delete(s.waiting, j.key)
			for _, c := range kids {
				o := s.orphans[c]
				delete(s.orphans, c)
				e.orphans--
				e.orphanTokens -= len(o.tokens)
				e.entries -= s.ratio
				x.scratch = HashTokens(x.scratch[:0], taint(j.pdx, o.extra), o.tokens, x.cfg.BlockSize, 0)
				pdx := x.scratch[:s.ratio]
				for range 1 + o.copies {
					parent := j.pdx
					for k := range s.ratio - 1 {
						x.add(e, s, subKey(c, k), pdx[k], parent)
						parent = pdx[k]
					}
					x.add(e, s, c, pdx[s.ratio-1], parent)
				}
				x.stats.joined++
				x.joins = append(x.joins, joinItem{c, pdx[s.ratio-1]})
			}
		}
	}
}
