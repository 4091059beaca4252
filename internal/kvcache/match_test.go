package kvcache

import (
	"fmt"
	"math/bits"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/kvevents"
)

// walked is where the engine of handle h stops holding blocks, the blocks
// looked up one by one from the first: what Match must tell.
func walked(x *Index, blocks []uint64, h int32, cpu bool) int32 {
	slot := x.slotOf(h)
	if slot < 0 || int(slot) >= 64*x.words {
		return 0
	}
	w, bit := slotBit(slot)
	for k, b := range blocks {
		held := false
		for t := range tiers {
			if row := x.tables[t].find(b); row != nil && row[w]&bit != 0 && (t == tierGPU || cpu) {
				held = true
			}
		}
		if !held {
			return int32(k)
		}
	}
	return int32(len(blocks))
}

// checkRows recounts from the tables what the Index keeps of them: the
// engines' holes and children, the rows kept, the blocks.
func checkRows(t *testing.T, x *Index) {
	t.Helper()
	n := x.words
	for tr := range tiers {
		held := 0
		tab := &x.tables[tr]
		kids := map[int32]map[uint64]uint32{}
		holes := map[int32]int{}
		blocks := map[int32]int{}
		tab.each(func(k uint64, row []uint64) {
			require.False(t, none(row[:2*n]), "a row no engine holds, nor a child of it")
			if none(row[:n]) {
				return
			}
			held++
			parent := row[2*n]
			for w := range n {
				for l := row[w]; l != 0; l &= l - 1 {
					s := int32(w*64 + bits.TrailingZeros64(l))
					blocks[s]++
					if parent == 0 {
						continue
					}
					if kids[s] == nil {
						kids[s] = map[uint64]uint32{}
					}
					kids[s][parent]++
					if p := tab.find(parent); p == nil || p[w]&(1<<(s%64)) == 0 {
						holes[s]++
					}
				}
			}
		})
		tab.each(func(k uint64, row []uint64) {
			for w := range n {
				var want uint64
				for s := range int32(64) {
					if kids[int32(w*64)+s][k] > 0 {
						want |= 1 << s
					}
				}
				if row[n+w] != want {
					require.Equal(t, want, row[n+w], "kid bits of %x, word %d", k, w)
				}
			}
		})
		for _, e := range x.engines {
			require.Equal(t, holes[e.slot], e.holes[tr], "holes of %s on tier %d", e.addr, tr)
			w, bit := slotBit(e.slot)
			require.Equal(t, holes[e.slot] != 0, x.open[tr][w]&bit != 0, "open %s", e.addr)
			require.Equal(t, blocks[e.slot], e.blocks[tr])
			for k, c := range e.kids[tr] {
				require.Positive(t, c)
				require.Equal(t, kids[e.slot][k], c+1, "children of a branch")
			}
			for k, c := range kids[e.slot] {
				if c > 1 {
					require.Equal(t, c-1, e.kids[tr][k])
				}
			}
		}
		for s := range MaxEngines {
			if w, bit := slotBit(int32(s)); x.open[tr][w]&bit != 0 {
				require.True(t, s < len(x.slots) && x.slots[s] != nil, "a free slot is not open")
			}
		}
		require.Equal(t, held, x.blocks[tr])
	}
	checkOrphans(t, x)
}

// checkOrphans recounts the engines' orphans and entries from their
// stores: every orphan waits for its parent once, every waiting key is an
// orphan, none is held under a known parent too.
func checkOrphans(t *testing.T, x *Index) {
	t.Helper()
	for _, e := range x.engines {
		orphans, tokens, entries := 0, 0, 0
		for _, s := range e.stores {
			entries += s.blocks.n + len(s.orphans)*s.ratio
			// Plain comparisons first: an engine may hold many orphans.
			for k, o := range s.orphans {
				orphans++
				tokens += len(o.tokens)
				if n := countOf(s.waiting[o.parent], k); n != 1 {
					require.Equal(t, 1, n, "%s: orphan %x waits for %x once", e.addr, k, o.parent)
				}
				if s.blocks.find(k) != nil {
					require.Fail(t, "an orphan held under a known parent too", "%s: %x", e.addr, k)
				}
			}
			for p, kids := range s.waiting {
				require.NotEmpty(t, kids)
				for _, k := range kids {
					if o := s.orphans[k]; o == nil || o.parent != p {
						require.Fail(t, "a key waits that is no orphan of that parent", "%s: %x waits for %x", e.addr, k, p)
					}
				}
			}
		}
		require.Equal(t, orphans, e.orphans, "%s: orphans", e.addr)
		require.Equal(t, tokens, e.orphanTokens, "%s: orphans' tokens", e.addr)
		require.Equal(t, entries, e.entries, "%s: entries", e.addr)
	}
}

func countOf(keys []uint64, k uint64) int {
	n := 0
	for _, c := range keys {
		if c == k {
			n++
		}
	}
	return n
}

