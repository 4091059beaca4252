package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

type answer struct {
	status int
	header http.Header
	body   string
}

func post(t *testing.T, hc *http.Client, url, body string, headers ...string) answer {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	return do(t, hc, req)
}

func do(t *testing.T, hc *http.Client, req *http.Request) answer {
	t.Helper()
	resp, err := hc.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return answer{status: resp.StatusCode, header: resp.Header, body: string(b)}
}

// requireAPIError checks an OpenAI-style error answer.
func requireAPIError(t *testing.T, a answer, status int, code, msgPart string) {
	t.Helper()
	require.Equal(t, status, a.status, a.body)
	require.Equal(t, "application/json", a.header.Get("Content-Type"))
	var e struct {
		Error struct{ Message, Type, Code string } `json:"error"`
	}
	require.NoError(t, json.Unmarshal([]byte(a.body), &e), a.body)
	require.Equal(t, code, e.Error.Code, a.body)
	require.Contains(t, e.Error.Message, msgPart)
	require.NotEmpty(t, e.Error.Type)
}

func requireNoEngineTraffic(t *testing.T, st *stack.Stack) {
	t.Helper()
	for _, e := range st.Engines() {
		require.Empty(t, e.Records(), "engine %s was called", e.Addr())
	}
}

func TestRouting(t *testing.T) {
	st := startStack(t, stack.Options{})
	_, hc := newClient(t, st)
	chatURL := st.URL() + "/v1/chat/completions"

	t.Run("client cannot choose the decode endpoint", func(t *testing.T) {
		// Point the spoofed header at a prefill engine, which would happily
		// serve a plain request: it must see only its prefill.
		target := st.Prefill[0].Addr()
		for i := range 4 { // round robin must not matter
			text := fmt.Sprintf("spoof %d", i)
			a := post(t, hc, chatURL, `{"model":"demo-model","messages":[{"role":"user","content":"`+text+`"}],"max_tokens":2}`,
				"X-Gateway-Destination-Endpoint", target, "X-Envoy-Original-Dst-Host", target)
			require.Equal(t, 200, a.status, a.body)
			require.True(t, isEngine(st.Decode, a.header.Get("X-Pdx-Sim-Engine")), "answered by a decode engine")
			requireHandoff(t, st, chatPrompt(text))
		}
	})

	t.Run("client kv_transfer_params are replaced", func(t *testing.T) {
		fake := `{"do_remote_prefill":true,"remote_engine_id":"evil","remote_block_ids":[[1]],"remote_request_id":"x","remote_host":"127.0.0.1","remote_port":1}`
		a := post(t, hc, chatURL, `{"model":"demo-model","kv_transfer_params":`+fake+`,"messages":[{"role":"user","content":"inject"}]}`)
		require.Equal(t, 200, a.status, a.body)
		requireHandoff(t, st, chatPrompt("inject"))
	})

	t.Run("prefill finished on EOS: decode recomputes from the plain body", func(t *testing.T) {
		text := "short [sim:eos]"
		a := post(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"`+text+`","max_tokens":2}`)
		require.Equal(t, 200, a.status, a.body)
		require.Equal(t, "recomputed", a.header.Get("X-Pdx-Sim-Kv"))
		fp := enginesim.Fingerprint(text)
		recs := recordsWhere(st, func(r enginesim.Record) bool { return r.Fingerprint == fp })
		require.Len(t, recs["prefill"], 1)
		require.Len(t, recs["plain"], 1, "decode got a plain request: %v", recs)
		require.NotContains(t, string(recs["plain"][0].Body), "kv_transfer_params")
	})

	t.Run("chunked request body gets a content-length that fits the rewrite", func(t *testing.T) {
		// An io.Reader of unknown length makes Go send the body chunked.
		body := io.MultiReader(strings.NewReader(`{"model":"demo-model",`), strings.NewReader(`"prompt":"chunked"}`))
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, st.URL()+"/v1/completions", body)
		require.NoError(t, err)
		a := do(t, hc, req)
		require.Equal(t, 200, a.status, a.body)
		requireHandoff(t, st, "chunked")
	})

	t.Run("long prompt", func(t *testing.T) {
		text := strings.Repeat("long context ", 4<<20/13) // 4 MiB
		a := post(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"`+text+`","max_tokens":2}`)
		require.Equal(t, 200, a.status, a.body)
		require.Contains(t, a.body, wantPrefix(text))
		requireHandoff(t, st, text)
	})

	t.Run("requests pdx does not route pass through", func(t *testing.T) {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, st.URL()+"/v1/models", nil)
		require.NoError(t, err)
		a := do(t, hc, req)
		require.Equal(t, 200, a.status, a.body)
		require.Contains(t, a.body, `"object":"list"`)
	})

	for _, tc := range []struct {
		name, path, body, code, msg string
		status                      int
		headers                     []string
	}{
		{name: "invalid JSON", path: "/v1/chat/completions", body: `{"model":"demo-model",`, status: 400, code: "invalid_json"},
		{name: "missing model", path: "/v1/completions", body: `{"prompt":"x"}`, status: 400, code: "missing_model"},
		{name: "duplicate key", path: "/v1/completions", body: `{"model":"demo-model","prompt":"x","prompt":"y"}`, status: 400, code: "duplicate_key", msg: `"prompt"`},
		{name: "gzip body", path: "/v1/completions", body: `{}`, status: 415, code: "unsupported_content_encoding", headers: []string{"Content-Encoding", "gzip"}},
		{name: "empty body", path: "/v1/completions", body: ``, status: 400, code: "missing_body"},
		{name: "not an object", path: "/v1/completions", body: `["demo-model"]`, status: 400, code: "invalid_json", msg: "JSON object"},
		{name: "model not a string", path: "/v1/completions", body: `{"model":1,"prompt":"x"}`, status: 400, code: "invalid_type", msg: `"model"`},
		{name: "stream not a boolean", path: "/v1/completions", body: `{"model":"demo-model","prompt":"x","stream":"yes"}`, status: 400, code: "invalid_type", msg: `"stream"`},
		{name: "max_tokens not an integer", path: "/v1/completions", body: `{"model":"demo-model","prompt":"x","max_tokens":"8"}`, status: 400, code: "invalid_type", msg: `"max_tokens"`},
		{name: "messages not an array", path: "/v1/chat/completions", body: `{"model":"demo-model","messages":{"role":"user"}}`, status: 400, code: "invalid_type", msg: `"messages"`},
		{name: "empty messages", path: "/v1/chat/completions", body: `{"model":"demo-model","messages":[]}`, status: 400, code: "empty_messages"},
		{name: "n above 1", path: "/v1/chat/completions", body: `{"model":"demo-model","messages":[{"role":"user","content":"x"}],"n":3}`, status: 400, code: "unsupported_value", msg: `"n" is 3`},
		{name: "duplicated protocol key", path: "/v1/completions", body: `{"model":"demo-model","prompt":"x","kv_transfer_params":{},"kv_transfer_param\u0073":{}}`, status: 400, code: "duplicate_key", msg: "kv_transfer_params"},
	} {
		t.Run("bad input: "+tc.name, func(t *testing.T) {
			for _, e := range st.Engines() {
				e.Reset()
			}
			a := post(t, hc, st.URL()+tc.path, tc.body, tc.headers...)
			requireAPIError(t, a, tc.status, tc.code, tc.msg)
			requireNoEngineTraffic(t, st)
		})
	}
}

