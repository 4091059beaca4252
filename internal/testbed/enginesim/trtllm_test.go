package enginesim

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

// trtllmPair is a context server and a generation server.
func trtllmPair(t *testing.T) (p, d *Server) {
	t.Helper()
	p = startSim(t, Config{Role: RolePrefill, Connector: ConnectorTRTLLM})
	d = startSim(t, Config{Role: RoleDecode, Connector: ConnectorTRTLLM})
	return p, d
}

// trtllmContext derives the context request of client, as the disagg server does.
func trtllmContext(client body) body {
	return client.with("stream", false, "stream_options", nil,
		"disaggregated_params", map[string]any{"request_type": "context_only"})
}

// contextParams runs the context phase of client on p and returns the
// answer's choices[0].disaggregated_params, every member as its exact text.
func contextParams(t *testing.T, p *Server, client body) map[string]json.RawMessage {
	t.Helper()
	r := post(t, p, pathFor(client), "req-1", trtllmContext(client))
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	var resp struct {
		Choices []struct {
			FinishReason        string                     `json:"finish_reason"`
			DisaggregatedParams map[string]json.RawMessage `json:"disaggregated_params"`
		} `json:"choices"`
	}
	require.NoError(t, json.Unmarshal(r.body, &resp))
	require.Len(t, resp.Choices, 1)
	require.NotNil(t, resp.Choices[0].DisaggregatedParams, "body: %s", r.body)
	return resp.Choices[0].DisaggregatedParams
}

// generationBody is client with the context's params, request_type set to
// generation_only and every other member's bytes kept; raw JSON so that
// ctx_request_id keeps its digits.
func generationBody(t *testing.T, client body, params map[string]json.RawMessage, edits ...any) []byte {
	t.Helper()
	gen := make(map[string]json.RawMessage, len(params))
	for k, v := range params {
		gen[k] = v
	}
	gen["request_type"] = json.RawMessage(`"generation_only"`)
	for i := 0; i < len(edits); i += 2 {
		if edits[i+1] == nil {
			delete(gen, edits[i].(string))
			continue
		}
		gen[edits[i].(string)] = marshal(t, edits[i+1])
	}
	b := make(map[string]json.RawMessage)
	for k, v := range client {
		b[k] = marshal(t, v)
	}
	b["disaggregated_params"] = marshal(t, gen)
	return marshal(t, b)
}

func TestTRTLLMHandoff(t *testing.T) {
	for _, api := range bothAPIs {
		for _, stream := range []bool{false, true} {
			t.Run(api.name+streamName(stream), func(t *testing.T) {
				p, d := trtllmPair(t)
				client := api.body.streaming(stream)
				path := pathFor(client)
				fp := Fingerprint(promptOf(t, client))

				params := contextParams(t, p, client)
				require.JSONEq(t, `"context_only"`, string(params["request_type"]))
				require.JSONEq(t, `[`+strconv.Itoa(firstTokenID(fp))+`]`, string(params["first_gen_tokens"]))
				require.JSONEq(t, `null`, string(params["draft_tokens"]))
				id, err := strconv.ParseUint(string(params["ctx_request_id"]), 10, 64)
				require.NoError(t, err, "ctx_request_id is an integer: %s", params["ctx_request_id"])
				require.Greater(t, id, uint64(1)<<53, "beyond float64's exact integers")
				var opaque string
				require.NoError(t, json.Unmarshal(params["encoded_opaque_state"], &opaque))
				addr, err := base64.StdEncoding.DecodeString(opaque)
				require.NoError(t, err)
				require.Equal(t, p.Addr(), string(addr))

				r := post(t, d, path, "req-1", generationBody(t, client, params))
				requireDecodePulled(t, d, p, r, client, stream, wantText(t, client))
				requireRecords(t, p,
					Record{RequestID: "req-1", Path: path, Kind: KindPrefill, Fingerprint: fp, Status: 200},
					Record{RequestID: "req-1", Path: "/sim/kv/ctx", Kind: KindKVPull, Fingerprint: fp, Status: 200})
			})
		}
	}
}

