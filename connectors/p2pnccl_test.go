package connectors

import (
	"context"
	"errors"
	"net/http"
	"regexp"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// p2pID matches vLLM's xPyD proxy id for the test endpoints: uuid4().hex.
var p2pID = regexp.MustCompile(`^___prefill_addr_10\.0\.0\.1:21001___decode_addr_10\.0\.0\.2:22001_[0-9a-f]{12}4[0-9a-f]{3}[89ab][0-9a-f]{15}$`)

func TestP2PNCCLPrepare(t *testing.T) {
	tests := []struct {
		name, client, prefill, decode string
	}{
		{
			name:    "completions, streaming",
			client:  `{"model":"m","prompt":"p","max_tokens":64,"stream":true,"stream_options":{"include_usage":true}}`,
			prefill: `{"model":"m","prompt":"p","max_tokens":1,"stream":false}`,
			decode:  `{"model":"m","prompt":"p","max_tokens":64,"stream":true,"stream_options":{"include_usage":true}}`,
		},
		{
			name:    "client protocol fields stripped on both legs, rest kept",
			client:  `{"seed":18446744073709551615,"model":"m","kv_transfer_param\u0073":{"remote_host":"10.6.6.6"},"bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":2,"disaggregated_params":{},"messages":[{"role":"user","content":"caf\u00e9"}],"temperature":0.70,"max_completion_tokens":9}`,
			prefill: `{"seed":18446744073709551615,"model":"m","messages":[{"role":"user","content":"caf\u00e9"}],"temperature":0.70,"max_completion_tokens":1,"stream":false,"max_tokens":1}`,
			decode:  `{"seed":18446744073709551615,"model":"m","messages":[{"role":"user","content":"caf\u00e9"}],"temperature":0.70,"max_completion_tokens":9}`,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req := newRequest(t, tc.client)
			eng := fakeengine.New().On(http.MethodPost, testPrefill.Address, req.Path, fakeengine.Reply{Body: `{"id":"x"}`})
			got, err := P2PNCCL{}.Prepare(t.Context(), Env{Engine: eng}, req)
			require.NoError(t, err)
			require.Regexp(t, p2pID, got.Decode.RequestID)
			require.Equal(t, tc.decode, string(got.Decode.Body))
			require.Nil(t, got.Prefill)
			require.Equal(t, []fakeengine.Call{{Method: http.MethodPost, Endpoint: testPrefill, Path: req.Path, RequestID: got.Decode.RequestID, Body: tc.prefill}},
				eng.Calls(), "the prefill is sent with the encoded id")
		})
	}
}

func TestP2PNCCLRequestIDFresh(t *testing.T) {
	req := newRequest(t, `{"model":"m","prompt":"p"}`)
	eng := fakeengine.New().On(http.MethodPost, testPrefill.Address, req.Path, fakeengine.Reply{Body: `{}`})
	seen := map[string]bool{}
	for range 500 {
		got, err := P2PNCCL{}.Prepare(t.Context(), Env{Engine: eng}, req)
		require.NoError(t, err)
		require.Regexp(t, p2pID, got.Decode.RequestID)
		require.False(t, seen[got.Decode.RequestID], "id %s reused", got.Decode.RequestID)
		seen[got.Decode.RequestID] = true
	}
}

func TestP2PNCCLErrors(t *testing.T) {
	canceled, cancel := context.WithCancel(t.Context())
	cancel()
	tests := []struct {
		name     string
		ctx      context.Context
		prefill  endpoint.Endpoint
		decode   endpoint.Endpoint
		reply    fakeengine.Reply
		wantErr  string
		is       error
		noEngine bool
	}{
		{name: "prefill without kv address", prefill: endpoint.Endpoint{Address: "10.0.0.1:8100"}, decode: testDecode, wantErr: "no kv_address", noEngine: true},
		{name: "decode without kv address", prefill: testPrefill, decode: endpoint.Endpoint{Address: "10.0.0.2:8200"}, wantErr: "no kv_address", noEngine: true},
		{name: "engine error", prefill: testPrefill, decode: testDecode, reply: fakeengine.Reply{Err: &engines.Error{Endpoint: testPrefill, Status: 400, Message: "bad id"}}, wantErr: "answered 400: bad id"},
		{name: "plain error named by the endpoint", prefill: testPrefill, decode: testDecode, reply: fakeengine.Reply{Err: errors.New("reset")}, wantErr: "prefill engine 10.0.0.1:8100: reset"},
		{name: "context ends the prefill", ctx: canceled, prefill: testPrefill, decode: testDecode, reply: fakeengine.Reply{Block: true}, is: context.Canceled},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := tc.ctx
			if ctx == nil {
				ctx = t.Context()
			}
			req := newRequest(t, `{"model":"m","prompt":"p"}`)
			req.Prefill, req.Decode = tc.prefill, tc.decode
			eng := fakeengine.New().On(http.MethodPost, tc.prefill.Address, req.Path, tc.reply)
			got, err := P2PNCCL{}.Prepare(ctx, Env{Engine: eng}, req)
			require.Equal(t, Handoff{}, got)
			require.Error(t, err)
			if tc.noEngine {
				require.Empty(t, eng.Calls())
				_, isEngine := errors.AsType[*engines.Error](err)
				require.False(t, isEngine, "a configuration error, not an engine failure")
			} else {
				requireEngineError(t, err, testPrefill)
			}
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
			}
			if tc.is != nil {
				require.ErrorIs(t, err, tc.is)
			}
		})
	}
}
