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
// blocks of an engine collide with probability 2^-64. An integer hash is
// its own key, but 0, whose key is zeroKey: a table's keys are not 0, and a
// publisher whose hashes count from 0 keeps its blocks 0 and 1 apart.
func key(h kvevents.Hash) uint64 {
	if k := h.Lo ^ bits.RotateLeft64(h.Hi*cellMul, 32); k != 0 {
		return k
	}
	return zeroKey
}

// zeroKey is the key of the hash that folds to 0, the integer 0 among
// them: any key but 0 and the small integers a counting publisher sends.
const zeroKey = cellMul

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
	seed, parent, ok := x.seedOf(e, rank, t, ev)
	if !ok {
		x.adopt(e, rank, t, ratio, ev)
		return
	}
	x.scratch = HashTokens(x.scratch[:0], seed, ev.TokenIDs, x.cfg.BlockSize, 0)
	s := e.store(rank, t, true)
	s.ratio = ratio
	// Load the cells the blocks go to before adding them: in a loop of
	// independent loads their cache misses overlap, where the adds would
	// wait for each in turn (a third less time for 8 blocks). The first
	// block's parent has its row updated too.
	tab := &x.tables[t]
	sink := x.sink
	if parent != 0 {
		sink ^= tab.touch(parent)
	}
	for i, h := range ev.Hashes {
		sink ^= s.blocks.touch(key(h)) ^ tab.touch(x.scratch[(i+1)*ratio-1])
	}
	x.sink = sink
	for i, h := range ev.Hashes {
		pdx, k := x.scratch[i*ratio:(i+1)*ratio], key(h)
		for j := range ratio - 1 {
			x.add(e, s, subKey(k, j), pdx[j], parent)
			parent = pdx[j]
		}
		x.add(e, s, k, pdx[ratio-1], parent)
		parent = pdx[ratio-1]
	}
	x.stats.stored += uint64(n)
	if e.orphans > 0 {
		x.joinRun(e, s, ev.Hashes)
	}
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
// hash, or the identity of a chain's start; and the parent's pdx hash (0
// for a chain's start); false when the parent is not known: the blocks are
// orphans (orphans.go).
//
// A parent named by the integer 0 is a chain's start, as llm-d's
// publishers (llm-d-inference-sim's default, positional events) name it
// (its EmptyBlockHash) where vLLM sends nil, unless the engine's rank holds
// a block whose hash is 0: a publisher whose hashes count blocks from 0.
// vLLM's and SGLang's hashes are 64 bits of a digest, 0 once in 2^64
// blocks; such a block's children would be taken for chain starts, and
// match only prompts that start with their tokens.
func (x *Index) seedOf(e *engine, rank int, t tier, ev *kvevents.Event) (seed, parent uint64, ok bool) {
	keys := ev.ExtraKeys
	if ev.LoRAName != "" {
		if _, ok := x.loras[ev.LoRAName]; !ok && len(x.loras) < maxLoRANames {
			x.loras[strings.Clone(ev.LoRAName)] = struct{}{}
		}
		// vLLM 0.32 puts the adapter's name in every block's extra keys
		// ([["sql"], ...]): the adapter is the seed's already.
		if onlyLoRAKeys(keys, ev.LoRAName) {
			keys = nil
		}
	}
	if ev.HasParent {
		if p, ok := e.parent(rank, t, ev.Parent); ok {
			// A child inherits its parent's LoRA through the chain.
			return taint(p, keys), p, true
		}
		if ev.Parent != (kvevents.Hash{}) || e.orphan(rank, zeroKey) != nil {
			return 0, 0, false
		}
	}
	switch {
	case ev.LoRAName != "":
		return Seed(ev.LoRAName, keys), 0, true
	case ev.LoRAID != 0:
		return taint(loraIDSeed(ev.LoRAID), keys), 0, true
	}
	return Seed("", keys), 0, true
}

// add records a copy of pdx block pdx, whose parent is parent, under key k
// in s.
func (x *Index) add(e *engine, s *store, k, pdx, parent uint64) {
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
	x.hold(e, s.tier, pdx, parent)
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
			if x.unadopt(e, s, k) {
				x.stats.removed++
			} else {
				x.stats.unknownRemovals++
			}
			continue
		}
		for j := range s.ratio - 1 {
			x.unref(e, s, subKey(k, j))
		}
		x.unref(e, s, k)
		x.stats.removed++
	}
}

// maxWarm is the most blocks warmRemovals loads at once.
const maxWarm = 32

// warmRemovals loads what the removals at the start of evs will read,
// and returns how many events it covered. A removal reads, each after
// the other, the store's cell of its block, the block's row and its
// parent's row (to take the block out of the parent's children): three
// cache misses in turn. Loaded in stages over the removals of a batch
// (vLLM evicts the blocks a step needs at once), the misses of each stage
// overlap. Loads only: the removals still do all the work, in order.
func (x *Index) warmRemovals(e *engine, rank int, evs []kvevents.Event) int {
	var (
		stores [maxWarm]*store
		keys   [maxWarm]uint64
		n, i   int
	)
	if e.lead < 0 {
		return 1
	}
	for ; i < len(evs) && evs[i].Kind == kvevents.BlockRemoved; i++ {
		ev := &evs[i]
		t, ok := tierOf(ev.Medium)
		s := e.store(rank, t, false)
		if !ok || s == nil || ev.GroupIdx != e.lead {
			continue
		}
		if n+len(ev.Hashes) > maxWarm {
			break
		}
		for _, h := range ev.Hashes {
			stores[n], keys[n] = s, key(h)
			n++
		}
	}
	if n < 2 {
		return max(i, 1) // nothing to overlap
	}
	sink := x.sink
	for j := range n {
		sink ^= stores[j].blocks.touch(keys[j])
	}
	var rows [maxWarm]uint64
	for j := range n {
		if v := stores[j].blocks.find(keys[j]); v != nil {
			rows[j] = v[0]
			sink ^= x.tables[stores[j].tier].touch(v[0])
		}
	}
	for j := range n {
		if rows[j] == 0 {
			continue
		}
		if row := x.tables[stores[j].tier].find(rows[j]); row != nil && row[2*x.words] != 0 {
			sink ^= x.tables[stores[j].tier].touch(row[2*x.words])
		}
	}
	x.sink = sink
	return max(i, 1)
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
		x.disown(e, s)
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
