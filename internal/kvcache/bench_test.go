package kvcache

import (
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdx-router/pdx/internal/kvevents"
)

// Benchmark shape: 64 engines of vLLM blocks of 16 tokens, each holding
// benchHeld blocks of other prompts; a 2,000-token prompt (125 blocks)
// whose first 40 blocks (a shared system prompt) 16 engines hold and
// whose whole 3 engines hold.
const (
	benchEngines = 64
	benchBlock   = 16
	benchHeld    = 4096
	benchShared  = 40
)

func benchAddr(i int) string { return fmt.Sprintf("10.0.%d.%d:8000", i/250, 1+i%250) }

func randomTokens(r *rand.Rand, n int) []uint32 {
	ids := make([]uint32, n)
	for i := range ids {
		ids[i] = r.Uint32N(128_000)
	}
	return ids
}

// benchState is an index and the engine hashes it has used.
type benchState struct {
	x    *Index
	r    *rand.Rand
	next uint64 // the next engine hash
}

// storeChain stores ids on engine as vLLM does, a BlockStored of up to 8
// blocks at a time, each chained to the last, and returns the hashes.
func (s *benchState) storeChain(engine string, ids []uint32) []uint64 {
	var hs []uint64
	for off := 0; off+benchBlock <= len(ids); {
		n := min(1+s.r.IntN(8), (len(ids)-off)/benchBlock)
		ev := kvevents.Event{Kind: kvevents.BlockStored, BlockSize: benchBlock, TokenIDs: ids[off : off+n*benchBlock], Medium: "GPU"}
		if len(hs) > 0 {
			ev.Parent, ev.HasParent = kvevents.Hash{Lo: hs[len(hs)-1]}, true
		}
		for range n {
			s.next++
			ev.Hashes = append(ev.Hashes, kvevents.Hash{Lo: s.next})
			hs = append(hs, s.next)
		}
		s.x.Apply(engine, &kvevents.Batch{Events: []kvevents.Event{ev}})
		off += n * benchBlock
	}
	return hs
}

// benchIndex is the benchmarks' index and a prompt's blocks and slots.
func benchIndex(tb testing.TB, engines, promptTokens, blockSize int) (*Index, []uint64, []int32) {
	tb.Helper()
	s := &benchState{x: New(Config{BlockSize: blockSize}), r: rand.New(rand.NewPCG(1, 2))}
	prompt := randomTokens(s.r, promptTokens)
	fill(s, engines, prompt, 3)
	blocks := HashTokens(nil, 0, prompt, blockSize, 0)
	addrs := make([]string, engines)
	for i := range addrs {
		addrs[i] = benchAddr(i)
	}
	return s.x, blocks, s.x.Slots(addrs, nil)
}

// fill gives engines benchHeld blocks of random prompts each, prompt's
// shared part to the first 16 and the whole of it to deep of them.
func fill(s *benchState, engines int, prompt []uint32, deep int) {
	for i := range engines {
		switch {
		case i < deep:
			s.storeChain(benchAddr(i), prompt)
		case i < 16:
			s.storeChain(benchAddr(i), prompt[:benchShared*benchBlock])
		}
		for e := s.x.engines[benchAddr(i)]; e == nil || e.blocks[tierGPU] < benchHeld; e = s.x.engines[benchAddr(i)] {
			s.storeChain(benchAddr(i), randomTokens(s.r, 64*benchBlock))
		}
	}
}

// BenchmarkMatch64 is a pick's precise prefix lookup over 64 engines:
// one prompt matched again and again (its blocks in the CPU's caches),
// and 256 prompts in turn (colder), each held whole by 3 engines, or by
// 8 to as many depths (spread: a shared start, a conversation's turns).
func BenchmarkMatch64(b *testing.B) {
	b.Run("one-prompt", func(b *testing.B) {
		x, blocks, slots := benchIndex(b, benchEngines, 2000, benchBlock)
		depth := make([]int32, len(slots))
		b.ReportAllocs()
		for b.Loop() {
			if x.Match(blocks, slots, depth) != int32(len(blocks)) {
				b.Fatal("no deep match")
			}
		}
	})
	for _, depths := range [][]int{{125, 125, 125}, {125, 100, 77, 50, 33, 20, 9, 3}} {
		name := "256-prompts"
		if len(depths) > 3 {
			name += "-spread"
		}
		b.Run(name, func(b *testing.B) { benchMatchPrompts(b, depths) })
	}
}

