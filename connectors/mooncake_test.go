package connectors

import (
	"context"
	"errors"
	"net/http"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

func TestNewMooncake(t *testing.T) {
	tests := []struct {
		protocol string
		want     Connector
		wantErr  string
	}{
		{protocol: "", want: NIXL{}},
		{protocol: "nixl", want: NIXL{}},
		{protocol: "vllm", want: MooncakeVLLMConnector{}},
		{protocol: "rdma", wantErr: `unknown mooncake protocol "rdma"`},
		{protocol: "VLLM", wantErr: `unknown mooncake protocol "VLLM"`},
	}
	for _, tc := range tests {
		t.Run(tc.protocol, func(t *testing.T) {
			c, err := newFor(t, "mooncake", tc.protocol)
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				require.Nil(t, c)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, c)
		})
	}
}

const mooncakeQuery = `{"0":{"engine_id":"a0b1-c2","worker_addr":{"0":{"0":"10.0.0.1:17001"}}},"1":{"engine_id":"other","worker_addr":{}}}`

func TestMooncakeVLLMPrepare(t *testing.T) {
	tests := []struct {
		name          string
		id            string
		bootstrapPort int
		query         string
		client        string
		prefill       string
		decode        string
		bootstrap     string
	}{
		{
			name:      "chat, default bootstrap port",
			id:        "req-1",
			query:     mooncakeQuery,
			client:    `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":64,"stream":true,"stream_options":{"include_usage":true}}`,
			prefill:   `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1,"stream":false,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"xfer-ID"}}`,
			decode:    `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":64,"stream":true,"stream_options":{"include_usage":true},"kv_transfer_params":{"do_remote_decode":false,"do_remote_prefill":true,"remote_bootstrap_addr":"http://10.0.0.1:8998","remote_engine_id":"a0b1-c2","transfer_id":"xfer-ID"}}`,
			bootstrap: "10.0.0.1:8998",
		},
		{
			name:          "own bootstrap port, escaped engine id kept, id escaped",
			id:            `r"1\`,
			bootstrapPort: 9100,
			query:         ` { "0" : { "engine_id" : "caf\u00e9" } } `,
			client:        `{"model":"m","prompt":"p","max_completion_tokens":5,"max_tokens":5}`,
			prefill:       `{"model":"m","prompt":"p","max_completion_tokens":1,"max_tokens":1,"stream":false,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"xfer-ID"}}`,
			decode:        `{"model":"m","prompt":"p","max_completion_tokens":5,"max_tokens":5,"kv_transfer_params":{"do_remote_decode":false,"do_remote_prefill":true,"remote_bootstrap_addr":"http://10.0.0.1:9100","remote_engine_id":"caf\u00e9","transfer_id":"xfer-ID"}}`,
			bootstrap:     "10.0.0.1:9100",
		},
		{
			name:      "client protocol fields stripped and replaced on both legs, other bytes kept",
			id:        "req-1",
			query:     mooncakeQuery,
			client:    `{"kv_transfer_param\u0073":{"remote_engine_id":"evil","transfer_id":"xfer-victim"},"seed":18446744073709551615,"model":"m","bootstrap_host":"10.6.6.6","bootstrap_port":1,"bootstrap_room":2,"disaggregated_params":{},"prompt":"p","temperature":0.50}`,
			prefill:   `{"kv_transfer_param\u0073":{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"xfer-ID"},"seed":18446744073709551615,"model":"m","prompt":"p","temperature":0.50,"stream":false,"max_tokens":1}`,
			decode:    `{"kv_transfer_param\u0073":{"do_remote_decode":false,"do_remote_prefill":true,"remote_bootstrap_addr":"http://10.0.0.1:8998","remote_engine_id":"a0b1-c2","transfer_id":"xfer-ID"},"seed":18446744073709551615,"model":"m","prompt":"p","temperature":0.50}`,
			bootstrap: "10.0.0.1:8998",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req := newRequest(t, tc.client)
			req.ID = tc.id
			req.Prefill.BootstrapPort = tc.bootstrapPort
			eng := fakeengine.New().
				On(http.MethodGet, tc.bootstrap, "/query", fakeengine.Reply{Body: tc.query}).
				On(http.MethodPost, testPrefill.Address, req.Path, fakeengine.Reply{Body: `{"id":"x","kv_transfer_params":null}`})
			got, err := MooncakeVLLMConnector{}.Prepare(t.Context(), Env{Engine: eng}, req)
			require.NoError(t, err)
			require.NoError(t, prefillOutcome(t, got.Prefill))
			calls := eng.Calls()
			require.Len(t, calls, 2)
			id := transferID(t, string(got.Decode.Body))
			require.Equal(t, id, transferID(t, calls[1].Body), "both legs meet on one transfer id")
			require.Equal(t, "xfer-"+got.Decode.RequestID, id, "the transfer id is xfer-<request id>")
			require.Equal(t, tc.decode, strings.ReplaceAll(string(got.Decode.Body), id, "xfer-ID"))
			calls[1].Body = strings.ReplaceAll(calls[1].Body, id, "xfer-ID")
			require.Equal(t, []fakeengine.Call{
				{Method: http.MethodGet, Endpoint: endpoint.Endpoint{Address: tc.bootstrap}, Path: "/query"},
				{Method: http.MethodPost, Endpoint: req.Prefill, Path: req.Path, RequestID: got.Decode.RequestID, Body: tc.prefill},
			}, calls, "one fresh request id on both legs")
		})
	}
}

var transferIDRE = regexp.MustCompile(`"transfer_id":"(xfer-[^"]*)"`)

