package kvevents

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"flag"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

var update = flag.Bool("update", false, "rewrite testdata/frames.txt, capturing the enginesim frames anew")

const framesFile = "testdata/frames.txt"

// frame is one payload of testdata/frames.txt.
type frame struct {
	name, comment string
	payload       []byte
}

// Block hashes of the hand-built frames: a uint64 above MaxInt64, a small
// one, a mid one; sha256 digests as vLLM's bytes hashes are.
const (
	h1 = uint64(0xdeadbeefcafef00d)
	h2 = uint64(42)
	h3 = uint64(0x0123456789abcdef)
)

func sha(s string) []byte {
	sum := sha256.Sum256([]byte(s))
	return sum[:]
}

// handBuilt are frames in shapes the simulator does not send, written as
// msgspec writes vLLM's and SGLang's structs (kv_events.py at each
// version): array_like structs as arrays of their fields in declaration
// order with trailing defaults left out, tagged structs with the tag
// first, integers in their smallest encoding, floats as float64.
func handBuilt(tb testing.TB) []frame {
	return []frame{
		{"vllm-0.9-array", "vLLM 0.9's first KV events: BlockStored through lora_id, BlockRemoved with block_hashes only, [ts, events] without a DP rank",
			pack(tb, []any{1.5, []any{
				[]any{"BlockStored", []any{h1, h2}, nil, []any{1, 2, 3, 4}, 2, nil},
				[]any{"BlockRemoved", []any{h1}},
				[]any{"AllBlocksCleared"},
			}})},
		{"vllm-0.10-array", "vLLM 0.10: medium added, data_parallel_rank in the batch (rank 1's publisher)",
			pack(tb, []any{1700000000.25, []any{
				[]any{"BlockStored", []any{h3}, h2, []any{100, 200}, 2, nil, "GPU"},
				[]any{"BlockRemoved", []any{h2}, "GPU"},
			}, 1})},
		{"vllm-0.11-array", "vLLM's last array encoding with every field: LoRA, extra keys (a cache salt on the first block), a sliding-window group; nil in the middle for defaults",
			pack(tb, []any{2.0, []any{
				[]any{"BlockStored", []any{h1, h3}, nil, []any{7, 8, 9, 10}, 2, 3, "GPU", "adapter", []any{[]any{"salt-1"}, nil}, 1, "sliding_window", 1024},
				[]any{"BlockRemoved", []any{h3}, "CPU", 1},
				[]any{"BlockStored", []any{h2}, h1, []any{11, 12}, 2, nil, "GPU", nil, nil, nil, "full_attention"},
			}, 0})},
		{"vllm-map-bytes", "vLLM since PR #42892 (tagged maps) with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: sha256 bytes hashes; extra_keys all null; a key this package does not know (locality)",
			pack(tb, []any{3.5, []any{
				om{{"type", "BlockStored"}, {"block_hashes", []any{sha("block 2")}}, {"parent_block_hash", sha("block 1")},
					{"token_ids", []any{5, 6}}, {"block_size", 2}, {"lora_id", nil}, {"medium", "GPU"}, {"lora_name", nil},
					{"extra_keys", []any{nil}}, {"group_idx", 0}, {"kv_cache_spec_kind", "full_attention"}, {"locality", "LOCAL"}},
				om{{"type", "BlockRemoved"}, {"block_hashes", []any{sha("block 1")}}, {"medium", "GPU"}, {"group_idx", 0}},
				om{{"type", "AllBlocksCleared"}},
			}, 0})},
		{"vllm-main-map-batch", "vLLM main after 0181ea31: the batch a map too (EventBatch without array_like); an event whose type is not its first key; two event types this package does not know",
			pack(tb, om{{"ts", 4.0}, {"events", []any{
				om{{"block_hashes", []any{h2}}, {"type", "BlockRemoved"}, {"medium", nil}},
				om{{"type", "BlockUpdated"}, {"block_hashes", []any{h1}}, {"medium", "GPU"}},
				[]any{"Heartbeat", 1, []any{2}},
				om{{"type", "BlockStored"}, {"block_hashes", []any{h1}}, {"parent_block_hash", nil}, {"token_ids", []any{1, 2}},
					{"block_size", 2}, {"lora_id", nil}, {"medium", "GPU"}, {"lora_name", nil}},
			}}, {"data_parallel_rank", 2}, {"extra", "ignored"}})},
		{"sglang-array", "SGLang's radix cache: one BlockStored per page, signed int64 hashes (hash_str_to_int64), [ts, events]",
			pack(tb, []any{5.0, []any{
				[]any{"BlockStored", []any{int64(-8070450532247928832)}, nil, []any{1, 2, 3}, 3, nil, "GPU"},
				[]any{"BlockStored", []any{int64(17)}, int64(-8070450532247928832), []any{4, 5, 6}, 3, nil, "GPU"},
				[]any{"BlockRemoved", []any{int64(-1)}},
			}})},
		{"mixed", "Both layouts in one batch, each event read by its own: llm-d's positional events (a chain's start named by parent 0) and vLLM's maps (parent nil, then a parent)",
			pack(tb, []any{6.0, []any{
				[]any{"BlockStored", []any{h1}, uint64(0), []any{uint32(1), uint32(2)}, 2, nil, "GPU", nil, nil},
				om{{"type", "BlockStored"}, {"block_hashes", []any{h2}}, {"parent_block_hash", nil}, {"token_ids", []any{3, 4}},
					{"block_size", 2}, {"lora_id", nil}, {"medium", "GPU"}, {"lora_name", nil}, {"extra_keys", []any{nil}},
					{"group_idx", 0}, {"kv_cache_spec_kind", "full_attention"}},
				om{{"type", "BlockStored"}, {"block_hashes", []any{h3}}, {"parent_block_hash", h1}, {"token_ids", []any{5, 6}},
					{"block_size", 2}, {"lora_id", nil}, {"medium", "GPU"}, {"lora_name", nil}},
				[]any{"BlockRemoved", []any{h2}, "GPU"},
			}, 0})},
	}
}

