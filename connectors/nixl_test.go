package connectors

import (
	"bytes"
	"errors"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/jsonedit"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

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
			name:   "max_completion_tokens set: both limits 1, as vLLM's proxy sends them",
			client: `{"model":"m","max_tokens":10,"max_completion_tokens":64,"messages":[]}`,
			want:   `{"model":"m","max_tokens":1,"max_completion_tokens":1,"messages":[],"stream":false,"kv_transfer_params":` + prefillParams + `}`,
		},
		{
			name:   "max_completion_tokens alone: max_tokens added, which /v1/completions reads",
			client: `{"model":"m","prompt":"p","max_completion_tokens":64}`,
			want:   `{"model":"m","prompt":"p","max_completion_tokens":1,"stream":false,"max_tokens":1,"kv_transfer_params":` + prefillParams + `}`,
		},
		{
			name:   "null options left out",
			client: `{"model":"m","prompt":"p","max_completion_tokens":null,"stream":null,"n":null,"stream_options":null}`,
			want:   `{"model":"m","prompt":"p","stream":false,"max_tokens":1,"kv_transfer_params":` + prefillParams + `}`,
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
			name:   "client bootstrap and disaggregated_params removed",
			client: `{"model":"m","bootstrap_host":"10.6.6.6","prompt":"p","bootstrap_port":1,"bootstrap_room":9223372036854775807,"disaggregated_params":{"request_type":"generation_only","ctx_request_id":1}}`,
			want:   `{"model":"m","prompt":"p","stream":false,"max_tokens":1,"kv_transfer_params":` + prefillParams + `}`,
		},
		{
			name:   "escaped protocol keys removed or replaced",
			client: `{"model":"m","kv_transfer_param\u0073":{"remote_host":"10.6.6.6"},"bootstrap_roo\u006d":7,"prompt":"p"}`,
			want:   `{"model":"m","kv_transfer_param\u0073":` + prefillParams + `,"prompt":"p","stream":false,"max_tokens":1}`,
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
			require.JSONEq(t, tc.want, string(bytes.Join(nixlPrefillBody(nil, APIChat, obj, nixlPrefillParams), nil)))
			require.Equal(t, tc.want, string(bytes.Join(nixlPrefillBody(nil, APIChat, obj, nixlPrefillParams), nil)), "byte-exact")
		})
	}
}

