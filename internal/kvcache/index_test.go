package kvcache

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/pdx-router/pdx/internal/kvevents"
)

// The tests' pdx blocks are 4 tokens.
const testBlock = 4

type evOpt func(*kvevents.Event)

func hashes(vs ...uint64) []kvevents.Hash {
	out := make([]kvevents.Hash, len(vs))
	for i, v := range vs {
		out[i] = kvevents.Hash{Lo: v}
	}
	return out
}

// stored is a BlockStored of engine hashes hs (parent 0: none) with ids,
// blocks of testBlock tokens.
func stored(parent uint64, hs []uint64, ids []uint32, opts ...evOpt) kvevents.Event {
	e := kvevents.Event{Kind: kvevents.BlockStored, Hashes: hashes(hs...), TokenIDs: ids, BlockSize: testBlock}
	if parent != 0 {
		e.Parent, e.HasParent = kvevents.Hash{Lo: parent}, true
	}
	for _, o := range opts {
		o(&e)
	}
	return e
}

func removed(hs []uint64, opts ...evOpt) kvevents.Event {
	e := kvevents.Event{Kind: kvevents.BlockRemoved, Hashes: hashes(hs...)}
	for _, o := range opts {
		o(&e)
	}
	return e
}

func cleared() kvevents.Event { return kvevents.Event{Kind: kvevents.AllBlocksCleared} }

// parentZero names the parent 0, as llm-d's positional events name a
// chain's start (stored's parent 0 is none, vLLM's nil).
func parentZero(e *kvevents.Event) { e.Parent, e.HasParent = kvevents.Hash{}, true }

func medium(m string) evOpt   { return func(e *kvevents.Event) { e.Medium = m } }
func lora(name string) evOpt  { return func(e *kvevents.Event) { e.LoRAName = name } }
func loraID(id int64) evOpt   { return func(e *kvevents.Event) { e.LoRAID = id } }
func extra(keys []byte) evOpt { return func(e *kvevents.Event) { e.ExtraKeys = keys } }
func size(n int) evOpt        { return func(e *kvevents.Event) { e.BlockSize = n } }
func group(idx int, kind string, window int) evOpt {
	return func(e *kvevents.Event) { e.GroupIdx, e.SpecKind, e.SlidingWindow = idx, kind, window }
}

// step changes an index.
type step func(*Index)

// apply is a batch of engine's events from DP rank (-1: none sent).
func apply(engine string, rank int, evs ...kvevents.Event) step {
	return func(x *Index) {
		b := &kvevents.Batch{Events: evs, DPRank: max(rank, 0), HasDPRank: rank >= 0}
		x.Apply(engine, b)
	}
}

func reset(engine string, rank int, reason string) step {
	return func(x *Index) { x.Reset(engine, rank, reason) }
}

// probe is what Match and MatchWithCPU tell of a prompt on an engine.
type probe struct {
	engine string
	model  string // the request's model, seeded with SeedFor
	ids    []uint32
	gpu    int32 // Match's depth
	cpu    int32 // MatchWithCPU's; -1: same as gpu
}

func (p probe) check(t *testing.T, x *Index) {
	t.Helper()
	blocks := HashTokens(nil, x.SeedFor(p.model), p.ids, x.BlockSize(), 0)
	slots := []int32{x.Slot(p.engine)}
	depth := make([]int32, 1)
	x.Match(blocks, slots, depth)
	require.Equal(t, p.gpu, depth[0], "GPU depth on %s", p.engine)
	want := p.cpu
	if want < 0 {
		want = p.gpu
	}
	x.MatchWithCPU(blocks, slots, depth)
	require.Equal(t, want, depth[0], "GPU or CPU depth on %s", p.engine)
}

func encode(t *testing.T, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	require.NoError(t, err)
	return b
}

