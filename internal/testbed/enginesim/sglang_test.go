package enginesim

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// sglangPair is a prefill and a decode engine; the decode waits at most wait.
func sglangPair(t *testing.T, prefill Config, wait time.Duration) (p, d *Server) {
	t.Helper()
	prefill.Role, prefill.Connector = RolePrefill, ConnectorSGLang
	p = startSim(t, prefill)
	d = startSim(t, Config{Role: RoleDecode, Connector: ConnectorSGLang, KVWaitTimeout: wait})
	return p, d
}

// withRoom adds the bootstrap fields naming p's bootstrap server.
func withRoom(b body, p *Server, room any) body {
	return b.with("bootstrap_host", "127.0.0.1", "bootstrap_port", p.BootstrapPort(), "bootstrap_room", room)
}

// Rooms beyond 2^53 that float64 cannot tell from their neighbours.
const (
	bigRoom    = "9007199254740993"    // 2^53 + 1
	maxRoom    = "9223372036854775807" // 2^63 - 1
	bigRoomLow = "9007199254740992"    // what float64 makes of bigRoom
)

func TestSGLangHandoff(t *testing.T) {
	for _, api := range bothAPIs {
		for _, stream := range []bool{false, true} {
			t.Run(api.name+streamName(stream), func(t *testing.T) {
				// The prefill takes a while, so the decode waits for it.
				p, d := sglangPair(t, Config{PrefillLatency: 30 * time.Millisecond}, time.Minute)
				require.NotZero(t, p.BootstrapPort())
				require.Zero(t, d.BootstrapPort(), "a decode engine runs no bootstrap server")
				b := withRoom(api.body.streaming(stream), p, json.Number(maxRoom))
				path := pathFor(b)

				// The same body goes to both, at the same time.
				dc := goPost(t, d, path, "req-1", b)
				pc := goPost(t, p, path, "req-1", b)
				pr, dr := await(t, pc), await(t, dc)

				first := "pdx-sim:" + Fingerprint(promptOf(t, b))
				require.Equal(t, first, answerText(t, pr, stream), "the prefill answers its first token, as asked")
				requireDecodePulled(t, d, p, dr, b, stream, wantText(t, b))
				requireRecordsAnyOrder(t, p,
					Record{RequestID: "req-1", Path: path, Kind: KindPrefill, Fingerprint: Fingerprint(promptOf(t, b)), Status: 200},
					Record{RequestID: "req-1", Path: "/sim/room", Kind: KindKVPull, Fingerprint: Fingerprint(promptOf(t, b)), Status: 200})
			})
		}
	}
}

func TestSGLangDecodeBeforePrefill(t *testing.T) {
	p, d := sglangPair(t, Config{}, time.Minute)
	b := withRoom(chatBody("late prefill").with("max_tokens", 3), p, 7)
	dc := goPost(t, d, "/v1/chat/completions", "req-1", b)
	waitForWaiters(t, p.proto.(*sglangProtocol).rooms)
	post(t, p, "/v1/chat/completions", "req-1", b).decode(t)
	requireDecodePulled(t, d, p, await(t, dc), b, false, wantText(t, b))
}