func TestTRTLLMGenerationFailures(t *testing.T) {
	const prompt = "What is a context server?"
	client := chatBody(prompt)
	tests := []struct {
		name    string
		run     func(t *testing.T, p, d *Server) []byte // the generation request body
		status  int
		wantMsg string
	}{
		{
			name: "ctx_request_id through float64",
			run: func(t *testing.T, p, _ *Server) []byte {
				params := contextParams(t, p, client)
				id, err := strconv.ParseUint(string(params["ctx_request_id"]), 10, 64)
				require.NoError(t, err)
				rounded := uint64(float64(id))
				if rounded == id {
					rounded++ // exact by chance: still a different id
				}
				return generationBody(t, client, params, "ctx_request_id", json.Number(strconv.FormatUint(rounded, 10)))
			},
			status:  http.StatusBadRequest,
			wantMsg: "failed with 404: no KV for ctx_request_id",
		},
		{
			name: "ctx_request_id as a string",
			run: func(t *testing.T, p, _ *Server) []byte {
				params := contextParams(t, p, client)
				return generationBody(t, client, params, "ctx_request_id", string(params["ctx_request_id"]))
			},
			status:  http.StatusBadRequest,
			wantMsg: "disaggregated_params.ctx_request_id must be an integer, got \"",
		},
		{
			name: "consumed",
			run: func(t *testing.T, p, d *Server) []byte {
				b := generationBody(t, client, contextParams(t, p, client))
				post(t, d, "/v1/chat/completions", "req-1", b).decode(t)
				return b
			},
			status:  http.StatusConflict,
			wantMsg: `was already taken by request "req-1"`,
		},
		{
			name: "wrong prompt",
			run: func(t *testing.T, p, _ *Server) []byte {
				return generationBody(t, client, contextParams(t, p, chatBody("another prompt")))
			},
			status:  http.StatusBadRequest,
			wantMsg: "holds a different prompt: prefilled prompt fingerprint " + Fingerprint("user: another prompt\n"),
		},
		{
			name: "first_gen_tokens changed",
			run: func(t *testing.T, p, _ *Server) []byte {
				return generationBody(t, client, contextParams(t, p, client), "first_gen_tokens", []int{1})
			},
			status:  http.StatusBadRequest,
			wantMsg: "disaggregated_params.first_gen_tokens [1] differ from those the context server issued",
		},
		{
			name: "opaque state not base64",
			run: func(t *testing.T, p, _ *Server) []byte {
				return generationBody(t, client, contextParams(t, p, client), "encoded_opaque_state", "%%%")
			},
			status:  http.StatusBadRequest,
			wantMsg: `encoded_opaque_state "%%%" is not base64`,
		},
		{
			name: "opaque state names a server that is gone",
			run: func(t *testing.T, p, _ *Server) []byte {
				gone := base64.StdEncoding.EncodeToString([]byte("127.0.0.1:" + strconv.Itoa(closedPort(t))))
				return generationBody(t, client, contextParams(t, p, client), "encoded_opaque_state", gone)
			},
			status:  http.StatusBadRequest,
			wantMsg: "KV transfer of ctx_request_id",
		},
		{
			name: "missing ctx_request_id",
			run: func(t *testing.T, p, _ *Server) []byte {
				return generationBody(t, client, contextParams(t, p, client), "ctx_request_id", nil)
			},
			status:  http.StatusBadRequest,
			wantMsg: "ctx_request_id must be an integer, got nothing",
		},
		{
			name: "context_only sent to the generation server",
			run: func(t *testing.T, _, _ *Server) []byte {
				return marshal(t, trtllmContext(client))
			},
			status:  http.StatusBadRequest,
			wantMsg: `engine is a generation server (role decode): disaggregated_params.request_type must be "generation_only", got "context_only"`,
		},
		{
			name: "unknown request_type",
			run: func(t *testing.T, p, _ *Server) []byte {
				return generationBody(t, client, contextParams(t, p, client), "request_type", "generation")
			},
			status:  http.StatusBadRequest,
			wantMsg: `unknown disaggregated_params.request_type "generation"`,
		},
		{
			name: "leaked bootstrap_room",
			run: func(t *testing.T, p, _ *Server) []byte {
				return generationBody(t, client.with("bootstrap_room", 1), contextParams(t, p, client))
			},
			status:  http.StatusBadRequest,
			wantMsg: "bootstrap_room is not part of the trtllm protocol",
		},
		{
			name: "streaming generation of an unknown context",
			run: func(t *testing.T, p, _ *Server) []byte {
				return generationBody(t, client.streaming(true), contextParams(t, p, client), "ctx_request_id", json.Number("1"))
			},
			status:  http.StatusBadRequest,
			wantMsg: "no KV for ctx_request_id 1 (unknown or expired)",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, d := trtllmPair(t)
			b := tt.run(t, p, d)
			requireRejected(t, d, post(t, d, "/v1/chat/completions", "req-1", b), tt.status, tt.wantMsg)
		})
	}
}

