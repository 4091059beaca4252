package enginesim

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/http"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
)

// eventView is a decoded KV event, whatever its encoding.
type eventView struct {
	Type      string
	Hashes    []uint64
	Parent    *uint64
	TokenIDs  []uint32
	BlockSize int
	Medium    string
}

// frame is one message of the PUB socket.
type frame struct {
	seq     uint64
	payload []byte
}

// subscribe connects a SUB socket to s's publisher and returns its
// messages. A PUB socket drops what it sends before a subscription
// arrives, as ZeroMQ's does, so it resets the cache until an
// AllBlocksCleared comes through, then drains up to the last one.
func subscribe(t *testing.T, s *Server, topic string) <-chan frame {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	sub := zmq4.NewSub(ctx)
	t.Cleanup(func() {
		_ = sub.Close()
		cancel()
	})
	require.NoError(t, sub.Dial(s.KVEventsEndpoint()))
	require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, topic))
	out := make(chan frame, 64)
	go func() {
		defer close(out)
		for {
			msg, err := sub.Recv()
			if err != nil {
				return
			}
			if len(msg.Frames) != 3 || string(msg.Frames[0]) != topic || len(msg.Frames[1]) != 8 {
				panic(fmt.Sprintf("not a [topic, seq, payload] message: %v", msg))
			}
			out <- frame{seq: binary.BigEndian.Uint64(msg.Frames[1]), payload: msg.Frames[2]}
		}
	}()
	// Each reset is one AllBlocksCleared batch, numbered from 0 whether a
	// subscriber got it or not: after n resets, seq n-1 is the last.
	client := testClient(t)
	deadline := time.After(10 * time.Second)
	var resets uint64
	for got := false; !got; {
		resp, err := client.Post("http://"+s.Addr()+"/reset_prefix_cache", "", nil)
		require.NoError(t, err)
		resp.Body.Close()
		resets++
		select {
		case f := <-out:
			got = f.seq == resets-1
			for !got {
				select {
				case f = <-out:
					got = f.seq == resets-1
				case <-deadline:
					require.FailNow(t, "the resets' batches never came")
				}
			}
		case <-time.After(50 * time.Millisecond):
		case <-deadline:
			require.FailNow(t, "the subscription never reached the publisher")
		}
	}
	return out
}

// uintOf is a decoded msgpack integer (of whichever width it came in).
func uintOf(t *testing.T, v any) uint64 {
	t.Helper()
	rv := reflect.ValueOf(v)
	switch rv.Kind() {
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return rv.Uint()
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		require.GreaterOrEqual(t, rv.Int(), int64(0))
		return uint64(rv.Int())
	}
	require.Failf(t, "not an integer", "%T %v", v, v)
	return 0
}

// decodeBatch decodes a payload, checking the shape of encoding: the batch
// [ts, events, rank 0], each event a map with exactly wantKeys (by type) or
// a tagged array.
func decodeBatch(t *testing.T, payload []byte, encoding string) []eventView {
	t.Helper()
	var batch []any
	require.NoError(t, msgpack.Unmarshal(payload, &batch))
	require.Len(t, batch, 3, "[ts, events, data_parallel_rank]")
	ts, ok := batch[0].(float64)
	require.True(t, ok, "ts is a float: %T", batch[0])
	require.InDelta(t, float64(time.Now().UnixNano())/1e9, ts, 10)
	require.Equal(t, uint64(0), uintOf(t, batch[2]), "data_parallel_rank")
	events, ok := batch[1].([]any)
	require.True(t, ok)
	var out []eventView
	for _, e := range events {
		var f map[string]any
		if encoding == EventsArray {
			a, ok := e.([]any)
			require.True(t, ok, "a tagged array: %T", e)
			f = map[string]any{"type": a[0]}
			names := map[string][]string{
				"BlockStored": {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
					"lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"},
				"BlockRemoved":     {"block_hashes", "medium", "group_idx"},
				"AllBlocksCleared": {},
			}[a[0].(string)]
			require.Len(t, a, len(names)+1, "%s's fields", a[0])
			for i, n := range names {
				f[n] = a[i+1]
			}
		} else {
			f, ok = e.(map[string]any)
			require.True(t, ok, "a tagged map: %T", e)
			keys := map[string]int{"BlockStored": 11, "BlockRemoved": 4, "AllBlocksCleared": 1}
			require.Len(t, f, keys[f["type"].(string)], "%v", f)
		}
		v := eventView{Type: f["type"].(string)}
		if v.Type == "AllBlocksCleared" {
			out = append(out, v)
			continue
		}
		for _, h := range f["block_hashes"].([]any) {
			v.Hashes = append(v.Hashes, uintOf(t, h))
		}
		v.Medium = f["medium"].(string)
		require.Equal(t, uint64(0), uintOf(t, f["group_idx"]))
		if v.Type == "BlockStored" {
			if p := f["parent_block_hash"]; p != nil {
				h := uintOf(t, p)
				v.Parent = &h
			}
			for _, id := range f["token_ids"].([]any) {
				v.TokenIDs = append(v.TokenIDs, uint32(uintOf(t, id)))
			}
			v.BlockSize = int(uintOf(t, f["block_size"]))
			require.Nil(t, f["lora_id"])
			require.Nil(t, f["lora_name"])
			require.Equal(t, make([]any, len(v.Hashes)), f["extra_keys"], "one null extra key per block")
			require.Equal(t, "full_attention", f["kv_cache_spec_kind"])
		}
		out = append(out, v)
	}
	return out
}