// TestMatchSearch applies events in every order, parents removed before
// their children among them, and checks after each batch what the index
// keeps of chains (checkRows), and that Match, MatchWithCPU and Held tell
// what a walk of every block tells, for every engine, holes or not.
func TestMatchSearch(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	// A tree of prompts: each extends part of an earlier one.
	var prompts [][]uint32
	for i := range 24 {
		var p []uint32
		if i > 0 {
			q := prompts[r.IntN(i)]
			p = append(p, q[:testBlock*r.IntN(len(q)/testBlock+1)]...)
		}
		for range 1 + r.IntN(20) {
			p = append(p, randomTokens(r, testBlock)...)
		}
		prompts = append(prompts, p)
	}
	engines := []string{"e0", "e1", "e2", "e3", "e4"}
	// e4 has engine blocks of two pdx blocks.
	blockSize := func(engine string) int {
		if engine == "e4" {
			return 2 * testBlock
		}
		return testBlock
	}
	// The engine hash of a block: its tokens' from the prompt's start, as
	// an engine's are, or another (two hashes of one content), or a
	// hash of other content (a conflict).
	ehash := func(engine string, prompt []uint32, end int) uint64 {
		return HashTokens(nil, uint64(len(engine)), prompt[:end], end, 0)[0]
	}
	type storeKey struct {
		engine string
		rank   int
		cpu    bool
	}
	storedHashes := map[storeKey][]uint64{}
	x := New(Config{BlockSize: testBlock})
	check := func(step int) {
		checkRows(t, x)
		for _, p := range prompts {
			blocks := HashTokens(nil, 0, p, testBlock, 0)
			slots := x.Slots(append(engines, "none"), nil)
			slots = append(slots, -1, 1000)
			r.Shuffle(len(slots), func(i, j int) { slots[i], slots[j] = slots[j], slots[i] })
			slots = slots[:1+r.IntN(len(slots))]
			depth := make([]int32, len(slots))
			for _, cpu := range []bool{false, true} {
				x.match(blocks, slots, depth, cpu)
				for i, s := range slots {
					if want := walked(x, blocks, s, cpu); depth[i] != want {
						require.Equal(t, want, depth[i], "step %d: slot %d of %v, cpu %v", step, s, slots, cpu)
					}
				}
			}
			require.Equal(t, int(walked(x, blocks, slots[0], false)), x.Held(slots[0], blocks))
		}
	}
	for step := range 3000 {
		engine := engines[r.IntN(len(engines))]
		bs := blockSize(engine)
		k := storeKey{engine, r.IntN(5) / 4, r.IntN(4) == 0}
		med := medium("GPU")
		if k.cpu {
			med = medium("CPU")
		}
		var evs []kvevents.Event
		for range 1 + r.IntN(4) {
			switch op := r.IntN(100); {
			case op < 55:
				p := prompts[r.IntN(len(prompts))]
				n := len(p) / bs
				if n == 0 {
					continue
				}
				i := r.IntN(n)
				if r.IntN(2) == 0 {
					// Go on from where the engine stops: long chains.
					blocks := HashTokens(nil, 0, p, testBlock, 0)
					i = min(n-1, int(walked(x, blocks, x.Slot(engine), true))*testBlock/bs)
				}
				j := min(n, i+1+r.IntN(8))
				var parent uint64
				if i > 0 {
					parent = ehash(engine, p, i*bs)
				}
				var hs []uint64
				for b := i; b < j; b++ {
					h := ehash(engine, p, (b+1)*bs)
					switch r.IntN(20) {
					case 0:
						h ^= 0x5555 // another hash of this content
					case 1:
						h = ehash(engine, prompts[r.IntN(len(prompts))], bs) // other content's
					}
					hs = append(hs, h)
				}
				ev := stored(0, hs, p[i*bs:j*bs], med, size(bs))
				if parent != 0 {
					ev.Parent, ev.HasParent = kvevents.Hash{Lo: parent}, true
				}
				evs = append(evs, ev)
				storedHashes[k] = append(storedHashes[k], hs...)
			case op < 95:
				if hs := storedHashes[k]; len(hs) > 0 {
					evs = append(evs, removed([]uint64{hs[r.IntN(len(hs))]}, med))
				}
			case op < 97:
				evs = append(evs, cleared())
			case op < 98:
				x.Reset(engine, k.rank, "gap")
			default:
				x.Forget(engine)
			}
		}
		x.Apply(engine, &kvevents.Batch{Events: evs, DPRank: k.rank, HasDPRank: true})
		check(step)
	}
	st := x.Stats()
	require.Positive(t, st.Orphans)
	require.Positive(t, st.Joined, "orphans joined their chains")
	for _, e := range engines {
		x.Forget(e)
	}
	checkRows(t, x)
	require.Zero(t, x.tables[tierGPU].n+x.tables[tierCPU].n)
	require.Zero(t, x.Stats().Blocks)
}