func TestNIXLPrepare(t *testing.T) {
	const kv = `{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"e1","remote_block_ids":[[1,2,3]],"remote_request_id":"r1","remote_host":"10.0.0.1","remote_port":21001,"tp_size":1}`
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
		{
			name:   "client protocol fields never reach decode",
			client: `{"model":"m","bootstrap_host":"10.6.6.6","bootstrap_port":1,"bootstrap_room":3,"disaggregated_params":{},"prompt":"p","kv_transfer_param\u0073":{"remote_host":"10.6.6.6"}}`,
			answer: `{"kv_transfer_params":` + kv + `}`,
			want:   `{"model":"m","prompt":"p","kv_transfer_param\u0073":` + kv + `}`,
		},
		{
			name:   "params bytes kept, big integers included",
			client: `{"model":"m","prompt":"p"}`,
			answer: `{"kv_transfer_params":{"remote_block_ids":[[18446744073709551615, 9007199254740993]],"x":1.0e0,"remote_host":"10.0.0.1","remote_port":21001}}`,
			want:   `{"model":"m","prompt":"p","kv_transfer_params":{"remote_block_ids":[[18446744073709551615, 9007199254740993]],"x":1.0e0,"remote_host":"10.0.0.1","remote_port":21001}}`,
		},
		{
			name:   "members vLLM adds pass unchecked",
			client: `{"model":"m","prompt":"p"}`,
			answer: `{"kv_transfer_params":{"remote_host":"10.0.0.1","remote_port":21001,"dcp_size":1,"remote_blocks_expiry_time":1.7e9}}`,
			want:   `{"model":"m","prompt":"p","kv_transfer_params":{"remote_host":"10.0.0.1","remote_port":21001,"dcp_size":1,"remote_blocks_expiry_time":1.7e9}}`,
		},
		{name: "KV source elsewhere", client: `{"model":"m"}`, answer: `{"kv_transfer_params":{"remote_host":"203.0.113.66","remote_port":21001}}`, wantErr: "203.0.113.66:21001"},
		{name: "KV source on another port", client: `{"model":"m"}`, answer: `{"kv_transfer_params":{"remote_host":"10.0.0.1","remote_port":9901}}`, wantErr: "kv_address is 10.0.0.1:21001"},
		{name: "KV source missing", client: `{"model":"m"}`, answer: `{"kv_transfer_params":{"remote_engine_id":"e"}}`, wantErr: "remote_host is nothing"},
		{name: "KV host not a string", client: `{"model":"m"}`, answer: `{"kv_transfer_params":{"remote_host":1,"remote_port":21001}}`, wantErr: "remote_host is 1"},
		{name: "KV port not a port", client: `{"model":"m"}`, answer: `{"kv_transfer_params":{"remote_host":"10.0.0.1","remote_port":"21001"}}`, wantErr: "remote_port is \"21001\""},
		{name: "engine error passed up", client: `{"model":"m"}`, engineErr: &engines.Error{Endpoint: testPrefill, Status: 500}, wantErr: "answered 500"},
		{name: "engine error named by its endpoint", client: `{"model":"m"}`, engineErr: &engines.Error{Status: 503}, wantErr: "prefill engine 10.0.0.1:8100 answered 503"},
		{name: "other engine errors become engines.Errors", client: `{"model":"m"}`, engineErr: errors.New("boom"), wantErr: "prefill engine 10.0.0.1:8100: boom"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req := newRequest(t, tc.client)
			req.Path = "/v1/completions"
			eng := fakeengine.New().On(http.MethodPost, testPrefill.Address, "/v1/completions", fakeengine.Reply{Body: tc.answer, Err: tc.engineErr})
			got, err := NIXL{}.Prepare(t.Context(), Env{Engine: eng}, req)
			require.Equal(t, []fakeengine.Call{{
				Method: http.MethodPost, Endpoint: testPrefill, Path: "/v1/completions",
				RequestID: "req-1", Body: string(bytes.Join(nixlPrefillBody(nil, APIOf(req.Path), req.Body, nixlPrefillParams), nil)),
			}}, eng.Calls())
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				requireEngineError(t, err, testPrefill)
				if tc.engineErr == nil {
					require.ErrorIs(t, err, engines.ErrBadAnswer)
				}
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, string(got.Decode.Body))
			require.Empty(t, got.Decode.RequestID)
			require.Nil(t, got.Prefill)
		})
	}
}

