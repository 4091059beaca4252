package kvcache

import (
	"math"
	"math/bits"
)

// Match sets depth[i], for each i of slots, to the number of leading
// blocks of a prompt (its HashTokens, seeded by SeedFor) that the engine
// of handle slots[i] (Register) holds on its GPU tier: the prefix it need
// not compute. A handle below 0, of a slot freed since, or with no engine,
// gets 0. It returns the deepest; depth must be at least as long as
// slots. It neither allocates nor writes to the Index.
func (x *Index) Match(blocks []uint64, slots []int32, depth []int32) int32 {
	return x.match(blocks, slots, depth, false)
}

// MatchWithCPU is Match counting blocks held on the GPU or the CPU tier:
// the prefix the engine can serve without computing it, part of it loaded
// back from host memory (vLLM's CPU offloading). A policy can weigh the
// difference with Match.
func (x *Index) MatchWithCPU(blocks []uint64, slots []int32, depth []int32) int32 {
	return x.match(blocks, slots, depth, true)
}

// Held is how many leading blocks of a prompt the engine of handle slot
// holds on its GPU tier: Match for one engine.
func (x *Index) Held(slot int32, blocks []uint64) int {
	slots, depth := [1]int32{slot}, [1]int32{}
	x.match(blocks, slots[:], depth[:], false)
	return int(depth[0])
}

// A match finds where each engine stops holding a prompt's blocks. A
// block's lookup misses the CPU's caches when the table is not in them
// (at scale, or matching prompt after prompt), a few hundred nanoseconds:
// a match costs the misses it waits for in turn more than its lookups.
//
//   - An engine without holes (rows.go) holds block k only if it holds
//     every block before it: the match searches where it stops. It looks
//     up blocks a stride apart (a power of 8, at most a sixteenth of the
//     blocks), then, where engines stopped between two of them, the
//     blocks between at a stride 8 times shorter, and so on. For 125
//     blocks: 17 lookups, and 7 more for each place engines stop, in two
//     rounds of misses (the second round's cells are loaded together).
//   - Engines with holes have every block looked up, from the first to
//     where the last of them stops (the others are then searched from
//     there), in chunks whose lookups overlap.
//
// Within a round the lookups are independent, so that their misses
// overlap (table.rows).
type matcher struct {
	x      *Index
	blocks []uint64
	cpu    bool
	// lo and hi are the words of the slots matched.
	lo, hi int
	// at is, by slot from word lo on, where it stopped: zeroed, then
	// written for every slot matched that stops past block 0.
	at []int16
	// sink keeps the loads of touch.
	sink uint64
}

// rows are, by tier, where the rows of a round's blocks are (table.rows).
type rows [tiers][]int

const (
	// firstChunk and maxChunk bound the chunks of the walk: they double,
	// so that a prompt matched a few blocks deep looks up few more.
	firstChunk = 8
	maxChunk   = maxRows
	// fanout is the most blocks a round of the search looks up, but for
	// the last block: its stride is a power of 8 and at most a sixteenth
	// of the blocks searched.
	fanout = 16
)

// slotSet is a set of slots, a bit each.
type slotSet [maxWords]uint64

func (x *Index) match(blocks []uint64, slots []int32, depth []int32, cpu bool) int32 {
	depth = depth[:len(slots)]
	clear(depth)
	if len(blocks) > math.MaxInt16 {
		blocks = blocks[:math.MaxInt16]
	}
	var live slotSet
	m := matcher{blocks: blocks, cpu: cpu, lo: maxWords, hi: -1}
	// Slots come by word (a Set's endpoints in order): a word's bits are
	// gathered in a register, not in memory from one slot to the next.
	// A handle's generation is checked with the depths, under the lock:
	// the slot of a stale one is matched for nothing.
	var acc uint64
	word := -1
	for _, h := range slots {
		if h >= 0 {
			s := h & slotMask
			if w := int(s) / 64; w != word {
				if word >= 0 {
					live[word] |= acc
				}
				word, acc = w, 0
				m.lo, m.hi = min(m.lo, w), max(m.hi, w)
			}
			acc |= 1 << (s % 64)
		}
	}
	if word >= 0 {
		live[word] |= acc
	}
	if m.hi < 0 || len(blocks) == 0 {
		return 0
	}
	// A match of up to 64 engines zeroes a stack array of their 64.
	if m.lo == m.hi {
		var at [64]int16
		m.at = at[:]
		return m.match(x, slots, depth, &live)
	}
	var at [MaxEngines]int16
	m.at = at[:(m.hi-m.lo+1)*64]
	return m.match(x, slots, depth, &live)
}

func (m *matcher) match(x *Index, slots []int32, depth []int32, live *slotSet) int32 {
	x.mu.RLock()
	m.x = x
	words := x.words
	// Slots past the table's words hold nothing: their depth stays 0.
	m.hi = min(m.hi, words-1)
	var open slotSet
	any, walk := false, false
	for w := m.lo; w <= m.hi; w++ {
		open[w] = x.open[tierGPU][w]
		if m.cpu {
			open[w] |= x.open[tierCPU][w]
		}
		any = any || live[w] != 0
		walk = walk || live[w]&open[w] != 0
	}
	k := 0
	if walk {
		k = m.walk(live, &open)
	}
	if any && k >= 0 {
		m.find(k, len(m.blocks), live)
	}
	var deepest int32
	for i, h := range slots {
		// A handle of a freed slot's older generation names no engine.
		if s := x.slotOf(h); s >= 0 && s < int32(64*words) {
			d := int32(m.at[int(s)-64*m.lo])
			depth[i] = d
			deepest = max(deepest, d)
		}
	}
	x.mu.RUnlock()
	return deepest
}

