package e2e

import (
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// A prefill engine's answer cannot steer the decode's KV pull: pdx passes
// on only a KV source that is the engine it called (or one the pool
// allows), and answers anything else with 502 without a decode.
func TestKVSourceFromThePrefillAnswer(t *testing.T) {
	for _, connector := range []string{"nixl", "mooncake"} {
		t.Run(connector, func(t *testing.T) {
			st := startStack(t, stack.Options{Connector: connector, Prefill: 1, Decode: 1, PoolYAML: "prefill_attempts: 1",
				Tune: func(role enginesim.Role, _ int, c *enginesim.Config) {
					if role == enginesim.RolePrefill {
						c.TamperKVParams = json.RawMessage(`{"remote_host":"203.0.113.66","remote_port":9901,"extra":1}`)
					}
				}})
			_, hc := newClient(t, st)
			a := post(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"steer me","max_tokens":2}`)
			requireAPIError(t, a, 502, "bad_prefill_answer", `KV source host "203.0.113.66"`)
			require.Empty(t, st.Decode[0].Records(), "nothing reached the decode engine")
		})
	}

}

// The prefill's output limit is 1 as vLLM reads it on every path: on
// /v1/completions vLLM reads only max_tokens, so a client's
// max_completion_tokens must not leave it at vLLM's default of 16.
func TestPrefillOutputLimit(t *testing.T) {
	st := startStack(t, stack.Options{Prefill: 1, Decode: 1})
	_, hc := newClient(t, st)
	for _, tc := range []struct{ path, body, prompt string }{
		{"/v1/completions", `{"model":"demo-model","prompt":"limit a","max_completion_tokens":5}`, "limit a"},
		{"/v1/chat/completions", `{"model":"demo-model","messages":[{"role":"user","content":"limit b"}],"max_completion_tokens":5,"max_tokens":7}`, chatPrompt("limit b")},
		{"/v1/chat/completions", `{"model":"demo-model","messages":[{"role":"user","content":"limit c"}],"max_tokens":5}`, chatPrompt("limit c")},
	} {
		a := post(t, hc, st.URL()+tc.path, tc.body)
		require.Equal(t, 200, a.status, a.body)
		requireHandoff(t, st, tc.prompt)
	}
}

// Engines never see a client's X-Request-Id: clients that send the same
// id at once get their own answers, each engine request has a fresh id,
// and each client gets its own id back.
func TestEngineRequestIDs(t *testing.T) {
	for _, connector := range []string{"nixl", "http", "trtllm"} {
		t.Run(connector, func(t *testing.T) {
			st := startStack(t, stack.Options{Connector: connector, Prefill: 1, Decode: 1})
			_, hc := newClient(t, st)
			const n = 16
			var wg sync.WaitGroup
			answers := make([]answer, n)
			for i := range n {
				wg.Go(func() {
					answers[i] = post(t, hc, st.URL()+"/v1/completions",
						fmt.Sprintf(`{"model":"demo-model","prompt":"same id %d","max_tokens":2}`, i), "X-Request-Id", "one-id-for-all")
				})
			}
			wg.Wait()
			seen := map[string]bool{}
			for i, a := range answers {
				require.Equal(t, 200, a.status, a.body)
				require.Contains(t, a.body, wantPrefix(fmt.Sprintf("same id %d", i)))
				require.Equal(t, "one-id-for-all", a.header.Get("X-Request-Id"))
				fp := enginesim.Fingerprint(fmt.Sprintf("same id %d", i))
				recs := recordsWhere(st, func(r enginesim.Record) bool { return r.Fingerprint == fp })
				require.Len(t, recs["prefill"], 1)
				id := recs["prefill"][0].RequestID
				require.NotEqual(t, "one-id-for-all", id)
				require.False(t, seen[id], "engine request id %s reused", id)
				seen[id] = true
				requireOneHandoff(t, st, fp, recs)
			}
		})
	}
}

// OpenAI clients send null for the options they leave unset: pdx reads
// null as absent, and engines get such members left out (SGLang refuses
// "stream": null, vLLM's completions refuse "n": null).
func TestNullOptionals(t *testing.T) {
	for _, connector := range []string{"nixl", "sglang"} {
		t.Run(connector, func(t *testing.T) {
			st := startStack(t, stack.Options{Connector: connector, Prefill: 1, Decode: 1})
			_, hc := newClient(t, st)
			a := post(t, hc, st.URL()+"/v1/completions",
				`{"model":"demo-model","prompt":"nulls","stream":null,"stream_options":null,"max_tokens":null,"max_completion_tokens":null,"n":null,"temperature":null}`)
			require.Equal(t, 200, a.status, a.body)
			requireHandoff(t, st, "nulls")
			a = post(t, hc, st.URL()+"/v1/chat/completions",
				`{"model":"demo-model","messages":[{"role":"user","content":"chat nulls"}],"stream":null,"max_tokens":null,"n":null}`)
			require.Equal(t, 200, a.status, a.body)
			requireHandoff(t, st, chatPrompt("chat nulls"))
		})
	}
}

// vllm-router's request shape: the bodies vLLM's own router sends engines
// (its defaults such as no_stop_trim and return_hidden_states, min_tokens 1,
// and on its prefill leg kv_transfer_params) come through Envoy and pdx as
// a client's, on every connector whose engines are vLLM's. The engines
// accept them, the hand-off is pdx's own (a client's kv_transfer_params are
// stripped), the prefill never gets a minimum above its limit of 1 (vLLM
// refuses min_tokens > max_tokens), and the decode gets the client's
// fields.
func TestVLLMRouterRequestShape(t *testing.T) {
	const routerFields = `"logprobs":false,"no_stop_trim":false,"ignore_eos":false,"skip_special_tokens":true,` +
		`"separate_reasoning":true,"stream_reasoning":true,"return_hidden_states":false,"include_reasoning":true`
	const prefillKV = `"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,` +
		`"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`
	for _, cc := range connectorCases(t) {
		if cc.opts.Connector == "sglang" || cc.opts.Connector == "trtllm" {
			continue // not vLLM's engines
		}
		t.Run(cc.name, func(t *testing.T) {
			opts := cc.opts
			opts.Prefill, opts.Decode = 1, 1
			st := startStack(t, opts)
			_, hc := newClient(t, st)
			for _, tc := range []struct {
				name, path, body, prompt string
				minTokens                int
			}{
				{"decode leg, chat", "/v1/chat/completions",
					`{"model":"demo-model","messages":[{"role":"user","content":"router decode"}],"stream":false,"max_tokens":5,"continue_final_message":false,` + routerFields + `,"min_tokens":1}`,
					chatPrompt("router decode"), 1},
				{"prefill leg, chat", "/v1/chat/completions",
					`{"model":"demo-model","messages":[{"role":"user","content":"router prefill"}],"stream":false,"max_tokens":1,"continue_final_message":false,` + routerFields + `,"min_tokens":1,` + prefillKV + `}`,
					chatPrompt("router prefill"), 1},
				{"streamed completion, minimum above the prefill's limit", "/v1/completions",
					`{"model":"demo-model","prompt":"router stream","stream":true,"max_tokens":6,` + routerFields + `,"min_tokens":3}`,
					"router stream", 3},
			} {
				a := post(t, hc, st.URL()+tc.path, tc.body)
				require.Equal(t, 200, a.status, "%s: %s", tc.name, a.body)
				require.Contains(t, a.body, wantPrefix(tc.prompt), tc.name)
				requireHandoff(t, st, tc.prompt)

				recs := recordsWhere(st, func(r enginesim.Record) bool { return r.Fingerprint == enginesim.Fingerprint(tc.prompt) })
				var prefill, decode map[string]any
				require.NoError(t, json.Unmarshal(recs["prefill"][0].Body, &prefill), tc.name)
				require.NoError(t, json.Unmarshal(recs["decode"][0].Body, &decode), tc.name)
				if m, ok := prefill["min_tokens"]; ok {
					require.LessOrEqual(t, m.(float64), 1.0, "%s: prefill min_tokens above its limit", tc.name)
				}
				require.Equal(t, float64(tc.minTokens), decode["min_tokens"], tc.name)
				require.Equal(t, false, decode["no_stop_trim"], "%s: the decode gets the client's fields", tc.name)
				if kv, ok := decode["kv_transfer_params"].(map[string]any); ok {
					require.NotEqual(t, true, kv["do_remote_decode"], "%s: the client's kv_transfer_params reached the decode", tc.name)
				}
			}
		})
	}
}

// Envoy closes an idle connection to a decode engine before the engine
// does (its 4 s against the engines' keep-alive of 5 s, uvicorn's), so
// it never sends a request on a connection the engine is closing; and
// the next request, on a new connection, is served.
func TestDecodeConnectionsCloseBeforeTheEngines(t *testing.T) {
	st := startStack(t, stack.Options{Prefill: 1, Decode: 1})
	_, hc := newClient(t, st)
	const body = `{"model":"demo-model","prompt":"keep alive","max_tokens":2}`
	a := post(t, hc, st.URL()+"/v1/completions", body)
	require.Equal(t, 200, a.status, a.body)
	admin := st.Envoy.AdminAddr()
	require.Eventually(t, func() bool {
		n, err := envoyStat(admin, "cluster.pdx_decode.upstream_cx_idle_timeout")
		return err == nil && n == 1
	}, 10*time.Second, 100*time.Millisecond, "Envoy closed its idle connection to the decode engine")
	require.Zero(t, envoyCounter(t, admin, "cluster.pdx_decode.upstream_cx_destroy_remote"), "the engine closed none first")
	a = post(t, hc, st.URL()+"/v1/completions", body)
	require.Equal(t, 200, a.status, a.body)
	require.Equal(t, 2, envoyCounter(t, admin, "cluster.pdx_decode.upstream_cx_total"))
}
