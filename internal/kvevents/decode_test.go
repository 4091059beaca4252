package kvevents

import (
	"encoding/binary"
	"encoding/hex"
	"maps"
	"math"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/cespare/xxhash/v2"
	"github.com/stretchr/testify/require"
)

// The simulator's block hashes in the captured frames: prompt a's block,
// b's two, c's second.
var (
	simA0 = Hash{Lo: 0x0d10e8449818ce0d}
	simB0 = Hash{Lo: 0x2444b9cc1a338d0d}
	simB1 = Hash{Lo: 0xdaa3abab5d963529}
	simC1 = Hash{Lo: 0x70f0738bb69864d8}
)

// llm-d-inference-sim's block hashes in the captured frames (llmd-sim-*):
// prompt a's two blocks, b's third, c's two.
var (
	llmdA0 = Hash{Lo: 0xc84ab123eb2ec1c7}
	llmdA1 = Hash{Lo: 0xd248fc1cd9046286}
	llmdB2 = Hash{Lo: 0xf84ee1de541f3e8e}
	llmdC0 = Hash{Lo: 0x622087423db22de7}
	llmdC1 = Hash{Lo: 0x6daf59163103d325}
)

// vLLM 0.32's block hashes in vllm-0.32-*.
var (
	v32H1 = Hash{Lo: 0xf3a5c6b1d2e40987}
	v32H2 = Hash{Lo: 0x8000000000000011}
	v32H3 = Hash{Lo: 0x1234567890abcdef}
	v32H4 = Hash{Lo: 0xc0ffee0ddba11000}
)

// counting is the token ids from, n of them.
func counting(from, n int) []uint32 {
	ids := make([]uint32, n)
	for i := range ids {
		ids[i] = uint32(from + i)
	}
	return ids
}

// shaHash is the Hash of a bytes hash as Hash documents it.
func shaHash(s string) Hash {
	b := sha(s)
	return Hash{Lo: binary.BigEndian.Uint64(b[len(b)-8:]), Hi: xxhash.Sum64(b)}
}

func simStored(parent *Hash, ids []uint32, hashes ...Hash) Event {
	e := Event{Kind: BlockStored, Hashes: hashes, TokenIDs: ids, BlockSize: 2, Medium: "GPU", SpecKind: "full_attention"}
	if parent != nil {
		e.Parent, e.HasParent = *parent, true
	}
	return e
}

func simRemoved(h Hash) Event { return Event{Kind: BlockRemoved, Hashes: []Hash{h}, Medium: "GPU"} }

