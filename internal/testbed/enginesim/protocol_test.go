package enginesim

import (
	"context"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/connectors"
)

func TestStartProtocolConfig(t *testing.T) {
	tests := []struct {
		name    string
		cfg     Config
		wantErr string
	}{
		{"unknown connector", Config{Connector: "ucx"}, `unknown connector "ucx" (want nixl, http, lmcache, mooncake, sglang, p2p-nccl, trtllm)`},
		{"unknown Mooncake protocol", Config{Connector: ConnectorMooncake, MooncakeProtocol: "rdma"}, `unknown Mooncake protocol "rdma"`},
		{"http without a store", Config{Connector: ConnectorHTTP}, `connector "http" needs StoreAddr`},
		{"lmcache without a store", Config{Connector: ConnectorLMCache}, `connector "lmcache" needs StoreAddr`},
		{"negative wait", Config{KVWaitTimeout: -time.Second}, "KVWaitTimeout must not be negative"},
		{"bad bootstrap address", Config{Connector: ConnectorSGLang, BootstrapAddr: "127.0.0.1:bad"}, "listen for bootstrap"},
		{"bad KV address", Config{Connector: ConnectorP2PNCCL, KVAddr: "127.0.0.1:bad"}, "listen for kv"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Start(t.Context(), "127.0.0.1:0", tt.cfg)
			require.ErrorContains(t, err, tt.wantErr)
		})
	}

	s := startSim(t, Config{})
	require.Equal(t, ConnectorNIXL, s.cfg.Connector)
	require.Equal(t, defaultKVWaitTimeout, s.cfg.KVWaitTimeout)
	require.Zero(t, s.BootstrapPort())
	require.Empty(t, s.KVAddr())
}

func TestSideListenersOnGivenAddresses(t *testing.T) {
	boot, kv := closedPort(t), closedPort(t)
	s := startSim(t, Config{Role: RolePrefill, Connector: ConnectorSGLang, BootstrapAddr: "127.0.0.1:" + strconv.Itoa(boot)})
	require.Equal(t, boot, s.BootstrapPort())
	m := startSim(t, Config{Role: RolePrefill, Connector: ConnectorMooncake, MooncakeProtocol: MooncakeVLLM})
	require.NotZero(t, m.BootstrapPort())
	p := startSim(t, Config{Connector: ConnectorP2PNCCL, KVAddr: "127.0.0.1:" + strconv.Itoa(kv)})
	require.Equal(t, "127.0.0.1:"+strconv.Itoa(kv), p.KVAddr())
	require.Zero(t, p.BootstrapPort())

	// Side listeners name their engine and answer in the OpenAI error shape.
	for _, url := range []string{
		"http://127.0.0.1:" + strconv.Itoa(boot) + "/sim/room",
		"http://" + p.KVAddr() + "/sim/p2p/kv",
	} {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, url, nil)
		require.NoError(t, err)
		r := do(t, req)
		r.errorMessage(t, http.StatusMethodNotAllowed)
		require.NotEmpty(t, r.header.Get(HeaderEngine))
	}
	require.Equal(t, http.StatusOK, get(t, s, "/health").status)
}