// The decode may be told to pull KV only from the prefill engine pdx
// called: its own host (or kv_address), or a host the pool allows.
func TestNIXLKVSource(t *testing.T) {
	allowed, err := endpoint.ParseHostSet([]string{"192.168.7.0/24", "kv-0.example"})
	require.NoError(t, err)
	noKV := endpoint.Endpoint{Address: "10.0.0.1:8100"}
	loop := endpoint.Endpoint{Address: "127.0.0.1:8100"}
	tests := []struct {
		name    string
		prefill endpoint.Endpoint
		hosts   endpoint.HostSet
		rank    endpoint.Rank
		host    string
		port    int
		ok      bool
	}{
		{name: "own host, any port", prefill: noKV, host: "10.0.0.1", port: 5600, ok: true},
		{name: "own host written otherwise", prefill: endpoint.Endpoint{Address: "[fd00::1]:8100"}, host: "fd00:0::1", port: 5600, ok: true},
		{name: "another host", prefill: noKV, host: "10.0.0.2", port: 5600},
		{name: "localhost from a remote engine", prefill: noKV, host: "localhost", port: 5600},
		{name: "localhost from an engine on loopback", prefill: loop, host: "localhost", port: 5600, ok: true},
		{name: "allowed prefix", prefill: noKV, hosts: allowed, host: "192.168.7.9", port: 5600, ok: true},
		{name: "allowed name", prefill: noKV, hosts: allowed, host: "KV-0.example", port: 5600, ok: true},
		{name: "outside the allowed prefix", prefill: noKV, hosts: allowed, host: "192.168.8.9", port: 5600},
		{name: "kv_address exactly", prefill: testPrefill, host: "10.0.0.1", port: 21001, ok: true},
		{name: "kv_address host, other port", prefill: testPrefill, host: "10.0.0.1", port: 5600},
		{name: "allowed host on the kv_address port", prefill: testPrefill, hosts: allowed, host: "192.168.7.9", port: 21001, ok: true},
		{name: "allowed host on another port", prefill: testPrefill, hosts: allowed, host: "192.168.7.9", port: 5600},
		// vLLM's DP rank r listens on VLLM_NIXL_SIDE_CHANNEL_PORT + r.
		{name: "dp rank 3 on its side channel", prefill: testPrefill, rank: endpoint.RankOf(3), host: "10.0.0.1", port: 21004, ok: true},
		{name: "dp rank 3 naming rank 0's", prefill: testPrefill, rank: endpoint.RankOf(3), host: "10.0.0.1", port: 21001},
		{name: "dp rank 0 is the kv_address", prefill: testPrefill, rank: endpoint.RankOf(0), host: "10.0.0.1", port: 21001, ok: true},
		{name: "dp rank without kv_address, any port", prefill: noKV, rank: endpoint.RankOf(3), host: "10.0.0.1", port: 5600, ok: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req := &Request{Prefill: tc.prefill, KVHosts: tc.hosts, PrefillRank: tc.rank}
			err := checkKVSource(req, []byte(tc.host), tc.port)
			if tc.ok {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, engines.ErrBadAnswer)
		})
	}
}

// Release sends the decode engine a one-token decode with the prefill's
// blocks: reading them (or aborting before it does) frees them.
func TestNIXLRelease(t *testing.T) {
	const kv = `{"do_remote_prefill":true,"remote_engine_id":"e1","remote_block_ids":[[1]],"remote_request_id":"r1","remote_host":"10.0.0.1","remote_port":21001}`
	req := newRequest(t, `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"max_completion_tokens":64}`)
	eng := fakeengine.New().
		On(http.MethodPost, testPrefill.Address, req.Path, fakeengine.Reply{Body: `{"kv_transfer_params":` + kv + `}`}).
		On(http.MethodPost, testDecode.Address, req.Path, fakeengine.Reply{Body: `{}`})
	got, err := NIXL{}.Prepare(t.Context(), Env{Engine: eng}, req)
	require.NoError(t, err)
	require.NotNil(t, got.Held, "the prefill keeps its blocks for the decode")
	require.NoError(t, got.Held.Release(t.Context(), Env{Engine: eng}))
	calls := eng.Calls()
	require.Len(t, calls, 2)
	require.Equal(t, fakeengine.Call{Method: http.MethodPost, Endpoint: testDecode, Path: req.Path, RequestID: "req-1",
		Body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":false,"max_completion_tokens":1,"max_tokens":1,"kv_transfer_params":` + kv + `}`}, calls[1])

	// A prefill that ended on EOS keeps no blocks: nothing to release.
	eng = fakeengine.New().On(http.MethodPost, testPrefill.Address, req.Path, fakeengine.Reply{Body: `{"kv_transfer_params":null}`})
	got, err = NIXL{}.Prepare(t.Context(), Env{Engine: eng}, req)
	require.NoError(t, err)
	require.Nil(t, got.Held, "nothing to release")
	require.Len(t, eng.Calls(), 1)
}
