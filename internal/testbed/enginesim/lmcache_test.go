package enginesim

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"
)

// startStore runs a KV store for the duration of the test.
func startStore(t *testing.T) *Store {
	t.Helper()
	st, err := StartStore(t.Context(), "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, st.Close()) })
	return st
}

// lmcachePair is a prefill and a decode engine sharing a store.
func lmcachePair(t *testing.T, connector string) (p, d *Server) {
	t.Helper()
	st := startStore(t)
	p = startSim(t, Config{Role: RolePrefill, Connector: connector, StoreAddr: st.Addr()})
	d = startSim(t, Config{Role: RoleDecode, Connector: connector, StoreAddr: st.Addr()})
	return p, d
}

func TestLMCacheHandoff(t *testing.T) {
	for _, api := range bothAPIs {
		for _, stream := range []bool{false, true} {
			for _, connector := range []string{ConnectorHTTP, ConnectorLMCache} {
				t.Run(api.name+streamName(stream)+" "+connector, func(t *testing.T) {
					p, d := lmcachePair(t, connector)
					client := api.body.streaming(stream)
					path := pathFor(client)

					pr := post(t, p, path, "req-1", client.prefillEdits())
					require.Equal(t, "pdx-sim:"+Fingerprint(promptOf(t, client)), pr.decode(t).text())
					require.Empty(t, pr.header.Get(HeaderKV))

					dr := post(t, d, path, "req-1", client)
					requireDecodePulled(t, d, p, dr, client, stream, wantText(t, client))
					requireRecords(t, p, Record{RequestID: "req-1", Path: path, Kind: KindPrefill,
						Fingerprint: Fingerprint(promptOf(t, client)), Status: 200})
				})
			}
		}
	}
}

func streamName(stream bool) string {
	if stream {
		return " streaming"
	}
	return ""
}

func TestLMCacheMissRecomputes(t *testing.T) {
	const prompt = "What is LMCache?"
	tests := []struct {
		name   string
		before func(t *testing.T, p, d *Server) // runs before the decode of prompt
	}{
		{name: "no prefill", before: func(*testing.T, *Server, *Server) {}},
		{name: "another prompt prefilled", before: func(t *testing.T, p, _ *Server) {
			post(t, p, "/v1/chat/completions", "req-1", chatBody("another prompt").prefillEdits()).decode(t)
		}},
		{name: "KV already consumed", before: func(t *testing.T, p, d *Server) {
			post(t, p, "/v1/chat/completions", "req-1", chatBody(prompt).prefillEdits()).decode(t)
			r := post(t, d, "/v1/chat/completions", "req-1", chatBody(prompt))
			require.Equal(t, KVPulled, r.header.Get(HeaderKV))
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, d := lmcachePair(t, ConnectorHTTP)
			tt.before(t, p, d)
			r := post(t, d, "/v1/chat/completions", "req-1", chatBody(prompt).with("max_tokens", 2))
			require.Equal(t, KVRecomputed, r.header.Get(HeaderKV))
			require.Empty(t, r.header.Get(HeaderKVSource))
			require.Equal(t, "pdx-sim:"+Fingerprint("user: "+prompt+"\n")+" t1", r.decode(t).text())
			rec := lastRecord(t, d)
			require.Equal(t, KindDecode, rec.Kind)
			require.Equal(t, KVRecomputed, rec.KV)
			require.Empty(t, rec.KVSource)
		})
	}
}

func TestLMCachePrefersOwnRequest(t *testing.T) {
	p, d := lmcachePair(t, ConnectorHTTP)
	p2 := startSim(t, Config{Role: RolePrefill, Connector: ConnectorHTTP, StoreAddr: p.cfg.StoreAddr})
	b := chatBody("same prompt, two clients")
	post(t, p, "/v1/chat/completions", "req-1", b.prefillEdits()).decode(t)
	post(t, p2, "/v1/chat/completions", "req-2", b.prefillEdits()).decode(t)
	r := post(t, d, "/v1/chat/completions", "req-2", b)
	require.Equal(t, p2.Addr(), r.header.Get(HeaderKVSource), "the entry of the decode's own request wins")
	r = post(t, d, "/v1/chat/completions", "req-3", b)
	require.Equal(t, p.Addr(), r.header.Get(HeaderKVSource), "else any entry of the prompt hits")
}

func TestLMCacheRejections(t *testing.T) {
	good := chatBody("hi").prefillEdits()
	tests := []struct {
		name    string
		role    Role
		body    body
		status  int
		wantMsg string
	}{
		// vLLM's SamplingParams._verify_args; a limit other than 1 and
		// streaming are vLLM's to serve (TestVLLMPrefillLegs).
		{name: "prefill with min_tokens above its limit", role: RolePrefill, body: good.with("min_tokens", 2), status: 400,
			wantMsg: "min_tokens must be less than or equal to max_tokens=1, got 2."},
		{name: "leaked kv_transfer_params", role: RoleDecode,
			body: chatBody("hi").with("kv_transfer_params", map[string]any{"do_remote_prefill": true}), status: 400,
			wantMsg: "kv_transfer_params is not part of the http protocol"},
		{name: "leaked bootstrap fields", role: RolePrefill, body: good.with("bootstrap_room", 1, "bootstrap_host", "x"), status: 400,
			wantMsg: "bootstrap_host, bootstrap_room are not part of the http protocol"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st := startStore(t)
			s := startSim(t, Config{Role: tt.role, Connector: ConnectorHTTP, StoreAddr: st.Addr()})
			requireRejected(t, s, post(t, s, "/v1/chat/completions", "req-1", tt.body), tt.status, tt.wantMsg)
		})
	}
}

