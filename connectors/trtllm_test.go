package connectors

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/jsonedit"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

func TestTRTLLMContextBody(t *testing.T) {
	tests := []struct {
		name, client, want string
		disaggID           uint64
	}{
		{
			name:   "streaming chat made non-streaming, output limit kept",
			client: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":64,"stream":true,"stream_options":{"include_usage":true}}`,
			want:   `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":64,"stream":false,"disaggregated_params":{"request_type":"context_only"}}`,
		},
		{
			name:     "current protocol: disagg_request_id",
			client:   `{"model":"m","prompt":"p"}`,
			disaggID: 1<<62 + 1,
			want:     `{"model":"m","prompt":"p","stream":false,"disaggregated_params":{"request_type":"context_only","disagg_request_id":4611686018427387905}}`,
		},
		{
			name:   "client disaggregated_params replaced in place, other protocol fields stripped",
			client: `{"model":"m","disaggregated_params":{"request_type":"generation_only","ctx_request_id":1},"prompt":"p","kv_transfer_params":{},"bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":2}`,
			want:   `{"model":"m","disaggregated_params":{"request_type":"context_only"},"prompt":"p","stream":false}`,
		},
		{
			name:   "escaped key replaced, bytes of the rest kept",
			client: `{"seed":18446744073709551615,"disaggregated_param\u0073":{"request_type":"generation_only"},"model":"m","prompt":"caf\u00e9","temperature":0.70,"min_tokens":3}`,
			want:   `{"seed":18446744073709551615,"disaggregated_param\u0073":{"request_type":"context_only"},"model":"m","prompt":"caf\u00e9","temperature":0.70,"min_tokens":3,"stream":false}`,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			obj, err := jsonedit.Parse([]byte(tc.client))
			require.NoError(t, err)
			require.Equal(t, tc.want, string(bytes.Join(trtllmContextBody(obj, tc.disaggID), nil)))
		})
	}
}

func TestTRTLLMDisaggRequestID(t *testing.T) {
	seen := map[uint64]bool{}
	for range 1000 {
		id := trtllmDisaggRequestID()
		require.GreaterOrEqual(t, id, uint64(1<<40), "above the workers' local ids")
		require.Less(t, id, uint64(1<<63-1), "a positive int64")
		require.False(t, seen[id])
		seen[id] = true
	}
}

// ctxParams are disaggregated_params as a context server answers them:
// integers beyond float64's exact range, text the engine must get back as is.
const ctxParams = `{"request_type":"context_only","first_gen_tokens":[29871, 9007199254740993],"ctx_request_id":18446744073709551615,"encoded_opaque_state":"MTAuMC4wLjE6ODEwMA==","draft_tokens":null,"disagg_request_id":null,"x":1.50e1}`

// genParams is ctxParams for the generation leg.
const genParams = `{"request_type":"generation_only","first_gen_tokens":[29871, 9007199254740993],"ctx_request_id":18446744073709551615,"encoded_opaque_state":"MTAuMC4wLjE6ODEwMA==","draft_tokens":null,"disagg_request_id":null,"x":1.50e1}`

