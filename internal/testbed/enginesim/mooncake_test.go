package enginesim

import (
	"encoding/json"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// mooncakePair is a prefill ("mc-prefill") and a decode engine of upstream
// vLLM's Mooncake protocol; the decode waits at most wait.
func mooncakePair(t *testing.T, prefill Config, wait time.Duration) (p, d *Server) {
	t.Helper()
	prefill.Role, prefill.Connector, prefill.MooncakeProtocol, prefill.EngineID = RolePrefill, ConnectorMooncake, MooncakeVLLM, "mc-prefill"
	p = startSim(t, prefill)
	d = startSim(t, Config{Role: RoleDecode, Connector: ConnectorMooncake, MooncakeProtocol: MooncakeVLLM, KVWaitTimeout: wait})
	return p, d
}

// mooncakePrefill derives the prefill leg of client for request rid.
func mooncakePrefill(client body, rid string) body {
	return client.prefillEdits().with("kv_transfer_params", map[string]any{
		"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": "xfer-" + rid,
	})
}

// mooncakeDecode derives the decode leg of client for request rid, whose
// prefill runs on p.
func mooncakeDecode(client body, p *Server, rid string) body {
	return client.with("kv_transfer_params", map[string]any{
		"do_remote_decode": false, "do_remote_prefill": true,
		"remote_bootstrap_addr": "http://127.0.0.1:" + strconv.Itoa(p.BootstrapPort()),
		"remote_engine_id":      "mc-prefill",
		"transfer_id":           "xfer-" + rid,
	})
}

func TestMooncakeVLLMQuery(t *testing.T) {
	p, d := mooncakePair(t, Config{}, time.Second)
	require.Zero(t, d.BootstrapPort(), "a decode engine runs no bootstrap server")
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, "http://127.0.0.1:"+strconv.Itoa(p.BootstrapPort())+"/query", nil)
	require.NoError(t, err)
	r := do(t, req)
	require.Equal(t, http.StatusOK, r.status)
	require.JSONEq(t, `{"0":{"engine_id":"mc-prefill","worker_addr":{"0":{"0":"`+p.Addr()+`"}}}}`, string(r.body))
}

// The bootstrap server counts the router's GET /query calls; a decode
// engine asks once per bootstrap server and keeps the answer, as
// upstream's decode does.
func TestMooncakeVLLMBootstrapQueries(t *testing.T) {
	p, d := mooncakePair(t, Config{}, time.Minute)
	for i := range 3 {
		rid := "req-" + itoa(i)
		client := chatBody("query "+rid).with("max_tokens", 3)
		post(t, p, "/v1/chat/completions", rid, mooncakePrefill(client, rid)).decode(t)
		requireDecodePulled(t, d, p, post(t, d, "/v1/chat/completions", rid, mooncakeDecode(client, p, rid)), client, false, wantText(t, client))
	}
	mp := p.proto.(*mooncakeProtocol)
	mp.mu.Lock()
	require.Equal(t, 1, mp.engineQueries, "the decode engine asked once")
	mp.mu.Unlock()
	require.Zero(t, p.BootstrapQueries(), "the decode engine's query is not the router's")

	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, "http://127.0.0.1:"+strconv.Itoa(p.BootstrapPort())+"/query", nil)
	require.NoError(t, err)
	for range 2 {
		require.Equal(t, http.StatusOK, do(t, req).status)
	}
	require.Equal(t, 2, p.BootstrapQueries())
	require.Equal(t, 2, p.State().BootstrapQueries)
	require.Equal(t, 3, p.State().KVPulled)
}