// TestCloseEndsWaits closes engines while a decode waits for KV: the wait
// ends at once and nothing leaks (goleak checks).
func TestCloseEndsWaits(t *testing.T) {
	t.Run("decode engine closes", func(t *testing.T) {
		p := startSim(t, Config{Role: RolePrefill, Connector: ConnectorSGLang})
		d, err := Start(t.Context(), "127.0.0.1:0", Config{Role: RoleDecode, Connector: ConnectorSGLang, KVWaitTimeout: time.Hour})
		require.NoError(t, err)
		dc := goPost(t, d, "/v1/chat/completions", "req-1", withRoom(chatBody("x"), p, 1))
		waitForWaiters(t, p.proto.(*sglangProtocol).rooms)
		require.NoError(t, d.Close())
		r := await(t, dc)
		require.Contains(t, r.errorMessage(t, http.StatusServiceUnavailable), "engine is shutting down")
	})
	t.Run("decode engine closes, streaming", func(t *testing.T) {
		p := startSim(t, Config{Role: RolePrefill, Connector: ConnectorSGLang})
		d, err := Start(t.Context(), "127.0.0.1:0", Config{Role: RoleDecode, Connector: ConnectorSGLang, KVWaitTimeout: time.Hour})
		require.NoError(t, err)
		dc := goPost(t, d, "/v1/chat/completions", "req-1", withRoom(chatBody("x").streaming(true), p, 1))
		waitForWaiters(t, p.proto.(*sglangProtocol).rooms)
		require.NoError(t, d.Close())
		requireStreamError(t, d, await(t, dc), http.StatusServiceUnavailable, "engine is shutting down")
	})
	t.Run("prefill engine closes", func(t *testing.T) {
		p, err := Start(t.Context(), "127.0.0.1:0", Config{Role: RolePrefill, Connector: ConnectorSGLang})
		require.NoError(t, err)
		d := startSim(t, Config{Role: RoleDecode, Connector: ConnectorSGLang, KVWaitTimeout: time.Hour})
		dc := goPost(t, d, "/v1/chat/completions", "req-1", withRoom(chatBody("x"), p, 1))
		waitForWaiters(t, p.proto.(*sglangProtocol).rooms)
		require.NoError(t, p.Close())
		requireRejected(t, d, await(t, dc), http.StatusServiceUnavailable, "failed with 503: engine is shutting down")
	})
	t.Run("p2p decode closes", func(t *testing.T) {
		d, err := Start(t.Context(), "127.0.0.1:0", Config{Role: RoleDecode, Connector: ConnectorP2PNCCL, KVWaitTimeout: time.Hour})
		require.NoError(t, err)
		dc := goPost(t, d, "/v1/chat/completions", p2pID("127.0.0.1:1", d.KVAddr()), chatBody("x"))
		waitForWaiters(t, d.proto.(*p2pProtocol).received)
		require.NoError(t, d.Close())
		require.Contains(t, await(t, dc).errorMessage(t, http.StatusServiceUnavailable), "engine is shutting down")
	})
}

// waitForWaiters waits until someone waits on h (its change channel is
// watched by a take).
func waitForWaiters(t *testing.T, h *handoffs) {
	t.Helper()
	require.Eventually(t, func() bool { return h.waiting() > 0 }, 5*time.Second, time.Millisecond)
}

