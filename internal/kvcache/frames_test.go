package kvcache

import (
	"bufio"
	"encoding/hex"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/kvevents"
)

// eventFrames are the captured payloads of package kvevents'
// testdata/frames.txt, by name.
func eventFrames(t *testing.T) map[string][]byte {
	t.Helper()
	f, err := os.Open("../kvevents/testdata/frames.txt")
	require.NoError(t, err)
	defer f.Close()
	frames := map[string][]byte{}
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		name, h, ok := strings.Cut(sc.Text(), " ")
		if !ok || strings.HasPrefix(name, "#") {
			continue
		}
		payload, err := hex.DecodeString(h)
		require.NoError(t, err, name)
		frames[name] = payload
	}
	require.NoError(t, sc.Err())
	return frames
}

// counting is the token ids from, n of them: the frames' prompts.
func counting(from, n int) []uint32 {
	ids := make([]uint32, n)
	for i := range ids {
		ids[i] = uint32(from + i)
	}
	return ids
}

// TestFrames applies captured batches of each publisher's layout to an
// index: llm-d-inference-sim's positional events (a chain's start named
// by parent 0) and its maps (nil), vLLM 0.32's maps in an array batch,
// both layouts in one batch. Each must be read whole: every block held
// where its prompt matches, no orphan.
func TestFrames(t *testing.T) {
	frames := eventFrames(t)
	a, b, c := counting(1000, 16), counting(2000, 8), counting(3000, 16) // llmd-sim-*'s prompts
	ab := concat(a, b)
	v1, v2, v3 := counting(9000, 32), counting(70000, 16), counting(128000, 16) // vllm-0.32-*'s
	// step applies a frame's events from..to (all for 0, 0), then checks
	// prompts' depths on the engine and the index's blocks.
	type step struct {
		frame    string
		from, to int
		probes   []probe
		blocks   int
	}
	llmd := func(enc string, ratio int32) []step {
		return []step{
			{frame: "llmd-sim-" + enc + "-1", blocks: 3 * int(ratio),
				probes: []probe{{"e", "", a, 2 * ratio, -1}, {"e", "", ab, 3 * ratio, -1}, {"e", "", c, 0, -1}}},
			// a's first block evicted: a's second and b's block are held
			// without it, and match nothing.
			{frame: "llmd-sim-" + enc + "-2", blocks: 4 * int(ratio),
				probes: []probe{{"e", "", ab, 0, -1}, {"e", "", c, 2 * ratio, -1}}},
			{frame: "llmd-sim-" + enc + "-3", probes: []probe{{"e", "", c, 0, -1}}},
		}
	}
	tests := []struct {
		name      string
		blockSize int
		steps     []step
		stored    uint64
	}{
		{"llm-d positional, parent 0", 8, llmd("array", 1), 5},
		{"llm-d maps, parent nil", 8, llmd("map", 1), 5},
		{"llm-d positional, pdx blocks half the engine's", 4, llmd("array", 2), 5},
		{"vLLM 0.32", 16, []step{
			{frame: "vllm-0.32-1", blocks: 3, probes: []probe{{"e", "", v1, 2, -1}, {"e", "", concat(v1, v2), 3, -1}}},
			{frame: "vllm-0.32-2", to: 2, blocks: 3,
				probes: []probe{{"e", "", concat(v1, v2), 2, -1}, {"e", "", concat(v1, v3), 3, -1}}},
			{frame: "vllm-0.32-2", from: 2, to: 3, probes: []probe{{"e", "", concat(v1, v3), 0, -1}}},
		}, 4},
		{"both layouts in one batch", 2, []step{
			{frame: "mixed", blocks: 2, probes: []probe{
				{"e", "", []uint32{1, 2, 5, 6}, 2, -1}, {"e", "", []uint32{3, 4}, 0, -1}, {"e", "", []uint32{5, 6}, 0, -1}}},
		}, 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x := New(Config{BlockSize: tt.blockSize})
			var seq uint64
			for _, s := range tt.steps {
				payload, ok := frames[s.frame]
				require.True(t, ok, s.frame)
				batch, err := kvevents.Decode(seq, payload)
				require.NoError(t, err)
				if s.to > 0 {
					batch.Events = batch.Events[s.from:s.to]
				}
				seq++
				x.Apply("e", &batch)
				for _, p := range s.probes {
					p.check(t, x)
				}
				require.Equal(t, s.blocks, x.Stats().Blocks, "after %s", s.frame)
				checkRows(t, x)
			}
			st := x.Stats()
			require.Zero(t, st.Orphans)
			require.Zero(t, st.UnknownRemovals)
			require.Zero(t, st.Malformed)
			require.Equal(t, tt.stored, st.StoredBlocks)
		})
	}
}