func TestIndex(t *testing.T) {
	a, b, c := tokens(0, 8), tokens(100, 4), tokens(200, 8) // 2, 1 and 2 blocks
	ab := concat(a, b, tokens(900, 3))                      // a, b and a partial block
	tests := []struct {
		name   string
		cfg    Config
		steps  []step
		probes []probe
		stats  func(t *testing.T, st Stats)
	}{
		{
			name:   "chains across batches",
			steps:  []step{apply("e1", -1, stored(0, []uint64{1, 2}, a)), apply("e1", -1, stored(2, []uint64{3}, b))},
			probes: []probe{{"e1", "", ab, 3, -1}, {"e1", "", a, 2, -1}, {"e1", "", c, 0, -1}, {"e2", "", ab, 0, -1}},
			stats: func(t *testing.T, st Stats) {
				require.Equal(t, uint64(2), st.Batches)
				require.Equal(t, uint64(3), st.StoredBlocks)
				require.Equal(t, 3, st.Blocks)
				require.Equal(t, []EngineStats{{Address: "e1", Slot: 0, GPUBlocks: 3, Entries: 3, Events: 2}}, st.Engines)
			},
		},
		{
			name:   "parent unknown",
			steps:  []step{apply("e1", -1, stored(0, []uint64{1, 2}, a), stored(99, []uint64{3}, b))},
			probes: []probe{{"e1", "", ab, 2, -1}},
			stats:  func(t *testing.T, st Stats) { require.Equal(t, uint64(1), st.Orphans) },
		},
		{
			name: "a child of an orphan is an orphan",
			steps: []step{apply("e1", -1, stored(99, []uint64{1, 2}, a), stored(2, []uint64{3}, b)),
				apply("e1", -1, removed([]uint64{1}))},
			probes: []probe{{"e1", "", ab, 0, -1}},
			stats: func(t *testing.T, st Stats) {
				require.Equal(t, uint64(3), st.Orphans)
				require.Zero(t, st.UnknownRemovals, "an orphan's removal resolves")
				require.Equal(t, uint64(1), st.RemovedBlocks)
				require.Equal(t, 2, st.Engines[0].Orphans)
				require.Zero(t, st.Blocks)
			},
		},
		{
			name: "orphans join when the block they wait for is stored",
			// b stored under a's second block, which the index never saw,
			// then c's first under b: orphans, their removal resolves...
			steps: []step{apply("e1", -1, stored(2, []uint64{3}, b), stored(3, []uint64{4}, c[:4]), stored(3, []uint64{5}, c[4:])),
				apply("e1", -1, removed([]uint64{5})),
				// ...and they join when the engine stores a again.
				apply("e1", -1, stored(0, []uint64{1, 2}, a))},
			probes: []probe{{"e1", "", concat(a, b, c[:4]), 4, -1}, {"e1", "", concat(a, b, c[4:]), 3, -1}},
			stats: func(t *testing.T, st Stats) {
				require.Equal(t, uint64(3), st.Orphans)
				require.Equal(t, uint64(2), st.Joined)
				require.Zero(t, st.UnknownRemovals)
				require.Zero(t, st.Engines[0].Orphans)
				require.Equal(t, 4, st.Engines[0].Entries)
				require.Equal(t, 4, st.Blocks)
			},
		},
		{
			name: "an orphan's children wait on for it once it left",
			// llm-d-inference-sim evicts the oldest unused block, a parent
			// before its child: the child joins when the parent is back.
			steps: []step{apply("e1", -1, stored(2, []uint64{3}, b), stored(3, []uint64{4}, c[:4])),
				apply("e1", -1, removed([]uint64{3})),
				apply("e1", -1, stored(0, []uint64{1, 2}, a)),
				apply("e1", -1, stored(2, []uint64{3}, b))},
			probes: []probe{{"e1", "", concat(a, b, c[:4]), 4, -1}},
			stats: func(t *testing.T, st Stats) {
				require.Equal(t, uint64(2), st.Orphans)
				require.Equal(t, uint64(1), st.Joined)
				require.Equal(t, uint64(1), st.RemovedBlocks)
			},
		},
		{
			name: "an orphan stored again under a known parent is a copy",
			steps: []step{apply("e1", -1, stored(7, []uint64{3}, b)),
				apply("e1", -1, stored(0, []uint64{1, 2}, a), stored(2, []uint64{3}, b)),
				apply("e1", -1, removed([]uint64{3}))},
			probes: []probe{{"e1", "", ab, 3, -1}},
			stats: func(t *testing.T, st Stats) {
				require.Equal(t, uint64(1), st.Joined)
				require.Equal(t, 3, st.Engines[0].Entries)
			},
		},
		{
			name: "orphans of another rank or tier wait apart",
			steps: []step{apply("e1", 1, stored(2, []uint64{3}, b)),
				apply("e1", 0, stored(0, []uint64{1, 2}, a)),
				apply("e1", 1, stored(2, []uint64{4}, b, medium("CPU")))},
			probes: []probe{{"e1", "", ab, 2, -1}},
			stats: func(t *testing.T, st Stats) {
				require.Equal(t, uint64(2), st.Orphans)
				require.Zero(t, st.Joined)
				require.Equal(t, 2, st.Engines[0].Orphans)
			},
		},
		{
			name: "orphans beyond an engine's bound are dropped",
			steps: []step{func(x *Index) { x.maxOrphanTokens = 3 * testBlock },
				apply("e1", -1, stored(9, []uint64{1, 2}, a), stored(8, []uint64{3, 4}, c), stored(2, []uint64{5}, b))},
			stats: func(t *testing.T, st Stats) {
				require.Equal(t, uint64(5), st.Orphans)
				require.Equal(t, uint64(2), st.OrphansDropped)
				require.Equal(t, 3, st.Engines[0].Orphans)
			},
		},
		{
			name:   "parent 0 is a chain's start (llm-d)",
			steps:  []step{apply("e1", -1, stored(0, []uint64{1, 2}, a, parentZero), stored(2, []uint64{3}, b))},
			probes: []probe{{"e1", "", ab, 3, -1}},
			stats:  func(t *testing.T, st Stats) { require.Zero(t, st.Orphans) },
		},
		{
			name: "parent 0 is the engine's block 0 when it holds one",
			// A publisher whose hashes count its blocks from 0: 0 and 1
			// are two blocks.
			steps: []step{apply("e1", -1, stored(0, []uint64{0}, a[:4]), stored(0, []uint64{1}, c[:4], parentZero)),
				apply("e1", -1, stored(0, []uint64{2}, b, parentZero))},
			probes: []probe{{"e1", "", concat(a[:4], c[:4]), 2, -1}, {"e1", "", concat(a[:4], b), 2, -1},
				{"e1", "", c[:4], 0, -1}},
			stats: func(t *testing.T, st Stats) { require.Equal(t, 3, st.Blocks) },
		},
		{
			name: "parent 0 of an orphan 0 is that orphan",
			steps: []step{apply("e1", -1, stored(5, []uint64{0}, b), stored(0, []uint64{1}, c[:4], parentZero)),
				apply("e1", -1, stored(0, []uint64{4, 5}, a))},
			probes: []probe{{"e1", "", concat(a, b, c[:4]), 4, -1}},
			stats:  func(t *testing.T, st Stats) { require.Equal(t, uint64(2), st.Joined) },
		},
		{
			name: "removal: two engine hashes of the same content",
			steps: []step{apply("e1", -1, stored(0, []uint64{1, 2}, a), stored(0, []uint64{5, 6}, a)),
				apply("e1", -1, removed([]uint64{2}))},
			probes: []probe{{"e1", "", a, 2, -1}},
			stats: func(t *testing.T, st Stats) {
				require.Equal(t, 2, st.Engines[0].GPUBlocks)
				require.Equal(t, 3, st.Engines[0].Entries)
			},
		},
		{
			name: "removal: the last copy goes",
			steps: []step{apply("e1", -1, stored(0, []uint64{1, 2}, a), stored(0, []uint64{5, 6}, a)),
				apply("e1", -1, removed([]uint64{2}), removed([]uint64{6}))},
			probes: []probe{{"e1", "", a, 1, -1}},
			stats: func(t *testing.T, st Stats) {
				require.Equal(t, uint64(2), st.RemovedBlocks)
				require.Equal(t, 1, st.Blocks)
			},
		},
		{
			name: "removal: one hash stored twice",
			steps: []step{apply("e1", -1, stored(0, []uint64{1}, tokens(0, 4)), stored(0, []uint64{1}, tokens(0, 4))),
				apply("e1", -1, removed([]uint64{1}))},
			probes: []probe{{"e1", "", a, 1, -1}},
		},
		{
			name: "removal: one hash stored twice, removed twice",
			steps: []step{apply("e1", -1, stored(0, []uint64{1}, tokens(0, 4)), stored(0, []uint64{1}, tokens(0, 4))),
				apply("e1", -1, removed([]uint64{1}), removed([]uint64{1}), removed([]uint64{1}))},
			probes: []probe{{"e1", "", a, 0, -1}},
			stats: func(t *testing.T, st Stats) {
				require.Equal(t, uint64(1), st.UnknownRemovals)
				require.Zero(t, st.Blocks)
				require.Zero(t, st.Engines[0].Entries)
			},
		},
		{
			name: "removal: a GPU and a CPU copy",
			steps: []step{apply("e1", -1, stored(0, []uint64{1, 2}, a), stored(0, []uint64{1, 2}, a, medium("CPU"))),
				apply("e1", -1, removed([]uint64{2}, medium("GPU")))},
			probes: []probe{{"e1", "", a, 1, 2}},
			stats: func(t *testing.T, st Stats) {
				require.Equal(t, 1, st.Engines[0].GPUBlocks)
				require.Equal(t, 2, st.Engines[0].CPUBlocks)
			},
		},
		{
			name: "CPU tier only",
			steps: []step{apply("e1", -1, stored(0, []uint64{1}, tokens(0, 4)), stored(1, []uint64{2, 3}, tokens(4, 8), medium("CPU"))),
				apply("e1", -1, removed([]uint64{3}, medium("CPU")))},
			// The CPU blocks chain to a GPU parent: the tier's blocks may.
			probes: []probe{{"e1", "", tokens(0, 12), 1, 2}},
		},
		{
			name:   "other media",
			steps:  []step{apply("e1", -1, stored(0, []uint64{1}, tokens(0, 4), medium("STORAGE")), removed([]uint64{1}, medium("disk")))},
			probes: []probe{{"e1", "", a, 0, 0}},
			stats:  func(t *testing.T, st Stats) { require.Equal(t, uint64(2), st.IgnoredMedia) },
		},
		{
			name:  "LoRA taint",
			steps: []step{apply("e1", -1, stored(0, []uint64{1, 2}, a, lora("sql")), stored(2, []uint64{3}, b, lora("sql")))},
			probes: []probe{
				{"e1", "sql", ab, 3, -1},
				{"e1", "", ab, 0, -1},
				{"e1", "base-model", ab, 0, -1}, // not an adapter engines published
			},
			stats: func(t *testing.T, st Stats) { require.Equal(t, 1, st.LoRANames) },
		},
		{
			// vLLM 0.32: the adapter's name is each block's extra key too.
			name: "LoRA taint, the name in the extra keys",
			steps: []step{apply("e1", -1,
				stored(0, []uint64{1, 2}, a, lora("sql"), extra(encode(t, []any{[]any{"sql"}, []any{"sql"}}))),
				stored(2, []uint64{3}, b, lora("sql"), extra(encode(t, []any{[]any{"sql"}}))))},
			probes: []probe{
				{"e1", "sql", ab, 3, -1},
				{"e1", "", ab, 0, -1},
			},
		},
		{
			// Another key beside the name (a cache salt) is another block.
			name:   "LoRA with a salt",
			steps:  []step{apply("e1", -1, stored(0, []uint64{1, 2}, a, lora("sql"), extra(encode(t, []any{[]any{"sql", "salt"}, []any{"sql"}}))))},
			probes: []probe{{"e1", "sql", a, 0, -1}},
		},
		{
			name: "LoRA and base blocks side by side",
			steps: []step{apply("e1", -1, stored(0, []uint64{1, 2}, a, lora("sql"))),
				apply("e1", -1, stored(0, []uint64{11}, tokens(0, 4)))},
			probes: []probe{{"e1", "sql", a, 2, -1}, {"e1", "other", a, 1, -1}},
		},
		{
			name:   "LoRA known by id only",
			steps:  []step{apply("e1", -1, stored(0, []uint64{1, 2}, a, loraID(3)), stored(2, []uint64{3}, b)), apply("e1", -1, removed([]uint64{3}))},
			probes: []probe{{"e1", "", ab, 0, -1}},
			stats: func(t *testing.T, st Stats) {
				require.Zero(t, st.Orphans, "kept, though never matched")
				require.Zero(t, st.UnknownRemovals)
				require.Equal(t, 2, st.Engines[0].Entries)
			},
		},
		{
			name:   "extra keys taint",
			steps:  []step{apply("e1", -1, stored(0, []uint64{1, 2}, a, extra(encode(t, []any{[]any{"salt"}, nil}))))},
			probes: []probe{{"e1", "", a, 0, -1}},
			stats:  func(t *testing.T, st Stats) { require.Equal(t, 2, st.Engines[0].GPUBlocks) },
		},
		{
			name:   "extra keys of nils do not",
			steps:  []step{apply("e1", -1, stored(0, []uint64{1, 2}, a, extra(encode(t, []any{nil, nil}))))},
			probes: []probe{{"e1", "", a, 2, -1}},
		},
		{
			name:   "a child's extra keys taint from there",
			steps:  []step{apply("e1", -1, stored(0, []uint64{1, 2}, a), stored(2, []uint64{3}, b, extra(encode(t, []any{[]any{"mm", 7}}))))},
			probes: []probe{{"e1", "", ab, 2, -1}},
		},
		{
			name: "only full-attention groups count",
			steps: []step{apply("e1", -1,
				stored(0, []uint64{1, 2}, a, group(0, "full_attention", 0)),
				stored(0, []uint64{1, 2}, c, group(0, "sliding_window", 0)),
				stored(0, []uint64{3, 4}, c, group(0, "full_attention", 4096)),
				stored(0, []uint64{5}, tokens(300, 4), group(0, "mamba", 0)),
				stored(0, []uint64{6}, tokens(400, 4), group(0, "unknown", 0)),
				stored(0, []uint64{7}, tokens(500, 4), group(0, "mla_attention", 0)),
			)},
			probes: []probe{{"e1", "", a, 2, -1}, {"e1", "", c, 0, -1}, {"e1", "", tokens(300, 4), 0, -1}, {"e1", "", tokens(500, 4), 1, -1}},
			stats:  func(t *testing.T, st Stats) { require.Equal(t, uint64(4), st.IgnoredGroups) },
		},
		{
			name: "the lead group counts, the others' events not",
			steps: []step{apply("e1", -1,
				stored(0, []uint64{9}, tokens(600, 4), group(0, "sliding_window", 0)),
				stored(0, []uint64{1, 2}, a, group(1, "full_attention", 0)),
				stored(0, []uint64{1, 2}, a, group(2, "full_attention", 0)),
				stored(0, []uint64{3}, c[:4], group(2, "full_attention", 0)),
				removed([]uint64{2}, group(2, "", 0)),
				removed([]uint64{9}, group(0, "", 0)),
			)},
			probes: []probe{{"e1", "", a, 2, -1}, {"e1", "", c, 0, -1}},
			stats:  func(t *testing.T, st Stats) { require.Equal(t, uint64(5), st.IgnoredGroups) },
		},
		{
			name: "AllBlocksCleared",
			steps: []step{apply("e1", 0, stored(0, []uint64{1, 2}, a)), apply("e1", 1, stored(0, []uint64{1}, c[:4])),
				apply("e1", 0, cleared())},
			probes: []probe{{"e1", "", a, 0, -1}, {"e1", "", c, 1, -1}},
			stats:  func(t *testing.T, st Stats) { require.Equal(t, 1, st.Engines[0].Entries) },
		},
		{
			name: "AllBlocksCleared then removals",
			steps: []step{apply("e1", -1, stored(0, []uint64{1, 2}, a, medium("CPU"))),
				apply("e1", -1, cleared(), removed([]uint64{1}, medium("CPU")))},
			probes: []probe{{"e1", "", a, 0, 0}},
			stats:  func(t *testing.T, st Stats) { require.Equal(t, uint64(1), st.UnknownRemovals) },
		},
		{
			name: "Reset one rank",
			steps: []step{apply("e1", 0, stored(0, []uint64{1, 2}, a)), apply("e1", 1, stored(0, []uint64{1, 2}, a)),
				apply("e1", 1, stored(2, []uint64{3}, b)), reset("e1", 1, "gap")},
			probes: []probe{{"e1", "", ab, 2, -1}},
			stats: func(t *testing.T, st Stats) {
				require.Equal(t, map[string]uint64{"gap": 1}, st.Resets)
				require.Equal(t, 2, st.Engines[0].Entries)
			},
		},
		{
			name: "Reset every rank",
			steps: []step{apply("e1", 0, stored(0, []uint64{1, 2}, a)), apply("e1", 1, stored(0, []uint64{1, 2}, a)),
				reset("e1", -1, "restart"), reset("e1", -1, "restart"), reset("e9", 0, "gap"),
				apply("e1", 1, stored(2, []uint64{3}, b))},
			probes: []probe{{"e1", "", ab, 0, -1}},
			stats: func(t *testing.T, st Stats) {
				require.Equal(t, map[string]uint64{"restart": 2, "gap": 1}, st.Resets)
				require.Equal(t, uint64(1), st.Orphans, "the parent went with the reset")
				require.Zero(t, st.Blocks)
			},
		},
		{
			name: "overflow",
			cfg:  Config{BlockSize: testBlock, MaxEntries: 4},
			steps: []step{apply("e1", -1, stored(0, []uint64{1, 2}, a), stored(2, []uint64{3}, b)),
				apply("e1", -1, stored(3, []uint64{4, 5}, c)), // 5 entries: reset, then orphans
				apply("e1", -1, stored(0, []uint64{6, 7}, c)),
				apply("e1", -1, stored(0, []uint64{8, 9, 10, 11, 12}, tokens(0, 20)))}, // beyond MaxEntries alone
			probes: []probe{{"e1", "", ab, 0, -1}, {"e1", "", c, 2, -1}},
			stats: func(t *testing.T, st Stats) {
				require.Equal(t, uint64(2), st.Overflows)
				require.Equal(t, uint64(2), st.Orphans)
				require.Equal(t, 4, st.Engines[0].Entries, "2 orphans and 2 blocks: an event too large alone is skipped, not a reset")
				require.Equal(t, 2, st.Engines[0].Orphans)
			},
		},
		{
			name: "engine blocks of two pdx blocks",
			steps: []step{apply("e1", -1, stored(0, []uint64{1}, a, size(8)), stored(1, []uint64{2}, concat(b, c[:4]), size(8))),
				apply("e1", -1, removed([]uint64{2}))},
			probes: []probe{{"e1", "", concat(a, b, c), 2, -1}},
			stats: func(t *testing.T, st Stats) {
				require.Equal(t, 2, st.Engines[0].Entries)
				require.Equal(t, 2, st.Blocks)
			},
		},
		{
			name: "block sizes not placed",
			steps: []step{apply("e1", -1, stored(0, []uint64{1}, tokens(0, 6), size(6)),
				stored(0, []uint64{2}, a[:4]), stored(0, []uint64{3}, tokens(0, 8), size(8)))},
			probes: []probe{{"e1", "", a, 1, -1}},
			stats:  func(t *testing.T, st Stats) { require.Equal(t, uint64(2), st.BlockSizeMismatches) },
		},
		{
			name: "malformed",
			steps: []step{apply("e1", -1, stored(0, []uint64{1, 2}, tokens(0, 7)), stored(0, nil, nil),
				stored(0, []uint64{1}, tokens(0, 4), size(0)), kvevents.Event{Kind: 42})},
			probes: []probe{{"e1", "", a, 0, -1}},
			stats:  func(t *testing.T, st Stats) { require.Equal(t, uint64(4), st.Malformed) },
		},
		{
			name: "removals of blocks never stored",
			steps: []step{apply("e1", -1, removed([]uint64{1, 2})), apply("e1", -1, stored(0, []uint64{3}, b)),
				apply("e1", -1, removed([]uint64{4}), removed([]uint64{3}, medium("CPU")))},
			stats: func(t *testing.T, st Stats) { require.Equal(t, uint64(4), st.UnknownRemovals) },
		},
		{
			name:   "a conflicting store replaces",
			steps:  []step{apply("e1", -1, stored(0, []uint64{1}, a[:4]), stored(0, []uint64{1}, c[:4]))},
			probes: []probe{{"e1", "", a, 0, -1}, {"e1", "", c, 1, -1}},
			stats:  func(t *testing.T, st Stats) { require.Equal(t, uint64(1), st.Conflicts) },
		},
		{
			name: "engines apart",
			steps: []step{apply("e1", -1, stored(0, []uint64{1, 2}, a), stored(2, []uint64{3}, b)),
				apply("e2", -1, stored(0, []uint64{1}, a[:4])), apply("e3", -1, stored(0, []uint64{7}, c[:4]))},
			probes: []probe{{"e1", "", ab, 3, -1}, {"e2", "", ab, 1, -1}, {"e3", "", ab, 0, -1}, {"e3", "", c, 1, -1}},
			stats:  func(t *testing.T, st Stats) { require.Len(t, st.Engines, 3) },
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := tt.cfg
			if cfg.BlockSize == 0 {
				cfg.BlockSize = testBlock
			}
			x := New(cfg)
			for _, s := range tt.steps {
				s(x)
			}
			for _, p := range tt.probes {
				p.check(t, x)
			}
			if tt.stats != nil {
				tt.stats(t, x.Stats())
			}
			checkRows(t, x)
		})
	}
}