func TestTRTLLMPrepare(t *testing.T) {
	tests := []struct {
		name, client, answer string
		legacy               bool
		decode               string // DISAGG stands for the request's disagg_request_id
	}{
		{
			name:   "chat: context usage and token ids handed over",
			client: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":64,"stream":true}`,
			answer: `{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"a"},"finish_reason":"not_finished","disaggregated_params":` + ctxParams + `}],"usage":{"prompt_tokens":3},"prompt_token_ids":[1,2,3]}`,
			decode: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":64,"stream":true,"prompt_token_ids":[1,2,3],"disaggregated_params":` + genParamsCurrent(`{"prompt_tokens":3}`) + `}`,
		},
		{
			name:   "completion: token ids replace the prompt",
			client: `{"model":"m","prompt":"p","max_tokens":1}`,
			answer: `{"choices":[{"index":0,"text":"a","finish_reason":"length","disaggregated_params":` + ctxParams + `}],"prompt_token_ids":[7]}`,
			decode: `{"model":"m","prompt":[7],"max_tokens":1,"disaggregated_params":` + genParamsCurrent("") + `}`,
		},
		{
			name:   "legacy: the params alone",
			legacy: true,
			client: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":64,"stream":true}`,
			answer: `{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"a"},"finish_reason":"not_finished","disaggregated_params":` + ctxParams + `}],"usage":{"prompt_tokens":3},"prompt_token_ids":[1,2,3]}`,
			decode: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":64,"stream":true,"disaggregated_params":` + genParams + `}`,
		},
		{
			name:   "legacy: finish_reason length still generates",
			legacy: true,
			client: `{"model":"m","prompt":"p","max_tokens":1}`,
			answer: `{"choices":[{"index":0,"text":"a","finish_reason":"length","disaggregated_params":` + ctxParams + `}]}`,
			decode: `{"model":"m","prompt":"p","max_tokens":1,"disaggregated_params":` + genParams + `}`,
		},
		{
			name:   "legacy: missing or null finish_reason generates",
			legacy: true,
			client: `{"model":"m","prompt":"p"}`,
			answer: `{"choices":[{"index":0,"text":"a","finish_reason":null,"disaggregated_params":` + ctxParams + `}]}`,
			decode: `{"model":"m","prompt":"p","disaggregated_params":` + genParams + `}`,
		},
		{
			name:   "legacy: request_type appended when the answer lacks it, whitespace kept",
			legacy: true,
			client: `{"model":"m","prompt":"p"}`,
			answer: `{"choices":[ { "disaggregated_params" : { "ctx_request_id" : 9223372036854775808 , "opaque_state" : "x" } } ]}`,
			decode: `{"model":"m","prompt":"p","disaggregated_params":{"ctx_request_id" : 9223372036854775808,"opaque_state" : "x","request_type":"generation_only"}}`,
		},
		{
			name:   "legacy: client disaggregated_params replaced in place, other protocol fields stripped",
			legacy: true,
			client: `{"disaggregated_param\u0073":{"request_type":"generation_only","ctx_request_id":666},"model":"m","bootstrap_room":2,"kv_transfer_params":{},"prompt":"p"}`,
			answer: `{"choices":[{"finish_reason":"not_finished","disaggregated_params":` + ctxParams + `}]}`,
			decode: `{"disaggregated_param\u0073":` + genParams + `,"model":"m","prompt":"p"}`,
		},
		{
			name:   "ctx_info_endpoint on the context server itself",
			legacy: true,
			client: `{"model":"m","prompt":"p"}`,
			answer: `{"choices":[{"disaggregated_params":{"ctx_request_id":1,"ctx_info_endpoint":["10.0.0.1:8500"]}}]}`,
			decode: `{"model":"m","prompt":"p","disaggregated_params":{"ctx_request_id":1,"ctx_info_endpoint":["10.0.0.1:8500"],"request_type":"generation_only"}}`,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req := newRequest(t, tc.client)
			if strings.Contains(tc.client, `"prompt"`) {
				req.Path = "/v1/completions"
			}
			eng := fakeengine.New().On(http.MethodPost, testPrefill.Address, req.Path, fakeengine.Reply{Body: tc.answer})
			got, err := TRTLLM{Legacy: tc.legacy}.Prepare(t.Context(), Env{Engine: eng}, req)
			require.NoError(t, err)
			calls := eng.Calls()
			require.Len(t, calls, 1)
			var disaggID uint64
			if !tc.legacy {
				disaggID = disaggIDOf(t, calls[0].Body)
			}
			require.Equal(t, strings.ReplaceAll(tc.decode, "DISAGG", strconv.FormatUint(disaggID, 10)), string(got.Decode.Body))
			require.Equal(t, Handoff{Decode: Decode{Body: got.Decode.Body}}, got, "no request id override, no concurrent prefill, no answer")
			require.Equal(t, []fakeengine.Call{{Method: http.MethodPost, Endpoint: testPrefill, Path: req.Path, RequestID: "req-1", Body: string(bytes.Join(trtllmContextBody(req.Body, disaggID), nil))}}, calls)
		})
	}
}

