package picker

import (
	"math/bits"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/cespare/xxhash/v2"
)

// BytesPerToken is how many bytes of prompt pdx counts as a token. pdx does
// not tokenize; four bytes a token is the usual rule for English text and
// BPE tokenizers, and close enough to compare prompts and set thresholds.
const BytesPerToken = 4

// MaxBlocks bounds how many leading blocks of a prompt are hashed: a match
// deeper than that adds little to a placement decision. It reaches 65,536
// tokens deep in the blocks of vLLM's default on GPUs (16 tokens).
const MaxBlocks = 4096

// Blocks appends to dst the chained hashes of prompt's full blocks of
// blockTokens tokens (at most MaxBlocks) and returns it: hash k covers
// blocks 0 to k, so equal hashes mean equal prefixes. prompt is the
// request's prompt as the client sent it (the raw JSON of "messages" or
// "prompt"): a conversation's next turn starts with the same bytes. Every
// pdx replica computes the same hashes.
func Blocks(dst []uint64, prompt []byte, blockTokens int) []uint64 {
	size := blockTokens * BytesPerToken
	if size <= 0 {
		return dst
	}
	dst = slices.Grow(dst, min(len(prompt)/size, MaxBlocks)) // one allocation, however fine the blocks
	var h uint64
	for off := 0; off+size <= len(prompt) && len(dst) < MaxBlocks; off += size {
		// Chained: the block's hash mixed with its predecessor's.
		h = mix(h*0x9e3779b97f4a7c15 ^ xxhash.Sum64(prompt[off:off+size]))
		dst = append(dst, h)
	}
	return dst
}

// index remembers which endpoints (by position in a view) were sent which
// prompt blocks: the approximate prefix cache of the Kthena, AIBrix and
// SGLang routers, which needs nothing from the engines. It keeps about
// capacity blocks in two generations: when the newer is full the older is
// dropped, so blocks not sent for a while are forgotten first (an LRU by
// halves, without per-entry bookkeeping).
//
// An engine's cache is smaller than what it was sent: once its metrics say
// how much KV it holds (setKVBlocks), the endpoint also has an LRU of that
// many blocks replayed on what was sent there, and a block counts as held
// only while the LRU has it. Without the engine's word, every block
// sent counts as held until the index forgets it: an engine that evicted
// it would draw the prompt for a hit it no longer has, and the forecast
// would count the prompts queued there as lighter than they are.
type index struct {
	mu sync.RWMutex
	// words is the number of 64-bit words of a block's endpoint bitset.
	words int
	// half is how many blocks a generation holds.
	half     int
	cur, old generation
	// sizes are, by position, how many blocks the endpoint's engine has
	// said it holds (0: not said), and lrus its cache as an LRU of that
	// size (under mu; made by the first add after the engine said).
	sizes []atomic.Int64
	lrus  []*lru
}

// generation maps a block hash to its bitset, stored in bits.
type generation struct {
	slots map[uint64]int32
	bits  []uint64
}

func newIndex(endpoints, capacity int) *index {
	words := max(1, (endpoints+63)/64)
	half := max(1, capacity/2)
	return &index{words: words, half: half, cur: newGeneration(half, words),
		sizes: make([]atomic.Int64, endpoints), lrus: make([]*lru, endpoints)}
}

func newGeneration(half, words int) generation {
	return generation{slots: make(map[uint64]int32, half), bits: make([]uint64, 0, half*words)}
}

// setKVBlocks records that the engine of the endpoint at pos holds blocks
// blocks of KV. An engine whose cache holds more than a generation has
// no LRU: the index forgets its blocks before the engine would.
func (x *index) setKVBlocks(pos int, blocks int64) {
	if pos >= 0 && pos < len(x.sizes) && blocks > 0 {
		if blocks > int64(x.half) {
			blocks = 0
		}
		x.sizes[pos].Store(blocks)
	}
}

// add records that the endpoint at pos was sent blocks.
func (x *index) add(pos int, blocks []uint64) {
	if pos < 0 || pos >= len(x.sizes) {
		return
	}
	w, bit := pos/64, uint64(1)<<(pos%64)
	x.mu.Lock()
	defer x.mu.Unlock()
	for _, b := range blocks {
		slot, ok := x.cur.slots[b]
		if !ok {
			if len(x.cur.slots) >= x.half {
				x.old, x.cur = x.cur, newGeneration(x.half, x.words)
			}
			slot = int32(len(x.cur.slots))
			x.cur.slots[b] = slot
			x.cur.bits = append(x.cur.bits, make([]uint64, x.words)...)
			// A block the older generation has keeps its endpoints.
			if s, ok := x.old.slots[b]; ok {
				copy(x.cur.bits[int(slot)*x.words:], x.old.bits[int(s)*x.words:(int(s)+1)*x.words])
			}
		}
		x.cur.bits[int(slot)*x.words+w] |= bit
	}
	if n := int(x.sizes[pos].Load()); n > 0 {
		r := x.lrus[pos]
		if r == nil {
			r = &lru{slots: map[uint64]int32{}, head: -1, tail: -1}
			x.lrus[pos] = r
		}
		r.resize(n)
		// Last to first: vLLM frees a finished request's blocks tail
		// first, so its prefix outlives its tail.
		for k := len(blocks) - 1; k >= 0; k-- {
			r.touch(blocks[k])
		}
	}
}