// TestMatchWithoutHoles is the index of engines that evict chains from
// their ends, as vLLM does: none has holes, and every match searches.
func TestMatchWithoutHoles(t *testing.T) {
	s := &benchState{x: New(Config{BlockSize: benchBlock}), r: rand.New(rand.NewPCG(1, 2))}
	var chains [][]uint64
	for i := range 32 {
		hs := s.storeChain(benchAddr(i%8), randomTokens(s.r, 40*benchBlock))
		chains = append(chains, hs)
	}
	// Evict the ends of some chains, a block at a time, from the last.
	for i, hs := range chains[:16] {
		for _, h := range hs[len(hs)-1-i:] {
			s.x.Apply(benchAddr(i%8), &kvevents.Batch{Events: []kvevents.Event{removed([]uint64{h}, medium("GPU"))}})
		}
	}
	checkRows(t, s.x)
	require.Equal(t, [tiers][maxWords]uint64{}, s.x.open)
	// Evicting a parent first opens the engine, until its child goes too.
	hs := chains[20]
	s.x.Apply(benchAddr(4), &kvevents.Batch{Events: []kvevents.Event{removed([]uint64{hs[10]}, medium("GPU"))}})
	checkRows(t, s.x)
	require.Equal(t, uint64(1<<4), s.x.open[tierGPU][0])
	for _, h := range hs[11:] {
		s.x.Apply(benchAddr(4), &kvevents.Batch{Events: []kvevents.Event{removed([]uint64{h}, medium("GPU"))}})
		require.Equal(t, h != hs[len(hs)-1], s.x.open[tierGPU][0] != 0, "a hole while any block after 10 is left")
	}
	checkRows(t, s.x)
}

// TestMatchLongPrompts is Match at every stride of its search: engines
// hold prefixes of a prompt of 1,200 blocks to depths about the strides'
// multiples, some with a hole, some their prompt's end on the CPU tier.
func TestMatchLongPrompts(t *testing.T) {
	x := New(Config{BlockSize: testBlock})
	prompt := randomTokens(rand.New(rand.NewPCG(5, 6)), 1200*testBlock)
	depths := []int{0, 1, 2, 7, 8, 9, 15, 16, 17, 63, 64, 65, 127, 128, 129, 511, 512, 513, 700, 1023, 1024, 1100, 1199, 1200}
	var engines []string
	store := func(engine string, blocks int, cpuFrom int) {
		engines = append(engines, engine)
		var evs []kvevents.Event
		for b := 0; b < blocks; b += 8 {
			end := min(blocks, b+8)
			var hs []uint64
			for i := b; i < end; i++ {
				hs = append(hs, uint64(i+1))
			}
			var parent uint64
			if b > 0 {
				parent = uint64(b)
			}
			med := medium("GPU")
			if b >= cpuFrom {
				med = medium("CPU")
			}
			evs = append(evs, stored(parent, hs, prompt[b*testBlock:end*testBlock], med))
		}
		x.Apply(engine, &kvevents.Batch{Events: evs})
	}
	for _, d := range depths {
		store(fmt.Sprintf("depth-%d", d), d, 1<<20)
	}
	store("cpu-from-64", 1200, 64)
	store("cpu-from-704", 900, 704)
	for _, hole := range []int{0, 300, 1199} {
		engine := fmt.Sprintf("hole-at-%d", hole)
		store(engine, 1200, 1<<20)
		x.Apply(engine, &kvevents.Batch{Events: []kvevents.Event{removed([]uint64{uint64(hole + 1)})}})
	}
	checkRows(t, x)
	require.NotZero(t, x.open[tierGPU][0], "engines with holes")
	slots := x.Slots(engines, nil)
	all := HashTokens(nil, 0, prompt, testBlock, 0)
	depth := make([]int32, len(slots))
	x.Match(all, slots, depth)
	require.Equal(t, append(slices.Clone(depths), 64, 704, 0, 300, 1199), toInts(depth))
	x.MatchWithCPU(all, slots, depth)
	require.Equal(t, append(slices.Clone(depths), 1200, 900, 0, 300, 1199), toInts(depth))
	for _, n := range []int{1, 16, 17, 100, 128, 129, 1000, 1024, 1025, 1200} {
		blocks := all[:n]
		for _, cpu := range []bool{false, true} {
			x.match(blocks, slots, depth, cpu)
			for i, s := range slots {
				require.Equal(t, walked(x, blocks, s, cpu), depth[i], "%s of %d blocks, cpu %v", engines[i], n, cpu)
			}
		}
		for i, s := range slots {
			require.Equal(t, int(walked(x, blocks, s, false)), x.Held(s, blocks), "%s of %d blocks", engines[i], n)
		}
	}
}

func toInts(vs []int32) []int {
	out := make([]int, len(vs))
	for i, v := range vs {
		out[i] = int(v)
	}
	return out
}
