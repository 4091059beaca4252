package enginesim

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func responsesBody(input string) body {
	return body{"model": "m", "instructions": "be brief", "input": []any{map[string]any{"role": "user", "content": input}}}
}

func messagesBody(content string) body {
	return body{"model": "m", "max_tokens": 64, "system": []any{map[string]any{"type": "text", "text": "be brief"}},
		"messages": []any{map[string]any{"role": "user", "content": []any{map[string]any{"type": "text", "text": content}}}}}
}

// sseEvents splits an agent API's stream into its events' names and data.
func sseEvents(t *testing.T, raw []byte) ([]string, []map[string]any) {
	t.Helper()
	var names []string
	var data []map[string]any
	for _, ev := range strings.Split(strings.TrimSpace(string(raw)), "\n\n") {
		name, rest, ok := strings.Cut(ev, "\n")
		require.True(t, ok, "event %q", ev)
		name, ok = strings.CutPrefix(name, "event: ")
		require.True(t, ok, "event %q has no event line", ev)
		payload, ok := strings.CutPrefix(rest, "data: ")
		require.True(t, ok, "event %q has no data", ev)
		var d map[string]any
		require.NoError(t, json.Unmarshal([]byte(payload), &d))
		require.Equal(t, name, d["type"], "the event names its type")
		names, data = append(names, name), append(data, d)
	}
	return names, data
}

// Both agent APIs hand the KV over as vLLM 0.32 does: a one-token prefill
// with do_remote_decode answers kv_transfer_params at the top level, and a
// decode carrying them pulls the prompt's KV and answers in the API's own
// shape, streamed or not.
func TestAgentAPIsHandoff(t *testing.T) {
	for _, tc := range []struct {
		name, path string
		body       body
		limit      string // the API's output limit
		// prompt is the chat prompt both APIs render to.
		prompt string
	}{
		{"responses", "/v1/responses", responsesBody("hello"), "max_output_tokens", "system: be brief\nuser: hello\n"},
		{"messages", "/v1/messages", messagesBody("hello"), "max_tokens", "system: be brief\nuser: hello\n"},
	} {
		for _, stream := range []bool{false, true} {
			t.Run(tc.name+map[bool]string{false: "", true: "/stream"}[stream], func(t *testing.T) {
				p := startSim(t, Config{Role: RolePrefill, EngineID: "prefill-engine", PromptTokensDetails: true})
				d := startSim(t, Config{Role: RoleDecode, PromptTokensDetails: true})
				fp := Fingerprint(tc.prompt)
				pre := tc.body.with("stream", false, tc.limit, 1, "kv_transfer_params", map[string]any{"do_remote_decode": true})
				pr := post(t, p, tc.path, "req-1", pre)
				require.Equal(t, http.StatusOK, pr.status, "%s", pr.body)
				var answer map[string]any
				require.NoError(t, json.Unmarshal(pr.body, &answer))
				kv, ok := answer["kv_transfer_params"].(map[string]any)
				require.True(t, ok, "kv_transfer_params at the top level: %s", pr.body)
				require.Equal(t, true, kv["do_remote_prefill"])
				require.Zero(t, p.Tally().LongPrefill, "the prefill generated one token")

				dr := post(t, d, tc.path, "req-1", tc.body.with("stream", stream, tc.limit, 3, "kv_transfer_params", kv))
				require.Equal(t, http.StatusOK, dr.status, "%s", dr.body)
				require.Equal(t, KVPulled, dr.header.Get(HeaderKV))
				want := "pdx-sim:" + fp + " t1 t2"
				if !stream {
					require.Equal(t, "application/json", dr.header.Get("Content-Type"))
					var got map[string]any
					require.NoError(t, json.Unmarshal(dr.body, &got))
					if tc.name == "responses" {
						require.Equal(t, "response", got["object"])
						require.Equal(t, "incomplete", got["status"])
						require.Nil(t, got["kv_transfer_params"], "vLLM dumps every member, null ones too")
						require.Contains(t, got, "kv_transfer_params")
						item := got["output"].([]any)[0].(map[string]any)
						require.Equal(t, want, item["content"].([]any)[0].(map[string]any)["text"])
						u := got["usage"].(map[string]any)
						require.EqualValues(t, promptTokens(tc.prompt), u["input_tokens"])
						require.EqualValues(t, 0, u["input_tokens_details"].(map[string]any)["cached_tokens"],
							"vLLM 0.32 counts no KV pulled from a prefill as cached (the real-engine tier)")
						require.EqualValues(t, 3, u["output_tokens"])
					} else {
						require.Equal(t, "message", got["type"])
						require.Equal(t, "chatcmpl-req-1", got["id"])
						require.Equal(t, "max_tokens", got["stop_reason"])
						require.NotContains(t, got, "kv_transfer_params", "dumped without nulls")
						require.Equal(t, want, got["content"].([]any)[0].(map[string]any)["text"])
						u := got["usage"].(map[string]any)
						require.EqualValues(t, promptTokens(tc.prompt), u["input_tokens"],
							"Anthropic counts cached tokens apart, and vLLM 0.32 none pulled from a prefill")
						require.EqualValues(t, 0, u["cache_read_input_tokens"])
						require.EqualValues(t, 3, u["output_tokens"])
					}
					return
				}
				require.Equal(t, "text/event-stream", dr.header.Get("Content-Type"))
				names, data := sseEvents(t, dr.body)
				var text strings.Builder
				if tc.name == "responses" {
					require.Equal(t, []string{"response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
						"response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
						"response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"}, names)
					for i, d := range data {
						require.EqualValues(t, i, d["sequence_number"])
						if names[i] == "response.output_text.delta" {
							text.WriteString(d["delta"].(string))
						}
					}
					require.Nil(t, data[0]["response"].(map[string]any)["usage"])
					last := data[len(data)-1]["response"].(map[string]any)
					require.EqualValues(t, 3, last["usage"].(map[string]any)["output_tokens"])
				} else {
					require.Equal(t, []string{"message_start", "content_block_start", "content_block_delta", "content_block_delta", "content_block_delta",
						"content_block_stop", "message_delta", "message_stop"}, names)
					for i, d := range data {
						if names[i] == "content_block_delta" {
							text.WriteString(d["delta"].(map[string]any)["text"].(string))
						}
					}
					require.Equal(t, "max_tokens", data[6]["delta"].(map[string]any)["stop_reason"])
					require.EqualValues(t, 3, data[6]["usage"].(map[string]any)["output_tokens"])
				}
				require.Equal(t, want, text.String())
			})
		}
	}
}