// benchMatchPrompts matches 256 prompts of 125 blocks in turn, each held
// by engines to depths.
func benchMatchPrompts(b *testing.B, depths []int) {
	s := &benchState{x: New(Config{BlockSize: benchBlock}), r: rand.New(rand.NewPCG(3, 4))}
	var prompts [][]uint64
	for p := range 256 {
		prompt := randomTokens(s.r, 2000)
		for i, d := range depths {
			s.storeChain(benchAddr((p*len(depths)+i)%benchEngines), prompt[:d*benchBlock])
		}
		prompts = append(prompts, HashTokens(nil, 0, prompt, benchBlock, 0))
	}
	fill(s, benchEngines, randomTokens(s.r, 2000), 0)
	addrs := make([]string, benchEngines)
	for i := range addrs {
		addrs[i] = benchAddr(i)
	}
	slots := s.x.Slots(addrs, nil)
	depth := make([]int32, len(slots))
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		blocks := prompts[i%len(prompts)]
		i++
		if s.x.Match(blocks, slots, depth) != int32(len(blocks)) {
			b.Fatal("no deep match")
		}
	}
}

// BenchmarkMatch64Parallel is Match from every core while a goroutine
// applies events at 64 engines × 1,000 events a second (it stores 8 blocks
// on an engine and evicts them, one BlockRemoved a block, catching up when
// it was not scheduled): the cost of the write lock to requests. On two
// cores the applier also takes its share of the CPU.
func BenchmarkMatch64Parallel(b *testing.B) {
	const rate = benchEngines * 1000 // events a second
	for _, applying := range []bool{false, true} {
		b.Run(fmt.Sprintf("applying=%v", applying), func(b *testing.B) {
			x, blocks, slots := benchIndex(b, benchEngines, 2000, benchBlock)
			stop := make(chan struct{})
			done := make(chan struct{})
			var applied atomic.Int64
			start := time.Now()
			go func() {
				defer close(done)
				if !applying {
					return
				}
				s := &benchState{x: x, r: rand.New(rand.NewPCG(5, 6)), next: 1 << 40}
				for i := 0; ; {
					select {
					case <-stop:
						return
					case <-time.After(500 * time.Microsecond):
					}
					for due := int64(rate * time.Since(start).Seconds()); applied.Load() < due; i++ {
						engine := benchAddr(i % benchEngines)
						before := s.x.stats.events // only this goroutine applies
						hs := s.storeChain(engine, randomTokens(s.r, 8*benchBlock))
						evs := make([]kvevents.Event, len(hs))
						for k, h := range hs {
							evs[k] = kvevents.Event{Kind: kvevents.BlockRemoved, Hashes: []kvevents.Hash{{Lo: h}}, Medium: "GPU"}
						}
						x.Apply(engine, &kvevents.Batch{Events: evs})
						x.mu.RLock()
						applied.Add(int64(x.stats.events - before))
						x.mu.RUnlock()
					}
				}
			}()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				depth := make([]int32, len(slots))
				for pb.Next() {
					x.Match(blocks, slots, depth)
				}
			})
			b.StopTimer()
			close(stop)
			<-done
			if applying {
				b.ReportMetric(float64(applied.Load())/time.Since(start).Seconds(), "events/s")
			}
		})
	}
}