func TestWrongMethodAndBodyLimit(t *testing.T) {
	st := startStack(t, stack.Options{MaxBodyBytes: 64 << 10})
	_, hc := newClient(t, st)

	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, st.URL()+"/v1/chat/completions", nil)
	require.NoError(t, err)
	a := do(t, hc, req)
	requireAPIError(t, a, 405, "method_not_allowed", "use POST")
	require.Equal(t, "POST", a.header.Get("Allow"))

	big := `{"model":"demo-model","prompt":"` + strings.Repeat("x", 64<<10) + `"}`
	requireAPIError(t, post(t, hc, st.URL()+"/v1/completions", big), 413, "body_too_large", "over the limit of 65536")
	requireNoEngineTraffic(t, st)
}

func TestPrefillFailures(t *testing.T) {
	t.Run("engine down", func(t *testing.T) {
		st := startStack(t, stack.Options{Prefill: 1, Decode: 1})
		_, hc := newClient(t, st)
		addr := st.Prefill[0].Addr()
		require.NoError(t, st.Prefill[0].Close())
		a := post(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"x"}`)
		requireAPIError(t, a, 503, "prefill_unavailable", addr)
		require.Empty(t, st.Decode[0].Records(), "nothing reached decode")
	})

	t.Run("engine slower than prefill_timeout", func(t *testing.T) {
		st := startStack(t, stack.Options{Prefill: 1, Decode: 1, PrefillTimeout: 300 * time.Millisecond,
			Engine: enginesim.Config{PrefillLatency: 10 * time.Second}})
		_, hc := newClient(t, st)
		start := time.Now()
		a := post(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"x"}`)
		requireAPIError(t, a, 504, "prefill_timeout", "after 300ms")
		require.Less(t, time.Since(start), 5*time.Second, "the client is answered at the timeout, not when the engine finishes")
		require.Empty(t, st.Decode[0].Records(), "nothing reached decode")
	})
}