func TestTRTLLMContextFailures(t *testing.T) {
	good := trtllmContext(chatBody("hi"))
	ctxParams := func(kv ...any) body {
		return good.with("disaggregated_params", map[string]any(body{"request_type": "context_only"}.with(kv...)))
	}
	tests := []struct {
		name    string
		body    body
		wantMsg string
	}{
		{"streams", good.with("stream", true), "stream must be false on a context_only request"},
		{"carries a ctx_request_id", ctxParams("ctx_request_id", 5), "disaggregated_params.ctx_request_id must be absent on a context_only request"},
		{"request_type missing", good.with("disaggregated_params", map[string]any{}), "disaggregated_params.request_type must be a string, got nothing"},
		{"generation_only", ctxParams("request_type", "generation_only"), `engine is a context server (role prefill): disaggregated_params.request_type must be "context_only"`},
		{"leaked kv_transfer_params", good.with("kv_transfer_params", map[string]any{}), "kv_transfer_params is not part of the trtllm protocol"},
		{"params not an object", good.with("disaggregated_params", "context_only"), "invalid disaggregated_params"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := startSim(t, Config{Role: RolePrefill, Connector: ConnectorTRTLLM})
			requireRejected(t, p, post(t, p, "/v1/chat/completions", "req-1", tt.body), http.StatusBadRequest, tt.wantMsg)
		})
	}
	t.Run("upstream's extra members are fine", func(t *testing.T) {
		p := startSim(t, Config{Role: RolePrefill, Connector: ConnectorTRTLLM})
		post(t, p, "/v1/chat/completions", "req-1", ctxParams("disagg_request_id", json.Number("9007199254740993"), "schedule_style", 0)).decode(t)
	})
}

func TestTRTLLMContextFinishedOnEOS(t *testing.T) {
	p, d := trtllmPair(t)
	client := chatBody("say nothing [sim:eos]")
	r := post(t, p, "/v1/chat/completions", "req-1", trtllmContext(client))
	resp := r.decode(t)
	require.Equal(t, "stop", resp.Choices[0].FinishReason, "the disagg server answers with this and skips the generation")
	require.True(t, bytes.Contains(r.body, []byte(`"disaggregated_params":{"request_type":"context_only"`)))
	// A router that still sends the generation gets no KV.
	params := contextParams(t, p, client)
	requireRejected(t, d, post(t, d, "/v1/chat/completions", "req-1", generationBody(t, client, params)), 400, "unknown or expired")
	// Without disaggregated_params the generation server computes the request in full.
	plain := post(t, d, "/v1/chat/completions", "req-1", client)
	require.Equal(t, KVRecomputed, plain.header.Get(HeaderKV))
	plain.decode(t)
	require.Equal(t, KindPlain, lastRecord(t, d).Kind)
}

func TestIntText(t *testing.T) {
	for raw, want := range map[string]string{"5": "5", "-5": "-5", "18446744073709551615": "18446744073709551615", "1.5": "", `"5"`: "", "": ""} {
		got, ok := intText(json.RawMessage(raw))
		require.Equal(t, want != "", ok, raw)
		require.Equal(t, want, got, raw)
	}
}
