package processor

import (
	"encoding/json"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// The Responses and Messages APIs are routed with a prefill on their own
// paths: the prefill is the client's body limited to one output token the
// way the API reads it, the decode body carries the prefill's
// kv_transfer_params, and a Responses body stores nothing on either leg.
func TestAgentAPIsRouted(t *testing.T) {
	const params = `{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[[1]],"remote_request_id":"r","remote_host":"127.0.0.1","remote_port":8100}`
	tests := []struct {
		name, path, client, answer, prefill, decode string
	}{
		{
			name:    "responses",
			path:    "/v1/responses",
			client:  `{"model":"m","input":"hi","instructions":"be brief","max_output_tokens":64,"stream":true}`,
			answer:  `{"id":"resp_1","object":"response","usage":{"input_tokens":9,"input_tokens_details":{"cached_tokens":0},"output_tokens":1,"total_tokens":10},"kv_transfer_params":` + params + `}`,
			prefill: `{"model":"m","input":"hi","instructions":"be brief","max_output_tokens":1,"stream":false,"store":false,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}`,
			decode:  `{"model":"m","input":"hi","instructions":"be brief","max_output_tokens":64,"stream":true,"store":false,"kv_transfer_params":` + params + `}`,
		},
		{
			name:    "responses storing: store turned off",
			path:    "/v1/responses",
			client:  `{"model":"m","store":true,"input":[{"role":"user","content":"hi"}]}`,
			answer:  `{"id":"resp_1","kv_transfer_params":` + params + `}`,
			prefill: `{"model":"m","store":false,"input":[{"role":"user","content":"hi"}],"stream":false,"max_output_tokens":1,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}`,
			decode:  `{"model":"m","store":false,"input":[{"role":"user","content":"hi"}],"kv_transfer_params":` + params + `}`,
		},
		{
			name:    "messages",
			path:    "/v1/messages",
			client:  `{"model":"m","max_tokens":1024,"system":"be brief","messages":[{"role":"user","content":"hi"}],"stream":true}`,
			answer:  `{"id":"chatcmpl-1","type":"message","usage":{"input_tokens":9,"output_tokens":1},"kv_transfer_params":` + params + `}`,
			prefill: `{"model":"m","max_tokens":1,"system":"be brief","messages":[{"role":"user","content":"hi"}],"stream":false,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}`,
			decode:  `{"model":"m","max_tokens":1024,"system":"be brief","messages":[{"role":"user","content":"hi"}],"stream":true,"kv_transfer_params":` + params + `}`,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			eng := fakeengine.New().On(http.MethodPost, "", tc.path, fakeengine.Reply{Body: tc.answer})
			out := run(t, testTable(t, false, time.Second), eng, headers("POST", tc.path, false), body(tc.client, true))
			require.Len(t, out, 2)
			calls := eng.Calls()
			require.Len(t, calls, 1)
			require.Equal(t, tc.path, calls[0].Path, "the prefill goes to the API's path")
			require.Equal(t, tc.prefill, calls[0].Body)
			br := out[1].GetRequestBody().GetResponse()
			require.Equal(t, tc.decode, string(br.GetBodyMutation().GetBody()))
		})
	}
}

func sglangTable(t *testing.T) *routing.Table {
	t.Helper()
	table, err := routing.New(&configv1.Config{Pools: []*configv1.Pool{{
		Name: "sg", Models: []string{"m"}, Connector: "sglang",
		Prefill:        []*configv1.Endpoint{{Address: "127.0.0.1:8100", BootstrapPort: 8998}},
		Decode:         []*configv1.Endpoint{{Address: "127.0.0.1:8200"}},
		PrefillTimeout: durationpb.New(time.Second),
	}}})
	require.NoError(t, err)
	return table
}

// anthropicErrorBody is Anthropic's error shape.
type anthropicErrorBody struct {
	Type  string `json:"type"`
	Error struct {
		Type    string `json:"type"`
		Message string `json:"message"`
	} `json:"error"`
}

