package kvcache

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/pdx-router/pdx/internal/kvevents"
	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

// The simulator's tests speak its wire; package kvevents decodes it for
// pdx. This file decodes it minimally, for the test only, so that the
// index is tested against the real publisher without depending on the
// decoder.

// simBatch decodes a payload of vLLM's KVEventBatch, [ts, events, rank],
// each event a tagged map or a tagged array.
func simBatch(seq uint64, payload []byte) (*kvevents.Batch, error) {
	var raw []any
	if err := msgpack.Unmarshal(payload, &raw); err != nil {
		return nil, err
	}
	if len(raw) != 3 {
		return nil, fmt.Errorf("batch of %d fields", len(raw))
	}
	b := &kvevents.Batch{Seq: seq}
	b.TS, _ = raw[0].(float64)
	if raw[2] != nil {
		b.DPRank, b.HasDPRank = int(toInt(raw[2])), true
	}
	evs, _ := raw[1].([]any)
	for _, e := range evs {
		f, err := simFields(e)
		if err != nil {
			return nil, err
		}
		ev, err := simEvent(f)
		if err != nil {
			return nil, err
		}
		b.Events = append(b.Events, ev)
	}
	return b, nil
}

// arrayFields are the fields of the array encoding, in order.
var arrayFields = map[string][]string{
	"BlockStored": {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
		"lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"},
	"BlockRemoved":     {"block_hashes", "medium", "group_idx"},
	"AllBlocksCleared": {},
}

func simFields(e any) (map[string]any, error) {
	switch e := e.(type) {
	case map[string]any:
		return e, nil
	case []any:
		if len(e) == 0 {
			return nil, fmt.Errorf("empty event")
		}
		tag, _ := e[0].(string)
		names, ok := arrayFields[tag]
		if !ok || len(e)-1 > len(names) {
			return nil, fmt.Errorf("event %q of %d fields", tag, len(e))
		}
		f := map[string]any{"type": tag}
		for i, v := range e[1:] {
			f[names[i]] = v
		}
		return f, nil
	}
	return nil, fmt.Errorf("event of type %T", e)
}

func simEvent(f map[string]any) (kvevents.Event, error) {
	var ev kvevents.Event
	switch f["type"] {
	case "BlockStored":
		ev.Kind = kvevents.BlockStored
	case "BlockRemoved":
		ev.Kind = kvevents.BlockRemoved
	case "AllBlocksCleared":
		ev.Kind = kvevents.AllBlocksCleared
		return ev, nil
	default:
		return ev, fmt.Errorf("event type %v", f["type"])
	}
	hs, _ := f["block_hashes"].([]any)
	for _, h := range hs {
		ev.Hashes = append(ev.Hashes, toHash(h))
	}
	if p := f["parent_block_hash"]; p != nil {
		ev.Parent, ev.HasParent = toHash(p), true
	}
	ids, _ := f["token_ids"].([]any)
	for _, id := range ids {
		ev.TokenIDs = append(ev.TokenIDs, uint32(toInt(id)))
	}
	ev.BlockSize = int(toInt(f["block_size"]))
	ev.LoRAID = toInt(f["lora_id"])
	ev.LoRAName, _ = f["lora_name"].(string)
	ev.Medium, _ = f["medium"].(string)
	if k := f["extra_keys"]; k != nil {
		b, err := msgpack.Marshal(k)
		if err != nil {
			return ev, err
		}
		ev.ExtraKeys = b
	}
	ev.GroupIdx = int(toInt(f["group_idx"]))
	ev.SpecKind, _ = f["kv_cache_spec_kind"].(string)
	ev.SlidingWindow = int(toInt(f["kv_cache_spec_sliding_window"]))
	return ev, nil
}

func toInt(v any) int64 {
	switch v := v.(type) {
	case int8:
		return int64(v)
	case int16:
		return int64(v)
	case int32:
		return int64(v)
	case int64:
		return v
	case uint8:
		return int64(v)
	case uint16:
		return int64(v)
	case uint32:
		return int64(v)
	case uint64:
		return int64(v)
	}
	return 0
}

