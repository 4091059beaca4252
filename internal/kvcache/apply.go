package kvcache

import (
	"math/bits"
	"strings"

	"github.com/pdx-router/pdx/internal/kvevents"
)

// tierOf is the tier of a medium: vLLM's MEDIUM_GPU ("GPU", or nothing
// sent) or MEDIUM_CPU; false for others (storage, remote), which are not
// placed.
func tierOf(medium string) (tier, bool) {
	switch {
	case medium == "" || strings.EqualFold(medium, "GPU"):
		return tierGPU, true
	case strings.EqualFold(medium, "CPU"):
		return tierCPU, true
	}
	return 0, false
}

// fullAttention reports whether a group of kind holds a prefix's KV for
// every token: vLLM's KVCacheSpecKind (vllm/v1/kv_cache_interface.py)
// full_attention, mla_attention (MLAAttentionSpec is a FullAttentionSpec)
// and sink_full_attention; "" is an event without the field, from a model
// with one full-attention group. Sliding-window, chunked-local, Mamba,
// encoder-only and cross-attention groups keep only part of a prefix (or
// none of it): counting their blocks would report hits the engine cannot
// use.
func fullAttention(kind string) bool {
	switch kind {
	case "", "full_attention", "mla_attention", "sink_full_attention":
		return true
	}
	return false
}

// counts reports whether ev's group counts for e (taking it as e's lead
// group when e has none), counting it ignored when not.
//
// Only one group counts: with several full-attention groups (vLLM's
// hybrid allocator splits a model's layers into groups of equal size),
// vLLM stores a request's blocks in every group under the same block
// hashes, when the request fills them, and frees them together; one group
// stands for the others, and following one keeps the engine hashes of
// different groups from being taken for copies of one block.
func (x *Index) counts(e *engine, ev *kvevents.Event) bool {
	if ev.Kind == kvevents.BlockStored && (!fullAttention(ev.SpecKind) || ev.SlidingWindow > 0) {
		x.stats.ignoredGroups++
		return false
	}
	if e.lead < 0 && ev.Kind == kvevents.BlockStored {
		e.lead = ev.GroupIdx
	}
	if ev.GroupIdx != e.lead {
		x.stats.ignoredGroups++
		return false
	}
	return true
}

// store returns e's store of rank and tier, creating it if create.
func (e *engine) store(rank int, t tier, create bool) *store {
	for _, s := range e.stores {
		if s.rank == rank && s.tier == t {
			return s
		}
	}
	if !create {
		return nil
	}
	s := &store{rank: rank, tier: t, blocks: newTable(1)}
	e.stores = append(e.stores, s)
	return s
}

// parent returns the pdx hash of engine block h of rank, from the store
// of tier t or else of another tier of the rank (a tier's blocks may chain
// to another's).
func (e *engine) parent(rank int, t tier, h kvevents.Hash) (uint64, bool) {
	k := key(h)
	if s := e.store(rank, t, false); s != nil {
		if v := s.blocks.find(k); v != nil {
			return v[0], true
		}
	}
	for _, s := range e.stores {
		if s.rank == rank && s.tier != t {
			if v := s.blocks.find(k); v != nil {
				return v[0], true
			}
		}
	}
	return 0, false
}

// key is an engine block hash as a store keys it, folded to 64 bits: two
// blocks of an engine collide with probability 2^-64 (an integer hash is
// its own key, but 0).
func key(h kvevents.Hash) uint64 { return nonZero(h.Lo ^ bits.RotateLeft64(h.Hi*cellMul, 32)) }

// subKey is the key under which a store keeps pdx block j (0-based, of
// ratio-1) of the engine block of key k that is not the last: k holds the
// last, which children chain to. A key derived so collides with another
// block's with probability 2^-64.
func subKey(k uint64, j int) uint64 { return nonZero(k ^ bits.RotateLeft64(uint64(j+1)*cellMul, 17)) }