// TestMatchSlots is Match's slots: unknown, negative, freed and reused.
func TestMatchSlots(t *testing.T) {
	a := tokens(0, 12)
	x := New(Config{BlockSize: testBlock})
	x.Apply("e1", &kvevents.Batch{Events: []kvevents.Event{stored(0, []uint64{1, 2, 3}, a)}})
	x.Apply("e2", &kvevents.Batch{Events: []kvevents.Event{stored(0, []uint64{1}, a[:4])}})
	require.Equal(t, int32(2), x.Register("e3"), "registered explicitly")
	require.Equal(t, int32(2), x.Register("e3"), "once")
	require.Equal(t, []int32{0, 1, 2, -1}, x.Slots([]string{"e1", "e2", "e3", "nope"}, nil))
	blocks := HashTokens(nil, 0, a, testBlock, 0)

	tests := []struct {
		name  string
		slots []int32
		want  []int32
	}{
		{"by slot", []int32{0, 1, 2}, []int32{3, 1, 0}},
		{"in any order, twice", []int32{1, 0, 1}, []int32{1, 3, 1}},
		{"below 0", []int32{-1, 0, -5}, []int32{0, 3, 0}},
		{"never given", []int32{7, 500, 1023, 1024, 1 << 30}, []int32{0, 0, 0, 0, 0}},
		{"none", nil, []int32{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			depth := make([]int32, len(tt.slots)+1)
			depth[len(tt.slots)] = 99
			deepest := x.Match(blocks, tt.slots, depth)
			require.Equal(t, tt.want, depth[:len(tt.slots)])
			require.Equal(t, int32(99), depth[len(tt.slots)], "only len(slots) written")
			var want int32
			for _, d := range tt.want {
				want = max(want, d)
			}
			require.Equal(t, want, deepest)
		})
	}
	require.Zero(t, x.Match(nil, []int32{0}, make([]int32, 1)), "no blocks")
	require.Panics(t, func() { x.Match(blocks, []int32{0, 1}, make([]int32, 1)) }, "depth shorter than slots")

	// A forgotten engine's slot holds nothing, and its next owner starts
	// empty.
	x.Forget("e1")
	x.Forget("e1")
	require.Equal(t, int32(-1), x.Slot("e1"))
	depth := make([]int32, 2)
	require.Equal(t, int32(1), x.Match(blocks, []int32{0, 1}, depth))
	require.Equal(t, []int32{0, 1}, depth)
	e4 := x.Register("e4")
	require.Equal(t, int32(1<<slotBits), e4, "the freed slot 0, in its next generation")
	x.Apply("e4", &kvevents.Batch{Events: []kvevents.Event{stored(0, []uint64{5, 6}, a[:8])}})
	depth = make([]int32, 3)
	x.Match(blocks, []int32{0, 1, e4}, depth)
	require.Equal(t, []int32{0, 1, 2}, depth, "e1's handle names no engine: not e4, which has its slot")
	require.False(t, x.Fresh([]int32{0, 1}))
	require.True(t, x.Fresh([]int32{e4, 1, 2}))
	st := x.Stats()
	require.Equal(t, []string{"e2", "e3", "e4"}, []string{st.Engines[0].Address, st.Engines[1].Address, st.Engines[2].Address})
}