// TestKVEventsPublished drives a prefix cache of 3 blocks of 4 tokens
// through stores, evictions and a reset and checks each batch the
// subscriber gets, in either encoding.
func TestKVEventsPublished(t *testing.T) {
	capa := Capacity{MaxRunning: 4, BlockTokens: 4, KVBlocks: 3, PrefillTokensPerSec: 1e9}
	// 40-byte prompts: 10 tokens, 2 full blocks and a partial one.
	a := strings.Repeat("a", 40)
	b := strings.Repeat("b", 40)
	c := strings.Repeat("b", 16) + strings.Repeat("c", 24) // shares b's first block
	ha, hb, hc := blocksOf(a, 4).hashes, blocksOf(b, 4).hashes, blocksOf(c, 4).hashes
	require.Equal(t, hb[0], hc[0])
	type blockFn func(scale int) eventView
	stored := func(hashes []uint64, parent *uint64, prompt string, from int) blockFn {
		return func(scale int) eventView {
			return eventView{Type: "BlockStored", Hashes: hashes, Parent: parent,
				TokenIDs: scaleTokens(tokenize(prompt)[from*4:(from+len(hashes))*4], scale), BlockSize: 4 * scale, Medium: "GPU"}
		}
	}
	removed := func(h uint64) blockFn {
		return func(int) eventView { return eventView{Type: "BlockRemoved", Hashes: []uint64{h}, Medium: "GPU"} }
	}
	cleared := func(int) eventView { return eventView{Type: "AllBlocksCleared"} }
	steps := []struct {
		name   string
		prompt string // "" resets the cache
		want   [][]blockFn
	}{
		{"a's full blocks are stored", a, [][]blockFn{{stored(ha, nil, a, 0)}}},
		// b's prefill needs 3 blocks: a's are evicted, tail first (vLLM
		// frees a request's blocks in reverse), then b's stored.
		{"b evicts a", b, [][]blockFn{{removed(ha[1]), removed(ha[0])}, {stored(hb, nil, b, 0)}}},
		// c reuses b's first block and needs 2 more: b's second goes, and
		// only c's new block is stored, its parent b's first.
		{"c extends b's first block", c, [][]blockFn{{removed(hb[1])}, {stored(hc[1:], &hb[0], c, 1)}}},
		{"reset", "", [][]blockFn{{cleared}}},
	}
	for _, tc := range []struct {
		encoding string
		scale    int // KVEvents.TokenScale: each token published as that many
	}{{EventsMap, 1}, {EventsArray, 1}, {EventsMap, 4}} {
		encoding := tc.encoding
		t.Run(fmt.Sprintf("%s/scale%d", encoding, tc.scale), func(t *testing.T) {
			s := startSim(t, Config{Capacity: &capa, KVEvents: &KVEvents{Endpoint: "tcp://127.0.0.1:0",
				ReplayEndpoint: "tcp://127.0.0.1:0", Topic: "kv@" + encoding, Encoding: encoding, TokenScale: tc.scale}})
			require.True(t, strings.HasPrefix(s.KVEventsEndpoint(), "tcp://127.0.0.1:"), s.KVEventsEndpoint())
			frames := subscribe(t, s, "kv@"+encoding)
			var got []frame
			for _, st := range steps {
				if st.prompt == "" {
					require.Equal(t, http.StatusOK, post(t, s, "/reset_prefix_cache", "", []byte("")).status, st.name)
				} else {
					r := post(t, s, "/v1/completions", "", map[string]any{"model": "m", "prompt": st.prompt, "max_tokens": 1})
					require.Equal(t, http.StatusOK, r.status, "%s: %s", st.name, r.body)
				}
				for i, want := range st.want {
					select {
					case f := <-frames:
						if len(got) > 0 {
							require.Equal(t, got[len(got)-1].seq+1, f.seq, "%s: sequence numbers count batches", st.name)
						}
						got = append(got, f)
						var wantEvents []eventView
						for _, w := range want {
							wantEvents = append(wantEvents, w(tc.scale))
						}
						require.Equal(t, wantEvents, decodeBatch(t, f.payload, encoding), "%s: batch %d", st.name, i)
					case <-time.After(5 * time.Second):
						require.Failf(t, "no batch", "%s: batch %d", st.name, i)
					}
				}
			}
			select {
			case f := <-frames:
				require.Failf(t, "an unexpected batch", "%v", decodeBatch(t, f.payload, encoding))
			case <-time.After(200 * time.Millisecond):
			}

			// A subscriber that missed batches asks the replay socket for
			// them from a sequence number on: it gets each as it was sent,
			// with its topic, then the end marker (no topic, -1, empty).
			from := got[2]
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			dealer := zmq4.NewDealer(ctx, zmq4.WithID(zmq4.SocketIdentity("replayer")))
			defer dealer.Close()
			require.NoError(t, dealer.Dial(s.KVEventsReplayEndpoint()))
			var start [8]byte
			binary.BigEndian.PutUint64(start[:], from.seq)
			require.NoError(t, dealer.SendMulti(zmq4.NewMsgFrom(nil, start[:])))
			for i, want := range append(got[2:], frame{seq: ^uint64(0), payload: []byte{}}) {
				msg, err := dealer.Recv()
				require.NoError(t, err)
				require.Len(t, msg.Frames, 4, "['', topic, seq, payload]")
				require.Empty(t, msg.Frames[0])
				if i < len(got)-2 {
					require.Equal(t, "kv@"+encoding, string(msg.Frames[1]))
				} else {
					require.Empty(t, msg.Frames[1], "the end marker has no topic")
				}
				require.Equal(t, want.seq, binary.BigEndian.Uint64(msg.Frames[2]))
				require.Equal(t, want.payload, msg.Frames[3], "replayed as sent")
			}
		})
	}
}

