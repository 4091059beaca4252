package connectors

import (
	"context"
	"errors"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

func TestHTTPPrepare(t *testing.T) {
	tests := []struct {
		name, client, prefill, decode string
	}{
		{
			name:    "chat, streaming",
			client:  `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":64,"stream":true,"stream_options":{"include_usage":true}}`,
			prefill: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1,"stream":false}`,
			decode:  `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":64,"stream":true,"stream_options":{"include_usage":true}}`,
		},
		{
			name:    "both limits 1, min tokens dropped",
			client:  `{"model":"m","max_tokens":10,"min_tokens":2,"max_completion_tokens":64,"min_completion_tokens":3,"messages":[]}`,
			prefill: `{"model":"m","max_tokens":1,"max_completion_tokens":1,"messages":[],"stream":false}`,
			decode:  `{"model":"m","max_tokens":10,"min_tokens":2,"max_completion_tokens":64,"min_completion_tokens":3,"messages":[]}`,
		},
		{
			name:    "number text, big integers, escapes and order kept",
			client:  `{"temperature":0.70,"seed":18446744073709551615,"model":"m","prompt":"caf\u00e9 \"q\"","logit_bias":{"42":-1e2}}`,
			prefill: `{"temperature":0.70,"seed":18446744073709551615,"model":"m","prompt":"caf\u00e9 \"q\"","logit_bias":{"42":-1e2},"stream":false,"max_tokens":1}`,
			decode:  `{"temperature":0.70,"seed":18446744073709551615,"model":"m","prompt":"caf\u00e9 \"q\"","logit_bias":{"42":-1e2}}`,
		},
		{
			name:    "client protocol fields stripped on both legs",
			client:  `{"model":"m","kv_transfer_params":{"remote_host":"10.6.6.6"},"prompt":"p","bootstrap_host":"10.6.6.6","bootstrap_port":8998,"bootstrap_room":9223372036854775807,"disaggregated_params":{"request_type":"generation_only"}}`,
			prefill: `{"model":"m","prompt":"p","stream":false,"max_tokens":1}`,
			decode:  `{"model":"m","prompt":"p"}`,
		},
		{
			name:    "escaped protocol keys stripped too",
			client:  `{"model":"m","kv_transfer_param\u0073":{"remote_host":"10.6.6.6"},"prompt":"p","\u0062ootstrap_room":1,"disaggregated_param\u0073":{}}`,
			prefill: `{"model":"m","prompt":"p","stream":false,"max_tokens":1}`,
			decode:  `{"model":"m","prompt":"p"}`,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req := newRequest(t, tc.client)
			eng := fakeengine.New().On(http.MethodPost, testPrefill.Address, req.Path, fakeengine.Reply{Body: `{"id":"x","choices":[{"text":"a"}]}`})
			got, err := HTTP{}.Prepare(t.Context(), Env{Engine: eng}, req)
			require.NoError(t, err)
			require.Equal(t, []fakeengine.Call{{Method: http.MethodPost, Endpoint: testPrefill, Path: req.Path, RequestID: "req-1", Body: tc.prefill}}, eng.Calls())
			require.Equal(t, tc.decode, string(got.Decode.Body))
			require.Equal(t, Handoff{Decode: Decode{Body: got.Decode.Body}}, got, "no request id override, no concurrent prefill")
		})
	}
}

func TestHTTPPrepareErrors(t *testing.T) {
	canceled, cancel := context.WithCancel(t.Context())
	cancel()
	tests := []struct {
		name    string
		ctx     context.Context
		reply   fakeengine.Reply
		wantErr string
		is      error
	}{
		{name: "engine error passed up", reply: fakeengine.Reply{Err: &engines.Error{Endpoint: testPrefill, Status: 500, Message: "boom"}}, wantErr: "answered 500: boom"},
		{name: "plain error becomes an engines.Error", reply: fakeengine.Reply{Err: errors.New("refused")}, wantErr: "refused"},
		{name: "context ends the prefill", ctx: canceled, reply: fakeengine.Reply{Block: true}, is: context.Canceled},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := tc.ctx
			if ctx == nil {
				ctx = t.Context()
			}
			req := newRequest(t, `{"model":"m","prompt":"p"}`)
			eng := fakeengine.New().On(http.MethodPost, testPrefill.Address, req.Path, tc.reply)
			got, err := HTTP{}.Prepare(ctx, Env{Engine: eng}, req)
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

func TestHTTPRegisteredAsLMCache(t *testing.T) {
	for _, name := range []string{"http", "lmcache"} {
		c, err := newFor(t, name, "")
		require.NoError(t, err)
		require.Equal(t, HTTP{}, c)
	}
}