// TestManyEngines widens the slots' bitsets past 64 and fills them all.
func TestManyEngines(t *testing.T) {
	x := New(Config{BlockSize: testBlock})
	a := tokens(0, 8)
	for i := range MaxEngines {
		engine := fmt.Sprintf("10.0.%d.%d:8000", i/256, i%256)
		// Engine i holds 1 or 2 blocks of a.
		x.Apply(engine, &kvevents.Batch{Events: []kvevents.Event{stored(0, []uint64{1, 2}[:1+i%2], a[:4*(1+i%2)])}})
		require.Equal(t, int32(i), x.Slot(engine))
	}
	x.Apply("one too many", &kvevents.Batch{Events: []kvevents.Event{stored(0, []uint64{1}, a[:4])}})
	require.Equal(t, int32(-1), x.Register("one too many"))
	require.Equal(t, uint64(1), x.Stats().NoSlot)
	require.Equal(t, maxWords, x.words)

	slots := make([]int32, MaxEngines)
	for i := range slots {
		slots[i] = int32(MaxEngines - 1 - i)
	}
	depth := make([]int32, MaxEngines)
	require.Equal(t, int32(2), x.Match(HashTokens(nil, 0, a, testBlock, 0), slots, depth))
	for i, s := range slots {
		require.Equal(t, 1+s%2, depth[i], "slot %d", s)
	}
}