// A streaming decode answers 200 before the prefill is even sent, as
// SGLang's server does; the KV it then pulls is named in trailers.
func TestSGLangStreamingHeadersFirst(t *testing.T) {
	for _, api := range bothAPIs {
		t.Run(api.name, func(t *testing.T) {
			p, d := sglangPair(t, Config{}, time.Minute)
			b := withRoom(api.body.streaming(true), p, json.Number(bigRoom))
			path := pathFor(b)
			req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://"+d.Addr()+path, bytesOf(t, b))
			require.NoError(t, err)
			req.Header.Set("X-Request-Id", "req-1")
			resp, err := testClient(t).Do(req) // returns once the headers are in
			require.NoError(t, err)
			defer resp.Body.Close()

			require.Empty(t, p.Records(), "no prefill was sent yet")
			require.Equal(t, http.StatusOK, resp.StatusCode)
			require.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
			require.Equal(t, d.Addr(), resp.Header.Get(HeaderEngine))
			require.Empty(t, resp.Header.Get(HeaderKV), "the KV is not there yet")
			require.Empty(t, resp.Header.Get(HeaderKVSource))
			require.Contains(t, resp.Trailer, HeaderKV, "declared as a trailer")
			require.Contains(t, resp.Trailer, HeaderKVSource, "declared as a trailer")
			require.Empty(t, d.Records(), "the decode is still waiting for the room")

			waitForWaiters(t, p.proto.(*sglangProtocol).rooms)
			pr := post(t, p, path, "req-1", b)
			require.Equal(t, "pdx-sim:"+Fingerprint(promptOf(t, b)), answerText(t, pr, true))

			data, err := io.ReadAll(resp.Body)
			require.NoError(t, err)
			r := reply{status: resp.StatusCode, header: resp.Header, trailer: resp.Trailer, body: data}
			requireDecodePulled(t, d, p, r, b, true, wantText(t, b))
		})
	}
}

func TestSGLangLosslessRoom(t *testing.T) {
	p, d := sglangPair(t, Config{}, 200*time.Millisecond)
	raw := func(room string) []byte {
		return []byte(`{"model":"m","prompt":"big rooms","max_tokens":3,"bootstrap_host":"127.0.0.1","bootstrap_port":` +
			strconv.Itoa(p.BootstrapPort()) + `,"bootstrap_room":` + room + `}`)
	}
	post(t, p, "/v1/completions", "req-1", raw(bigRoom)).decode(t)
	// float64 would turn both rooms into 2^53: the engine must not.
	r := post(t, d, "/v1/completions", "req-1", raw(bigRoomLow))
	requireRejected(t, d, r, http.StatusInternalServerError, "no prefill registered KV for bootstrap_room "+bigRoomLow)
	r = post(t, d, "/v1/completions", "req-1", raw(bigRoom))
	require.Equal(t, KVPulled, r.header.Get(HeaderKV), "body: %s", r.body)
	require.Equal(t, bigRoom, rooms(p)[0], "the prefill registered the exact room")
}

// rooms lists the rooms a prefill engine registered.
func rooms(p *Server) []string {
	h := p.proto.(*sglangProtocol).rooms
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []string
	for k := range h.entries {
		out = append(out, k)
	}
	return out
}

// A decode that cannot have the room's KV is refused: with an error status,
// or, when it streams, with an SSE error event after the 200 headers (those
// went out before the wait), as SGLang reports errors mid-stream.
func TestSGLangDecodeFailures(t *testing.T) {
	const prompt = "What is a bootstrap room?"
	tests := []struct {
		name string
		// run prefills (or not) on p, then returns the decode body for d.
		run     func(t *testing.T, p, d *Server) body
		status  int
		wantMsg string
		// early: refused before the wait, so never with a 200.
		early bool
	}{
		{
			// decode.py fails a receiver timed out in WaitingForInput with 500.
			name:    "no prefill in time",
			run:     func(_ *testing.T, p, _ *Server) body { return withRoom(chatBody(prompt).with("rid", "r-42"), p, 42) },
			status:  http.StatusInternalServerError,
			wantMsg: "Decode transfer failed for request rank=0 decode_req.req.rid='r-42' decode_req.req.bootstrap_room=42 with exception timed out after 0.2s in KVPoll.WaitingForInput (KV pull of bootstrap_room 42 from the bootstrap server at 127.0.0.1:",
		},
		{
			name: "wrong prompt",
			run: func(t *testing.T, p, _ *Server) body {
				post(t, p, "/v1/chat/completions", "req-1", withRoom(chatBody("another prompt"), p, 42)).decode(t)
				return withRoom(chatBody(prompt), p, 42)
			},
			status:  http.StatusBadRequest,
			wantMsg: "KV of bootstrap_room 42 holds a different prompt: prefilled prompt fingerprint " + Fingerprint("user: another prompt\n"),
		},
		{
			name: "room already consumed",
			run: func(t *testing.T, p, d *Server) body {
				b := withRoom(chatBody(prompt), p, 42)
				post(t, p, "/v1/chat/completions", "req-1", b).decode(t)
				post(t, d, "/v1/chat/completions", "req-1", b).decode(t)
				return b
			},
			status:  http.StatusConflict,
			wantMsg: `KV of bootstrap_room 42 was already taken by request "req-1"`,
		},
		{
			name: "bootstrap server not listening",
			run: func(t *testing.T, _, _ *Server) body {
				return chatBody(prompt).with("bootstrap_host", "127.0.0.1", "bootstrap_port", closedPort(t), "bootstrap_room", 42)
			},
			status:  http.StatusBadRequest,
			wantMsg: "KV pull of bootstrap_room 42 from the bootstrap server at 127.0.0.1:",
		},
		{
			name:    "missing bootstrap fields",
			run:     func(*testing.T, *Server, *Server) body { return chatBody(prompt) },
			status:  http.StatusBadRequest,
			wantMsg: "missing bootstrap_host, bootstrap_port and bootstrap_room: an SGLang decode engine needs them",
			early:   true,
		},
	}
	for _, tt := range tests {
		for _, stream := range []bool{false, true} {
			t.Run(tt.name+streamName(stream), func(t *testing.T) {
				p, d := sglangPair(t, Config{}, 200*time.Millisecond)
				b := tt.run(t, p, d).streaming(stream)
				r := post(t, d, "/v1/chat/completions", "req-1", b)
				if stream && !tt.early {
					requireStreamError(t, d, r, tt.status, tt.wantMsg)
					return
				}
				requireRejected(t, d, r, tt.status, tt.wantMsg)
			})
		}
	}
}

