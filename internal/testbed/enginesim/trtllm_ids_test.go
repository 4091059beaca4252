package enginesim

import (
	"encoding/json"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"
)

// contextAnswer is a TensorRT-LLM context server's answer, members kept exact.
type contextAnswer struct {
	Choices []struct {
		FinishReason        string                     `json:"finish_reason"`
		DisaggregatedParams map[string]json.RawMessage `json:"disaggregated_params"`
	} `json:"choices"`
	PromptTokenIDs json.RawMessage `json:"prompt_token_ids"`
	Usage          json.RawMessage `json:"usage"`
}

// runContext sends the context request of client, with params as its
// disaggregated_params, to p.
func runContext(t *testing.T, p *Server, client body, params map[string]any) contextAnswer {
	t.Helper()
	r := post(t, p, pathFor(client), "req-1", client.with("stream", false, "stream_options", nil, "disaggregated_params", params))
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	var a contextAnswer
	require.NoError(t, decodeJSON(r.body, &a))
	require.Len(t, a.Choices, 1)
	return a
}

const disaggID = "9223372036854775806" // 2^63-2: TensorRT-LLM's ids reach [2^40, 2^63-1)

func TestTokenizerRoundTrip(t *testing.T) {
	for _, text := range []string{"", "a", "abcd", "abcde", "user: héllo ✓\n", "trailing spaces   "} {
		ids := tokenize(text)
		require.Equal(t, text, detokenize(ids))
		require.Equal(t, max(1, len(ids)), promptTokens(text))
	}
	require.Equal(t, []uint32{0x61626364, 0x65000000}, tokenize("abcde"))
	require.Equal(t, "[]", string(mustJSON(tokenize(""))))
}

// The current protocol: the context echoes disagg_request_id and returns its
// tokenization of the prompt; the generation request carries those token
// ids (as prompt on completions, prompt_token_ids on chat) and ctx_usage,
// whose prompt tokens the generation's usage reports.
func TestTRTLLMTokenIDsAndUsage(t *testing.T) {
	for _, api := range bothAPIs {
		t.Run(api.name, func(t *testing.T) {
			p, d := trtllmPair(t)
			client := api.body
			prompt := promptOf(t, client)
			a := runContext(t, p, client, map[string]any{"request_type": "context_only", "disagg_request_id": json.Number(disaggID)})
			params := a.Choices[0].DisaggregatedParams
			require.Equal(t, disaggID, string(params["disagg_request_id"]), "echoed exactly")
			require.JSONEq(t, string(mustJSON(tokenize(prompt))), string(a.PromptTokenIDs))

			var ids []uint32
			require.NoError(t, json.Unmarshal(a.PromptTokenIDs, &ids))
			gen := client.with("prompt_token_ids", ids)
			if api.name == "completions" {
				gen = client.with("prompt", ids)
			}
			usage := map[string]any{"prompt_tokens": 101, "completion_tokens": 1, "total_tokens": 102,
				"prompt_tokens_details": map[string]any{"cached_tokens": 7}}
			r := post(t, d, pathFor(client), "req-1", generationBody(t, gen, params, "ctx_usage", usage))
			requireDecodePulled(t, d, p, r, client, false, wantText(t, client))
			resp := r.decode(t)
			require.Equal(t, 101, resp.Usage.PromptTokens, "counted from ctx_usage")
			require.Equal(t, 101+3, resp.Usage.TotalTokens)
		})
	}
}