// TestKVEventsConfig is the configurations the engine refuses.
func TestKVEventsConfig(t *testing.T) {
	capa := ReferenceCapacity(1, 1)
	tests := []struct {
		name string
		cfg  Config
		want string
	}{
		{"no capacity", Config{KVEvents: &KVEvents{Endpoint: "tcp://127.0.0.1:0"}}, "KVEvents needs Capacity"},
		{"no endpoint", Config{Capacity: &capa, KVEvents: &KVEvents{}}, "KVEvents.Endpoint is required"},
		{"not tcp", Config{Capacity: &capa, KVEvents: &KVEvents{Endpoint: "ipc:///tmp/kv"}}, "only tcp://"},
		{"bad encoding", Config{Capacity: &capa, KVEvents: &KVEvents{Endpoint: "tcp://127.0.0.1:0", Encoding: "json"}}, "unknown KVEvents.Encoding"},
		{"DP", Config{Capacity: &capa, DPSize: 2, KVEvents: &KVEvents{Endpoint: "tcp://127.0.0.1:0"}}, "DPSize > 1"},
		{"connect to port 0", Config{Capacity: &capa, KVEvents: &KVEvents{Endpoint: "tcp://127.0.0.1:0", Connect: true}}, "needs the port to dial"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Start(t.Context(), "127.0.0.1:0", tt.cfg)
			require.ErrorContains(t, err, tt.want)
		})
	}
}

