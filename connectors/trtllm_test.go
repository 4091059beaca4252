package connectors

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/jsonedit"
)

func TestTRTLLMContextBody(t *testing.T) {
	tests := []struct {
		name, client, want string
	}{
		{
			name:   "streaming chat made non-streaming, output limit kept",
			client: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":64,"stream":true,"stream_options":{"include_usage":true}}`,
			want:   `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":64,"stream":false,"disaggregated_params":{"request_type":"context_only"}}`,
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
			require.Equal(t, tc.want, string(bytes.Join(trtllmContextBody(obj), nil)))
		})
	}
}

// ctxParams are disaggregated_params as a context server answers them:
// integers beyond float64's exact range, text the engine must get back as is.
const ctxParams = `{"request_type":"context_only","first_gen_tokens":[29871, 9007199254740993],"ctx_request_id":18446744073709551615,"encoded_opaque_state":"MTAuMC4wLjE6ODEwMA==","draft_tokens":null,"disagg_request_id":null,"x":1.50e1}`

// genParams is ctxParams for the generation leg.
const genParams = `{"request_type":"generation_only","first_gen_tokens":[29871, 9007199254740993],"ctx_request_id":18446744073709551615,"encoded_opaque_state":"MTAuMC4wLjE6ODEwMA==","draft_tokens":null,"disagg_request_id":null,"x":1.50e1}`

func TestTRTLLMPrepare(t *testing.T) {
	tests := []struct {
		name, client, answer, decode string
	}{
		{
			name:   "chat",
			client: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":64,"stream":true}`,
			answer: `{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"a"},"finish_reason":"not_finished","disaggregated_params":` + ctxParams + `}],"usage":{"prompt_tokens":3}}`,
			decode: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":64,"stream":true,"disaggregated_params":` + genParams + `}`,
		},
		{
			name:   "finish_reason length still generates",
			client: `{"model":"m","prompt":"p","max_tokens":1}`,
			answer: `{"choices":[{"index":0,"text":"a","finish_reason":"length","disaggregated_params":` + ctxParams + `}]}`,
			decode: `{"model":"m","prompt":"p","max_tokens":1,"disaggregated_params":` + genParams + `}`,
		},
		{
			name:   "missing or null finish_reason generates",
			client: `{"model":"m","prompt":"p"}`,
			answer: `{"choices":[{"index":0,"text":"a","finish_reason":null,"disaggregated_params":` + ctxParams + `}]}`,
			decode: `{"model":"m","prompt":"p","disaggregated_params":` + genParams + `}`,
		},
		{
			name:   "request_type appended when the answer lacks it, whitespace kept",
			client: `{"model":"m","prompt":"p"}`,
			answer: `{"choices":[ { "disaggregated_params" : { "ctx_request_id" : 9223372036854775808 , "opaque_state" : "x" } } ]}`,
			decode: `{"model":"m","prompt":"p","disaggregated_params":{"ctx_request_id" : 9223372036854775808,"opaque_state" : "x","request_type":"generation_only"}}`,
		},
		{
			name:   "client disaggregated_params replaced in place, other protocol fields stripped",
			client: `{"disaggregated_param\u0073":{"request_type":"generation_only","ctx_request_id":666},"model":"m","bootstrap_room":2,"kv_transfer_params":{},"prompt":"p"}`,
			answer: `{"choices":[{"finish_reason":"not_finished","disaggregated_params":` + ctxParams + `}]}`,
			decode: `{"disaggregated_param\u0073":` + genParams + `,"model":"m","prompt":"p"}`,
		},
		{
			name:   "finished on the context server: generation recomputes from the plain body",
			client: `{"model":"m","prompt":"p","disaggregated_params":{"request_type":"generation_only"},"stream":true}`,
			answer: `{"choices":[{"text":"","finish_reason":"stop","disaggregated_params":` + ctxParams + `}]}`,
			decode: `{"model":"m","prompt":"p","stream":true}`,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req := newRequest(t, tc.client)
			eng := newFakeEngine().on(http.MethodPost, testPrefill.Address, req.Path, reply{body: tc.answer})
			got, err := TRTLLM{}.Prepare(t.Context(), eng, req)
			require.NoError(t, err)
			require.Equal(t, tc.decode, string(got.Body))
			require.Equal(t, Decode{Body: got.Body}, got, "no request id override, no concurrent prefill")
			require.Equal(t, []engineCall{{method: http.MethodPost, endpoint: testPrefill, path: req.Path, requestID: "req-1", body: string(bytes.Join(trtllmContextBody(req.Body), nil))}}, eng.recorded())
		})
	}
}

