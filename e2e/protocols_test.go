package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// TensorRT-LLM's current disagg server sends a disagg_request_id on both
// legs and hands the generation server the context's usage and prompt
// token ids; a legacy server refuses those, and a pool says which it has.
func TestTRTLLMProtocols(t *testing.T) {
	for _, tc := range []struct {
		name     string
		legacy   bool // the engines are a legacy server
		poolYAML string
		status   int
	}{
		{name: "current", status: 200},
		{name: "legacy engines, legacy pool", legacy: true, poolYAML: "trtllm_protocol: legacy", status: 200},
		// What the setting is for: a legacy server refuses the members it
		// does not know (extra="forbid").
		{name: "legacy engines, current pool", legacy: true, poolYAML: "prefill_attempts: 1", status: 400},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := startStack(t, stack.Options{Connector: "trtllm", Prefill: 1, Decode: 1, PoolYAML: tc.poolYAML,
				Engine: enginesim.Config{TRTLLMLegacy: tc.legacy}})
			_, hc := newClient(t, st)
			for _, path := range []string{"/v1/completions", "/v1/chat/completions"} {
				text := tc.name + " " + path
				body, prompt := fmt.Sprintf(`{"model":"demo-model","prompt":%q,"max_tokens":3}`, text), text
				if path == "/v1/chat/completions" {
					body, prompt = fmt.Sprintf(`{"model":"demo-model","messages":[{"role":"user","content":%q}],"max_tokens":3}`, text), chatPrompt(text)
				}
				a := post(t, hc, st.URL()+path, body)
				require.Equal(t, tc.status, a.status, a.body)
				if tc.status != 200 {
					require.Contains(t, a.body, "disagg_request_id")
					continue
				}
				require.Contains(t, a.body, wantPrefix(prompt))
				requireHandoff(t, st, prompt)
				fp := enginesim.Fingerprint(prompt)
				recs := recordsWhere(st, func(r enginesim.Record) bool { return r.Fingerprint == fp })
				var gen struct {
					Prompt              json.RawMessage
					PromptTokenIDs      []int                      `json:"prompt_token_ids"`
					DisaggregatedParams map[string]json.RawMessage `json:"disaggregated_params"`
				}
				require.NoError(t, json.Unmarshal(recs["decode"][0].Body, &gen))
				if tc.legacy {
					require.NotContains(t, gen.DisaggregatedParams, "disagg_request_id")
					require.NotContains(t, gen.DisaggregatedParams, "ctx_usage")
					continue
				}
				require.Contains(t, gen.DisaggregatedParams, "disagg_request_id")
				require.Contains(t, gen.DisaggregatedParams, "ctx_usage")
				if path == "/v1/completions" {
					require.Equal(t, byte('['), gen.Prompt[0], "the context's token ids replace the prompt")
				} else {
					require.NotEmpty(t, gen.PromptTokenIDs)
				}
			}
		})
	}
}

// A context answer that already finished the request is the client's
// answer (as upstream's disagg server returns it), with no generation
// request; a client that streams gets it as events with the text.
func TestTRTLLMFinishedContext(t *testing.T) {
	st := startStack(t, stack.Options{Connector: "trtllm", Prefill: 1, Decode: 1})
	_, hc := newClient(t, st)
	const text = "finished at once [sim:eos]"

	a := post(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"`+text+`","max_tokens":8}`, "X-Request-Id", "done-1")
	require.Equal(t, 200, a.status, a.body)
	require.Equal(t, "application/json", a.header.Get("Content-Type"))
	require.Equal(t, "done-1", a.header.Get("X-Request-Id"))
	var c struct {
		Choices []struct {
			Text         string
			FinishReason string `json:"finish_reason"`
		}
	}
	require.NoError(t, json.Unmarshal([]byte(a.body), &c), a.body)
	require.Len(t, c.Choices, 1)
	require.Equal(t, wantPrefix(text), c.Choices[0].Text)
	require.Equal(t, "stop", c.Choices[0].FinishReason)
	require.NotContains(t, a.body, "disaggregated_params")

	a = post(t, hc, st.URL()+"/v1/chat/completions",
		`{"model":"demo-model","messages":[{"role":"user","content":"`+text+`"}],"stream":true,"stream_options":{"include_usage":true}}`)
	require.Equal(t, 200, a.status, a.body)
	require.Equal(t, "text/event-stream", a.header.Get("Content-Type"))
	var content strings.Builder
	var events []string
	sc := bufio.NewScanner(strings.NewReader(a.body))
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		events = append(events, data)
		if data == "[DONE]" {
			continue
		}
		var chunk struct {
			Object  string
			Choices []struct{ Delta struct{ Content string } }
			Usage   *struct {
				CompletionTokens int `json:"completion_tokens"`
			}
		}
		require.NoError(t, json.Unmarshal([]byte(data), &chunk), data)
		require.Equal(t, "chat.completion.chunk", chunk.Object)
		for _, ch := range chunk.Choices {
			content.WriteString(ch.Delta.Content)
		}
	}
	require.Equal(t, wantPrefix(chatPrompt(text)), content.String())
	require.Len(t, events, 3, "the text, the usage, the end: %q", events)
	require.Equal(t, "[DONE]", events[2])

	require.Empty(t, st.Decode[0].Records(), "no generation request")
}

// pdx asks a Mooncake prefill's bootstrap server for its engine id once,
// not on every request.
func TestMooncakeEngineIDAskedOnce(t *testing.T) {
	st := startStack(t, stack.Options{Connector: "mooncake", MooncakeProtocol: "vllm", Prefill: 1, Decode: 1})
	_, hc := newClient(t, st)
	const n = 20
	for i := range n {
		a := post(t, hc, st.URL()+"/v1/completions", fmt.Sprintf(`{"model":"demo-model","prompt":"query %d","max_tokens":2}`, i))
		require.Equal(t, http.StatusOK, a.status, a.body)
		requireHandoff(t, st, fmt.Sprintf("query %d", i))
	}
	require.Equal(t, 1, st.Prefill[0].BootstrapQueries(), "one /query for %d requests", n)
}