// TestRender is vLLM's Renderer APIs: the token ids the engine would run,
// the simulator tokenizer's, as its KV events carry them.
func TestRender(t *testing.T) {
	capa := ReferenceCapacity(1, 1)
	scaled := startSim(t, Config{Capacity: &capa, KVEvents: &KVEvents{Endpoint: "tcp://127.0.0.1:0", TokenScale: 3}})
	r := post(t, scaled, "/v1/completions/render", "", map[string]any{"model": "m", "prompt": "hello there"})
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	var gs []generateRequest
	require.NoError(t, decodeJSON(r.body, &gs))
	require.Equal(t, scaleTokens(tokenize("hello there"), 3), gs[0].TokenIDs, "ids as the KV events carry them")

	s := startSim(t, Config{})
	msgs := []map[string]string{{"role": "user", "content": "hello there"}}
	chatIDs := tokenize(ChatPromptText([]Message{{Role: "user", Content: "hello there"}}))
	tests := []struct {
		name, path string
		body       map[string]any
		list       bool
		ids        []uint32
		prefix     string
	}{
		{"chat", "/v1/chat/completions/render", map[string]any{"model": "m", "messages": msgs, "max_tokens": 3}, false, chatIDs, "chatcmpl-"},
		{"completion", "/v1/completions/render", map[string]any{"model": "m", "prompt": "hello there", "max_tokens": 3}, true, tokenize("hello there"), "cmpl-"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := post(t, s, tt.path, "", tt.body)
			require.Equal(t, http.StatusOK, r.status, "%s", r.body)
			var g generateRequest
			if tt.list {
				var gs []generateRequest
				require.NoError(t, decodeJSON(r.body, &gs))
				require.Len(t, gs, 1)
				g = gs[0]
			} else {
				require.NoError(t, decodeJSON(r.body, &g))
			}
			require.Equal(t, tt.ids, g.TokenIDs)
			require.Equal(t, "m", g.Model)
			require.Equal(t, 3, g.SamplingParams.MaxTokens)
			require.True(t, strings.HasPrefix(g.RequestID, tt.prefix), g.RequestID)
			require.Empty(t, s.Records(), "a render runs nothing")
		})
	}
	r = post(t, s, "/v1/completions/render", "", map[string]any{"prompt": "x"})
	require.Equal(t, http.StatusBadRequest, r.status, "rendered requests are checked as served ones")

	// vllm serve without --enable-scale-out, vLLM 0.32's answer.
	off := startSim(t, Config{NoScaleOut: true})
	for _, path := range []string{"/v1/chat/completions/render", "/v1/completions/render"} {
		r := post(t, off, path, "", map[string]any{"model": "m", "prompt": "hello there"})
		require.Equal(t, http.StatusForbidden, r.status, "%s", r.body)
		require.JSONEq(t, `{"error":{"message":"Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them.","type":"PermissionDeniedError","param":null,"code":403}}`, string(r.body))
	}
}

// TestServedModelName is vLLM's --served-model-name: what /v1/models lists
// (vllm-router's kv_aware trusts an engine's KV events only for requests
// naming it).
func TestServedModelName(t *testing.T) {
	for _, tt := range []struct{ name, served, want string }{
		{"default", "", ModelName},
		{"configured", "demo-model", "demo-model"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := startSim(t, Config{ServedModelName: tt.served})
			r := get(t, s, "/v1/models")
			require.Equal(t, http.StatusOK, r.status)
			var list struct {
				Data []struct{ ID string } `json:"data"`
			}
			require.NoError(t, decodeJSON(r.body, &list))
			require.Len(t, list.Data, 1)
			require.Equal(t, tt.want, list.Data[0].ID)
		})
	}
}