// external are the prefixes of the frames testdata/frames.txt holds that
// were recorded outside these tests, which -update keeps as they are:
//
//   - llmd-sim-*: llm-d-inference-sim (main at eec055a, with llm-d-router
//     v0.10.0) publishing through its own KVCacheHelper and KVEventSender
//     to a SUB socket it dials: 8-token blocks, room for 4; prompt a of 2
//     blocks, b extending a by 1 (batch 1), c of 2 new blocks, evicting
//     a's first, the oldest unused (batch 2), and a reset (batch 3); its
//     default positional layout (array) and --use-vllm-map-event-format
//     (map).
//   - vllm-0.32-*: vLLM 0.32.0's KVEventBatch built from its own
//     vllm.distributed.kv_events classes and encoded by msgspec 0.23 as
//     its ZmqEventPublisher does, the events of real-vllm.md's "KV
//     events": a run of two blocks, its child (batch 1); the child's
//     eviction, another child, the cache reset (batch 2).
var external = []string{"llmd-sim-", "vllm-0.32-"}

// TestFramesFile checks that testdata/frames.txt holds what handBuilt
// writes; with -update it rewrites the file, capturing the simulator's
// frames again from a running enginesim publisher.
func TestFramesFile(t *testing.T) {
	want := handBuilt(t)
	if *update {
		var frames []frame
		for _, enc := range []string{enginesim.EventsMap, enginesim.EventsArray} {
			frames = append(frames, captureSim(t, enc)...)
		}
		for _, f := range readFrameFile(t) {
			if slices.ContainsFunc(external, func(p string) bool { return strings.HasPrefix(f.name, p) }) {
				frames = append(frames, f)
			}
		}
		writeFrames(t, append(frames, want...))
	}
	got := readFrames(t)
	for _, f := range want {
		require.Equal(t, hex.EncodeToString(f.payload), hex.EncodeToString(got[f.name]),
			"%s: testdata/frames.txt is stale: go test ./internal/kvevents -run TestFramesFile -update", f.name)
	}
}

func writeFrames(t *testing.T, frames []frame) {
	var b strings.Builder
	b.WriteString(`# KV event batch payloads (msgpack), one per line: a name, then hex.
# Written by go test ./internal/kvevents -run TestFramesFile -update:
# sim-* are captured from a running enginesim publisher over ZMQ
# (Capacity{BlockTokens: 2, KVBlocks: 2}; prompt a stored, b evicting a,
# c reusing b's first block, a reset; see captureSim); llmd-sim-* and
# vllm-0.32-* were recorded from llm-d-inference-sim and vLLM 0.32's own
# encoders (see external in frames_test.go), and are kept as they are; the
# others are built by handBuilt as msgspec writes each vLLM or SGLang
# version.
`)
	for _, f := range frames {
		fmt.Fprintf(&b, "\n# %s\n%s %s\n", f.comment, f.name, hex.EncodeToString(f.payload))
	}
	require.NoError(t, os.WriteFile(framesFile, []byte(b.String()), 0o644))
}