func (x *Index) stored(e *engine, rank int, ev *kvevents.Event) {
	t, ratio, ok := x.placeable(e, rank, ev)
	if !ok {
		return
	}
	n := len(ev.Hashes)
	if e.entries+n*ratio > x.cfg.MaxEntries {
		x.overflow(e)
	}
	seed, ok := x.seedOf(e, rank, t, ev)
	if !ok {
		x.stats.orphans += uint64(n)
		return
	}
	x.scratch = HashTokens(x.scratch[:0], seed, ev.TokenIDs, x.cfg.BlockSize, 0)
	s := e.store(rank, t, true)
	s.ratio = ratio
	// Load the cells the blocks go to before adding them: in a loop of
	// independent loads their cache misses overlap, where the adds would
	// wait for each in turn (a third less time for 8 blocks).
	sink := x.sink
	for i, h := range ev.Hashes {
		sink ^= s.blocks.touch(key(h)) ^ x.table.touch(x.scratch[(i+1)*ratio-1])
	}
	x.sink = sink
	for i, h := range ev.Hashes {
		pdx, k := x.scratch[i*ratio:(i+1)*ratio], key(h)
		for j := range ratio - 1 {
			x.add(e, s, subKey(k, j), pdx[j])
		}
		x.add(e, s, k, pdx[ratio-1])
	}
	x.stats.stored += uint64(n)
}

// placeable returns the tier of a BlockStored and how many pdx blocks an
// engine block of it is; false, counted, when its blocks are not placed.
func (x *Index) placeable(e *engine, rank int, ev *kvevents.Event) (tier, int, bool) {
	n, bs := len(ev.Hashes), ev.BlockSize
	if n == 0 || bs <= 0 || len(ev.TokenIDs) != n*bs {
		x.stats.malformed++
		return 0, 0, false
	}
	if !x.counts(e, ev) {
		return 0, 0, false
	}
	t, ok := tierOf(ev.Medium)
	if !ok {
		x.stats.ignoredMedia++
		return 0, 0, false
	}
	ratio := bs / x.cfg.BlockSize
	if s := e.store(rank, t, false); bs%x.cfg.BlockSize != 0 || (s != nil && s.ratio != 0 && s.ratio != ratio) {
		x.stats.blockSize++
		return 0, 0, false
	}
	if n*ratio > x.cfg.MaxEntries {
		// Too large to hold at all: skipped, its children will be orphans.
		x.stats.overflows++
		return 0, 0, false
	}
	return t, ratio, true
}

// seedOf is the seed a BlockStored's blocks chain from: its parent's pdx
// hash, or the identity of a chain's start; false when the parent is not
// known.
func (x *Index) seedOf(e *engine, rank int, t tier, ev *kvevents.Event) (uint64, bool) {
	if ev.LoRAName != "" {
		if _, ok := x.loras[ev.LoRAName]; !ok && len(x.loras) < maxLoRANames {
			x.loras[strings.Clone(ev.LoRAName)] = struct{}{}
		}
	}
	switch {
	case ev.HasParent:
		p, ok := e.parent(rank, t, ev.Parent)
		// A child inherits its parent's LoRA through the chain.
		return taint(p, ev.ExtraKeys), ok
	case ev.LoRAName != "":
		return Seed(ev.LoRAName, ev.ExtraKeys), true
	case ev.LoRAID != 0:
		return taint(loraIDSeed(ev.LoRAID), ev.ExtraKeys), true
	}
	return Seed("", ev.ExtraKeys), true
}

// add records a copy of pdx block pdx under key k in s.
func (x *Index) add(e *engine, s *store, k, pdx uint64) {
	v, added := s.blocks.upsert(k)
	switch old := v[0]; {
	case added:
		v[0] = pdx
		e.entries++
	case old == pdx:
		if s.dups == nil {
			s.dups = make(map[uint64]uint32)
		}
		s.dups[k]++
	default:
		// The engine reused a hash for other content (or its parent
		// changed under it): the old blocks are gone.
		x.stats.conflicts++
		v[0] = pdx
		for range 1 + s.dups[k] {
			x.release(e, s.tier, old)
		}
		delete(s.dups, k)
	}
	x.hold(e, s.tier, pdx)
}