// genParamsCurrent is ctxParams for the generation leg of the current
// protocol, with usage as ctx_usage ("" for none).
func genParamsCurrent(usage string) string {
	p := `{"request_type":"generation_only","first_gen_tokens":[29871, 9007199254740993],"ctx_request_id":18446744073709551615,"encoded_opaque_state":"MTAuMC4wLjE6ODEwMA==","draft_tokens":null,"disagg_request_id":DISAGG,"x":1.50e1`
	if usage != "" {
		p += `,"ctx_usage":` + usage
	}
	return p + `}`
}

// disaggIDOf returns the disagg_request_id of a context request.
func disaggIDOf(t *testing.T, body string) uint64 {
	t.Helper()
	obj, err := jsonedit.Parse([]byte(body))
	require.NoError(t, err)
	raw, _ := obj.Raw("disaggregated_params")
	params, err := jsonedit.Parse(raw)
	require.NoError(t, err)
	id, _ := params.Raw("disagg_request_id")
	n, err := strconv.ParseUint(string(id), 10, 64)
	require.NoError(t, err, "%s", body)
	return n
}

// A context answer that finished the request is the client's answer: as
// JSON, or as events for a client that streams.
func TestTRTLLMFinishedContext(t *testing.T) {
	const chatAnswer = `{"id":"chatcmpl-1","object":"chat.completion","created":7,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"done."},"finish_reason":"stop","disaggregated_params":` + ctxParams + `}],"usage":{"prompt_tokens":3,"completion_tokens":1}}`
	const textAnswer = `{"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":[{"index":0,"text":"done.","finish_reason":"stop"}]}`
	tests := []struct {
		name, path, client, answer string
		want                       struct{ ContentType, Body string }
	}{
		{
			name: "chat, not streamed", path: "/v1/chat/completions",
			client: `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, answer: chatAnswer,
			want: struct{ ContentType, Body string }{ContentType: "application/json", Body: `{"id":"chatcmpl-1","object":"chat.completion","created":7,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"done."},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}`},
		},
		{
			name: "chat, streamed with usage", path: "/v1/chat/completions",
			client: `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}`, answer: chatAnswer,
			want: struct{ ContentType, Body string }{ContentType: "text/event-stream", Body: "" +
				`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"done."},"logprobs":null,"finish_reason":"stop"}]}` + "\n\n" +
				`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}` + "\n\n" +
				"data: [DONE]\n\n"},
		},
		{
			name: "completion, streamed", path: "/v1/completions",
			client: `{"model":"m","prompt":"p","stream":true}`, answer: textAnswer,
			want: struct{ ContentType, Body string }{ContentType: "text/event-stream", Body: "" +
				`data: {"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":[{"index":0,"text":"done.","logprobs":null,"finish_reason":"stop"}]}` + "\n\n" +
				"data: [DONE]\n\n"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req := newRequest(t, tc.client)
			req.Path = tc.path
			eng := fakeengine.New().On(http.MethodPost, testPrefill.Address, req.Path, fakeengine.Reply{Body: tc.answer})
			got, err := TRTLLM{}.Prepare(t.Context(), Env{Engine: eng}, req)
			require.NoError(t, err)
			require.Nil(t, got.Decode.Body, "no generation leg")
			require.NotNil(t, got.Answer)
			require.Equal(t, tc.want.ContentType, got.Answer.ContentType)
			require.Equal(t, string(tc.want.Body), string(got.Answer.Body))
		})
	}
}

func TestTRTLLMPrepareErrors(t *testing.T) {
	canceled, cancel := context.WithCancel(t.Context())
	cancel()
	tests := []struct {
		name    string
		ctx     context.Context
		reply   fakeengine.Reply
		wantErr string
		is      error
	}{
		{name: "engine error", reply: fakeengine.Reply{Err: &engines.Error{Endpoint: testPrefill, Status: 400, Message: "streaming context"}}, wantErr: "answered 400: streaming context"},
		{name: "plain error named by the endpoint", reply: fakeengine.Reply{Err: errors.New("reset")}, wantErr: "prefill engine 10.0.0.1:8100: reset"},
		{name: "context ends the prefill", ctx: canceled, reply: fakeengine.Reply{Block: true}, is: context.Canceled},
		{name: "not JSON", reply: fakeengine.Reply{Body: `<html>`}, is: engines.ErrBadAnswer},
		{name: "no choices", reply: fakeengine.Reply{Body: `{"id":"x"}`}, wantErr: "no choices", is: engines.ErrBadAnswer},
		{name: "no choice", reply: fakeengine.Reply{Body: `{"choices":[]}`}, is: engines.ErrBadAnswer},
		{name: "two choices", reply: fakeengine.Reply{Body: `{"choices":[{"disaggregated_params":` + ctxParams + `},{"disaggregated_params":` + ctxParams + `}]}`}, is: engines.ErrBadAnswer},
		{name: "choices not an array", reply: fakeengine.Reply{Body: `{"choices":{}}`}, is: engines.ErrBadAnswer},
		{name: "choice not an object", reply: fakeengine.Reply{Body: `{"choices":[1]}`}, is: engines.ErrBadAnswer},
		{name: "missing disaggregated_params", reply: fakeengine.Reply{Body: `{"choices":[{"text":"a","finish_reason":"length"}]}`}, wantErr: "no disaggregated_params", is: engines.ErrBadAnswer},
		{name: "null disaggregated_params", reply: fakeengine.Reply{Body: `{"choices":[{"disaggregated_params":null}]}`}, is: engines.ErrBadAnswer},
		{name: "top-level disaggregated_params is not where upstream puts them", reply: fakeengine.Reply{Body: `{"disaggregated_params":` + ctxParams + `,"choices":[{"text":"a"}]}`}, is: engines.ErrBadAnswer},
		{name: "disaggregated_params not an object", reply: fakeengine.Reply{Body: `{"choices":[{"disaggregated_params":[1]}]}`}, is: engines.ErrBadAnswer},
		{name: "no ctx_request_id", reply: fakeengine.Reply{Body: `{"choices":[{"disaggregated_params":{"request_type":"context_only"}}]}`}, wantErr: "no ctx_request_id", is: engines.ErrBadAnswer},
		{name: "null ctx_request_id", reply: fakeengine.Reply{Body: `{"choices":[{"disaggregated_params":{"ctx_request_id":null}}]}`}, is: engines.ErrBadAnswer},
		{name: "string ctx_request_id", reply: fakeengine.Reply{Body: `{"choices":[{"disaggregated_params":{"ctx_request_id":"1"}}]}`}, is: engines.ErrBadAnswer},
		{name: "ctx_info_endpoint elsewhere", reply: fakeengine.Reply{Body: `{"choices":[{"disaggregated_params":{"ctx_request_id":1,"ctx_info_endpoint":"tcp://203.0.113.66:8500"}}]}`}, wantErr: `"203.0.113.66"`, is: engines.ErrBadAnswer},
		{name: "ctx_info_endpoint not a string", reply: fakeengine.Reply{Body: `{"choices":[{"disaggregated_params":{"ctx_request_id":1,"ctx_info_endpoint":7}}]}`}, is: engines.ErrBadAnswer},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := tc.ctx
			if ctx == nil {
				ctx = t.Context()
			}
			req := newRequest(t, `{"model":"m","prompt":"p"}`)
			eng := fakeengine.New().On(http.MethodPost, testPrefill.Address, req.Path, tc.reply)
			got, err := TRTLLM{}.Prepare(ctx, Env{Engine: eng}, req)
			require.Equal(t, Handoff{}, got)
			requireEngineError(t, err, testPrefill)
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
			}
			if tc.is != nil {
				require.ErrorIs(t, err, tc.is)
			}
		})
	}
}
