package kvcache

import (
	"log/slog"
	"sync"

	"github.com/pdx-router/pdx/internal/kvevents"
)

// MaxEngines is how many engines an Index tells apart: engine slots are
// 0 to MaxEngines-1. Match keeps a depth per slot on its stack.
const MaxEngines = 1 << slotBits

// A handle (Register) is an engine's slot in its low slotBits bits and the
// slot's generation above them: a slot freed (Forget, Retain) starts a new
// generation, so that a handle kept past its engine names no engine rather
// than the slot's next one. A generation wraps after 2^21 reuses of a
// slot; a holder of handles refreshes them long before (Fresh).
const (
	slotBits = 10
	slotMask = MaxEngines - 1
	genMask  = 1<<(31-slotBits) - 1
)

// handle is slot's handle in its current generation.
func (x *Index) handle(slot int32) int32 { return x.handles[slot] }

// slotOf is the slot of handle h, -1 when h names no engine now: below 0,
// or of an older generation of its slot. Callers hold the lock.
func (x *Index) slotOf(h int32) int32 {
	// A slot's handle is not below 0: one load and compare tells both.
	if s := h & slotMask; x.handles[s] == h {
		return s
	}
	return -1
}

// maxWords is the number of bitset words of MaxEngines slots.
const maxWords = MaxEngines / 64

// maxLoRANames bounds the adapter names an Index remembers (SeedFor).
const maxLoRANames = 4096

// maxReasons bounds the distinct Reset reasons counted; later ones count
// as "other".
const maxReasons = 32

// Config configures an Index. The zero value is usable.
type Config struct {
	// BlockSize is the tokens of a pdx block, the block size requests are
	// hashed with (HashTokens); default 16, vLLM's on CUDA. An engine whose
	// blocks are a multiple of it (a CPU tier of larger blocks) has each
	// block counted as that many pdx blocks; other sizes are not placed.
	BlockSize int
	// MaxEntries bounds the engine block hashes tracked per engine (all
	// its ranks and tiers); default 1<<20. An engine beyond it is reset
	// and counted in Stats.Overflows: a publisher that never sends
	// removals must not grow the index without bound.
	MaxEntries int
	// Logger logs resets and overflows; default: discard.
	Logger *slog.Logger
}

// Index is the engines' KV caches as their events tell them: which engine
// holds which pdx block on which tier. It implements [kvevents.Sink] and is
// safe for concurrent use: Apply, Reset and Forget from subscriptions,
// Match and SeedFor from every request (under a read lock: they neither
// allocate nor write).
type Index struct {
	cfg Config
	log *slog.Logger

	mu sync.RWMutex
	// tables map a pdx block hash, by tier, to its holders and its place
	// in its chain (see rows.go).
	tables [tiers]table
	// words is the width of a bitset of engine slots, in words.
	words int
	// open are, by tier, the slots of engines holding a block of the tier
	// without its parent (engine.holes): Match walks their blocks one by
	// one, where it searches those of the others.
	open [tiers][maxWords]uint64
	// blocks are, by tier, the pdx blocks some engine holds there.
	blocks [tiers]int
	// engines by address, and by slot (nil: a free slot).
	engines map[string]*engine
	slots   []*engine
	free    []int32 // freed slots, reused before new ones
	// handles are the slots' handles in their current generations (see
	// handle): slot i's is i until it is first freed.
	handles [MaxEngines]int32
	// loras are the adapter names engines published blocks of.
	loras map[string]struct{}
	// maxOrphanTokens bounds an engine's orphans (maxOrphanTokens).
	maxOrphanTokens int
	// scratch holds an event's pdx hashes while it is applied, joins the
	// blocks whose waiting orphans join (orphans.go).
	scratch []uint64
	joins   []joinItem
	// sink keeps the loads that warm the caches from being optimized
	// away (stored).
	sink  uint64
	stats counters
}

var _ kvevents.Sink = (*Index)(nil)

