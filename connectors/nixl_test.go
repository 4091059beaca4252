package connectors

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/jsonedit"
)

// engineFunc adapts a function to [Engine].
type engineFunc func(ctx context.Context, ep Endpoint, path, requestID string, body []byte) ([]byte, error)

func (f engineFunc) Post(ctx context.Context, ep Endpoint, path, requestID string, body []byte) ([]byte, error) {
	return f(ctx, ep, path, requestID, body)
}

func (f engineFunc) Get(context.Context, string, string) ([]byte, error) {
	return nil, errors.New("unexpected GET")
}

const prefillParams = `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`

func TestNIXLPrefillBody(t *testing.T) {
	tests := []struct {
		name, client, want string
	}{
		{
			name:   "chat with max_tokens and stream",
			client: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":64,"stream":true,"stream_options":{"include_usage":true}}`,
			want:   `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1,"stream":false,"kv_transfer_params":` + prefillParams + `}`,
		},
		{
			name:   "max_completion_tokens limited, max_tokens dropped",
			client: `{"model":"m","max_tokens":10,"max_completion_tokens":64,"messages":[]}`,
			want:   `{"model":"m","max_completion_tokens":1,"messages":[],"stream":false,"kv_transfer_params":` + prefillParams + `}`,
		},
		{
			name:   "no limit given adds max_tokens",
			client: `{"model":"m","prompt":"p"}`,
			want:   `{"model":"m","prompt":"p","stream":false,"max_tokens":1,"kv_transfer_params":` + prefillParams + `}`,
		},
		{
			name:   "min_tokens and min_completion_tokens removed",
			client: `{"model":"m","prompt":"p","min_tokens":5,"min_completion_tokens":5,"max_tokens":9}`,
			want:   `{"model":"m","prompt":"p","max_tokens":1,"stream":false,"kv_transfer_params":` + prefillParams + `}`,
		},
		{
			name:   "client kv_transfer_params replaced",
			client: `{"model":"m","prompt":"p","kv_transfer_params":{"remote_host":"10.0.0.66"}}`,
			want:   `{"model":"m","prompt":"p","kv_transfer_params":` + prefillParams + `,"stream":false,"max_tokens":1}`,
		},
		{
			name:   "other fields keep bytes and order",
			client: `{"temperature":0.70,"seed":18446744073709551615,"model":"m","prompt":"caf\u00e9","logit_bias":{"42":-1e2}}`,
			want:   `{"temperature":0.70,"seed":18446744073709551615,"model":"m","prompt":"caf\u00e9","logit_bias":{"42":-1e2},"stream":false,"max_tokens":1,"kv_transfer_params":` + prefillParams + `}`,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			obj, err := jsonedit.Parse([]byte(tc.client))
			require.NoError(t, err)
			require.JSONEq(t, tc.want, string(nixlPrefillBody(obj)))
			require.Equal(t, tc.want, string(nixlPrefillBody(obj)), "byte-exact")
		})
	}
}

func TestNIXLPrepare(t *testing.T) {
	const kv = `{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"e1","remote_block_ids":[[1,2,3]],"remote_request_id":"r1","remote_host":"127.0.0.1","remote_port":8100,"tp_size":1}`
	tests := []struct {
		name      string
		client    string
		answer    string
		engineErr error
		want      string
		wantErr   string
	}{
		{
			name:   "params appended to client body unchanged",
			client: `{"model":"m","prompt":"p","stream":true,"max_tokens":64}`,
			answer: `{"id":"x","choices":[{"text":"a"}],"kv_transfer_params":` + kv + `}`,
			want:   `{"model":"m","prompt":"p","stream":true,"max_tokens":64,"kv_transfer_params":` + kv + `}`,
		},
		{
			name:   "null params give the plain client body",
			client: `{"model":"m","prompt":"p"}`,
			answer: `{"id":"x","kv_transfer_params":null}`,
			want:   `{"model":"m","prompt":"p"}`,
		},
		{
			name:   "absent params give the plain client body",
			client: `{"model":"m","prompt":"p"}`,
			answer: `{"id":"x"}`,
			want:   `{"model":"m","prompt":"p"}`,
		},
		{
			name:   "client params never reach decode",
			client: `{"model":"m","kv_transfer_params":{"remote_host":"10.6.6.6"},"prompt":"p"}`,
			answer: `{"kv_transfer_params":null}`,
			want:   `{"model":"m","prompt":"p"}`,
		},
		{
			name:   "client params replaced by the prefill's",
			client: `{"model":"m","kv_transfer_params":{"remote_host":"10.6.6.6"},"prompt":"p"}`,
			answer: `{"kv_transfer_params":` + kv + `}`,
			want:   `{"model":"m","kv_transfer_params":` + kv + `,"prompt":"p"}`,
		},
		{name: "non-JSON answer", client: `{"model":"m"}`, answer: `<html>`, wantErr: "invalid prefill answer"},
		{name: "params not an object", client: `{"model":"m"}`, answer: `{"kv_transfer_params":[1]}`, wantErr: "not an object"},
		{name: "engine error passed up", client: `{"model":"m"}`, engineErr: &EngineError{Status: 500}, wantErr: "answered 500"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			obj, err := jsonedit.Parse([]byte(tc.client))
			require.NoError(t, err)
			req := &Request{ID: "req-1", Path: "/v1/completions", Body: obj, Prefill: Endpoint{Address: "127.0.0.1:8100"}, Decode: Endpoint{Address: "127.0.0.1:8200"}}
			var calls int
			eng := engineFunc(func(_ context.Context, ep Endpoint, path, id string, body []byte) ([]byte, error) {
				calls++
				require.Equal(t, req.Prefill, ep)
				require.Equal(t, "/v1/completions", path)
				require.Equal(t, "req-1", id)
				require.Equal(t, string(nixlPrefillBody(obj)), string(body))
				return []byte(tc.answer), tc.engineErr
			})
			got, err := NIXL{}.Prepare(t.Context(), eng, req)
			require.Equal(t, 1, calls)
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				var ee *EngineError
				require.True(t, errors.As(err, &ee), "connector errors are EngineErrors")
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, string(got.Body))
		})
	}
}