// TestDecodeFrames decodes every frame of testdata/frames.txt.
func TestDecodeFrames(t *testing.T) {
	frames := readFrames(t)
	a, b, c := tokens(promptA), tokens(promptB), tokens(promptC)
	sim := func(events ...Event) Batch { return Batch{Events: events, HasDPRank: true} }
	simBatches := []Batch{
		sim(simStored(nil, a[:2], simA0)),
		sim(simRemoved(simA0)),
		sim(simStored(nil, b, simB0, simB1)),
		sim(simRemoved(simB1)),
		sim(simStored(&simB0, c[2:4], simC1)),
		sim(Event{Kind: AllBlocksCleared}),
	}
	tests := map[string]Batch{
		"vllm-0.9-array": {TS: 1.5, Events: []Event{
			{Kind: BlockStored, Hashes: []Hash{{Lo: h1}, {Lo: h2}}, TokenIDs: []uint32{1, 2, 3, 4}, BlockSize: 2},
			{Kind: BlockRemoved, Hashes: []Hash{{Lo: h1}}},
			{Kind: AllBlocksCleared},
		}},
		"vllm-0.10-array": {TS: 1700000000.25, DPRank: 1, HasDPRank: true, Events: []Event{
			{Kind: BlockStored, Hashes: []Hash{{Lo: h3}}, Parent: Hash{Lo: h2}, HasParent: true, TokenIDs: []uint32{100, 200}, BlockSize: 2, Medium: "GPU"},
			{Kind: BlockRemoved, Hashes: []Hash{{Lo: h2}}, Medium: "GPU"},
		}},
		"vllm-0.11-array": {TS: 2, HasDPRank: true, Events: []Event{
			{Kind: BlockStored, Hashes: []Hash{{Lo: h1}, {Lo: h3}}, TokenIDs: []uint32{7, 8, 9, 10}, BlockSize: 2, LoRAID: 3,
				LoRAName: "adapter", Medium: "GPU", ExtraKeys: pack(t, []any{[]any{"salt-1"}, nil}), GroupIdx: 1,
				SpecKind: "sliding_window", SlidingWindow: 1024},
			{Kind: BlockRemoved, Hashes: []Hash{{Lo: h3}}, Medium: "CPU", GroupIdx: 1},
			{Kind: BlockStored, Hashes: []Hash{{Lo: h2}}, Parent: Hash{Lo: h1}, HasParent: true, TokenIDs: []uint32{11, 12}, BlockSize: 2,
				Medium: "GPU", SpecKind: "full_attention"},
		}},
		"vllm-map-bytes": {TS: 3.5, HasDPRank: true, Events: []Event{
			{Kind: BlockStored, Hashes: []Hash{shaHash("block 2")}, Parent: shaHash("block 1"), HasParent: true, TokenIDs: []uint32{5, 6},
				BlockSize: 2, Medium: "GPU", SpecKind: "full_attention"},
			{Kind: BlockRemoved, Hashes: []Hash{shaHash("block 1")}, Medium: "GPU"},
			{Kind: AllBlocksCleared},
		}},
		"vllm-main-map-batch": {TS: 4, DPRank: 2, HasDPRank: true, Skipped: 2, Events: []Event{
			{Kind: BlockRemoved, Hashes: []Hash{{Lo: h2}}},
			{Kind: BlockStored, Hashes: []Hash{{Lo: h1}}, TokenIDs: []uint32{1, 2}, BlockSize: 2, Medium: "GPU"},
		}},
		"sglang-array": {TS: 5, Events: []Event{
			{Kind: BlockStored, Hashes: []Hash{{Lo: 0x9000000000000000}}, TokenIDs: []uint32{1, 2, 3}, BlockSize: 3, Medium: "GPU"},
			{Kind: BlockStored, Hashes: []Hash{{Lo: 17}}, Parent: Hash{Lo: 0x9000000000000000}, HasParent: true, TokenIDs: []uint32{4, 5, 6}, BlockSize: 3, Medium: "GPU"},
			{Kind: BlockRemoved, Hashes: []Hash{{Lo: math.MaxUint64}}},
		}},
	}
	for _, enc := range []string{"map", "array"} {
		for i, want := range simBatches {
			tests["sim-"+enc+"-"+string(rune('1'+i))] = want
		}
	}
	// llm-d-inference-sim: the same events in both layouts, but for a
	// chain start's parent, 0 in the positional one (HasParent, Parent 0:
	// package kvcache reads it as none) and nil in the maps; lora_id,
	// lora_name and extra_keys nil or left out.
	for _, enc := range []string{"array", "map"} {
		root := func(e Event) Event {
			e.HasParent = enc == "array"
			return e
		}
		llmd := func(parent Hash, ids []uint32, hashes ...Hash) Event {
			return Event{Kind: BlockStored, Hashes: hashes, Parent: parent, HasParent: true, TokenIDs: ids, BlockSize: 8, Medium: "GPU"}
		}
		llmdBatch := func(events ...Event) Batch { return Batch{Events: events, HasDPRank: true} }
		tests["llmd-sim-"+enc+"-1"] = llmdBatch(root(llmd(Hash{}, counting(1000, 16), llmdA0, llmdA1)), llmd(llmdA1, counting(2000, 8), llmdB2))
		tests["llmd-sim-"+enc+"-2"] = llmdBatch(Event{Kind: BlockRemoved, Hashes: []Hash{llmdA0}, Medium: "GPU"},
			root(llmd(Hash{}, counting(3000, 16), llmdC0, llmdC1)))
		tests["llmd-sim-"+enc+"-3"] = llmdBatch(Event{Kind: AllBlocksCleared})
	}
	// vLLM 0.32: every field sent but the sliding window; extra_keys all
	// nil.
	v32 := func(parent *Hash, ids []uint32, hashes ...Hash) Event {
		e := Event{Kind: BlockStored, Hashes: hashes, TokenIDs: ids, BlockSize: 16, Medium: "GPU", SpecKind: "full_attention"}
		if parent != nil {
			e.Parent, e.HasParent = *parent, true
		}
		return e
	}
	tests["vllm-0.32-1"] = Batch{TS: 1767225600.125, HasDPRank: true, Events: []Event{
		v32(nil, counting(9000, 32), v32H1, v32H2), v32(&v32H2, counting(70000, 16), v32H3)}}
	tests["vllm-0.32-2"] = Batch{TS: 1767225600.25, HasDPRank: true, Events: []Event{
		{Kind: BlockRemoved, Hashes: []Hash{v32H3}, Medium: "GPU"}, v32(&v32H2, counting(128000, 16), v32H4), {Kind: AllBlocksCleared}}}
	tests["mixed"] = Batch{TS: 6, HasDPRank: true, Events: []Event{
		{Kind: BlockStored, Hashes: []Hash{{Lo: h1}}, HasParent: true, TokenIDs: []uint32{1, 2}, BlockSize: 2, Medium: "GPU"},
		{Kind: BlockStored, Hashes: []Hash{{Lo: h2}}, TokenIDs: []uint32{3, 4}, BlockSize: 2, Medium: "GPU", SpecKind: "full_attention"},
		{Kind: BlockStored, Hashes: []Hash{{Lo: h3}}, Parent: Hash{Lo: h1}, HasParent: true, TokenIDs: []uint32{5, 6}, BlockSize: 2, Medium: "GPU"},
		{Kind: BlockRemoved, Hashes: []Hash{{Lo: h2}}, Medium: "GPU"},
	}}
	require.Len(t, frames, len(tests), "a test for every frame")
	for name, want := range tests {
		t.Run(name, func(t *testing.T) {
			payload, ok := frames[name]
			require.True(t, ok, "testdata/frames.txt has %s", name)
			got, err := Decode(7, payload)
			require.NoError(t, err)
			want.Seq = 7
			if strings.HasPrefix(name, "sim-") || strings.HasPrefix(name, "llmd-sim-") {
				require.InDelta(t, 1.8e9, got.TS, 0.2e9, "a timestamp of the capture's time")
				want.TS = got.TS
			}
			require.Equal(t, want, got)
		})
	}
}