func (x *Index) removed(e *engine, rank int, ev *kvevents.Event) {
	if e.lead < 0 {
		// Nothing stored since the engine was reset.
		x.stats.unknownRemovals += uint64(len(ev.Hashes))
		return
	}
	if !x.counts(e, ev) {
		return
	}
	t, ok := tierOf(ev.Medium)
	if !ok {
		x.stats.ignoredMedia++
		return
	}
	s := e.store(rank, t, false)
	if s == nil {
		x.stats.unknownRemovals += uint64(len(ev.Hashes))
		return
	}
	for _, h := range ev.Hashes {
		k := key(h)
		if s.blocks.find(k) == nil {
			x.stats.unknownRemovals++
			continue
		}
		for j := range s.ratio - 1 {
			x.unref(e, s, subKey(k, j))
		}
		x.unref(e, s, k)
		x.stats.removed++
	}
}

// unref drops one copy of the block under key k in s.
func (x *Index) unref(e *engine, s *store, k uint64) {
	v := s.blocks.find(k)
	if v == nil {
		return
	}
	pdx := v[0]
	switch n := s.dups[k]; {
	case n > 1:
		s.dups[k] = n - 1
	case n == 1:
		delete(s.dups, k)
	default:
		s.blocks.remove(k)
		e.entries--
	}
	x.release(e, s.tier, pdx)
}

// bit is where e's bit for tier t is in a block's bitsets.
func (x *Index) bit(e *engine, t tier) (int, uint64) {
	return int(t)*x.words() + int(e.slot)/64, 1 << (e.slot % 64)
}

// hold counts a copy of pdx on tier t of e, setting e's bit when it is the
// first.
func (x *Index) hold(e *engine, t tier, pdx uint64) {
	row, _ := x.table.upsert(pdx)
	w, bit := x.bit(e, t)
	if row[w]&bit != 0 {
		c := e.extra[pdx]
		c[t]++
		e.extra[pdx] = c
		return
	}
	row[w] |= bit
	e.blocks[t]++
}

// release drops a copy of pdx on tier t of e, clearing e's bit with the
// last, and the block with the last engine's.
func (x *Index) release(e *engine, t tier, pdx uint64) {
	if len(e.extra) > 0 {
		if c, ok := e.extra[pdx]; ok && c[t] > 0 {
			if c[t]--; c == ([tiers]uint32{}) {
				delete(e.extra, pdx)
			} else {
				e.extra[pdx] = c
			}
			return
		}
	}
	row := x.table.find(pdx)
	w, bit := x.bit(e, t)
	if row == nil || row[w]&bit == 0 {
		return
	}
	row[w] &^= bit
	e.blocks[t]--
	for _, v := range row {
		if v != 0 {
			return
		}
	}
	x.table.remove(pdx)
}

// drop forgets e's blocks of rank, of every rank for -1.
func (x *Index) drop(e *engine, rank int) {
	kept := e.stores[:0]
	for _, s := range e.stores {
		if rank >= 0 && s.rank != rank {
			kept = append(kept, s)
			continue
		}
		s.blocks.each(func(k uint64, v []uint64) {
			for range 1 + s.dups[k] {
				x.release(e, s.tier, v[0])
			}
		})
		e.entries -= s.blocks.n
	}
	clear(e.stores[len(kept):])
	e.stores = kept
	if len(e.stores) == 0 {
		// The engine may have restarted with another model: relearn.
		e.lead = -1
	}
}

// overflow resets e, which holds more than MaxEntries engine blocks.
func (x *Index) overflow(e *engine) {
	x.stats.overflows++
	x.log.Warn("kvcache: engine holds too many blocks; forgetting them",
		"engine", e.addr, "entries", e.entries, "max", x.cfg.MaxEntries)
	x.drop(e, -1)
}