// held is how many of the first sent blocks the endpoint at pos was sent
// its LRU has (see index); all of them when its engine has not said.
// x.mu is held.
func (x *index) held(pos int, blocks []uint64, sent int) int {
	if sent == 0 || x.sizes[pos].Load() <= 0 {
		return sent
	}
	r := x.lrus[pos]
	if r == nil {
		return 0
	}
	// What it holds of a prompt is a prefix: a block is sent only with
	// those before it, which add touches after it (see add), so they are
	// the more recently sent.
	if r.has(blocks[sent-1]) {
		return sent
	}
	lo, hi := 0, sent-1
	for lo < hi {
		mid := int(uint(lo+hi) >> 1)
		if r.has(blocks[mid]) {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	return lo
}

// lru is an endpoint's prefix cache as an LRU of its engine's size in
// blocks, replayed on the blocks sent there: a doubly linked list through
// nodes, most recently sent first, whose nodes are reused once it is full.
type lru struct {
	size       int
	slots      map[uint64]int32 // block → its node
	nodes      []lruNode
	free       []int32 // nodes a shrink left unused
	head, tail int32   // most and least recently sent; -1 when empty
}

type lruNode struct {
	block      uint64
	prev, next int32
}

// has reports whether the LRU holds block b.
func (r *lru) has(b uint64) bool {
	_, ok := r.slots[b]
	return ok
}

// resize makes the LRU n blocks, evicting the least recently sent beyond.
func (r *lru) resize(n int) {
	r.size = n
	for len(r.slots) > n {
		r.free = append(r.free, r.evict())
	}
}

// touch makes b the most recently sent block, evicting the least recently
// sent one if b is new and the LRU is full.
func (r *lru) touch(b uint64) {
	if i, ok := r.slots[b]; ok {
		if i != r.head {
			r.unlink(i)
			r.pushFront(i)
		}
		return
	}
	var i int32
	switch {
	case len(r.slots) >= r.size:
		i = r.evict()
	case len(r.free) > 0:
		i = r.free[len(r.free)-1]
		r.free = r.free[:len(r.free)-1]
	default:
		i = int32(len(r.nodes))
		r.nodes = append(r.nodes, lruNode{})
	}
	r.nodes[i].block = b
	r.slots[b] = i
	r.pushFront(i)
}

// evict drops the least recently sent block and returns its node.
func (r *lru) evict() int32 {
	i := r.tail
	r.unlink(i)
	delete(r.slots, r.nodes[i].block)
	return i
}

func (r *lru) unlink(i int32) {
	n := &r.nodes[i]
	if n.prev >= 0 {
		r.nodes[n.prev].next = n.next
	} else {
		r.head = n.next
	}
	if n.next >= 0 {
		r.nodes[n.next].prev = n.prev
	} else {
		r.tail = n.prev
	}
}

func (r *lru) pushFront(i int32) {
	n := &r.nodes[i]
	n.prev, n.next = -1, r.head
	if r.head >= 0 {
		r.nodes[r.head].prev = i
	}
	r.head = i
	if r.tail < 0 {
		r.tail = i
	}
}

// matches sets depth[pos] to the number of leading blocks the endpoint at
// pos was sent and holds still (held), for every position below
// len(depth), and returns the deepest.
func (x *index) matches(blocks []uint64, depth []int32) int32 {
	clear(depth)
	if len(blocks) == 0 {
		return 0
	}
	x.mu.RLock()
	defer x.mu.RUnlock()
	deepest := int32(0)
	for k, b := range blocks {
		bitset := x.bits(b)
		if bitset == nil {
			break
		}
		deeper := false
		for w, set := range bitset {
			for set != 0 {
				i := w*64 + bits.TrailingZeros64(set)
				set &= set - 1
				if i < len(depth) && depth[i] == int32(k) {
					depth[i] = int32(k + 1)
					deeper = true
				}
			}
		}
		if !deeper {
			break
		}
		deepest = int32(k + 1)
	}
	if deepest == 0 {
		return 0
	}
	deepest = 0
	for i, d := range depth[:min(len(depth), len(x.sizes))] {
		if d > 0 {
			depth[i] = int32(x.held(i, blocks, int(d)))
			deepest = max(deepest, depth[i])
		}
	}
	return deepest
}

// bits returns block b's endpoint bitset (words long), nil when the index
// does not have b. The newer generation's, when it has b, includes the
// older's: add copies it over.
func (x *index) bits(b uint64) []uint64 {
	for _, g := range [2]*generation{&x.cur, &x.old} {
		if s, ok := g.slots[b]; ok {
			return g.bits[int(s)*x.words : (int(s)+1)*x.words]
		}
	}
	return nil
}

// matched returns how many leading blocks the endpoint at pos was sent
// and, when held, holds still (see index).
func (x *index) matched(pos int, blocks []uint64, held bool) int {
	if pos < 0 || pos >= len(x.sizes) {
		return 0
	}
	w, bit := pos/64, uint64(1)<<(pos%64)
	x.mu.RLock()
	defer x.mu.RUnlock()
	sent := len(blocks)
	for k, b := range blocks {
		if set := x.bits(b); set == nil || set[w]&bit == 0 {
			sent = k
			break
		}
	}
	if !held {
		return sent
	}
	return x.held(pos, blocks, sent)
}