func toHash(v any) kvevents.Hash {
	if b, ok := v.([]byte); ok {
		var buf [16]byte
		copy(buf[:], b)
		return kvevents.Hash{Lo: binary.BigEndian.Uint64(buf[:8]), Hi: binary.BigEndian.Uint64(buf[8:])}
	}
	return kvevents.Hash{Lo: uint64(toInt(v))}
}

// subscribeSim feeds x the simulator's published batches under engine's
// name until the test ends, and returns how many it applied. A PUB socket
// drops what it sends before the subscription reaches it: prime makes the
// engine publish a batch, again until one arrives (nil: reset its cache).
func subscribeSim(t *testing.T, s *enginesim.Server, x *Index, engine string, client *http.Client, prime func()) *atomic.Int64 {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	sub := zmq4.NewSub(ctx)
	done := make(chan struct{})
	t.Cleanup(func() {
		_ = sub.Close()
		cancel()
		<-done
	})
	require.NoError(t, sub.Dial(s.KVEventsEndpoint()))
	require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, ""))
	var applied atomic.Int64
	errs := make(chan error, 1)
	go func() {
		defer close(done)
		for {
			msg, err := sub.Recv()
			if err != nil {
				return
			}
			if len(msg.Frames) != 3 || len(msg.Frames[1]) != 8 {
				errs <- fmt.Errorf("not [topic, seq, payload]: %d frames", len(msg.Frames))
				return
			}
			b, err := simBatch(binary.BigEndian.Uint64(msg.Frames[1]), msg.Frames[2])
			if err != nil {
				errs <- err
				return
			}
			x.Apply(engine, b)
			applied.Add(1)
		}
	}()
	t.Cleanup(func() {
		select {
		case err := <-errs:
			t.Errorf("decoding the simulator's events: %v", err)
		default:
		}
	})
	if prime == nil {
		// One AllBlocksCleared batch each.
		prime = func() {
			resp, err := client.Post("http://"+s.Addr()+"/reset_prefix_cache", "", nil)
			require.NoError(t, err)
			resp.Body.Close()
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for applied.Load() == 0 {
		require.True(t, time.Now().Before(deadline), "the subscription never reached the publisher")
		prime()
		time.Sleep(50 * time.Millisecond)
	}
	return &applied
}

func postJSON(t *testing.T, client *http.Client, url string, body, out any) {
	t.Helper()
	data, err := json.Marshal(body)
	require.NoError(t, err)
	resp, err := client.Post(url, "application/json", bytes.NewReader(data))
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, url)
	if out != nil {
		require.NoError(t, json.NewDecoder(resp.Body).Decode(out))
	}
}

// rendered is the token ids the simulator's render API gives prompt.
func rendered(t *testing.T, client *http.Client, s *enginesim.Server, prompt string) []uint32 {
	t.Helper()
	var gs []struct {
		TokenIDs []uint32 `json:"token_ids"`
	}
	postJSON(t, client, "http://"+s.Addr()+"/v1/completions/render", map[string]any{"model": "m", "prompt": prompt}, &gs)
	require.Len(t, gs, 1)
	return gs[0].TokenIDs
}