func TestMooncakeVLLMHandoff(t *testing.T) {
	for _, api := range bothAPIs {
		for _, stream := range []bool{false, true} {
			t.Run(api.name+streamName(stream), func(t *testing.T) {
				p, d := mooncakePair(t, Config{PrefillLatency: 30 * time.Millisecond}, time.Minute)
				client := api.body.streaming(stream)
				path := pathFor(client)
				fp := Fingerprint(promptOf(t, client))

				// pdx fires the prefill and hands the decode to Envoy at once.
				pc := goPost(t, p, path, "req-1", mooncakePrefill(client, "req-1"))
				dc := goPost(t, d, path, "req-1", mooncakeDecode(client, p, "req-1"))
				pr, dr := await(t, pc), await(t, dc)

				require.Equal(t, "pdx-sim:"+fp, pr.decode(t).text())
				requireDecodePulled(t, d, p, dr, client, stream, wantText(t, client))
				requireRecordsAnyOrder(t, p,
					Record{RequestID: "req-1", Path: path, Kind: KindPrefill, Fingerprint: fp, Status: 200},
					Record{RequestID: "req-1", Path: "/sim/kv/transfer", Kind: KindKVPull, Fingerprint: fp, Status: 200})
			})
		}
	}
}

func TestMooncakeVLLMDecodeBeforePrefill(t *testing.T) {
	p, d := mooncakePair(t, Config{}, time.Minute)
	client := completionBody("late prefill").with("max_tokens", 3)
	dc := goPost(t, d, "/v1/completions", "req-1", mooncakeDecode(client, p, "req-1"))
	waitForWaiters(t, p.proto.(*mooncakeProtocol).transfers)
	require.Equal(t, 1, d.HeldSlots(), "the scheduled decode holds its blocks while it waits")
	post(t, p, "/v1/completions", "req-1", mooncakePrefill(client, "req-1")).decode(t)
	requireDecodePulled(t, d, p, await(t, dc), client, false, wantText(t, client))
}

// A client may reuse its request id once the earlier request is done; the
// decode of the reuse may even reach the prefill's worker before the reused
// prefill has registered its KV.
func TestMooncakeVLLMRequestIDReuse(t *testing.T) {
	p, d := mooncakePair(t, Config{}, time.Minute)
	for i, text := range []string{"first", "second", "third"} {
		client := chatBody(text).with("max_tokens", 3)
		if i == 2 {
			dc := goPost(t, d, "/v1/chat/completions", "req-1", mooncakeDecode(client, p, "req-1"))
			waitForWaiters(t, p.proto.(*mooncakeProtocol).transfers)
			post(t, p, "/v1/chat/completions", "req-1", mooncakePrefill(client, "req-1")).decode(t)
			requireDecodePulled(t, d, p, await(t, dc), client, false, wantText(t, client))
			continue
		}
		post(t, p, "/v1/chat/completions", "req-1", mooncakePrefill(client, "req-1")).decode(t)
		r := post(t, d, "/v1/chat/completions", "req-1", mooncakeDecode(client, p, "req-1"))
		requireDecodePulled(t, d, p, r, client, false, wantText(t, client))
	}
}

func TestMooncakeVLLMUpstreamProxyLimits(t *testing.T) {
	// Upstream's proxy sets max_tokens and, when present, max_completion_tokens to 1.
	p, d := mooncakePair(t, Config{}, time.Minute)
	client := chatBody("both limits").with("max_completion_tokens", 3)
	prefill := mooncakePrefill(client, "req-1").with("max_tokens", 1, "max_completion_tokens", 1)
	post(t, p, "/v1/chat/completions", "req-1", prefill).decode(t)
	r := post(t, d, "/v1/chat/completions", "req-1", mooncakeDecode(client, p, "req-1"))
	requireDecodePulled(t, d, p, r, client, false, wantText(t, client))
}