func TestHandoffs(t *testing.T) {
	now := time.Now()
	a := kvAnswer{Fingerprint: "fp", RequestID: "r1", Source: "p"}
	t.Run("put and take once", func(t *testing.T) {
		h := newHandoffs("room", time.Minute)
		require.Nil(t, h.put("1", a, now))
		require.Equal(t, http.StatusConflict, h.put("1", a, now).status)
		got, err := h.take(t.Context(), "1", "d1", 0)
		require.NoError(t, err)
		require.Equal(t, a, got)
		_, err = h.take(t.Context(), "1", "d2", 10*time.Millisecond)
		require.ErrorContains(t, err, `KV of room 1 was already taken by request "d1" (and no prefill registered it again)`)
		require.Equal(t, http.StatusConflict, asAPIError(err).status)
		_, err = h.take(t.Context(), "1", "d2", 0)
		require.Equal(t, http.StatusConflict, asAPIError(err).status)

		// Ids need only be unique among requests in flight: a taken key may be used again.
		b := kvAnswer{Fingerprint: "fp2", RequestID: "r1", Source: "p"}
		require.Nil(t, h.put("1", b, now))
		got, err = h.take(t.Context(), "1", "d3", 0)
		require.NoError(t, err)
		require.Equal(t, b, got)
	})
	t.Run("a waiting take gets the key's next KV", func(t *testing.T) {
		h := newHandoffs("room", time.Minute)
		require.Nil(t, h.put("1", a, now))
		_, err := h.take(t.Context(), "1", "d1", 0)
		require.NoError(t, err)
		done := make(chan kvAnswer, 1)
		go func() {
			got, _ := h.take(t.Context(), "1", "d2", time.Hour)
			done <- got
		}()
		waitForWaiters(t, h)
		b := kvAnswer{Fingerprint: "fp2", RequestID: "r2", Source: "p"}
		require.Nil(t, h.put("1", b, time.Now()))
		require.Equal(t, b, <-done)
	})
	t.Run("unknown", func(t *testing.T) {
		h := newHandoffs("room", time.Minute)
		_, err := h.take(t.Context(), "1", "d1", 0)
		require.Equal(t, http.StatusNotFound, asAPIError(err).status)
		_, err = h.take(t.Context(), "1", "d1", 10*time.Millisecond)
		require.Equal(t, http.StatusGatewayTimeout, asAPIError(err).status)
		require.ErrorContains(t, err, "no prefill registered KV for room 1 within 10ms")
	})
	t.Run("waits for a put", func(t *testing.T) {
		h := newHandoffs("room", time.Minute)
		done := make(chan error, 1)
		go func() {
			_, err := h.take(t.Context(), "1", "d1", time.Hour)
			done <- err
		}()
		waitForWaiters(t, h)
		require.Nil(t, h.put("2", a, time.Now()), "another key does not end the wait")
		require.Nil(t, h.put("1", a, time.Now()))
		require.NoError(t, <-done)
	})
	t.Run("context ends the wait", func(t *testing.T) {
		h := newHandoffs("room", time.Minute)
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		_, err := h.take(ctx, "1", "d1", time.Hour)
		require.ErrorIs(t, err, context.Canceled)
	})
	t.Run("expiry", func(t *testing.T) {
		h := newHandoffs("room", time.Millisecond)
		require.Nil(t, h.put("1", a, now.Add(-time.Second)))
		_, err := h.take(t.Context(), "1", "d1", 0)
		require.Equal(t, http.StatusNotFound, asAPIError(err).status)
		require.Nil(t, h.put("1", a, now.Add(-time.Second)), "an expired key is free again")
		require.Nil(t, h.put("2", a, now))
		require.NotContains(t, h.entries, "1", "put sweeps expired entries")
	})
}

// TestPrefillLimit: a prefill leg generates up to its limit as vLLM reads
// it on its endpoint, like any request (vLLM has no prefill-only limit):
// chat reads max_completion_tokens, else max_tokens (a null one is absent);
// completions read only max_tokens, 16 when absent. Both keys may be
// present (vLLM's toy proxy sets both).
func TestPrefillLimit(t *testing.T) {
	chat, cmpl := chatBody("x"), completionBody("x")
	tests := []struct {
		name string
		body body
		want int
	}{
		{"chat, max_tokens 1", chat.with("max_tokens", 1), 1},
		{"chat, max_completion_tokens 1", chat.with("max_completion_tokens", 1), 1},
		{"chat, both 1", chat.with("max_tokens", 1, "max_completion_tokens", 1), 1},
		{"chat reads max_completion_tokens first", chat.with("max_completion_tokens", 1, "max_tokens", 5), 1},
		{"chat, max_completion_tokens 5 beats max_tokens 1", chat.with("max_completion_tokens", 5, "max_tokens", 1), 5},
		{"chat, null max_completion_tokens is absent", chat.with("max_completion_tokens", json.RawMessage("null"), "max_tokens", 2), 2},
		{"chat, no limit: the simulator's short default", chat, defaultMaxTokens},
		{"completions, max_tokens 1", cmpl.with("max_tokens", 1), 1},
		{"completions, both 1", cmpl.with("max_tokens", 1, "max_completion_tokens", 1), 1},
		{"completions ignore max_completion_tokens", cmpl.with("max_tokens", 1, "max_completion_tokens", 5), 1},
		{"completions, max_tokens 2", cmpl.with("max_tokens", 2, "max_completion_tokens", 1), 2},
		{"completions, only max_completion_tokens: 16", cmpl.with("max_completion_tokens", 1), 16},
		{"completions, null max_tokens: 16", cmpl.with("max_tokens", json.RawMessage("null")), 16},
		{"completions, no limit: 16", cmpl, 16},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := startSim(t, Config{Role: RolePrefill})
			resp := post(t, s, pathFor(tt.body), "req-1", tt.body.asPrefill().with("max_tokens", tt.body["max_tokens"])).decode(t)
			require.Equal(t, tt.want, resp.Usage.CompletionTokens)
			require.Equal(t, "length", resp.Choices[0].FinishReason)
			require.NotEqual(t, "null", string(resp.KVTransferParams), "a length-capped prefill hands off its KV")
			require.Equal(t, tt.want > 1, s.Tally().LongPrefill == 1)
		})
	}
}