// TestSimulatorEvents feeds the index the KV events of the real engine
// simulator, in both of vLLM's encodings, and checks the property precise
// placement rests on: a prompt's tokens from the render API, hashed with
// HashTokens, give the blocks the engine's events stored, so that before
// each request Match predicts exactly the prefix the engine then reuses
// (its prefix-cache hits), through stores, shared prefixes and evictions.
func TestSimulatorEvents(t *testing.T) {
	for _, encoding := range []string{enginesim.EventsMap, enginesim.EventsArray} {
		t.Run(encoding, func(t *testing.T) {
			// 24 blocks of 16 tokens: a few prompts of up to 11 blocks
			// evict each other.
			capa := enginesim.Capacity{MaxRunning: 4, BlockTokens: 16, KVBlocks: 24, PrefillTokensPerSec: 1e9}
			s, err := enginesim.Start(t.Context(), "127.0.0.1:0", enginesim.Config{Capacity: &capa,
				KVEvents: &enginesim.KVEvents{Endpoint: "tcp://127.0.0.1:0", Encoding: encoding}})
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, s.Close()) })
			tr := &http.Transport{}
			t.Cleanup(tr.CloseIdleConnections)
			client := &http.Client{Transport: tr, Timeout: 10 * time.Second}

			x := New(Config{}) // blocks of 16, as the engine's
			const engine = "sim:8000"
			subscribeSim(t, s, x, engine, client, nil)
			slot := []int32{x.Slot(engine)}
			depth := make([]int32, 1)
			match := func(ids []uint32) int {
				x.Match(HashTokens(nil, x.SeedFor("m"), ids, x.BlockSize(), 0), slot, depth)
				return int(depth[0])
			}
			complete := func(prompt string) {
				postJSON(t, client, "http://"+s.Addr()+"/v1/completions", map[string]any{"model": "m", "prompt": prompt, "max_tokens": 1}, nil)
			}
			// sync waits until the index has applied every event of the
			// requests so far: it sends a prompt of one fresh block and
			// waits for the block to be placed (batches come in order).
			markers := 0
			sync := func() {
				markers++
				marker := fmt.Sprintf("marker %04d %s", markers, strings.Repeat(".", 64))
				complete(marker)
				ids := rendered(t, client, s, marker)
				require.Eventually(t, func() bool { return match(ids) >= 1 }, 10*time.Second, 5*time.Millisecond, "marker %d", markers)
			}

			// Conversations: a shared system prompt, then turns that extend
			// their own history, so prompts share prefixes of every length.
			r := rand.New(rand.NewPCG(1, 2))
			system := "You are a helpful assistant. " + strings.Repeat("Answer briefly. ", 8) // 2 blocks and more
			history := make([]string, 3)
			for i := range history {
				history[i] = system
			}
			hits := 0
			for turn := range 24 {
				c := r.IntN(len(history))
				if len(history[c]) > 600 {
					history[c] = system // a new conversation
				}
				history[c] += fmt.Sprintf("[turn %d of %d: %s] ", turn, c, strings.Repeat(string(rune('a'+turn%26)), 20+r.IntN(60)))
				prompt := history[c]
				ids := rendered(t, client, s, prompt)

				sync()
				predicted := match(ids)
				before := s.Usage().PrefixHitTokens
				complete(prompt)
				got := s.Usage().PrefixHitTokens - before
				// vLLM computes at least the prompt's last token.
				want := min(predicted, (len(ids)-1)/capa.BlockTokens) * capa.BlockTokens
				require.Equal(t, int64(want), got, "turn %d: prefix the engine reused (predicted %d blocks)", turn, predicted)
				hits += predicted

				sync()
				require.Equal(t, len(ids)/capa.BlockTokens, match(ids), "turn %d: the engine's events stored every full block of the rendered prompt", turn)
			}
			st := x.Stats()
			require.Positive(t, hits, "some prompts were placed by their prefix")
			require.Positive(t, st.RemovedBlocks, "evictions were applied")
			require.Zero(t, st.Orphans+st.Malformed+st.UnknownRemovals+st.IgnoredGroups+st.IgnoredMedia+st.Conflicts, "%+v", st)
			require.LessOrEqual(t, st.Engines[0].GPUBlocks, capa.KVBlocks, "no more than the engine can hold")
			require.Equal(t, st.Engines[0].Entries, st.Engines[0].GPUBlocks, "one engine hash per block")
		})
	}
}