func TestMatchAllocs(t *testing.T) {
	x, blocks, slots := benchIndex(t, 64, 2000, 16)
	depth := make([]int32, len(slots))
	require.Zero(t, testing.AllocsPerRun(100, func() { x.Match(blocks, slots, depth) }))
	require.Zero(t, testing.AllocsPerRun(100, func() { x.MatchWithCPU(blocks, slots, depth) }))
	require.Zero(t, testing.AllocsPerRun(100, func() { _ = x.Held(slots[0], blocks) }))
	require.Zero(t, testing.AllocsPerRun(100, func() { _ = x.SeedFor("base") }))
	require.Zero(t, testing.AllocsPerRun(100, func() { _ = x.Slots([]string{"10.0.0.1:8000"}, slots[:0]) }))
}

// TestConcurrent applies, matches, resets and forgets at once, for the race
// detector, then checks the index is consistent.
func TestConcurrent(t *testing.T) {
	x := New(Config{BlockSize: testBlock, MaxEntries: 200})
	engines := []string{"e0", "e1", "e2", "e3"}
	prompt := tokens(0, 64)
	var wg sync.WaitGroup
	for i, engine := range engines {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(i), 1))
			for round := range 300 {
				n := 1 + r.IntN(8)
				hs := make([]uint64, n)
				for j := range hs {
					hs[j] = uint64(round*16 + j + 1)
				}
				evs := []kvevents.Event{stored(0, hs, prompt[:4*n], medium([]string{"GPU", "CPU"}[r.IntN(2)]))}
				if r.IntN(4) == 0 {
					evs = append(evs, removed(hs[:1]))
				}
				if r.IntN(50) == 0 {
					evs = append(evs, cleared())
				}
				x.Apply(engine, &kvevents.Batch{Events: evs, DPRank: r.IntN(2), HasDPRank: true})
			}
		})
	}
	wg.Go(func() {
		for i := range 100 {
			x.Forget(engines[i%len(engines)])
			x.Reset(engines[(i+1)%len(engines)], i%2, "gap")
			_ = x.Register(engines[i%len(engines)])
			_ = x.Stats()
		}
	})
	for range 2 {
		wg.Go(func() {
			blocks := HashTokens(nil, 0, prompt, testBlock, 0)
			slots := make([]int32, 0, len(engines))
			depth := make([]int32, len(engines))
			for range 2000 {
				slots = x.Slots(engines, slots[:0])
				if d := x.Match(blocks, slots, depth); d < 0 || d > int32(len(blocks)) {
					panic(fmt.Sprintf("depth %d", d))
				}
				x.MatchWithCPU(blocks, slots, depth)
			}
		})
	}
	wg.Wait()

	// Forgetting every engine leaves nothing behind.
	st := x.Stats()
	total := 0
	for _, e := range st.Engines {
		require.LessOrEqual(t, e.Entries, 200)
		total += e.GPUBlocks + e.CPUBlocks
	}
	require.LessOrEqual(t, st.Blocks, total)
	for _, engine := range engines {
		x.Forget(engine)
	}
	st = x.Stats()
	require.Zero(t, st.Blocks)
	require.Empty(t, st.Engines)
	require.Zero(t, x.tables[tierGPU].n+x.tables[tierCPU].n)
}