func readFrames(tb testing.TB) map[string][]byte {
	frames := map[string][]byte{}
	for _, f := range readFrameFile(tb) {
		frames[f.name] = f.payload
	}
	return frames
}

// readFrameFile reads testdata/frames.txt in order, each frame with the
// comment line before it.
func readFrameFile(tb testing.TB) []frame {
	tb.Helper()
	data, err := os.ReadFile(framesFile)
	require.NoError(tb, err)
	var frames []frame
	var comment string
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if c, ok := strings.CutPrefix(line, "# "); ok {
			comment = c
		}
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		name, h, ok := strings.Cut(line, " ")
		require.True(tb, ok, "%q", line)
		payload, err := hex.DecodeString(h)
		require.NoError(tb, err, name)
		frames = append(frames, frame{name, comment, payload})
	}
	require.NoError(tb, sc.Err())
	return frames
}

// simCapacity is the capturing engine's: 2-token blocks, room for 2.
var simCapacity = enginesim.Capacity{MaxRunning: 4, BlockTokens: 2, KVBlocks: 2, PrefillTokensPerSec: 1e9}

// The capture's prompts (the simulator's tokens are 4 bytes each): a has
// one full block; b two, evicting a's; c shares b's first and adds one,
// evicting b's second.
const (
	promptA = "abcdefghij"
	promptB = "ABCDEFGHIJKLMNOP"
	promptC = "ABCDEFGHxyzwq"
)

// captureSim records the batches of an enginesim publisher in encoding
// as it runs prompts a, b and c and resets its cache.
func captureSim(t *testing.T, encoding string) []frame {
	s := startEngine(t, enginesim.Config{Capacity: &simCapacity,
		KVEvents: &enginesim.KVEvents{Endpoint: "tcp://127.0.0.1:0", Encoding: encoding}})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sub := zmq4.NewSub(ctx)
	defer sub.Close()
	require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, ""))
	require.NoError(t, sub.Dial(s.KVEventsEndpoint()))
	msgs := make(chan zmq4.Msg, 16)
	go func() {
		for {
			m, err := sub.Recv()
			if err != nil {
				return
			}
			select {
			case msgs <- m:
			case <-ctx.Done():
				return
			}
		}
	}()
	// The subscription is in once a reset's batch comes through.
	for synced := false; !synced; {
		require.True(t, s.ResetPrefixCache())
		select {
		case <-msgs:
			synced = true
		case <-time.After(50 * time.Millisecond):
		}
	}
	time.Sleep(50 * time.Millisecond)
	for len(msgs) > 0 {
		<-msgs
	}
	var frames []frame
	take := func(what string, n int) {
		for i := range n {
			select {
			case m := <-msgs:
				frames = append(frames, frame{fmt.Sprintf("sim-%s-%d", encoding, len(frames)+1),
					fmt.Sprintf("enginesim %s encoding: %s (batch %d of %d)", encoding, what, i+1, n), m.Frames[2]})
			case <-time.After(5 * time.Second):
				require.FailNow(t, "no batch", what)
			}
		}
	}
	complete(t, s, promptA)
	take("prompt a's block stored", 1)
	complete(t, s, promptB)
	take("prompt b evicts a's block, then its two are stored", 2)
	complete(t, s, promptC)
	take("prompt c evicts b's second block, stores its own second, parent b's first", 2)
	require.True(t, s.ResetPrefixCache())
	take("the cache reset", 1)
	return frames
}

// startEngine runs an engine simulator for the test.
func startEngine(t *testing.T, cfg enginesim.Config) *enginesim.Server {
	t.Helper()
	s, err := enginesim.Start(t.Context(), "127.0.0.1:0", cfg)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, s.Close()) })
	return s
}

// complete runs prompt on s (its prefill stores the prompt's blocks).
func complete(t *testing.T, s *enginesim.Server, prompt string) {
	t.Helper()
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	body := fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":1}`, prompt)
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://"+s.Addr()+"/v1/completions", strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Do(req)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusOK, resp.StatusCode)
}

// tokens is the simulator tokenizer's ids of s (4 bytes each, big-endian,
// the last padded with zeros).
func tokens(s string) []uint32 {
	var ids []uint32
	for i := 0; i < len(s); i += 4 {
		var w [4]byte
		copy(w[:], s[i:])
		ids = append(ids, binary.BigEndian.Uint32(w[:]))
	}
	return ids
}