// The same prompt in the two APIs' shapes renders to the same tokens (the
// chat template's), as vLLM's render endpoints do.
func TestAgentAPIsRender(t *testing.T) {
	s := startSim(t, Config{ChatTemplate: "<tmpl>"})
	var ids [][]any
	for path, b := range map[string]body{
		"/v1/chat/completions/render": {"model": "m", "messages": []any{map[string]any{"role": "system", "content": "be brief"}, map[string]any{"role": "user", "content": "hello"}}},
		"/v1/responses/render":        responsesBody("hello"),
		"/v1/messages/render":         messagesBody("hello"),
	} {
		r := post(t, s, path, "", b)
		require.Equal(t, http.StatusOK, r.status, "%s: %s", path, r.body)
		var g map[string]any
		require.NoError(t, json.Unmarshal(r.body, &g), "%s answers one object", path)
		ids = append(ids, g["token_ids"].([]any))
	}
	require.Equal(t, ids[0], ids[1])
	require.Equal(t, ids[0], ids[2])
}

// What vLLM 0.32 refuses of the agent APIs, as it refuses it.
func TestAgentAPIsRefused(t *testing.T) {
	for _, tc := range []struct {
		name, path string
		body       body
		status     int
		msg        string
	}{
		{"messages without max_tokens", "/v1/messages", messagesBody("x").with("max_tokens", nil), 400, "max_tokens: Field required"},
		{"messages max_tokens 0", "/v1/messages", messagesBody("x").with("max_tokens", 0), 400, "max_tokens must be positive"},
		{"messages role", "/v1/messages", messagesBody("x").with("messages", []any{map[string]any{"role": "tool", "content": "x"}}), 400, "role"},
		{"responses without input", "/v1/responses", body{"model": "m"}, 400, "input: Field required"},
		{"responses max_output_tokens 0", "/v1/responses", responsesBody("x").with("max_output_tokens", 0), 400, "max_tokens must be at least 1"},
		{"responses background", "/v1/responses", responsesBody("x").with("background", true), 400, "VLLM_ENABLE_RESPONSES_API_STORE"},
		{"responses background without store", "/v1/responses", responsesBody("x").with("background", true, "store", false), 400, "background can only be used when `store` is true"},
		{"responses previous_response_id", "/v1/responses", responsesBody("x").with("previous_response_id", "resp_1"), 404, "Response with id 'resp_1' not found."},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := startSim(t, Config{})
			requireRejected(t, s, post(t, s, tc.path, "req-1", tc.body), tc.status, tc.msg)
		})
	}
	// Stored responses are silently not stored (the engine's default).
	s := startSim(t, Config{})
	r := post(t, s, "/v1/responses", "req-1", responsesBody("x").with("store", true))
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	// SGLang's and TensorRT-LLM's engines take no P/D there.
	sg := startSim(t, Config{Connector: ConnectorSGLang})
	require.Equal(t, http.StatusNotFound, post(t, sg, "/v1/messages", "req-1", messagesBody("x")).status)
}

// P2P NCCL reads its addresses from the id the engine runs the request
// under: for the Responses API, the body's request_id.
func TestP2PResponsesRequestID(t *testing.T) {
	p := startSim(t, Config{Role: RolePrefill, Connector: ConnectorP2PNCCL})
	d := startSim(t, Config{Role: RoleDecode, Connector: ConnectorP2PNCCL})
	id := "___prefill_addr_" + p.KVAddr() + "___decode_addr_" + d.KVAddr() + "_" + strings.Repeat("ab", 16)
	b := responsesBody("hello")
	r := post(t, p, "/v1/responses", id, b.with("stream", false, "max_output_tokens", 1))
	requireRejected(t, p, r, 400, "request_id")
	r = post(t, p, "/v1/responses", id, b.with("stream", false, "max_output_tokens", 1, "request_id", id))
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	r = post(t, d, "/v1/responses", id, b.with("request_id", id))
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	require.Equal(t, KVPulled, r.header.Get(HeaderKV))
}