func TestSGLangBadFields(t *testing.T) {
	p := startSim(t, Config{Role: RolePrefill, Connector: ConnectorSGLang})
	port := p.BootstrapPort()
	good := chatBody("hi").with("bootstrap_host", "127.0.0.1", "bootstrap_port", port, "bootstrap_room", 1)
	tests := []struct {
		name    string
		body    any
		status  int
		wantMsg string
	}{
		{"no bootstrap fields", chatBody("hi"), 400, "missing bootstrap_host, bootstrap_port and bootstrap_room: an SGLang prefill engine"},
		{"incomplete", good.with("bootstrap_room", nil), 400, "bootstrap fields are incomplete: missing bootstrap_room"},
		{"room as a string", good.with("bootstrap_room", "1"), 400, `bootstrap_room must be an integer in [0, 2^64), got "1"`},
		{"negative room", good.with("bootstrap_room", -1), 400, "bootstrap_room must be an integer in [0, 2^64), got -1"},
		{"fractional room", good.with("bootstrap_room", 1.5), 400, "got 1.5"},
		{"room in exponent form", []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"bootstrap_host":"127.0.0.1","bootstrap_port":` +
			strconv.Itoa(port) + `,"bootstrap_room":1e3}`), 400, "got 1e3"},
		{"room too big", []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"bootstrap_host":"127.0.0.1","bootstrap_port":` +
			strconv.Itoa(port) + `,"bootstrap_room":18446744073709551616}`), 400, "got 18446744073709551616"},
		{"port as a string", good.with("bootstrap_port", strconv.Itoa(port)), 400, "bootstrap_port must be an integer port"},
		{"port out of range", good.with("bootstrap_port", 70000), 400, "bootstrap_port must be an integer port, got 70000"},
		{"host not a string", good.with("bootstrap_host", 5), 400, "bootstrap_host must be a non-empty string, got 5"},
		{"wrong bootstrap port", good.with("bootstrap_port", closedPort(t)), 400, "does not name this prefill engine's bootstrap server (port " + strconv.Itoa(port) + ")"},
		{"leaked kv_transfer_params", good.with("kv_transfer_params", map[string]any{"do_remote_decode": true}), 400,
			"kv_transfer_params is not part of the sglang protocol"},
		{"leaked disaggregated_params", good.with("disaggregated_params", map[string]any{"request_type": "context_only"}), 400,
			"disaggregated_params is not part of the sglang protocol"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			requireRejected(t, p, post(t, p, "/v1/chat/completions", "req-1", tt.body), tt.status, tt.wantMsg)
		})
	}
	t.Run("room reused", func(t *testing.T) {
		b := good.with("bootstrap_room", 99)
		post(t, p, "/v1/chat/completions", "req-1", b).decode(t)
		requireRejected(t, p, post(t, p, "/v1/chat/completions", "req-2", b), http.StatusConflict,
			`bootstrap_room 99 is already in use (prefilled for request "req-1" and not yet taken)`)
	})
}