func TestLMCacheStoreDown(t *testing.T) {
	addr := "127.0.0.1:" + itoa(closedPort(t))
	p := startSim(t, Config{Role: RolePrefill, Connector: ConnectorHTTP, StoreAddr: addr})
	requireRejected(t, p, post(t, p, "/v1/chat/completions", "req-1", chatBody("hi").prefillEdits()),
		http.StatusBadGateway, "storing KV in the KV store at "+addr+" failed")
	d := startSim(t, Config{Role: RoleDecode, Connector: ConnectorHTTP, StoreAddr: addr})
	requireRejected(t, d, post(t, d, "/v1/chat/completions", "req-1", chatBody("hi").with("stream", true)),
		http.StatusBadGateway, "looking up KV in the KV store at "+addr+" failed")
}

func TestStoreAPI(t *testing.T) {
	st := startStore(t)
	s := startSim(t, Config{Connector: ConnectorHTTP, StoreAddr: st.Addr()})
	var got storeLookup
	take := func(rid string) storeLookup {
		t.Helper()
		got = storeLookup{}
		require.NoError(t, s.sideCall(t.Context(), s.client, "take", storeURL(st.Addr(), "fp", "/take"), "", storeTake{RequestID: rid}, &got))
		return got
	}
	require.False(t, take("a").Hit)
	var ok struct{}
	require.NoError(t, s.sideCall(t.Context(), s.client, "put", storeURL(st.Addr(), "fp", ""), "", storeEntry{Engine: "e", RequestID: "a"}, &ok))
	require.Equal(t, storeLookup{Hit: true, storeEntry: storeEntry{Engine: "e", RequestID: "a"}}, take("b"))
	require.False(t, take("a").Hit, "an entry is taken once")

	err := s.sideCall(t.Context(), s.client, "put", storeURL(st.Addr(), "fp", ""), "", map[string]any{"x": 1}, &ok)
	require.ErrorContains(t, err, "invalid store entry")
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, "http://"+st.Addr()+"/kv/fp", nil)
	require.NoError(t, err)
	r := do(t, req)
	r.errorMessage(t, http.StatusNotFound)
	require.NoError(t, st.Close())
	require.NoError(t, st.Close(), "Close is idempotent")
}