func TestMooncakeVLLMDecodeFailures(t *testing.T) {
	const prompt = "What is a transfer id?"
	prefilled := func(t *testing.T, p *Server, b body) {
		t.Helper()
		post(t, p, "/v1/chat/completions", "req-1", mooncakePrefill(b, "req-1")).decode(t)
	}
	tests := []struct {
		name    string
		run     func(t *testing.T, p, d *Server) (string, body) // request id and decode body
		status  int
		wantMsg string
	}{
		{
			name: "no prefill in time",
			run: func(_ *testing.T, p, _ *Server) (string, body) {
				return "req-1", mooncakeDecode(chatBody(prompt), p, "req-1")
			},
			status:  http.StatusGatewayTimeout,
			wantMsg: "no prefill registered KV for transfer_id xfer-req-1 within 200ms",
		},
		{
			name: "no prefill in time, streaming",
			run: func(_ *testing.T, p, _ *Server) (string, body) {
				return "req-1", mooncakeDecode(chatBody(prompt).streaming(true), p, "req-1")
			},
			status:  http.StatusGatewayTimeout,
			wantMsg: "no prefill registered KV for transfer_id xfer-req-1",
		},
		{
			name: "wrong prompt",
			run: func(t *testing.T, p, _ *Server) (string, body) {
				prefilled(t, p, chatBody("another prompt"))
				return "req-1", mooncakeDecode(chatBody(prompt), p, "req-1")
			},
			status:  http.StatusBadRequest,
			wantMsg: "KV of transfer_id xfer-req-1 holds a different prompt",
		},
		{
			name: "transfer consumed",
			run: func(t *testing.T, p, d *Server) (string, body) {
				prefilled(t, p, chatBody(prompt))
				b := mooncakeDecode(chatBody(prompt), p, "req-1")
				post(t, d, "/v1/chat/completions", "req-1", b).decode(t)
				return "req-1", b
			},
			status:  http.StatusConflict,
			wantMsg: `KV of transfer_id xfer-req-1 was already taken by request "req-1"`,
		},
		{
			name: "wrong engine id",
			run: func(t *testing.T, p, _ *Server) (string, body) {
				prefilled(t, p, chatBody(prompt))
				return "req-1", mooncakeDecodeWith(chatBody(prompt), p, "req-1", "remote_engine_id", "someone-else")
			},
			status:  http.StatusBadRequest,
			wantMsg: `remote_engine_id mismatch: the Mooncake bootstrap server at 127.0.0.1:`,
		},
		{
			name: "transfer id of another request",
			run: func(t *testing.T, p, _ *Server) (string, body) {
				prefilled(t, p, chatBody(prompt))
				return "req-2", mooncakeDecode(chatBody(prompt), p, "req-1")
			},
			status:  http.StatusBadRequest,
			wantMsg: `transfer_id must be "xfer-req-2" ("xfer-" + X-Request-Id), got "xfer-req-1"`,
		},
		{
			name: "bootstrap server not listening",
			run: func(t *testing.T, p, _ *Server) (string, body) {
				return "req-1", mooncakeDecodeWith(chatBody(prompt), p, "req-1", "remote_bootstrap_addr", "http://127.0.0.1:"+strconv.Itoa(closedPort(t)))
			},
			status:  http.StatusBadRequest,
			wantMsg: "querying the Mooncake bootstrap server at 127.0.0.1:",
		},
		{
			name: "bootstrap address without scheme",
			run: func(_ *testing.T, p, _ *Server) (string, body) {
				return "req-1", mooncakeDecodeWith(chatBody(prompt), p, "req-1", "remote_bootstrap_addr", "127.0.0.1:8998")
			},
			status:  http.StatusBadRequest,
			wantMsg: `remote_bootstrap_addr must be "http://<host>:<port>", got "127.0.0.1:8998"`,
		},
		{
			name: "missing engine id",
			run: func(_ *testing.T, p, _ *Server) (string, body) {
				return "req-1", mooncakeDecodeWith(chatBody(prompt), p, "req-1", "remote_engine_id", nil)
			},
			status:  http.StatusBadRequest,
			wantMsg: "kv_transfer_params.remote_engine_id is missing",
		},
		{
			name: "leaked bootstrap_room",
			run: func(_ *testing.T, p, _ *Server) (string, body) {
				return "req-1", mooncakeDecode(chatBody(prompt), p, "req-1").with("bootstrap_room", 1)
			},
			status:  http.StatusBadRequest,
			wantMsg: "bootstrap_room is not part of the mooncake (vllm) protocol",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, d := mooncakePair(t, Config{}, 200*time.Millisecond)
			rid, b := tt.run(t, p, d)
			requireRejected(t, d, post(t, d, "/v1/chat/completions", rid, b), tt.status, tt.wantMsg)
		})
	}
}