func TestTRTLLMPrepareErrors(t *testing.T) {
	canceled, cancel := context.WithCancel(t.Context())
	cancel()
	tests := []struct {
		name    string
		ctx     context.Context
		reply   reply
		wantErr string
		is      error
	}{
		{name: "engine error", reply: reply{err: &EngineError{Endpoint: testPrefill, Status: 400, Message: "streaming context"}}, wantErr: "answered 400: streaming context"},
		{name: "plain error named by the endpoint", reply: reply{err: errors.New("reset")}, wantErr: "prefill engine 10.0.0.1:8100: reset"},
		{name: "context ends the prefill", ctx: canceled, reply: reply{block: true}, is: context.Canceled},
		{name: "not JSON", reply: reply{body: `<html>`}, is: ErrBadAnswer},
		{name: "no choices", reply: reply{body: `{"id":"x"}`}, wantErr: "no choices", is: ErrBadAnswer},
		{name: "no choice", reply: reply{body: `{"choices":[]}`}, is: ErrBadAnswer},
		{name: "two choices", reply: reply{body: `{"choices":[{"disaggregated_params":` + ctxParams + `},{"disaggregated_params":` + ctxParams + `}]}`}, is: ErrBadAnswer},
		{name: "choices not an array", reply: reply{body: `{"choices":{}}`}, is: ErrBadAnswer},
		{name: "choice not an object", reply: reply{body: `{"choices":[1]}`}, is: ErrBadAnswer},
		{name: "missing disaggregated_params", reply: reply{body: `{"choices":[{"text":"a","finish_reason":"length"}]}`}, wantErr: "no disaggregated_params", is: ErrBadAnswer},
		{name: "null disaggregated_params", reply: reply{body: `{"choices":[{"disaggregated_params":null}]}`}, is: ErrBadAnswer},
		{name: "finished and missing disaggregated_params", reply: reply{body: `{"choices":[{"finish_reason":"stop"}]}`}, is: ErrBadAnswer},
		{name: "top-level disaggregated_params is not where upstream puts them", reply: reply{body: `{"disaggregated_params":` + ctxParams + `,"choices":[{"text":"a"}]}`}, is: ErrBadAnswer},
		{name: "disaggregated_params not an object", reply: reply{body: `{"choices":[{"disaggregated_params":[1]}]}`}, is: ErrBadAnswer},
		{name: "no ctx_request_id", reply: reply{body: `{"choices":[{"disaggregated_params":{"request_type":"context_only"}}]}`}, wantErr: "no ctx_request_id", is: ErrBadAnswer},
		{name: "null ctx_request_id", reply: reply{body: `{"choices":[{"disaggregated_params":{"ctx_request_id":null}}]}`}, is: ErrBadAnswer},
		{name: "string ctx_request_id", reply: reply{body: `{"choices":[{"disaggregated_params":{"ctx_request_id":"1"}}]}`}, is: ErrBadAnswer},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := tc.ctx
			if ctx == nil {
				ctx = t.Context()
			}
			req := newRequest(t, `{"model":"m","prompt":"p"}`)
			eng := newFakeEngine().on(http.MethodPost, testPrefill.Address, req.Path, tc.reply)
			got, err := TRTLLM{}.Prepare(ctx, eng, req)
			require.Equal(t, Decode{}, got)
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
