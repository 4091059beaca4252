package picker

import (
	"math/bits"
	"sync"

	"github.com/cespare/xxhash/v2"
)

// BytesPerToken is how many bytes of prompt pdx counts as a token. pdx does
// not tokenize; four bytes a token is the usual rule for English text and
// BPE tokenizers, and close enough to compare prompts and set thresholds.
const BytesPerToken = 4

// MaxBlocks bounds how many leading blocks of a prompt are hashed: a match
// deeper than that adds little to a placement decision.
const MaxBlocks = 1024

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
type index struct {
	mu sync.RWMutex
	// words is the number of 64-bit words of a block's endpoint bitset.
	words int
	// half is how many blocks a generation holds.
	half     int
	cur, old generation
}

// generation maps a block hash to its bitset, stored in bits.
type generation struct {
	slots map[uint64]int32
	bits  []uint64
}

func newIndex(endpoints, capacity int) *index {
	words := max(1, (endpoints+63)/64)
	half := max(1, capacity/2)
	return &index{words: words, half: half, cur: newGeneration(half, words)}
}

func newGeneration(half, words int) generation {
	return generation{slots: make(map[uint64]int32, half), bits: make([]uint64, 0, half*words)}
}

// add records that the endpoint at pos was sent blocks.
func (x *index) add(pos int, blocks []uint64) {
	if pos < 0 || pos >= x.words*64 {
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
}

// matches sets depth[pos] to the number of leading blocks the endpoint at
// pos was sent, for every position below len(depth), and returns the
// deepest.
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

// matched returns how many leading blocks the endpoint at pos was sent.
func (x *index) matched(pos int, blocks []uint64) int {
	if pos < 0 || pos >= x.words*64 {
		return 0
	}
	w, bit := pos/64, uint64(1)<<(pos%64)
	x.mu.RLock()
	defer x.mu.RUnlock()
	for k, b := range blocks {
		if set := x.bits(b); set == nil || set[w]&bit == 0 {
			return k
		}
	}
	return len(blocks)
}