// engine is one publisher address: its slot and its ranks' stores.
type engine struct {
	addr string
	slot int32
	// stores are one per DP rank and tier.
	stores []*store
	// A pdx block is on a tier while any copy of it is (another engine
	// hash of the same content, another rank): the engine's bit in the
	// table says there is one, extra counts the copies beyond it, rare
	// enough that the common block costs no lookup here.
	extra map[uint64][tiers]uint32
	// holes counts, by tier, the blocks it holds whose parent it does not
	// hold there. At 0 what it holds of any chain is a prefix of it.
	holes [tiers]int
	// kids counts, by tier, the children it holds of a block beyond the
	// first (a row's kid bit says it holds one): branches, rare enough to
	// be kept apart.
	kids [tiers]map[uint64]uint32
	// blocks is how many distinct pdx blocks it has on each tier.
	blocks [tiers]int
	// entries is the engine hashes tracked, over all stores, orphans
	// included.
	entries int
	// orphans are the orphans of its stores (orphans.go), orphanTokens
	// their tokens.
	orphans, orphanTokens int
	// lead is the cache group whose blocks count: the first full-attention
	// group the engine published, -1 until then.
	lead   int
	events uint64
}

// store is one rank's blocks on one tier.
type store struct {
	rank int
	tier tier
	// ratio is the engine's block size over Config.BlockSize, 0 until its
	// first block: an engine block is ratio pdx blocks.
	ratio int
	// blocks maps an engine block's key to the pdx hash of its last pdx
	// block.
	blocks table
	// dups counts the copies beyond the first of keys stored more than
	// once: vLLM may cache two physical blocks of one hash, and evicts
	// each. Rare, so kept apart from blocks.
	dups map[uint64]uint32
	// orphans are the blocks stored under a parent the index does not
	// know, by key, and waiting their keys by their parent's (orphans.go);
	// nil without any.
	orphans map[uint64]*orphan
	waiting map[uint64][]uint64
}

// tier is where an engine keeps a block.
type tier uint8

const (
	tierGPU tier = iota
	tierCPU
	tiers
)

