package enginesim

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// p2pPair is a prefill and a decode engine; the decode waits at most wait.
func p2pPair(t *testing.T, wait time.Duration) (p, d *Server) {
	t.Helper()
	p = startSim(t, Config{Role: RolePrefill, Connector: ConnectorP2PNCCL})
	d = startSim(t, Config{Role: RoleDecode, Connector: ConnectorP2PNCCL, KVWaitTimeout: wait})
	return p, d
}

// p2pID is the request id of disagg_proxy_p2p_nccl_xpyd.py.
func p2pID(prefillKV, decodeKV string) string {
	return "___prefill_addr_" + prefillKV + "___decode_addr_" + decodeKV + "_" + randomHex(16)
}

func TestP2PHandoff(t *testing.T) {
	for _, api := range bothAPIs {
		for _, stream := range []bool{false, true} {
			t.Run(api.name+streamName(stream), func(t *testing.T) {
				p, d := p2pPair(t, time.Minute)
				require.NotEmpty(t, p.KVAddr())
				require.NotEqual(t, p.KVAddr(), d.KVAddr())
				client := api.body.streaming(stream)
				path, id := pathFor(client), p2pID(p.KVAddr(), d.KVAddr())
				fp := Fingerprint(promptOf(t, client))

				require.Equal(t, "pdx-sim:"+fp, post(t, p, path, id, client.prefillEdits()).decode(t).text())
				r := post(t, d, path, id, client)
				requireDecodePulled(t, d, p, r, client, stream, wantText(t, client))
				requireRecords(t, p, Record{RequestID: id, Path: path, Kind: KindPrefill, Fingerprint: fp, Status: 200})
				requireRecords(t, d,
					Record{RequestID: id, Path: "/sim/p2p/kv", Kind: KindKVPush, Fingerprint: fp, Status: 200},
					Record{RequestID: id, Path: path, Kind: KindDecode, Fingerprint: fp, Status: 200, KV: KVPulled, KVSource: p.Addr()})
			})
		}
	}
}

func TestP2PDecodeWaitsForKV(t *testing.T) {
	p, d := p2pPair(t, time.Minute)
	b := chatBody("decode first").with("max_tokens", 3)
	id := p2pID(p.KVAddr(), d.KVAddr())
	dc := goPost(t, d, "/v1/chat/completions", id, b)
	waitForWaiters(t, d.proto.(*p2pProtocol).received)
	post(t, p, "/v1/chat/completions", id, b.prefillEdits()).decode(t)
	requireDecodePulled(t, d, p, await(t, dc), b, false, wantText(t, b))
}

func TestP2PDecodeFailures(t *testing.T) {
	const prompt = "What is P2P NCCL?"
	tests := []struct {
		name    string
		run     func(t *testing.T, p, d *Server) (string, body) // request id and decode body
		status  int
		wantMsg string
	}{
		{
			name: "no KV in time",
			run: func(_ *testing.T, p, d *Server) (string, body) {
				return p2pID(p.KVAddr(), d.KVAddr()), chatBody(prompt)
			},
			status:  http.StatusGatewayTimeout,
			wantMsg: "within 200ms (no prefill at ",
		},
		{
			name: "no KV in time, streaming",
			run: func(_ *testing.T, p, d *Server) (string, body) {
				return p2pID(p.KVAddr(), d.KVAddr()), chatBody(prompt).streaming(true)
			},
			status:  http.StatusGatewayTimeout,
			wantMsg: "no KV arrived at KV listener 127.0.0.1:",
		},
		{
			name: "wrong prompt",
			run: func(t *testing.T, p, d *Server) (string, body) {
				id := p2pID(p.KVAddr(), d.KVAddr())
				post(t, p, "/v1/chat/completions", id, chatBody("another prompt").prefillEdits()).decode(t)
				return id, chatBody(prompt)
			},
			status:  http.StatusBadRequest,
			wantMsg: "holds a different prompt: prefilled prompt fingerprint " + Fingerprint("user: another prompt\n"),
		},
		{
			name: "KV consumed",
			run: func(t *testing.T, p, d *Server) (string, body) {
				id := p2pID(p.KVAddr(), d.KVAddr())
				post(t, p, "/v1/chat/completions", id, chatBody(prompt).prefillEdits()).decode(t)
				post(t, d, "/v1/chat/completions", id, chatBody(prompt)).decode(t)
				return id, chatBody(prompt)
			},
			status:  http.StatusConflict,
			wantMsg: "was already taken by request",
		},
		{
			name: "decode_addr of another engine",
			run: func(t *testing.T, p, _ *Server) (string, body) {
				return p2pID(p.KVAddr(), "127.0.0.1:1"), chatBody(prompt)
			},
			status:  http.StatusBadRequest,
			wantMsg: "decode_addr 127.0.0.1:1 in the request id is not this decode engine's KV address",
		},
		{
			name:    "malformed id",
			run:     func(*testing.T, *Server, *Server) (string, body) { return "req-1", chatBody(prompt) },
			status:  http.StatusBadRequest,
			wantMsg: `X-Request-Id "req-1" is not a P2P NCCL request id (want ___prefill_addr_<ip:port>___decode_addr_<ip:port>_<32 lowercase hex digits>)`,
		},
		{
			name:    "missing id",
			run:     func(*testing.T, *Server, *Server) (string, body) { return "", chatBody(prompt) },
			status:  http.StatusBadRequest,
			wantMsg: "missing X-Request-Id header: P2P NCCL names the engines' KV addresses in it",
		},
		{
			name: "leaked kv_transfer_params",
			run: func(_ *testing.T, p, d *Server) (string, body) {
				return p2pID(p.KVAddr(), d.KVAddr()), chatBody(prompt).with("kv_transfer_params", map[string]any{})
			},
			status:  http.StatusBadRequest,
			wantMsg: "kv_transfer_params is not part of the p2p-nccl protocol",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, d := p2pPair(t, 200*time.Millisecond)
			id, b := tt.run(t, p, d)
			requireRejected(t, d, post(t, d, "/v1/chat/completions", id, b), tt.status, tt.wantMsg)
		})
	}
}