// listenSub is a SUB socket listening on ep, for publishers that dial
// (KVEvents.Connect), and its messages.
func listenSub(t *testing.T, ep string) <-chan frame {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	sub := zmq4.NewSub(ctx)
	require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, ""))
	require.NoError(t, sub.Listen(ep))
	out := make(chan frame, 64)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			msg, err := sub.Recv()
			if ctx.Err() != nil {
				return
			}
			if err != nil || len(msg.Frames) != 3 {
				continue // a publisher's connection ended
			}
			select {
			case out <- frame{seq: binary.BigEndian.Uint64(msg.Frames[1]), payload: msg.Frames[2]}:
			case <-ctx.Done():
				return
			}
		}
	}()
	t.Cleanup(func() {
		cancel()
		_ = sub.Close()
		<-done
	})
	return out
}

// nextBatch resets s's prefix cache (one AllBlocksCleared batch) until a
// batch comes out of frames, and returns it. A PUB socket drops what it
// sends before a subscription reaches it, so the first resets may be lost.
func nextBatch(t *testing.T, s *Server, frames <-chan frame) frame {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		require.True(t, s.ResetPrefixCache())
		select {
		case f := <-frames:
			return f
		case <-time.After(50 * time.Millisecond):
		case <-deadline:
			require.FailNow(t, "no batch came")
		}
	}
}

// TestKVEventsConnect is a publisher that dials its subscriber (vLLM's
// connect, for an endpoint without a wildcard): started before the
// subscriber listens, it is picked up once it does, and after a restart
// it dials again and numbers from 0.
func TestKVEventsConnect(t *testing.T) {
	capa := Capacity{MaxRunning: 4, BlockTokens: 4, KVBlocks: 3, PrefillTokensPerSec: 1e9}
	// A port nothing listens on yet: the publisher must keep dialling.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	require.NoError(t, ln.Close())
	ep := fmt.Sprintf("tcp://127.0.0.1:%d", port)
	s := startSim(t, Config{Capacity: &capa, KVEvents: &KVEvents{Endpoint: ep, Connect: true}})
	require.Equal(t, ep, s.KVEventsEndpoint())
	require.True(t, s.ResetPrefixCache(), "a batch with nobody to take it is dropped")
	time.Sleep(3 * kvDialRetry)

	frames := listenSub(t, ep)
	first := nextBatch(t, s, frames)
	require.Positive(t, first.seq, "batch 0 went out before anyone listened")
	require.Equal(t, []eventView{{Type: "AllBlocksCleared"}}, decodeBatch(t, first.payload, EventsMap))

	require.NoError(t, s.RestartKVEvents())
	require.Equal(t, ep, s.KVEventsEndpoint())
	for {
		f := nextBatch(t, s, frames)
		if f.seq <= first.seq {
			break // the new publisher's numbers
		}
	}
}

// TestKVEventsRestart is a bound publisher replaced by RestartKVEvents: on
// the port it had, its batches numbered from 0 again, its replay buffer
// empty.
func TestKVEventsRestart(t *testing.T) {
	capa := Capacity{MaxRunning: 4, BlockTokens: 4, KVBlocks: 3, PrefillTokensPerSec: 1e9}
	s := startSim(t, Config{Capacity: &capa, KVEvents: &KVEvents{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0"}})
	ep, replay := s.KVEventsEndpoint(), s.KVEventsReplayEndpoint()
	frames := subscribe(t, s, "")
	before := nextBatch(t, s, frames)
	require.Positive(t, before.seq)

	require.NoError(t, s.RestartKVEvents())
	require.Equal(t, ep, s.KVEventsEndpoint(), "the same port")
	require.Equal(t, replay, s.KVEventsReplayEndpoint())
	subscribe(t, s, "") // counts its resets' batches from 0

	// The new replay buffer holds only the new batches.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	dealer := zmq4.NewDealer(ctx)
	defer dealer.Close()
	require.NoError(t, dealer.Dial(replay))
	require.NoError(t, dealer.SendMulti(zmq4.NewMsgFrom(nil, make([]byte, 8))))
	msg, err := dealer.Recv()
	require.NoError(t, err)
	require.Len(t, msg.Frames, 4, "['', topic, seq, payload]")
	require.Equal(t, uint64(0), binary.BigEndian.Uint64(msg.Frames[2]), "the first batch after the restart")

	other := startSim(t, Config{Capacity: &capa})
	require.ErrorContains(t, other.RestartKVEvents(), "publishes no KV events")
}