// look finds the rows of keys in the tables matched.
func (m *matcher) look(keys []uint64, r *rows) {
	m.x.tables[tierGPU].rows(keys, r[tierGPU])
	if m.cpu {
		m.x.tables[tierCPU].rows(keys, r[tierCPU])
	}
}

// held is word w of the holders of the i-th block of r.
func (m *matcher) held(r *rows, i, w int) uint64 {
	var h uint64
	if c := r[tierGPU][i]; c >= 0 {
		h = m.x.tables[tierGPU].cells[c+1+w]
	}
	if m.cpu {
		if c := r[tierCPU][i]; c >= 0 {
			h |= m.x.tables[tierCPU].cells[c+1+w]
		}
	}
	return h
}

// stop records that the slots of set stop at block k.
func (m *matcher) stop(set *slotSet, k int) {
	if k == 0 {
		return // as zeroed: most engines hold none of a prompt
	}
	for w := m.lo; w <= m.hi; w++ {
		for l := set[w]; l != 0; l &= l - 1 {
			m.at[(w-m.lo)*64+bits.TrailingZeros64(l)] = int16(k)
		}
	}
}

// walk looks up the blocks one by one from the first, taking out of live
// the slots that stop, until no slot of open is left in live. It returns
// where it stopped, -1 when no slot is left.
func (m *matcher) walk(live, open *slotSet) int {
	blocks := m.blocks
	var gpu, cpu [maxChunk]int
	r := rows{gpu[:], cpu[:]}
	k := 0
	for n := firstChunk; k < len(blocks); n = min(2*n, maxChunk) {
		chunk := blocks[k:min(k+n, len(blocks))]
		m.look(chunk, &r)
		for i := range chunk {
			var left, walking uint64
			for w := m.lo; w <= m.hi; w++ {
				l := live[w]
				if l == 0 {
					continue
				}
				held := m.held(&r, i, w)
				if gone := l &^ held; gone != 0 {
					for ; gone != 0 && k > 0; gone &= gone - 1 {
						m.at[(w-m.lo)*64+bits.TrailingZeros64(gone)] = int16(k)
					}
					l &= held
					live[w] = l
				}
				left |= l
				walking |= l & open[w]
			}
			if left == 0 {
				return -1
			}
			k++
			if walking == 0 {
				return k
			}
		}
	}
	return k
}

// find records where the slots of set stop, each holding blocks[a-1] (or
// a is 0) and not blocks[b] (or b is len(blocks)), none with holes: one
// holding block k holds the blocks before it, so that it stops after the
// last block looked up it holds, and before the first it does not.
func (m *matcher) find(a, b int, set *slotSet) {
	if a == b {
		m.stop(set, a)
		return
	}
	var keys [fanout + 2]uint64
	var at [fanout + 2]int
	n, stride := probes(m.blocks, a, b, &keys, &at)
	var gpu, cpu [fanout + 2]int
	r := rows{gpu[:], cpu[:]}
	m.look(keys[:n], &r)
	if stride > 1 {
		// Where slots stop between two blocks looked up, the blocks
		// between are looked up next, an interval after another: loading
		// their cells first overlaps the misses of every interval.
		held := *set
		for i := range n {
			var left, stopped uint64
			for w := m.lo; w <= m.hi; w++ {
				h := held[w] & m.held(&r, i, w)
				stopped |= held[w] &^ h
				held[w] = h
				left |= h
			}
			if stopped != 0 && i > 0 && at[i-1]+1 < at[i] {
				m.touch(at[i-1]+1, at[i])
			}
			if left == 0 {
				break
			}
		}
	}
	// held are the slots of set holding the last block looked up, from
	// block a-1.
	held := *set
	var gone slotSet
	for i := range n {
		var left, stopped uint64
		for w := m.lo; w <= m.hi; w++ {
			h := held[w] & m.held(&r, i, w)
			gone[w] = held[w] &^ h
			held[w] = h
			left |= h
			stopped |= gone[w]
		}
		if stopped != 0 {
			// Stopped after the block before this one looked up.
			prev := a
			if i > 0 {
				prev = at[i-1] + 1
			}
			m.find(prev, at[i], &gone)
		}
		if left == 0 {
			return
		}
	}
	m.stop(&held, b)
}

// probes sets keys and at to the blocks find looks up of blocks a to b-1
// (a < b), and their positions: a, a+stride, ... and b-1, the stride a power of 8
// and at most a fanout-th of the blocks. It returns how many, and the
// stride.
func probes(blocks []uint64, a, b int, keys *[fanout + 2]uint64, at *[fanout + 2]int) (n, stride int) {
	stride = 1
	for b-a > fanout*stride {
		stride *= 8
	}
	for k := a; k < b; k += stride {
		keys[n], at[n] = blocks[k], k
		n++
	}
	if at[n-1] != b-1 {
		keys[n], at[n] = blocks[b-1], b-1
		n++
	}
	return n, stride
}

// touch loads the home cells of the blocks find(a, b) looks up first.
func (m *matcher) touch(a, b int) {
	var keys [fanout + 2]uint64
	var at [fanout + 2]int
	n, _ := probes(m.blocks, a, b, &keys, &at)
	for t := range tiers {
		if tab := &m.x.tables[t]; tab.n > 0 && (t == tierGPU || m.cpu) {
			for _, k := range keys[:n] {
				m.sink ^= tab.touch(k)
			}
		}
	}
}