// TestDecodeMalformed is payloads that are not a batch: each is an error,
// none a panic.
func TestDecodeMalformed(t *testing.T) {
	stored := func(fields ...any) []byte {
		return pack(t, []any{1.0, []any{append([]any{"BlockStored"}, fields...)}, 0})
	}
	tests := []struct {
		name    string
		payload []byte
		want    string
	}{
		{"empty", nil, "truncated"},
		{"not a batch", pack(t, "hello"), "want a batch"},
		{"batch of one", pack(t, []any{1.0}), "an array of 1"},
		{"ts a string", pack(t, []any{"now", []any{}}), "ts: want a number"},
		{"events not an array", pack(t, []any{1.0, 3}), "events: want an array"},
		{"event a number", pack(t, []any{1.0, []any{5}}), "event 0: want an event"},
		{"empty event", pack(t, []any{1.0, []any{[]any{}}}), "an empty event array"},
		{"tag not a string", pack(t, []any{1.0, []any{[]any{1, 2}}}), "tag: want a string"},
		{"stored too short", stored([]any{1}, nil, []any{1}), "BlockStored with 3 fields"},
		{"hash a string", stored([]any{"abc"}, nil, []any{}, 2), "want an integer"},
		{"empty bytes hash", stored([]any{[]byte{}}, nil, []any{}, 2), "an empty bytes hash"},
		{"token id negative", stored([]any{1}, nil, []any{-1}, 2), "out of range"},
		{"token id over 32 bits", stored([]any{1}, nil, []any{uint64(1) << 32}, 2), "out of range"},
		{"block size a float", stored([]any{1}, nil, []any{1}, 2.5), "want an integer"},
		{"lora id over int64", stored([]any{1}, nil, []any{1}, 2, uint64(math.MaxUint64)), "overflows an int64"},
		{"medium a number", stored([]any{1}, nil, []any{1}, 2, nil, 7), "want a string"},
		{"negative rank", pack(t, []any{1.0, []any{}, -1}), "data_parallel_rank"},
		{"map event without type", pack(t, []any{1.0, []any{om{{"block_hashes", []any{1}}}}}), "without type"},
		{"map event without hashes", pack(t, []any{1.0, []any{om{{"type", "BlockRemoved"}, {"medium", "GPU"}}}}), "without block_hashes"},
		{"map key not a string", pack(t, []any{1.0, []any{map[int]int{1: 2}}}), "want a string"},
		{"map batch without events", pack(t, om{{"ts", 1.0}}), "without ts or events"},
		{"trailing bytes", append(pack(t, []any{1.0, []any{}}), 0xc0), "1 bytes after the batch"},
		{"truncated", pack(t, []any{1.0, []any{[]any{"BlockStored", []any{h1}, nil, []any{1, 2}, 2}}})[:30], "truncated"},
		{"reserved byte", []byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x92, 0xa3, 'X', 'Y', 'Z', 0xc1}, "0xc1"},
		{"too deep", deep(40), "nested too deep"},
		{"too big", make([]byte, MaxPayload+1), "over the"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Decode(3, tt.payload)
			require.ErrorContains(t, err, tt.want)
			require.ErrorContains(t, err, "kvevents: batch 3: ")
		})
	}
}

// deep is a batch whose one unknown event nests n arrays.
func deep(n int) []byte {
	v := []byte{0xc0}
	for range n {
		v = append([]byte{0x91}, v...)
	}
	return append([]byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x92, 0xa1, 'X'}, v...)
}