// A concurrent connector's decode is already on its way when its prefill
// fails. The client must get pdx's error at once, not wait on a decode that
// waits for KV that will never come.
func TestConcurrentPrefillFailures(t *testing.T) {
	for _, cc := range connectorCases(t) {
		spec, err := connectors.Lookup(cc.opts.Connector)
		require.NoError(t, err)
		if !spec.Traits(&configv1.Pool{Connector: cc.opts.Connector, MooncakeProtocol: cc.opts.MooncakeProtocol}).Concurrent {
			continue
		}
		t.Run(cc.name+": prefill engine down", func(t *testing.T) {
			opts := cc.opts
			opts.Prefill, opts.Decode = 1, 1
			st := startStack(t, opts)
			_, hc := newClient(t, st)
			addr := st.Prefill[0].Addr()
			require.NoError(t, st.Prefill[0].Close())
			for _, stream := range []bool{false, true} {
				start := time.Now()
				a := post(t, hc, st.URL()+"/v1/chat/completions",
					fmt.Sprintf(`{"model":"demo-model","messages":[{"role":"user","content":"down %v"}],"stream":%v}`, stream, stream))
				require.Equal(t, 503, a.status, a.body)
				require.Contains(t, a.body, addr)
				require.Less(t, time.Since(start), 10*time.Second, "answered when the prefill failed, not when the decode gave up")
			}
		})

		t.Run(cc.name+": prefill slower than prefill_timeout", func(t *testing.T) {
			opts := cc.opts
			opts.Prefill, opts.Decode = 1, 1
			opts.PrefillTimeout = 500 * time.Millisecond
			opts.Engine = enginesim.Config{PrefillLatency: 20 * time.Second}
			st := startStack(t, opts)
			_, hc := newClient(t, st)
			for _, stream := range []bool{false, true} {
				a := post(t, hc, st.URL()+"/v1/completions",
					fmt.Sprintf(`{"model":"demo-model","prompt":"slow %v","stream":%v}`, stream, stream))
				requireAPIError(t, a, 504, "prefill_timeout", "after 500ms")
			}
			// Envoy reset the decode when pdx answered, and pdx told the
			// decode engine to abort it: it was given up, never finished.
			require.Eventually(t, func() bool {
				var decodes int
				for _, r := range st.Decode[0].Records() {
					switch {
					case r.Kind == enginesim.KindAbort:
					case r.Kind == "decode" && r.KV == "pulled":
						return false
					default:
						decodes++
					}
				}
				return decodes == 2
			}, 10*time.Second, 20*time.Millisecond, "decode records: %v", st.Decode[0].Records())
		})
	}
}