// BenchmarkApply is the cost of an event, on 64 engines holding benchHeld
// blocks each: a BlockStored of 1, 4 or 8 new blocks (vLLM sends one per
// run of newly full blocks), chained to the engine's previous one, and a
// BlockRemoved of one block (vLLM sends one per eviction). An op is one
// event in a batch of its own. The events come from a pool of 1<<16
// blocks, stored then removed (untimed) in turn, so that most of what an
// event touches is not in the CPU's caches, as with engines' real traffic.
func BenchmarkApply(b *testing.B) {
	const poolBlocks = 1 << 16
	for _, n := range []int{1, 4, 8} {
		b.Run(fmt.Sprintf("stored-%d", n), func(b *testing.B) {
			x, _, _ := benchIndex(b, benchEngines, 2000, benchBlock)
			stores, removes := applyPool(poolBlocks/n, n)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; b.Loop(); i++ {
				if i%len(stores) == 0 && i > 0 {
					b.StopTimer()
					for j := range removes {
						x.Apply(removes[j].engine, &removes[j].batch)
					}
					b.StartTimer()
				}
				x.Apply(stores[i%len(stores)].engine, &stores[i%len(stores)].batch)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/block")
		})
	}
	// vLLM evicts the blocks a step needs at once: a batch holds as many
	// BlockRemoved events, whose lookups Apply overlaps.
	for _, per := range []int{1, 8} {
		b.Run(fmt.Sprintf("removed-1/batch-%d", per), func(b *testing.B) {
			x, _, _ := benchIndex(b, benchEngines, 2000, benchBlock)
			stores, removes := applyPool(poolBlocks/4, 4)
			// An engine's removals, per to a batch.
			byEngine := map[string][]kvevents.Event{}
			for _, r := range removes {
				byEngine[r.engine] = append(byEngine[r.engine], r.batch.Events...)
			}
			var batches []engineBatch
			for i := range benchEngines {
				evs := byEngine[benchAddr(i)]
				for j := 0; j < len(evs); j += per {
					batches = append(batches, engineBatch{benchAddr(i), kvevents.Batch{Events: evs[j:min(j+per, len(evs))]}})
				}
			}
			events := 0
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; b.Loop(); i++ {
				if i%len(batches) == 0 {
					b.StopTimer()
					for j := range stores {
						x.Apply(stores[j].engine, &stores[j].batch)
					}
					b.StartTimer()
				}
				bt := &batches[i%len(batches)]
				x.Apply(bt.engine, &bt.batch)
				events += len(bt.batch.Events)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(events), "ns/event")
		})
	}
}

type engineBatch struct {
	engine string
	batch  kvevents.Batch
}

// applyPool returns events BlockStored batches of n blocks each, round
// robin over the engines, each chained to the engine's previous one up to
// 32 blocks, and the BlockRemoved batches (a block each) that undo them.
func applyPool(events, n int) (stores, removes []engineBatch) {
	r := rand.New(rand.NewPCG(7, 8))
	next := uint64(1 << 50)
	last := make([]uint64, benchEngines)
	length := make([]int, benchEngines)
	for i := range events {
		e := i % benchEngines
		ev := kvevents.Event{Kind: kvevents.BlockStored, BlockSize: benchBlock, TokenIDs: randomTokens(r, n*benchBlock), Medium: "GPU"}
		if length[e] > 0 && length[e]+n <= 32 {
			ev.Parent, ev.HasParent = kvevents.Hash{Lo: last[e]}, true
		} else {
			length[e] = 0
		}
		for range n {
			next++
			ev.Hashes = append(ev.Hashes, kvevents.Hash{Lo: next})
			removes = append(removes, engineBatch{benchAddr(e), kvevents.Batch{Events: []kvevents.Event{
				{Kind: kvevents.BlockRemoved, Hashes: []kvevents.Hash{{Lo: next}}, Medium: "GPU"}}}})
		}
		last[e], length[e] = next, length[e]+n
		stores = append(stores, engineBatch{benchAddr(e), kvevents.Batch{Events: []kvevents.Event{ev}}})
	}
	return stores, removes
}

// BenchmarkHashTokens is a request's side: hashing a 2,000-token prompt.
func BenchmarkHashTokens(b *testing.B) {
	ids := randomTokens(rand.New(rand.NewPCG(1, 2)), 2000)
	dst := make([]uint64, 0, 128)
	b.ReportAllocs()
	for b.Loop() {
		dst = HashTokens(dst[:0], 0, ids, benchBlock, 0)
	}
}