// New returns an empty Index.
func New(cfg Config) *Index {
	if cfg.BlockSize <= 0 {
		cfg.BlockSize = 16
	}
	if cfg.MaxEntries <= 0 {
		cfg.MaxEntries = 1 << 20
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	x := &Index{
		cfg:             cfg,
		log:             log,
		tables:          [tiers]table{newTable(rowVals(1)), newTable(rowVals(1))},
		words:           1,
		engines:         make(map[string]*engine),
		loras:           make(map[string]struct{}),
		maxOrphanTokens: maxOrphanTokens,
		stats:           counters{resets: make(map[string]uint64)},
	}
	for i := range x.handles {
		x.handles[i] = int32(i)
	}
	return x
}

// BlockSize is the tokens of a pdx block: requests are hashed with it.
func (x *Index) BlockSize() int { return x.cfg.BlockSize }

// SeedFor is the Seed of a request for model: the model names a LoRA
// adapter when an engine published blocks under that lora_name, and the
// request's prefix is then that adapter's; else it is the base model's (0).
// Until some engine has cached blocks of an adapter, its requests hash as
// the base model's, and may be placed where the base model's prefix is:
// no engine then holds the adapter's, so no better placement is lost.
func (x *Index) SeedFor(model string) uint64 {
	x.mu.RLock()
	_, ok := x.loras[model]
	x.mu.RUnlock()
	if !ok {
		return 0
	}
	return Seed(model, nil)
}

// Register returns the handle of address's slot, giving it one if it has
// none; -1 when all MaxEngines slots are taken. A handle names the engine
// until Forget or Retain frees its slot; kept past that, it names none
// (Match gives it 0, Fresh reports it stale), not the slot's next engine.
func (x *Index) Register(address string) int32 {
	x.mu.Lock()
	defer x.mu.Unlock()
	if e := x.engine(address); e != nil {
		return x.handle(e.slot)
	}
	return -1
}

// Slot returns the handle of address's slot, -1 when it has none.
func (x *Index) Slot(address string) int32 {
	x.mu.RLock()
	defer x.mu.RUnlock()
	if e := x.engines[address]; e != nil {
		return x.handle(e.slot)
	}
	return -1
}

// Slots appends to dst the handles of addresses' slots (-1 for those
// without one) and returns it.
func (x *Index) Slots(addresses []string, dst []int32) []int32 {
	x.mu.RLock()
	defer x.mu.RUnlock()
	for _, a := range addresses {
		s := int32(-1)
		if e := x.engines[a]; e != nil {
			s = x.handle(e.slot)
		}
		dst = append(dst, s)
	}
	return dst
}

// Fresh reports whether handles, as Register gave them, still name their
// engines: false when a slot was freed since (its engine left, and may
// have come back under another slot), or a handle is -1 while a slot is
// free. A holder of handles registers its addresses again when not.
func (x *Index) Fresh(handles []int32) bool {
	x.mu.RLock()
	defer x.mu.RUnlock()
	room := len(x.free) > 0 || len(x.slots) < MaxEngines
	for _, h := range handles {
		switch s := x.slotOf(h); {
		case s >= 0 && int(s) < len(x.slots) && x.slots[s] != nil: // its engine's
		case h < 0 && !room: // none to be had
		default:
			return false
		}
	}
	return true
}

// Forget drops everything address published and frees its slot, which a
// later engine may get: stop its subscription first, or its next batch
// registers it again.
func (x *Index) Forget(address string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if e := x.engines[address]; e != nil {
		x.forget(e)
	}
}

// Retain forgets every engine whose address is not among addresses (the
// engines of the routing table), and returns how many: engines that left,
// whose subscriptions have stopped, and addresses registered by a pick's
// view of endpoints that have left already.
func (x *Index) Retain(addresses []string) int {
	keep := make(map[string]struct{}, len(addresses))
	for _, a := range addresses {
		keep[a] = struct{}{}
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	n := 0
	for addr, e := range x.engines {
		if _, ok := keep[addr]; !ok {
			x.forget(e)
			n++
		}
	}
	return n
}

// forget drops e and frees its slot, starting the slot's next generation.
// Callers hold the write lock.
func (x *Index) forget(e *engine) {
	x.drop(e, -1)
	delete(x.engines, e.addr)
	x.slots[e.slot] = nil
	next := (uint32(x.handles[e.slot])>>slotBits + 1) & genMask
	x.handles[e.slot] = int32(next<<slotBits) | e.slot
	x.free = append(x.free, e.slot)
}

// engine returns address's engine, registering it; nil when no slot is
// free. Callers hold the write lock.
func (x *Index) engine(address string) *engine {
	if e := x.engines[address]; e != nil {
		return e
	}
	var slot int32
	switch {
	case len(x.free) > 0:
		slot = x.free[len(x.free)-1]
		x.free = x.free[:len(x.free)-1]
	case len(x.slots) < MaxEngines:
		slot = int32(len(x.slots))
		x.slots = append(x.slots, nil)
		if len(x.slots) > 64*x.words {
			// More slots than the bitsets have bits: widen them.
			x.widen(min(maxWords, 2*x.words))
		}
	default:
		return nil
	}
	e := &engine{addr: address, slot: slot, extra: make(map[uint64][tiers]uint32), lead: -1}
	x.engines[address] = e
	x.slots[slot] = e
	return e
}

// Apply implements [kvevents.Sink]: it applies b's events to engine's
// blocks, in order.
func (x *Index) Apply(address string, b *kvevents.Batch) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.stats.batches++
	e := x.engine(address)
	if e == nil {
		x.stats.noSlot += uint64(len(b.Events))
		return
	}
	rank := 0
	if b.HasDPRank {
		rank = b.DPRank
	}
	warm := 0 // the events warmed up to
	for i := range b.Events {
		ev := &b.Events[i]
		x.stats.events++
		e.events++
		switch ev.Kind {
		case kvevents.BlockStored:
			x.stored(e, rank, ev)
		case kvevents.BlockRemoved:
			if i >= warm {
				warm = i + x.warmRemovals(e, rank, b.Events[i:])
			}
			x.removed(e, rank, ev)
		case kvevents.AllBlocksCleared:
			x.drop(e, rank)
		default:
			x.stats.malformed++
		}
	}
}

// Reset implements [kvevents.Sink]: it drops what engine's rank (every
// rank for -1) published.
func (x *Index) Reset(address string, rank int, reason string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if _, ok := x.stats.resets[reason]; !ok && len(x.stats.resets) >= maxReasons {
		reason = "other"
	}
	x.stats.resets[reason]++
	if e := x.engines[address]; e != nil {
		x.drop(e, rank)
	}
	x.log.Debug("kvcache: engine reset", "engine", address, "rank", rank, "reason", reason)
}
