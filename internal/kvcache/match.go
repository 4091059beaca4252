package kvcache

import (
	"math"
	"math/bits"
)

// Match sets depth[i], for each i of slots, to the number of leading
// blocks of a prompt (its HashTokens, seeded by SeedFor) that the engine
// of slot slots[i] holds on its GPU tier: the prefix it need not compute.
// A slot below 0, or with no engine, gets 0. It returns the deepest; depth
// must be at least as long as slots. It neither allocates nor writes to
// the Index.
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

func (x *Index) match(blocks []uint64, slots []int32, depth []int32, cpu bool) int32 {
	depth = depth[:len(slots)]
	clear(depth)
	if len(blocks) > math.MaxInt16 {
		blocks = blocks[:math.MaxInt16]
	}
	// live are the slots still matching; at, by slot, where one stopped.
	var live [maxWords]uint64
	var at [MaxEngines]int16
	lo, hi := maxWords, -1
	for _, s := range slots {
		if s >= 0 && s < MaxEngines {
			w := int(s) / 64
			live[w] |= 1 << (s % 64)
			lo, hi = min(lo, w), max(hi, w)
		}
	}
	if hi < 0 || len(blocks) == 0 {
		return 0
	}
	x.mu.RLock()
	words := x.words()
	hi = min(hi, words-1)
	k := 0
	for ; k < len(blocks); k++ {
		row := x.table.find(blocks[k])
		if row == nil {
			break
		}
		var any uint64
		for w := lo; w <= hi; w++ {
			l := live[w]
			if l == 0 {
				continue
			}
			held := row[w]
			if cpu {
				held |= row[words+w]
			}
			if gone := l &^ held; gone != 0 {
				for ; gone != 0; gone &= gone - 1 {
					at[w*64+bits.TrailingZeros64(gone)] = int16(k)
				}
				l &= held
				live[w] = l
			}
			any |= l
		}
		if any == 0 {
			break
		}
	}
	x.mu.RUnlock()
	// Slots past the table's words hold nothing: they stopped at 0.
	for w := lo; w <= hi; w++ {
		for l := live[w]; l != 0; l &= l - 1 {
			at[w*64+bits.TrailingZeros64(l)] = int16(k)
		}
	}
	var deepest int32
	for i, s := range slots {
		if s >= 0 && int(s) < 64*words {
			d := int32(at[s])
			depth[i] = d
			deepest = max(deepest, d)
		}
	}
	return deepest
}

// Held is how many leading blocks of a prompt the engine of slot holds on
// its GPU tier: Match for one engine.
func (x *Index) Held(slot int32, blocks []uint64) int {
	slots, depth := [1]int32{slot}, [1]int32{}
	x.match(blocks, slots[:], depth[:], false)
	return int(depth[0])
}