// TestSimulatorMidStream subscribes to an engine whose cache holds a
// system prompt already, as after pdx restarts: the blocks stored under it
// are orphans, kept with their descendants, and their removals resolve;
// once the engine has evicted the prompt and stored it again, Match
// predicts exactly what the engine reuses.
func TestSimulatorMidStream(t *testing.T) {
	capa := enginesim.Capacity{MaxRunning: 4, BlockTokens: 16, KVBlocks: 16, PrefillTokensPerSec: 1e9}
	s, err := enginesim.Start(t.Context(), "127.0.0.1:0", enginesim.Config{Capacity: &capa,
		KVEvents: &enginesim.KVEvents{Endpoint: "tcp://127.0.0.1:0"}})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, s.Close()) })
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	client := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	complete := func(prompt string) int64 {
		hits := s.Usage().PrefixHitTokens
		postJSON(t, client, "http://"+s.Addr()+"/v1/completions", map[string]any{"model": "m", "prompt": prompt, "max_tokens": 1}, nil)
		return s.Usage().PrefixHitTokens - hits
	}
	const engine = "sim:8000"
	markers := 0
	marker := func() string {
		markers++
		return fmt.Sprintf("marker %04d %s", markers, strings.Repeat(".", 64))
	}
	// The engine caches the system prompt before pdx subscribes: another
	// subscriber sees its batch go out first.
	system := "You are a helpful assistant. " + strings.Repeat("Answer briefly. ", 8) // 2 blocks and more
	before := New(Config{})
	subscribeSim(t, s, before, engine, client, func() { complete(marker()) })
	complete(system + "[turn 0: before pdx]")
	ids0 := rendered(t, client, s, system+"[turn 0: before pdx]")
	require.Eventually(t, func() bool {
		d := []int32{0}
		before.Match(HashTokens(nil, 0, ids0, before.BlockSize(), 0), []int32{before.Slot(engine)}, d)
		return d[0] > 0
	}, 10*time.Second, 5*time.Millisecond)

	x := New(Config{})
	subscribeSim(t, s, x, engine, client, func() { complete(marker()) })
	slot := []int32{x.Slot(engine)}
	depth := make([]int32, 1)
	match := func(ids []uint32) int {
		x.Match(HashTokens(nil, 0, ids, x.BlockSize(), 0), slot, depth)
		return int(depth[0])
	}
	// sync waits until the index has applied the events so far.
	sync := func() {
		m := marker()
		complete(m)
		ids := rendered(t, client, s, m)
		require.Eventually(t, func() bool { return match(ids) >= 1 }, 10*time.Second, 5*time.Millisecond)
	}

	// Turns of a conversation under the system prompt the index never saw
	// stored: orphans, none dropped, the second turn's under the first's.
	turn1 := system + "[turn 1: " + strings.Repeat("x", 70) + "]"
	turn2 := turn1 + "[turn 2: " + strings.Repeat("y", 70) + "]"
	ids1, ids2 := rendered(t, client, s, turn1), rendered(t, client, s, turn2)
	hit := int(complete(turn1)) / capa.BlockTokens
	require.Positive(t, hit, "the system prompt was cached")
	complete(turn2)
	sync()
	orphans := len(ids2)/capa.BlockTokens - hit
	st := x.Stats()
	require.Equal(t, uint64(orphans), st.Orphans)
	require.Zero(t, st.OrphansDropped)
	require.Equal(t, orphans, st.Engines[0].Orphans, "kept, the second turn's under the first's")
	require.Zero(t, match(ids1), "their prefix is not known")

	// Other prompts evict the conversation: the orphans' removals resolve.
	for range 8 {
		complete(fmt.Sprintf("other %d %s", markers, strings.Repeat("o", 200)))
		markers++
	}
	sync()
	st = x.Stats()
	require.Zero(t, st.Engines[0].Orphans, "every orphan's removal resolved")

	// The system prompt stored again from its start: placed exactly.
	complete(system + "[turn 3]")
	sync()
	turn4 := system + "[turn 4]"
	ids4 := rendered(t, client, s, turn4)
	predicted := match(ids4)
	require.Positive(t, predicted)
	require.Equal(t, int64(min(predicted, (len(ids4)-1)/capa.BlockTokens)*capa.BlockTokens), complete(turn4))
}