func TestSGLangRoleBothIgnoresBootstrap(t *testing.T) {
	s := startSim(t, Config{Connector: ConnectorSGLang})
	require.NotZero(t, s.BootstrapPort())
	for _, b := range []body{chatBody("x"), withRoom(chatBody("x"), s, 1)} {
		r := post(t, s, "/v1/chat/completions", "req-1", b)
		require.Equal(t, KVRecomputed, r.header.Get(HeaderKV))
		r.decode(t)
		require.Equal(t, KindPlain, lastRecord(t, s).Kind)
	}
	requireRejected(t, s, post(t, s, "/v1/chat/completions", "req-1", withRoom(chatBody("x"), s, "1")), 400, "bootstrap_room must be an integer")
}

// A decode whose client went away keeps its slot until SGLang's next
// disconnect check notices it; the check aborts the decode, and its wait at
// the prefill's bootstrap server ends too.
func TestSGLangDecodeClientGone(t *testing.T) {
	const check = 30 * time.Millisecond
	for _, stream := range []bool{false, true} {
		t.Run("decode"+streamName(stream), func(t *testing.T) {
			p := startSim(t, Config{Role: RolePrefill, Connector: ConnectorSGLang})
			d := startSim(t, Config{Role: RoleDecode, Connector: ConnectorSGLang, KVWaitTimeout: time.Minute, DisconnectCheckInterval: check})
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+d.Addr()+"/v1/chat/completions",
				bytesOf(t, withRoom(chatBody("x").streaming(stream), p, 5)))
			require.NoError(t, err)
			req.Header.Set("X-Request-Id", "gone")
			start := time.Now()
			// The client leaves once the decode waits for its room; a
			// streaming one after it has the 200 the decode answers at once.
			leave := func() {
				waitForWaiters(t, p.proto.(*sglangProtocol).rooms)
				cancel()
			}
			if !stream {
				go leave()
			}
			resp, err := testClient(t).Do(req)
			if stream {
				require.NoError(t, err, "a streaming decode answers 200 at once")
				require.Equal(t, http.StatusOK, resp.StatusCode)
				go leave()
				_, err = io.ReadAll(resp.Body)
				resp.Body.Close()
			}
			require.ErrorIs(t, err, context.Canceled)
			requireAbandoned(t, d, KindDecode)
			require.GreaterOrEqual(t, time.Since(start), check, "noticed at a check, not at once")
			require.Contains(t, d.Records()[0].Error, "noticed at SGLang's disconnect check")
			require.Zero(t, d.HeldSlots())
			// The bootstrap server stops waiting for the room too.
			require.Eventually(t, func() bool { return len(p.Records()) == 1 }, 5*time.Second, 5*time.Millisecond)
			require.Equal(t, statusClientGone, p.Records()[0].Status)
		})
	}
}

func TestUintText(t *testing.T) {
	tests := []struct {
		raw  string
		want string
		ok   bool
	}{
		{"0", "0", true},
		{maxRoom, maxRoom, true},
		{"18446744073709551615", "18446744073709551615", true},
		{"18446744073709551616", "", false},
		{"-1", "", false},
		{"1.0", "", false},
		{"1e3", "", false},
		{`"1"`, "", false},
		{"null", "", false},
	}
	for _, tt := range tests {
		t.Run(tt.raw, func(t *testing.T) {
			got, ok := uintText(json.RawMessage(tt.raw))
			require.Equal(t, tt.ok, ok)
			require.Equal(t, tt.want, got)
		})
	}
}