// mooncakeDecodeWith is a decode leg with one kv_transfer_params member
// changed (nil deletes it).
func mooncakeDecodeWith(client body, p *Server, rid, key string, value any) body {
	b := mooncakeDecode(client, p, rid)
	kv := body(b["kv_transfer_params"].(map[string]any)).with(key, value)
	return b.with("kv_transfer_params", map[string]any(kv))
}

func TestMooncakeVLLMPrefillFailures(t *testing.T) {
	good := mooncakePrefill(chatBody("hi"), "req-1")
	kv := func(key string, value any) body {
		return good.with("kv_transfer_params", map[string]any(body(good["kv_transfer_params"].(map[string]any)).with(key, value)))
	}
	tests := []struct {
		name    string
		role    Role
		rid     string
		body    body
		status  int
		wantMsg string
	}{
		// A limit other than 1 and streaming are vLLM's to serve
		// (TestVLLMPrefillLegs); min_tokens above the limit is vLLM's refusal.
		{name: "min_tokens above the limit", body: good.with("min_tokens", 2), status: 400, wantMsg: "min_tokens must be less than or equal to max_tokens=1, got 2."},
		{name: "no transfer id", body: kv("transfer_id", nil), status: 400, wantMsg: `transfer_id is missing (want "xfer-req-1")`},
		{name: "foreign transfer id", body: kv("transfer_id", "xfer-other"), status: 400, wantMsg: `got "xfer-other"`},
		{name: "missing request id", rid: "-", body: good, status: 400, wantMsg: "missing X-Request-Id"},
		{name: "decode fields set", body: kv("remote_engine_id", "x"), status: 400, wantMsg: "kv_transfer_params.remote_engine_id must be absent"},
		{name: "decode role", role: RoleDecode, body: good, status: 400, wantMsg: "engine is a KV consumer (role decode)"},
		{name: "prefill role gets a decode", role: RolePrefill, body: chatBody("hi").with("kv_transfer_params", map[string]any{"do_remote_prefill": true}),
			status: 400, wantMsg: "engine is a KV producer (role prefill)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			role := tt.role
			if role == "" {
				role = RolePrefill
			}
			rid := tt.rid
			switch rid {
			case "":
				rid = "req-1"
			case "-":
				rid = ""
			}
			s := startSim(t, Config{Role: role, Connector: ConnectorMooncake, MooncakeProtocol: MooncakeVLLM})
			requireRejected(t, s, post(t, s, "/v1/chat/completions", rid, tt.body), tt.status, tt.wantMsg)
		})
	}
	t.Run("transfer id reused", func(t *testing.T) {
		s := startSim(t, Config{Role: RolePrefill, Connector: ConnectorMooncake, MooncakeProtocol: MooncakeVLLM})
		post(t, s, "/v1/chat/completions", "req-1", good).decode(t)
		requireRejected(t, s, post(t, s, "/v1/chat/completions", "req-1", good), http.StatusConflict, "transfer_id xfer-req-1 is already in use")
	})
}

func TestMooncakeNIXLFlavour(t *testing.T) {
	// Mooncake's "nixl" flavour is the NIXL protocol.
	p := startSim(t, Config{Role: RolePrefill, Connector: ConnectorMooncake, EngineID: "prefill-engine"})
	d := startSim(t, Config{Role: RoleDecode, Connector: ConnectorMooncake, MooncakeProtocol: MooncakeNIXL})
	require.Zero(t, p.BootstrapPort())
	b := chatBody("nixl over mooncake").with("max_tokens", 3)
	kv := prefill(t, p, "req-1", b)
	r := post(t, d, "/v1/chat/completions", "req-1", b.with("kv_transfer_params", kv))
	requireDecodePulled(t, d, p, r, b, false, wantText(t, b))

	var raw map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(marshal(t, kv), &raw))
	require.Contains(t, raw, "remote_block_ids")
}
