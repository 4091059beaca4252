package connectors

import (
	"bytes"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/jsonedit"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

func TestAPIOf(t *testing.T) {
	for path, want := range map[string]API{
		"/v1/chat/completions": APIChat, "/v1/completions": APICompletions,
		"/v1/responses": APIResponses, "/v1/messages": APIMessages,
		"/v1/messages/count_tokens": 0, "/v1/responses/": 0, "/V1/MESSAGES": 0, "/generate": 0,
	} {
		require.Equal(t, want, APIOf(path), path)
		require.Equal(t, want != 0, Routed(path), path)
		if want != 0 {
			require.Equal(t, path, want.Path())
		}
	}
	require.Equal(t, []string{"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}, RoutedPaths())
	set := APIResponses | APIMessages
	require.True(t, set.Has(APIMessages))
	require.False(t, set.Has(APIChat))
	require.False(t, set.Has(0), "no API is in a set")
	require.Empty(t, set.Path(), "a set has no path")
	require.True(t, APIMessages.Anthropic())
	require.False(t, APIResponses.Anthropic())
	require.True(t, AnthropicPath("/v1/messages/count_tokens"))
	require.False(t, AnthropicPath("/v1/responses"))
}

// Which API each connector disaggregates: vLLM's connectors all four,
// SGLang and TensorRT-LLM only chat and completions (see their specs for
// the engines' sources that say so).
func TestNotDisaggregated(t *testing.T) {
	for name, p := range variants() {
		_, traits, err := New(p)
		require.NoError(t, err, name)
		switch strings.SplitN(name, "/", 2)[0] {
		case "sglang", "trtllm":
			require.Equal(t, APIResponses|APIMessages, traits.NotDisaggregated, name)
		default:
			require.Zero(t, traits.NotDisaggregated, name)
		}
	}
}

// The prefill body of each API is limited to one output token the way that
// API reads it, not streamed.
func TestPrefillOnlyEdits(t *testing.T) {
	tests := []struct {
		name   string
		api    API
		client string
		want   string
	}{
		{
			name:   "responses: max_output_tokens 1, no stream, max_tokens left alone",
			api:    APIResponses,
			client: `{"model":"m","input":"hi","instructions":"be brief","max_output_tokens":64,"stream":true,"max_tokens":7}`,
			want:   `{"model":"m","input":"hi","instructions":"be brief","max_output_tokens":1,"stream":false,"max_tokens":7}`,
		},
		{
			name:   "responses without a limit gets one",
			api:    APIResponses,
			client: `{"model":"m","input":[{"role":"user","content":"hi"}]}`,
			want:   `{"model":"m","input":[{"role":"user","content":"hi"}],"stream":false,"max_output_tokens":1}`,
		},
		{
			name:   "responses: null stream left out, then set",
			api:    APIResponses,
			client: `{"model":"m","input":"hi","stream":null,"stream_options":{"include_obfuscation":false}}`,
			want:   `{"model":"m","input":"hi","stream":false,"max_output_tokens":1}`,
		},
		{
			name:   "messages: max_tokens 1, no stream",
			api:    APIMessages,
			client: `{"model":"m","max_tokens":1024,"system":"s","messages":[{"role":"user","content":"hi"}],"stream":true}`,
			want:   `{"model":"m","max_tokens":1,"system":"s","messages":[{"role":"user","content":"hi"}],"stream":false}`,
		},
		{
			name:   "messages: a thinking budget, which must be below max_tokens, left out",
			api:    APIMessages,
			client: `{"model":"m","max_tokens":4096,"thinking":{"type":"enabled","budget_tokens":2048},"messages":[]}`,
			want:   `{"model":"m","max_tokens":1,"messages":[],"stream":false}`,
		},
		{
			name:   "messages: thinking without a budget kept (it shapes the prompt)",
			api:    APIMessages,
			client: `{"model":"m","max_tokens":4096,"thinking":{"type":"disabled"},"messages":[]}`,
			want:   `{"model":"m","max_tokens":1,"thinking":{"type":"disabled"},"messages":[],"stream":false}`,
		},
		{
			name:   "messages: max_completion_tokens not added (Messages has none)",
			api:    APIMessages,
			client: `{"model":"m","max_tokens":9,"messages":[]}`,
			want:   `{"model":"m","max_tokens":1,"messages":[],"stream":false}`,
		},
		{
			name:   "chat unchanged",
			api:    APIChat,
			client: `{"model":"m","messages":[],"max_completion_tokens":9,"min_tokens":2}`,
			want:   `{"model":"m","messages":[],"max_completion_tokens":1,"stream":false,"max_tokens":1}`,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			obj, err := jsonedit.Parse([]byte(tc.client))
			require.NoError(t, err)
			var buf [maxEdits]jsonedit.Edit
			got := string(bytes.Join(enginePieces(nil, obj, prefillOnlyEdits(buf[:0], tc.api, obj)...), nil))
			require.Equal(t, tc.want, got)
		})
	}
}

// Every vLLM connector sends the APIs' own prefill to the API's path and
// hands its decode what the protocol needs.
func TestPrepareAgentAPIs(t *testing.T) {
	const kv = `{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"e1","remote_block_ids":[[1]],"remote_request_id":"r1","remote_host":"10.0.0.1","remote_port":21001}`
	bodies := map[API]string{
		APIResponses: `{"model":"m","input":"hi","max_output_tokens":64,"stream":true,"kv_transfer_params":{"remote_host":"10.6.6.6"}}`,
		APIMessages:  `{"model":"m","max_tokens":64,"messages":[{"role":"user","content":"hi"}],"stream":true,"kv_transfer_params":{"remote_host":"10.6.6.6"}}`,
	}
	answers := map[API]string{
		APIResponses: `{"id":"resp_1","object":"response","status":"incomplete","usage":{"input_tokens":9,"input_tokens_details":{"cached_tokens":0},"output_tokens":1,"total_tokens":10},"kv_transfer_params":` + kv + `}`,
		APIMessages:  `{"id":"chatcmpl-1","type":"message","stop_reason":"max_tokens","usage":{"input_tokens":9,"output_tokens":1},"kv_transfer_params":` + kv + `}`,
	}
	prefills := map[API]string{
		APIResponses: `{"model":"m","input":"hi","max_output_tokens":1,"stream":false`,
		APIMessages:  `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"hi"}],"stream":false`,
	}
	decodes := map[API]string{
		APIResponses: `{"model":"m","input":"hi","max_output_tokens":64,"stream":true`,
		APIMessages:  `{"model":"m","max_tokens":64,"messages":[{"role":"user","content":"hi"}],"stream":true`,
	}
	for _, api := range []API{APIResponses, APIMessages} {
		for _, c := range []struct {
			name            string
			conn            Connector
			prefillKV       string // the prefill's kv_transfer_params, "" for none
			decodeKV        bool   // the decode carries the prefill's
			requestIDInBody bool
		}{
			{name: "nixl", conn: NIXL{}, prefillKV: string(nixlPrefillParams), decodeKV: true},
			{name: "http", conn: HTTP{}},
			{name: "p2p-nccl", conn: P2PNCCL{}, requestIDInBody: api == APIResponses},
		} {
			t.Run(api.Path()+"/"+c.name, func(t *testing.T) {
				req := newRequest(t, bodies[api])
				req.Path = api.Path()
				eng := fakeengine.New().On(http.MethodPost, testPrefill.Address, req.Path, fakeengine.Reply{Body: answers[api]})
				got, err := c.conn.Prepare(t.Context(), Env{Engine: eng}, req)
				require.NoError(t, err)
				calls := eng.Calls()
				require.Len(t, calls, 1)
				require.Equal(t, api.Path(), calls[0].Path, "the prefill goes to the API's own path")
				prefill, decode := prefills[api], decodes[api]
				if c.requestIDInBody {
					id := appendJSONString(nil, got.Decode.RequestID)
					prefill += `,"request_id":` + string(id)
					decode += `,"request_id":` + string(id)
				}
				if c.prefillKV != "" {
					prefill += `,"kv_transfer_params":` + c.prefillKV
				}
				if c.decodeKV {
					decode += `,"kv_transfer_params":` + kv
				}
				require.Equal(t, prefill+"}", calls[0].Body)
				require.Equal(t, decode+"}", string(got.Decode.Body))
				require.Equal(t, Prefilled{PromptTokens: 9, CachedTokens: 0, Details: api == APIResponses}, got.Prefilled,
					"the prefill's usage read in the API's own fields")
			})
		}
	}
}

// Mooncake's concurrent protocol sends the API's own prefill body too.
func TestMooncakeVLLMAgentAPIs(t *testing.T) {
	req := newRequest(t, `{"model":"m","max_tokens":64,"messages":[{"role":"user","content":"hi"}],"stream":true}`)
	req.Path = MessagesPath
	eng := fakeengine.New().
		On(http.MethodGet, "10.0.0.1:8998", "/query", fakeengine.Reply{Body: `{"0":{"engine_id":"eng-p"}}`}).
		On(http.MethodPost, testPrefill.Address, MessagesPath, fakeengine.Reply{Body: `{"type":"message"}`})
	c, _, err := New(&configv1.Pool{Connector: "mooncake", MooncakeProtocol: MooncakeVLLM})
	require.NoError(t, err)
	got, err := c.Prepare(t.Context(), Env{Engine: eng}, req)
	require.NoError(t, err)
	require.NoError(t, prefillOutcome(t, got.Prefill))
	var prefill string
	for _, call := range eng.Calls() {
		if call.Path == MessagesPath {
			prefill = call.Body
		}
	}
	require.True(t, strings.HasPrefix(prefill, `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"hi"}],"stream":false,"kv_transfer_params":{"do_remote_decode":true`), prefill)
	require.True(t, strings.HasPrefix(string(got.Decode.Body), `{"model":"m","max_tokens":64,"messages":[{"role":"user","content":"hi"}],"stream":true,"kv_transfer_params":{"do_remote_decode":false,"do_remote_prefill":true`), string(got.Decode.Body))
}

// The prefill's usage, in each API's shape.
func TestPrefilledShapes(t *testing.T) {
	tests := []struct {
		name, answer string
		want         Prefilled
	}{
		{"chat", `{"usage":{"prompt_tokens":100,"completion_tokens":1,"total_tokens":101,"prompt_tokens_details":{"cached_tokens":64}}}`, Prefilled{100, 64, true}},
		{"chat without details", `{"usage":{"prompt_tokens":100,"completion_tokens":1}}`, Prefilled{PromptTokens: 100}},
		{"responses", `{"usage":{"input_tokens":100,"input_tokens_details":{"cached_tokens":64,"cache_write_tokens":0},"output_tokens":1,"total_tokens":101}}`, Prefilled{100, 64, true}},
		{"messages with cache details: input_tokens excludes the cached", `{"usage":{"input_tokens":36,"output_tokens":1,"cache_read_input_tokens":64}}`, Prefilled{100, 64, true}},
		{"messages with cache creation", `{"usage":{"input_tokens":30,"output_tokens":1,"cache_read_input_tokens":64,"cache_creation_input_tokens":6}}`, Prefilled{100, 64, true}},
		{"messages without details", `{"usage":{"input_tokens":100,"output_tokens":1}}`, Prefilled{PromptTokens: 100}},
		{"no usage", `{"id":"x"}`, Prefilled{}},
		{"not numbers", `{"usage":{"input_tokens":"100"}}`, Prefilled{}},
		{"cached over the prompt", `{"usage":{"input_tokens":10,"input_tokens_details":{"cached_tokens":64},"total_tokens":11}}`, Prefilled{}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, prefilledOf([]byte(tc.answer)))
		})
	}
}