// TestDecodeHostile is payloads claiming more than they hold: Decode
// refuses them without allocating for the claim.
func TestDecodeHostile(t *testing.T) {
	prefix := func(tail ...byte) []byte {
		// [1.0, [["BlockStored", <tail>
		return append(hexBytes(t, "92cb3ff0000000000000"+"91"+"95"+"ab426c6f636b53746f726564"), tail...)
	}
	tests := []struct {
		name    string
		payload []byte
	}{
		{"4G events", hexBytes(t, "92cb3ff0000000000000ddffffffff")},
		{"4G hashes", prefix(0xdd, 0xff, 0xff, 0xff, 0xff)},
		{"4G tokens", prefix(0x91, 0x01, 0xc0, 0xdd, 0xff, 0xff, 0xff, 0xff)},
		{"4G map pairs", hexBytes(t, "92cb3ff000000000000091dfffffffff")},
		{"4G byte hash", prefix(0x91, 0xc6, 0xff, 0xff, 0xff, 0xff)},
		{"4G string", hexBytes(t, "92cb3ff00000000000009192dbffffffff")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			for range 10 {
				_, err := Decode(0, tt.payload)
				require.ErrorContains(t, err, "truncated")
			}
			runtime.ReadMemStats(&after)
			require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(64<<10), "allocated for 10 decodes")
		})
	}
}

func hexBytes(tb testing.TB, s string) []byte {
	b, err := hex.DecodeString(s)
	require.NoError(tb, err)
	return b
}

// TestHash is Hash's rule: integers as their bits, bytes folded.
func TestHash(t *testing.T) {
	digest := sha("x")
	tests := []struct {
		name string
		wire any
		want Hash
	}{
		{"small", 7, Hash{Lo: 7}},
		{"above MaxInt64", uint64(math.MaxUint64), Hash{Lo: math.MaxUint64}},
		{"negative (SGLang)", int64(-1), Hash{Lo: math.MaxUint64}},
		{"int8", int64(-100), Hash{Lo: uint64(math.MaxUint64 - 99)}},
		{"sha256", digest, Hash{Lo: binary.BigEndian.Uint64(digest[24:]), Hi: xxhash.Sum64(digest)}},
		{"short bytes", []byte{1, 2}, Hash{Lo: 0x0102, Hi: xxhash.Sum64([]byte{1, 2})}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, err := Decode(0, pack(t, []any{0.0, []any{[]any{"BlockRemoved", []any{tt.wire}}}}))
			require.NoError(t, err)
			require.Equal(t, []Hash{tt.want}, b.Events[0].Hashes)
		})
	}
	// The integer vLLM sends for a bytes hash (its low 64 bits) is the
	// bytes' Lo; Hi keeps the two apart.
	asInt := binary.BigEndian.Uint64(digest[24:])
	require.Equal(t, asInt, bytesHash(digest).Lo)
	require.NotZero(t, bytesHash(digest).Hi)
	require.NotEqual(t, bytesHash([]byte{0, 1}), bytesHash([]byte{1}), "the same integer, other bytes")
}

// TestDecoderReuse: one Decoder over every captured frame, in turn and
// again, gives what Decode gives each, allocates nothing once its arrays
// have grown, and lets go of the arrays of a batch over maxRetained.
func TestDecoderReuse(t *testing.T) {
	frames := readFrames(t)
	names := slices.Sorted(maps.Keys(frames))
	var dec Decoder
	for range 2 {
		for _, name := range names {
			want, err := Decode(3, frames[name])
			require.NoError(t, err, name)
			got, err := dec.Decode(3, frames[name])
			require.NoError(t, err, name)
			if len(got.Events) == 0 {
				require.Empty(t, want.Events, name)
				got.Events = nil
			}
			require.Equal(t, want, *got, name)
		}
	}
	payload, _ := benchBatch(t, false)
	allocs := testing.AllocsPerRun(100, func() {
		if _, err := dec.Decode(1, payload); err != nil {
			t.Fatal(err)
		}
	})
	require.Zero(t, allocs)

	_, err := dec.Decode(1, []byte{0xc0})
	require.Error(t, err)
	again, err := dec.Decode(2, payload)
	require.NoError(t, err, "a batch that fails leaves the Decoder usable")
	require.Len(t, again.Events, 5)

	ids := make([]any, maxRetained/4+1)
	for i := range ids {
		ids[i] = 7
	}
	flood := pack(t, []any{0.0, []any{[]any{"BlockStored", []any{1}, nil, ids, len(ids)}}})
	b, err := dec.Decode(3, flood)
	require.NoError(t, err)
	require.Len(t, b.Events[0].TokenIDs, len(ids))
	_, err = dec.Decode(4, payload)
	require.NoError(t, err)
	require.Less(t, cap(dec.d.tokens), maxRetained/4, "the flood's token array is not kept")
}