func TestTRTLLMGenerationTokenIDFailures(t *testing.T) {
	client := completionBody("the right prompt").with("max_tokens", 3)
	tests := []struct {
		name    string
		edit    func(gen body, ids []uint32) body
		edits   []any // disaggregated_params edits
		status  int
		wantMsg string
	}{
		{
			name:    "token ids of another prompt",
			edit:    func(gen body, _ []uint32) body { return gen.with("prompt", tokenize("the wrong prompt")) },
			status:  http.StatusBadRequest,
			wantMsg: "holds a different prompt: prefilled prompt fingerprint " + Fingerprint("the right prompt"),
		},
		{
			name:    "a token id out of the vocabulary",
			edit:    func(gen body, _ []uint32) body { return gen.with("prompt", []int64{1 << 32}) },
			status:  http.StatusBadRequest,
			wantMsg: "prompt[0] = 4294967296 is not a token id of the simulator's vocabulary",
		},
		{
			name:    "ctx_usage not a usage object",
			edit:    func(gen body, ids []uint32) body { return gen.with("prompt", ids) },
			edits:   []any{"ctx_usage", 5},
			status:  http.StatusBadRequest,
			wantMsg: "disaggregated_params.ctx_usage must be a usage object, got 5",
		},
		{
			name:    "disagg_request_id as a string",
			edit:    func(gen body, ids []uint32) body { return gen.with("prompt", ids) },
			edits:   []any{"disagg_request_id", disaggID},
			status:  http.StatusBadRequest,
			wantMsg: `disaggregated_params.disagg_request_id must be an integer, got "` + disaggID + `"`,
		},
		{
			name:    "a member DisaggregatedParams does not declare",
			edit:    func(gen body, ids []uint32) body { return gen.with("prompt", ids) },
			edits:   []any{"opaque_state", "x"},
			status:  http.StatusBadRequest,
			wantMsg: "disaggregated_params.opaque_state: extra inputs are not permitted",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, d := trtllmPair(t)
			a := runContext(t, p, client, map[string]any{"request_type": "context_only"})
			var ids []uint32
			require.NoError(t, json.Unmarshal(a.PromptTokenIDs, &ids))
			gen := tt.edit(client, ids)
			r := post(t, d, "/v1/completions", "req-1", generationBody(t, gen, a.Choices[0].DisaggregatedParams, tt.edits...))
			requireRejected(t, d, r, tt.status, tt.wantMsg)
		})
	}
}

func TestTRTLLMContextMembers(t *testing.T) {
	p := startSim(t, Config{Role: RolePrefill, Connector: ConnectorTRTLLM})
	good := trtllmContext(chatBody("hi"))
	tests := []struct {
		name    string
		params  map[string]any
		wantMsg string
	}{
		{"extra member", map[string]any{"request_type": "context_only", "kv_cache": 1},
			"disaggregated_params.kv_cache: extra inputs are not permitted"},
		{"extra member, null", map[string]any{"request_type": "context_only", "kv_cache": nil},
			"disaggregated_params.kv_cache: extra inputs are not permitted"},
		{"disagg_request_id not an integer", map[string]any{"request_type": "context_only", "disagg_request_id": 1.5},
			"disaggregated_params.disagg_request_id must be an integer, got 1.5"},
		{"base64 token ids", map[string]any{"request_type": "context_only", "return_prompt_token_ids_b64": true},
			"return_prompt_token_ids_b64 is not modelled (a simulator limitation"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			requireRejected(t, p, post(t, p, "/v1/chat/completions", "req-1", good.with("disaggregated_params", tt.params)),
				http.StatusBadRequest, tt.wantMsg)
		})
	}
}

// An older TensorRT-LLM server knows only the first five members of
// DisaggregatedParams and answers without token ids.
func TestTRTLLMLegacy(t *testing.T) {
	p := startSim(t, Config{Role: RolePrefill, Connector: ConnectorTRTLLM, TRTLLMLegacy: true})
	d := startSim(t, Config{Role: RoleDecode, Connector: ConnectorTRTLLM, TRTLLMLegacy: true})
	client := chatBody("old server").with("max_tokens", 3)
	a := runContext(t, p, client, map[string]any{"request_type": "context_only"})
	params := a.Choices[0].DisaggregatedParams
	require.Nil(t, a.PromptTokenIDs, "no prompt_token_ids")
	require.NotContains(t, params, "disagg_request_id")
	r := post(t, d, "/v1/chat/completions", "req-1", generationBody(t, client, params))
	requireDecodePulled(t, d, p, r, client, false, wantText(t, client))

	for _, tt := range []struct {
		name    string
		s       *Server
		body    any
		wantMsg string
	}{
		{"context with disagg_request_id", p, trtllmContext(client).with("disaggregated_params",
			map[string]any{"request_type": "context_only", "disagg_request_id": json.Number(disaggID)}),
			"disaggregated_params.disagg_request_id: extra inputs are not permitted (this TensorRT-LLM server's DisaggregatedParams declares only request_type, first_gen_tokens, ctx_request_id, encoded_opaque_state, draft_tokens)"},
		{"generation with ctx_usage", d, generationBody(t, client, params, "ctx_usage", map[string]any{"prompt_tokens": 1}),
			"disaggregated_params.ctx_usage: extra inputs are not permitted"},
		{"chat with prompt_token_ids", d, generationBody(t, client.with("prompt_token_ids", []int{1}), params),
			"prompt_token_ids: extra inputs are not permitted"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			requireRejected(t, tt.s, post(t, tt.s, "/v1/chat/completions", "req-1", tt.body), http.StatusBadRequest, tt.wantMsg)
		})
	}
}