// transferID returns the transfer id in body, which must be fresh per
// attempt: "xfer-" and a random UUID's 32 hex digits.
func transferID(t *testing.T, body string) string {
	t.Helper()
	m := transferIDRE.FindStringSubmatch(body)
	require.NotNil(t, m, "no transfer_id in %s", body)
	require.Regexp(t, `^xfer-[0-9a-f]{32}$`, m[1])
	return m[1]
}

func TestMooncakeVLLMTransferIDIsFresh(t *testing.T) {
	// A client repeating its X-Request-Id must not make two requests share
	// (and steal) one transfer's KV.
	seen := map[string]bool{}
	for range 100 {
		req := newRequest(t, `{"model":"m","prompt":"p"}`)
		eng := fakeengine.New().
			On(http.MethodGet, "10.0.0.1:8998", "/query", fakeengine.Reply{Body: `{"0":{"engine_id":"e"}}`}).
			On(http.MethodPost, testPrefill.Address, req.Path, fakeengine.Reply{Body: `{}`})
		got, err := MooncakeVLLMConnector{}.Prepare(t.Context(), Env{Engine: eng}, req)
		require.NoError(t, err)
		require.NoError(t, prefillOutcome(t, got.Prefill))
		id := transferID(t, string(got.Decode.Body))
		require.False(t, seen[id], "transfer id %s reused", id)
		seen[id] = true
	}
}

func TestMooncakeVLLMQueryErrors(t *testing.T) {
	tests := []struct {
		name    string
		reply   fakeengine.Reply
		wantErr string
		is      error
	}{
		{name: "bootstrap server fails", reply: fakeengine.Reply{Err: &engines.Error{Endpoint: endpoint.Endpoint{Address: "10.0.0.1:8998"}, Status: 500, Message: "boom"}}, wantErr: "querying Mooncake bootstrap server 10.0.0.1:8998: prefill engine 10.0.0.1:8998 answered 500: boom"},
		{name: "bootstrap server unreachable", reply: fakeengine.Reply{Err: errors.New("connection refused")}, wantErr: "connection refused"},
		{name: "not JSON", reply: fakeengine.Reply{Body: `<html>`}, is: engines.ErrBadAnswer},
		{name: "nothing registered yet", reply: fakeengine.Reply{Body: `{}`}, wantErr: "no dp rank 0", is: engines.ErrBadAnswer},
		{name: "rank 0 null", reply: fakeengine.Reply{Body: `{"0":null}`}, is: engines.ErrBadAnswer},
		{name: "engine id not a string", reply: fakeengine.Reply{Body: `{"0":{"engine_id":5}}`}, wantErr: "no engine_id string", is: engines.ErrBadAnswer},
		{name: "engine id empty", reply: fakeengine.Reply{Body: `{"0":{"engine_id":""}}`}, is: engines.ErrBadAnswer},
		{name: "engine id missing", reply: fakeengine.Reply{Body: `{"0":{"worker_addr":{}}}`}, is: engines.ErrBadAnswer},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req := newRequest(t, `{"model":"m","prompt":"p"}`)
			eng := fakeengine.New().
				On(http.MethodGet, "10.0.0.1:8998", "/query", tc.reply).
				On(http.MethodPost, testPrefill.Address, req.Path, fakeengine.Reply{Body: `{}`})
			got, err := MooncakeVLLMConnector{}.Prepare(t.Context(), Env{Engine: eng}, req)
			require.Equal(t, Handoff{}, got)
			ee := requireEngineError(t, err, testPrefill)
			require.Zero(t, ee.Status, "the client's request is not at fault")
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
			}
			if tc.is != nil {
				require.ErrorIs(t, err, tc.is)
			}
			calls := eng.Calls()
			require.Len(t, calls, 1, "no prefill without the engine id")
			require.Equal(t, http.MethodGet, calls[0].Method)
		})
	}
}