// TestVLLMPrefillLegs: the prefill legs of the other vLLM connectors
// generate up to their limit and stream when asked, as vLLM does, and
// still hand off: LMCache and P2P NCCL move the KV as the prompt is
// computed, Mooncake's decode names the transfer itself. The engines count
// such prefills (Tally).
func TestVLLMPrefillLegs(t *testing.T) {
	client := chatBody("a prefill as vLLM serves it").with("max_tokens", 3)
	type legs struct {
		p, d           *Server
		rid            string
		prefill, dbody body
	}
	connectors := []struct {
		name string
		make func(t *testing.T) legs
	}{
		{"http", func(t *testing.T) legs {
			p, d := lmcachePair(t, ConnectorHTTP)
			return legs{p, d, "req-1", client.prefillEdits(), client}
		}},
		{"mooncake (vllm)", func(t *testing.T) legs {
			p, d := mooncakePair(t, Config{}, 5*time.Second)
			return legs{p, d, "req-1", mooncakePrefill(client, "req-1"), mooncakeDecode(client, p, "req-1")}
		}},
		{"p2p-nccl", func(t *testing.T) legs {
			p, d := p2pPair(t, 5*time.Second)
			return legs{p, d, p2pID(p.KVAddr(), d.KVAddr()), client.prefillEdits(), client}
		}},
	}
	edits := []struct {
		name   string
		edit   func(body) body
		tokens int
		stream bool
	}{
		{"limit 5", func(b body) body { return b.with("max_tokens", 5) }, 5, false},
		{"streamed", func(b body) body { return b.with("stream", true) }, 1, true},
		{"limit missing", func(b body) body { return b.with("max_tokens", nil) }, defaultMaxTokens, false},
	}
	for _, c := range connectors {
		for _, e := range edits {
			t.Run(c.name+", "+e.name, func(t *testing.T) {
				l := c.make(t)
				r := post(t, l.p, "/v1/chat/completions", l.rid, e.edit(l.prefill))
				want := strings.Join(outputTokens(Fingerprint(promptOf(t, client)), e.tokens), "")
				require.Equal(t, want, answerText(t, r, e.stream))
				require.Equal(t, Tally{LongPrefill: b2i(e.tokens > 1), StreamedPrefill: b2i(e.stream)}, l.p.Tally())
				requireDecodePulled(t, l.d, l.p, post(t, l.d, "/v1/chat/completions", l.rid, l.dbody), client, false, wantText(t, client))
			})
		}
	}
}

// TestSpeaksEveryConnector: every pdx connector with a prefill leg has a
// protocol here, so that the end-to-end tests run it against engines that
// check its hand-off. (Aggregated engines speak none.)
func TestSpeaksEveryConnector(t *testing.T) {
	for _, name := range connectors.Names() {
		spec, err := connectors.Lookup(name)
		require.NoError(t, err)
		pool := &configv1.Pool{Connector: name}
		if spec.Defaults != nil {
			spec.Defaults(pool)
		}
		if !spec.Traits(pool).Prefills {
			continue
		}
		require.Contains(t, Connectors(), name, "pdx connector %q has no simulator protocol: add its file here and its line in protocols (protocol.go)", name)
	}
}