// Each API gets its own error shape: OpenAI's for Responses, Anthropic's
// for Messages (and its token count); no engine is called.
func TestAgentAPIErrors(t *testing.T) {
	tests := []struct {
		name, path, body string
		table            func(*testing.T) *routing.Table
		status           int
		code             string // OpenAI's error code
		anthropicType    string // Anthropic's error type
		message          string
	}{
		{name: "responses without input", path: "/v1/responses", body: `{"model":"m"}`, status: 400, code: "missing_input"},
		{name: "responses input of a number", path: "/v1/responses", body: `{"model":"m","input":5}`, status: 400, code: "invalid_type"},
		{name: "responses empty input", path: "/v1/responses", body: `{"model":"m","input":[]}`, status: 400, code: "empty_input"},
		{name: "responses max_output_tokens 0", path: "/v1/responses", body: `{"model":"m","input":"hi","max_output_tokens":0}`, status: 400, code: "invalid_value"},
		{name: "responses previous_response_id", path: "/v1/responses", body: `{"model":"m","input":"hi","previous_response_id":"resp_1"}`,
			status: 400, code: "unsupported_value", message: "pdx stores none"},
		{name: "responses background", path: "/v1/responses", body: `{"model":"m","input":"hi","background":true}`, status: 400, code: "unsupported_value"},
		{name: "responses store of a string", path: "/v1/responses", body: `{"model":"m","input":"hi","store":"yes"}`, status: 400, code: "invalid_type"},
		{name: "responses on sglang", path: "/v1/responses", body: `{"model":"m","input":"hi"}`, table: sglangTable, status: 501, code: "unsupported_api",
			message: `connector "sglang"`},
		{name: "responses of an unknown model", path: "/v1/responses", body: `{"model":"x","input":"hi"}`, status: 404, code: "model_not_found"},
		{name: "messages without max_tokens", path: "/v1/messages", body: `{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
			status: 400, anthropicType: "invalid_request_error", message: `no "max_tokens"`},
		{name: "messages without messages", path: "/v1/messages", body: `{"model":"m","max_tokens":5}`, status: 400, anthropicType: "invalid_request_error"},
		{name: "messages system of a number", path: "/v1/messages", body: `{"model":"m","max_tokens":5,"system":1,"messages":[{"role":"user","content":"hi"}]}`,
			status: 400, anthropicType: "invalid_request_error"},
		{name: "messages not JSON", path: "/v1/messages", body: `{"model":`, status: 400, anthropicType: "invalid_request_error"},
		{name: "messages of an unknown model", path: "/v1/messages", body: `{"model":"x","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`,
			status: 404, anthropicType: "not_found_error"},
		{name: "messages on sglang", path: "/v1/messages", body: `{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`,
			table: sglangTable, status: 501, anthropicType: "api_error", message: "/v1/messages is not disaggregated"},
		{name: "count_tokens of an unknown model", path: "/v1/messages/count_tokens", body: `{"model":"x","messages":[]}`,
			status: 404, anthropicType: "not_found_error"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			eng := answering(fakeengine.Reply{Body: kvAnswer})
			table := testTable(t, false, time.Second)
			if tc.table != nil {
				table = tc.table(t)
			}
			out := run(t, table, eng, headers("POST", tc.path, false), body(tc.body, true))
			require.Empty(t, eng.Calls(), "no engine is called")
			ir := out[len(out)-1].GetImmediateResponse()
			require.NotNil(t, ir)
			require.EqualValues(t, tc.status, ir.GetStatus().GetCode())
			var msg string
			if tc.anthropicType != "" {
				var b anthropicErrorBody
				require.NoError(t, json.Unmarshal(ir.GetBody(), &b))
				require.Equal(t, "error", b.Type)
				require.Equal(t, tc.anthropicType, b.Error.Type)
				require.NotContains(t, string(ir.GetBody()), `"code"`, "Anthropic's shape has no code")
				msg = b.Error.Message
			} else {
				status, b := immediateOf(t, out[len(out)-1])
				require.Equal(t, tc.status, status)
				require.Equal(t, tc.code, b.Error.Code)
				msg = b.Error.Message
			}
			require.NotEmpty(t, msg)
			require.Contains(t, msg, tc.message)
		})
	}
}

// The APIs' companions pass through to the model's pool by default: no
// prefill leg, protocol fields stripped.
func TestDefaultPassThrough(t *testing.T) {
	for _, path := range []string{"/v1/messages/count_tokens", "/tokenize", "/detokenize"} {
		eng := answering(fakeengine.Reply{Err: errors.New("no engine may be called")})
		out := run(t, testTable(t, false, time.Second), eng,
			headers("POST", path, false), body(`{"model":"m","messages":[{"role":"user","content":"hi"}],"kv_transfer_params":{"remote_host":"10.6.6.6"}}`, true))
		require.Len(t, out, 2, path)
		require.Empty(t, eng.Calls(), path)
		br := out[1].GetRequestBody().GetResponse()
		require.Equal(t, "127.0.0.1:8200", setHeaders(br.GetHeaderMutation())[DestinationHeader], path)
		require.JSONEq(t, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, string(br.GetBodyMutation().GetBody()), path)
	}
}