func TestP2PPrefillFailures(t *testing.T) {
	good := chatBody("hi").prefillEdits()
	tests := []struct {
		name    string
		id      func(p, d *Server) string
		body    body
		status  int
		wantMsg string
	}{
		{name: "prefill_addr of another engine", id: func(_, d *Server) string { return p2pID(d.KVAddr(), d.KVAddr()) }, body: good,
			status: 400, wantMsg: "prefill_addr 127.0.0.1:"},
		{name: "decode KV listener not listening", id: func(p, _ *Server) string { return p2pID(p.KVAddr(), "127.0.0.1:1") }, body: good,
			status: http.StatusBadGateway, wantMsg: "sending KV to decode_addr 127.0.0.1:1 failed"},
		{name: "uuid not hex", id: func(p, d *Server) string {
			return "___prefill_addr_" + p.KVAddr() + "___decode_addr_" + d.KVAddr() + "_" + strings.Repeat("g", 32)
		}, body: good, status: 400, wantMsg: "is not a P2P NCCL request id"},
		// A limit other than 1 and streaming are vLLM's to serve
		// (TestVLLMPrefillLegs); min_tokens above the limit is vLLM's refusal.
		{name: "min_tokens above the limit", id: func(p, d *Server) string { return p2pID(p.KVAddr(), d.KVAddr()) }, body: good.with("min_tokens", 2),
			status: 400, wantMsg: "min_tokens must be less than or equal to max_tokens=1, got 2."},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, d := p2pPair(t, time.Second)
			requireRejected(t, p, post(t, p, "/v1/chat/completions", tt.id(p, d), tt.body), tt.status, tt.wantMsg)
		})
	}
	t.Run("KV sent to the wrong decode engine", func(t *testing.T) {
		p, d := p2pPair(t, 200*time.Millisecond)
		other := startSim(t, Config{Role: RoleDecode, Connector: ConnectorP2PNCCL})
		// The id names other as the decode, so the KV goes there; d is not it.
		id := p2pID(p.KVAddr(), other.KVAddr())
		post(t, p, "/v1/chat/completions", id, good).decode(t)
		requireRejected(t, d, post(t, d, "/v1/chat/completions", id, chatBody("hi")), 400, "is not this decode engine's KV address")
		require.Equal(t, KindKVPush, lastRecord(t, other).Kind)
	})
}

func TestP2PKVListener(t *testing.T) {
	p, d := p2pPair(t, time.Second)
	id := p2pID(p.KVAddr(), d.KVAddr())
	send := func(to *Server, kv p2pKV) error {
		var ok struct{}
		return p.sideCall(t.Context(), p.client, "send", "http://"+to.KVAddr()+"/sim/p2p/kv", "", kv, &ok)
	}
	require.ErrorContains(t, send(d, p2pKV{RequestID: id, Sender: "127.0.0.1:9", Fingerprint: "fp"}),
		"came from 127.0.0.1:9, not from its prefill_addr "+p.KVAddr())
	require.ErrorContains(t, send(d, p2pKV{RequestID: "x", Sender: p.KVAddr()}), "is not a P2P NCCL request id")
	require.ErrorContains(t, send(p, p2pKV{RequestID: id, Sender: p.KVAddr()}), "role prefill")
	require.NoError(t, send(d, p2pKV{RequestID: id, Sender: p.KVAddr(), Fingerprint: "fp"}))
	require.ErrorContains(t, send(d, p2pKV{RequestID: id, Sender: p.KVAddr(), Fingerprint: "fp"}), "already in use")
	require.Equal(t, http.StatusConflict, lastRecord(t, d).Status)
}

func TestP2PRoleBoth(t *testing.T) {
	a := startSim(t, Config{Connector: ConnectorP2PNCCL})
	b := startSim(t, Config{Connector: ConnectorP2PNCCL})
	client := completionBody("kv_both").with("max_tokens", 3)
	id := p2pID(a.KVAddr(), b.KVAddr())
	post(t, a, "/v1/completions", id, client.prefillEdits()).decode(t)
	requireDecodePulled(t, b, a, post(t, b, "/v1/completions", id, client), client, false, wantText(t, client))
	requireRejected(t, a, post(t, a, "/v1/completions", p2pID(a.KVAddr(), a.KVAddr()), client), 400, "neither or both of prefill_addr")
}