func TestMooncakeVLLMPrefillOutcome(t *testing.T) {
	tests := []struct {
		name    string
		reply   fakeengine.Reply
		wantErr string
	}{
		{name: "success", reply: fakeengine.Reply{Body: `{"choices":[]}`}},
		{name: "engine error", reply: fakeengine.Reply{Err: &engines.Error{Endpoint: testPrefill, Status: 503, Message: "overloaded"}}, wantErr: "answered 503: overloaded"},
		{name: "plain error named by the endpoint", reply: fakeengine.Reply{Err: errors.New("reset")}, wantErr: "prefill engine 10.0.0.1:8100: reset"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req := newRequest(t, `{"model":"m","prompt":"p"}`)
			eng := fakeengine.New().
				On(http.MethodGet, "10.0.0.1:8998", "/query", fakeengine.Reply{Body: mooncakeQuery}).
				On(http.MethodPost, testPrefill.Address, req.Path, tc.reply)
			got, err := MooncakeVLLMConnector{}.Prepare(t.Context(), Env{Engine: eng}, req)
			require.NoError(t, err, "prefill failures arrive on the channel")
			err = prefillOutcome(t, got.Prefill)
			if tc.wantErr == "" {
				require.NoError(t, err)
				return
			}
			requireEngineError(t, err, testPrefill)
			require.ErrorContains(t, err, tc.wantErr)
		})
	}
}

func TestMooncakeVLLMCancelledWhilePrefillHangs(t *testing.T) {
	defer goleak.VerifyNone(t)
	req := newRequest(t, `{"model":"m","prompt":"p"}`)
	eng := fakeengine.New().
		On(http.MethodGet, "10.0.0.1:8998", "/query", fakeengine.Reply{Body: mooncakeQuery}).
		On(http.MethodPost, testPrefill.Address, req.Path, fakeengine.Reply{Block: true})
	ctx, cancel := context.WithCancel(t.Context())
	got, err := MooncakeVLLMConnector{}.Prepare(ctx, Env{Engine: eng}, req)
	require.NoError(t, err, "Prepare returns while the prefill runs")
	<-eng.Blocked()
	cancel()
	err = prefillOutcome(t, got.Prefill)
	requireEngineError(t, err, testPrefill)
	require.ErrorIs(t, err, context.Canceled)
}

func TestMooncakeVLLMCancelledWhileQueryHangs(t *testing.T) {
	defer goleak.VerifyNone(t)
	req := newRequest(t, `{"model":"m","prompt":"p"}`)
	eng := fakeengine.New().On(http.MethodGet, "10.0.0.1:8998", "/query", fakeengine.Reply{Block: true})
	ctx, cancel := context.WithCancel(t.Context())
	go func() { <-eng.Blocked(); cancel() }()
	_, err := MooncakeVLLMConnector{}.Prepare(ctx, Env{Engine: eng}, req)
	requireEngineError(t, err, testPrefill)
	require.ErrorIs(t, err, context.Canceled)
	require.Len(t, eng.Calls(), 1)
}
