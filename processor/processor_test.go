package processor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/durationpb"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

func TestMain(m *testing.M) {
	strictTransitions = true // a phase change the table does not allow panics
	goleak.VerifyTestMain(m)
}

// fakeStream feeds Process the messages of in and collects its answers.
type fakeStream struct {
	grpc.ServerStream
	ctx  context.Context
	in   chan *extprocv3.ProcessingRequest
	out  chan *extprocv3.ProcessingResponse
	recv error // returned once in is drained; io.EOF by default
}

func newFakeStream(ctx context.Context) *fakeStream {
	return &fakeStream{ctx: ctx, in: make(chan *extprocv3.ProcessingRequest, 8), out: make(chan *extprocv3.ProcessingResponse, 8)}
}

func (s *fakeStream) Context() context.Context { return s.ctx }

func (s *fakeStream) Recv() (*extprocv3.ProcessingRequest, error) {
	select {
	case m, ok := <-s.in:
		if !ok {
			if s.recv != nil {
				return nil, s.recv
			}
			return nil, io.EOF
		}
		return m, nil
	case <-s.ctx.Done():
		return nil, s.ctx.Err()
	}
}

func (s *fakeStream) Send(r *extprocv3.ProcessingResponse) error {
	s.out <- r
	return nil
}

// answering returns an engine that answers every prefill (POST), whatever
// its endpoint, as r does.
func answering(r fakeengine.Reply) *fakeengine.Engine {
	return fakeengine.New().On(http.MethodPost, "", "", r)
}

const kvAnswer = `{"id":"p","choices":[{"text":"x"}],"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[[1]],"remote_request_id":"r","remote_host":"127.0.0.1","remote_port":8100}}`

func testTable(t testing.TB, withDefault bool, timeout time.Duration) *routing.Table {
	t.Helper()
	table, err := routing.New(&configv1.Config{Pools: []*configv1.Pool{{
		Name:           "p",
		Models:         []string{"m"},
		Default:        withDefault,
		Connector:      "nixl",
		Prefill:        []*configv1.Endpoint{{Address: "127.0.0.1:8100"}, {Address: "127.0.0.1:8101"}},
		Decode:         []*configv1.Endpoint{{Address: "127.0.0.1:8200"}},
		PrefillTimeout: durationpb.New(timeout),
		// The tests know which endpoint comes next.
		PrefillPicker: &configv1.Picker{Policy: picker.RoundRobinPolicy},
	}}})
	require.NoError(t, err)
	return table
}

func headers(method, path string, endOfStream bool, extra ...string) *extprocv3.ProcessingRequest {
	hs := []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte(method)},
		{Key: ":path", RawValue: []byte(path)},
	}
	for i := 0; i+1 < len(extra); i += 2 {
		hs = append(hs, &corev3.HeaderValue{Key: extra[i], RawValue: []byte(extra[i+1])})
	}
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: hs}, EndOfStream: endOfStream},
	}}
}

func body(b string, endOfStream bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: []byte(b), EndOfStream: endOfStream},
	}}
}

var (
	responseHeaders = &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{}}}
	responseBody    = &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{}}}
	requestTrailers = &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}}
	noPhase         = &extprocv3.ProcessingRequest{}
)

// run feeds msgs to a fresh Process call and returns its answers.
func run(t *testing.T, table *routing.Table, eng connectors.Engine, msgs ...*extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
	t.Helper()
	stream := newFakeStream(t.Context())
	for _, m := range msgs {
		stream.in <- m
	}
	close(stream.in)
	srv := New(table, eng, slog.New(slog.DiscardHandler))
	require.NoError(t, srv.Process(stream))
	requireLegsEnded(t, table)
	close(stream.out)
	var out []*extprocv3.ProcessingResponse
	for r := range stream.out {
		out = append(out, r)
	}
	return out
}

// requireLegsEnded checks that no request is counted on any endpoint or
// rank of any leg of the table's pools: a stream that has ended has ended
// every lease it took, whatever its way out. The test helpers that run a
// stream call it.
func requireLegsEnded(t *testing.T, table *routing.Table) {
	t.Helper()
	for _, pool := range table.Pools() {
		for _, leg := range []*picker.Leg{&pool.Prefill, &pool.Decode} {
			for _, ep := range leg.Endpoints() {
				require.Zero(t, leg.InFlight(ep), "pool %s: every stream ended its lease on %s", pool.Name, ep.Address)
				for r := range ep.DPSize {
					require.Zero(t, leg.RankInFlight(ep, r), "pool %s: every stream released rank %d of %s", pool.Name, r, ep.Address)
				}
			}
		}
	}
}

func setHeaders(m *extprocv3.HeaderMutation) map[string]string {
	out := map[string]string{}
	for _, h := range m.GetSetHeaders() {
		out[h.GetHeader().GetKey()] = string(h.GetHeader().GetRawValue())
	}
	return out
}

func TestRoutesInferenceRequest(t *testing.T) {
	const client = `{"model":"m","messages":[{"role":"user","content":"hi"}],"prompt":"hi","stream":true,"max_tokens":9}`
	tests := []struct {
		name      string
		path      string
		clientID  string
		wantKeep  bool
		extraMsgs []*extprocv3.ProcessingRequest
		wantExtra int // answers to extraMsgs
	}{
		{name: "chat, client request id kept for the response", path: "/v1/chat/completions", clientID: "client-id-1", wantKeep: true},
		{name: "completions with query, id generated", path: "/v1/completions?x=1"},
		{name: "unprintable client id replaced", path: "/v1/completions", clientID: "bad id"},
		// Once routed, pdx holds the stream until Envoy ends it (to count
		// the decode) and passes on whatever Envoy still sends.
		{name: "the stream is held and passes the response on", path: "/v1/chat/completions", extraMsgs: []*extprocv3.ProcessingRequest{responseHeaders, noPhase, responseBody}, wantExtra: 2},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			eng := answering(fakeengine.Reply{Body: kvAnswer})
			msgs := []*extprocv3.ProcessingRequest{
				headers("POST", tc.path, false, "x-request-id", tc.clientID, DestinationHeader, "10.6.6.6:80"),
				body(client, true),
			}
			out := run(t, testTable(t, false, time.Second), eng, append(msgs, tc.extraMsgs...)...)
			require.Len(t, out, 2+tc.wantExtra)

			hr := out[0].GetRequestHeaders().GetResponse()
			require.Equal(t, clientRoutingHeaders, hr.GetHeaderMutation().GetRemoveHeaders(), "client's routing headers removed")
			require.Nil(t, out[0].GetModeOverride(), "sequential connectors need no response phase")

			calls := eng.Calls()
			require.Len(t, calls, 1)
			require.Equal(t, "127.0.0.1:8100", calls[0].Endpoint.Address)
			require.JSONEq(t, `{"model":"m","messages":[{"role":"user","content":"hi"}],"prompt":"hi","stream":false,"max_tokens":1,
				"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}`, calls[0].Body)

			br := out[1].GetRequestBody().GetResponse()
			decodeBody := br.GetBodyMutation().GetBody()
			require.JSONEq(t, `{"model":"m","messages":[{"role":"user","content":"hi"}],"prompt":"hi","stream":true,"max_tokens":9,
				"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[[1]],"remote_request_id":"r","remote_host":"127.0.0.1","remote_port":8100}}`, string(decodeBody))
			hs := setHeaders(br.GetHeaderMutation())
			require.Equal(t, "127.0.0.1:8200", hs[DestinationHeader])
			require.Equal(t, strconv.Itoa(len(decodeBody)), hs["content-length"])
			require.Equal(t, calls[0].RequestID, hs["x-request-id"], "one request id on both legs")
			uuid := `^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`
			require.Regexp(t, uuid, calls[0].RequestID, "engines get pdx's fresh id, never the client's")
			lb := out[1].GetDynamicMetadata().GetFields()[MetadataNamespace].GetStructValue().GetFields()
			require.Equal(t, "127.0.0.1:8200", lb[DestinationHeader].GetStringValue())
			clientID := out[1].GetDynamicMetadata().GetFields()[RequestMetadataNamespace].GetStructValue().GetFields()["request_id"].GetStringValue()
			if tc.wantKeep {
				require.Equal(t, tc.clientID, clientID, "the client's id is left for the response")
			} else {
				require.Regexp(t, uuid, clientID)
			}
			require.NotEqual(t, calls[0].RequestID, clientID)

		})
	}
}

func TestConnectorNoneRoutesWithoutPrefill(t *testing.T) {
	table, err := routing.New(&configv1.Config{Pools: []*configv1.Pool{{
		Name: "agg", Default: true, Connector: "none",
		Decode:         []*configv1.Endpoint{{Address: "127.0.0.1:8200"}},
		PrefillTimeout: durationpb.New(time.Second),
	}}})
	require.NoError(t, err)
	eng := answering(fakeengine.Reply{Err: errors.New("no engine may be called")})
	out := run(t, table, eng,
		headers("POST", "/v1/completions", false),
		body(`{"model":"m","prompt":"hi","kv_transfer_params":{"remote_host":"10.6.6.6"}}`, true))
	require.Len(t, out, 2)
	require.Empty(t, eng.Calls())
	br := out[1].GetRequestBody().GetResponse()
	require.JSONEq(t, `{"model":"m","prompt":"hi"}`, string(br.GetBodyMutation().GetBody()))
	require.Equal(t, "127.0.0.1:8200", setHeaders(br.GetHeaderMutation())[DestinationHeader])

	// A body pdx would not change is not sent back: Envoy keeps its own.
	const compact = `{"model":"m","prompt":"hi"}`
	out = run(t, table, eng, headers("POST", "/v1/completions", false), body(compact, true))
	require.Len(t, out, 2)
	br = out[1].GetRequestBody().GetResponse()
	require.Nil(t, br.GetBodyMutation())
	hs := setHeaders(br.GetHeaderMutation())
	require.Equal(t, "127.0.0.1:8200", hs[DestinationHeader])
	require.Equal(t, strconv.Itoa(len(compact)), hs["content-length"])
}

// Paths other than the generation APIs pdx routes get 404, and GET
// /v1/models is answered from the pools, unless a pool lists them as
// pass-through.
func TestOtherPaths(t *testing.T) {
	eng := answering(fakeengine.Reply{})
	table := testTable(t, true, time.Second)
	for _, path := range []string{"/v1/embeddings", "/v1/completions/x", "/V1/CHAT/COMPLETIONS", "/v1/chat/completions/", "/v1/chat/completions;x", "/v1/responses/resp_1", "/v1/messages/batches", "/generate", "/"} {
		out := run(t, table, eng, headers("POST", path, false), body(`{"model":"m","kv_transfer_params":{}}`, true))
		require.Len(t, out, 1, path)
		status, b := immediateOf(t, out[0])
		require.Equal(t, 404, status, path)
		require.Equal(t, "not_found", b.Error.Code, path)
	}

	out := run(t, table, eng, headers("GET", "/v1/models", true, "x-request-id", "list-1"))
	require.Len(t, out, 1)
	ir := out[0].GetImmediateResponse()
	require.EqualValues(t, 200, ir.GetStatus().GetCode())
	require.Equal(t, "list-1", setHeaders(ir.GetHeaders())["x-request-id"])
	var list struct {
		Object string
		Data   []struct{ ID, Object, OwnedBy string }
	}
	require.NoError(t, json.Unmarshal(ir.GetBody(), &list))
	require.Equal(t, "list", list.Object)
	require.Len(t, list.Data, 1)
	require.Equal(t, "m", list.Data[0].ID)
	require.Equal(t, "model", list.Data[0].Object)

	out = run(t, table, eng, headers("POST", "/v1/models", false))
	status, _ := immediateOf(t, out[0])
	require.Equal(t, 405, status)
	require.Empty(t, eng.Calls())
}

func passThroughTable(t *testing.T) *routing.Table {
	t.Helper()
	table, err := routing.New(&configv1.Config{Pools: []*configv1.Pool{{
		Name: "a", Models: []string{"a"}, Connector: "nixl",
		Prefill:        []*configv1.Endpoint{{Address: "127.0.0.1:8100"}},
		Decode:         []*configv1.Endpoint{{Address: "127.0.0.1:8200"}},
		PrefillTimeout: durationpb.New(time.Second),
		PassThrough:    []string{"/v1/embeddings", "/health"},
	}, {
		Name: "b", Models: []string{"b"}, Default: true, Connector: "nixl",
		Prefill:        []*configv1.Endpoint{{Address: "127.0.0.1:8101"}},
		Decode:         []*configv1.Endpoint{{Address: "127.0.0.1:8201"}},
		PrefillTimeout: durationpb.New(time.Second),
		PassThrough:    []string{"/v1/models", "/tokenize"},
	}}})
	require.NoError(t, err)
	return table
}

func TestPassThrough(t *testing.T) {
	tests := []struct {
		name     string
		msgs     []*extprocv3.ProcessingRequest
		decode   string
		wantBody string // "" for none sent back
	}{
		{name: "GET without body, first pool listing the path", msgs: msgs(headers("GET", "/health", true)), decode: "127.0.0.1:8200"},
		{name: "GET models passed to the default pool that lists it", msgs: msgs(headers("GET", "/v1/models", true)), decode: "127.0.0.1:8201"},
		{name: "JSON body: the model's pool, protocol fields stripped", msgs: msgs(headers("POST", "/v1/embeddings", false),
			body(`{"model":"a","input":"x","kv_transfer_params":{"remote_host":"10.6.6.6"},"bootstrap_room":1}`, true)),
			decode: "127.0.0.1:8200", wantBody: `{"model":"a","input":"x"}`},
		{name: "JSON body without a model: the default pool", msgs: msgs(headers("POST", "/tokenize", false), body(`{"prompt":"x"}`, true)), decode: "127.0.0.1:8201"},
		{name: "body that is not JSON passes as it is", msgs: msgs(headers("POST", "/v1/embeddings", false), body(`input=x`, true)), decode: "127.0.0.1:8200"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			eng := answering(fakeengine.Reply{})
			out := run(t, passThroughTable(t), eng, tc.msgs...)
			require.Len(t, out, len(tc.msgs))
			require.Empty(t, eng.Calls(), "no prefill")
			last := out[len(out)-1]
			var cr *extprocv3.CommonResponse
			if len(tc.msgs) == 1 {
				cr = last.GetRequestHeaders().GetResponse()
				require.Equal(t, passThroughMode, last.GetModeOverride(), "nothing more of the request is needed")
			} else {
				cr = last.GetRequestBody().GetResponse()
				require.Nil(t, out[0].GetModeOverride())
			}
			hs := setHeaders(cr.GetHeaderMutation())
			require.Equal(t, tc.decode, hs[DestinationHeader])
			require.Regexp(t, `^[0-9a-f-]{36}$`, hs["x-request-id"])
			if len(tc.msgs) == 1 {
				require.Equal(t, clientRoutingHeaders, cr.GetHeaderMutation().GetRemoveHeaders())
			}
			if tc.wantBody == "" {
				require.Nil(t, cr.GetBodyMutation())
			} else {
				require.Equal(t, tc.wantBody, string(cr.GetBodyMutation().GetBody()))
				require.Equal(t, strconv.Itoa(len(tc.wantBody)), hs["content-length"])
			}
		})
	}

	for _, tc := range []struct {
		name, path, body, code string
		status                 int
	}{
		{name: "model of a pool without the path", path: "/v1/embeddings", body: `{"model":"b","input":"x"}`, status: 404, code: "not_found"},
		{name: "JSON that does not parse", path: "/v1/embeddings", body: `{"model":"a","kv_transfer_params":{},}`, status: 400, code: "invalid_json"},
		{name: "duplicated protocol key", path: "/v1/embeddings", body: `{"model":"a","kv_transfer_params":{},"kv_transfer_param\u0073":{}}`, status: 400, code: "duplicate_key"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := run(t, passThroughTable(t), answering(fakeengine.Reply{}), headers("POST", tc.path, false), body(tc.body, true))
			status, b := immediateOf(t, out[len(out)-1])
			require.Equal(t, tc.status, status)
			require.Equal(t, tc.code, b.Error.Code)
		})
	}
}

type apiErrorBody struct {
	Error struct {
		Message string `json:"message"`
		Type    string `json:"type"`
		Code    string `json:"code"`
	} `json:"error"`
}

// immediate returns the status and error body of an ImmediateResponse.
func immediateOf(t *testing.T, r *extprocv3.ProcessingResponse) (int, apiErrorBody) {
	t.Helper()
	ir := r.GetImmediateResponse()
	require.NotNil(t, ir, "want an ImmediateResponse, got %v", r)
	require.Equal(t, "application/json", setHeaders(ir.GetHeaders())["content-type"])
	var b apiErrorBody
	require.NoError(t, json.Unmarshal(ir.GetBody(), &b))
	require.NotEmpty(t, b.Error.Message)
	require.NotEmpty(t, b.Error.Type)
	return int(ir.GetStatus().GetCode()), b
}

// chatBody is a valid chat request for model "m".
const chatBody = `{"model":"m","messages":[{"role":"user","content":"hi"}]}`

func TestErrors(t *testing.T) {
	post := headers("POST", "/v1/chat/completions", false)
	tests := []struct {
		name       string
		msgs       []*extprocv3.ProcessingRequest
		engine     *fakeengine.Engine
		noDefault  bool
		timeout    time.Duration
		wantStatus int
		wantCode   string
		wantMsg    string
		wantCalls  int
	}{
		{name: "invalid JSON", msgs: msgs(post, body(`{"model":`, true)), wantStatus: 400, wantCode: "invalid_json"},
		{name: "not an object", msgs: msgs(post, body(`["m"]`, true)), wantStatus: 400, wantCode: "invalid_json", wantMsg: "JSON object"},
		{name: "missing model", msgs: msgs(post, body(`{"prompt":"x"}`, true)), wantStatus: 400, wantCode: "missing_model"},
		{name: "model not a string", msgs: msgs(post, body(`{"model":7}`, true)), wantStatus: 400, wantCode: "invalid_type", wantMsg: `"model" must be a string`},
		{name: "empty model", msgs: msgs(post, body(`{"model":""}`, true)), wantStatus: 400, wantCode: "missing_model"},
		{name: "stream not a bool", msgs: msgs(post, body(`{"model":"m","stream":"yes"}`, true)), wantStatus: 400, wantCode: "invalid_type"},
		{name: "duplicate key", msgs: msgs(post, body(`{"model":"m","model":"other"}`, true)), wantStatus: 400, wantCode: "duplicate_key"},
		{name: "unknown model without default pool", noDefault: true, msgs: msgs(post, body(`{"model":"gpt-9"}`, true)), wantStatus: 404, wantCode: "model_not_found", wantMsg: `"gpt-9"`},
		{name: "GET on an inference path", msgs: msgs(headers("GET", "/v1/chat/completions", true)), wantStatus: 405, wantCode: "method_not_allowed", wantMsg: "use POST"},
		{name: "max_tokens not an integer", msgs: msgs(post, body(`{"model":"m","messages":[{}],"max_tokens":"9"}`, true)), wantStatus: 400, wantCode: "invalid_type", wantMsg: `"max_tokens" must be an integer`},
		{name: "max_tokens fractional", msgs: msgs(post, body(`{"model":"m","messages":[{}],"max_tokens":1.5}`, true)), wantStatus: 400, wantCode: "invalid_type"},
		{name: "max_completion_tokens zero", msgs: msgs(post, body(`{"model":"m","messages":[{}],"max_completion_tokens":0}`, true)), wantStatus: 400, wantCode: "invalid_value", wantMsg: "at least 1"},
		{name: "messages missing", msgs: msgs(post, body(`{"model":"m"}`, true)), wantStatus: 400, wantCode: "missing_messages"},
		{name: "messages not an array", msgs: msgs(post, body(`{"model":"m","messages":"hi"}`, true)), wantStatus: 400, wantCode: "invalid_type", wantMsg: `"messages" must be an array`},
		{name: "messages empty", msgs: msgs(post, body(`{"model":"m","messages":[ ]}`, true)), wantStatus: 400, wantCode: "empty_messages"},
		{name: "prompt missing", msgs: msgs(headers("POST", "/v1/completions", false), body(`{"model":"m"}`, true)), wantStatus: 400, wantCode: "missing_prompt"},
		{name: "prompt a number", msgs: msgs(headers("POST", "/v1/completions", false), body(`{"model":"m","prompt":5}`, true)), wantStatus: 400, wantCode: "invalid_type"},
		{name: "n above 1 with a KV hand-off of one sequence", msgs: msgs(post, body(`{"model":"m","messages":[{}],"n":2}`, true)), wantStatus: 400, wantCode: "unsupported_value", wantMsg: `connector "nixl"`},
		{name: "n not an integer", msgs: msgs(post, body(`{"model":"m","messages":[{}],"n":"2"}`, true)), wantStatus: 400, wantCode: "invalid_type"},
		{name: "compressed body", msgs: msgs(headers("POST", "/v1/completions", false, "content-encoding", "gzip")), wantStatus: 415, wantCode: "unsupported_content_encoding"},
		{name: "no body", msgs: msgs(headers("POST", "/v1/completions", true)), wantStatus: 400, wantCode: "missing_body"},
		{name: "streamed body chunk", msgs: msgs(post, body(`{"model":`, false)), wantStatus: 500, wantCode: "internal_error", wantMsg: "BUFFERED"},
		{name: "body before headers", msgs: msgs(body(`{}`, true)), wantStatus: 500, wantCode: "internal_error", wantMsg: "request body in state request_headers"},
		{name: "headers twice", msgs: msgs(post, post), wantStatus: 500, wantCode: "internal_error"},
		{name: "model null", msgs: msgs(post, body(`{"model":null}`, true)), wantStatus: 400, wantCode: "missing_model"},
		{
			name: "prefill 500", msgs: msgs(post, body(chatBody, true)),
			engine:     answering(fakeengine.Reply{Err: &engines.Error{Endpoint: endpoint.Endpoint{Address: "127.0.0.1:8100"}, Status: 500, Message: "boom"}}),
			wantStatus: 502, wantCode: "prefill_failed", wantMsg: "127.0.0.1:8100 answered 500: boom", wantCalls: 1,
		},
		{
			name: "prefill refuses the request", msgs: msgs(post, body(chatBody, true)),
			engine:     answering(fakeengine.Reply{Err: &engines.Error{Status: 400, Message: "prompt too long"}}),
			wantStatus: 400, wantCode: "prefill_rejected", wantMsg: "prompt too long", wantCalls: 1,
		},
		{
			name: "prefill unreachable", msgs: msgs(post, body(chatBody, true)),
			engine:     answering(fakeengine.Reply{Err: &engines.Error{Err: errors.New("connection refused")}}),
			wantStatus: 503, wantCode: "prefill_unavailable", wantCalls: 1,
		},
		{
			name: "prefill answer not JSON", msgs: msgs(post, body(chatBody, true)),
			engine: answering(fakeengine.Reply{Body: `<html>`}), wantStatus: 502, wantCode: "bad_prefill_answer", wantMsg: "invalid prefill answer", wantCalls: 1,
		},
		{
			name: "prefill answer names another KV source", msgs: msgs(post, body(chatBody, true)),
			engine:     answering(fakeengine.Reply{Body: `{"kv_transfer_params":{"remote_host":"203.0.113.66","remote_port":9901}}`}),
			wantStatus: 502, wantCode: "bad_prefill_answer", wantMsg: `KV source host "203.0.113.66"`, wantCalls: 1,
		},
		{name: "too many headers", msgs: msgs(headers("POST", "/v1/chat/completions", false, manyHeaders(96)...)), wantStatus: 431, wantCode: "headers_too_large", wantMsg: "98 headers"},
		{name: "headers too large", msgs: msgs(headers("POST", "/v1/chat/completions", false, "x-big", strings.Repeat("x", 60<<10-100))), wantStatus: 431, wantCode: "headers_too_large"},
		{
			name: "prefill timeout", msgs: msgs(post, body(chatBody, true)), timeout: 50 * time.Millisecond,
			engine: answering(fakeengine.Reply{Block: true}), wantStatus: 504, wantCode: "prefill_timeout", wantMsg: "prefill on 127.0.0.1:8100: prefill timed out after 50ms", wantCalls: 1,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			eng := tc.engine
			if eng == nil {
				eng = answering(fakeengine.Reply{Body: kvAnswer})
			}
			timeout := tc.timeout
			if timeout == 0 {
				timeout = time.Second
			}
			out := run(t, testTable(t, !tc.noDefault, timeout), eng, tc.msgs...)
			status, b := immediateOf(t, out[len(out)-1])
			require.Equal(t, tc.wantStatus, status)
			require.Equal(t, tc.wantCode, b.Error.Code)
			require.Contains(t, b.Error.Message, tc.wantMsg)
			require.Len(t, eng.Calls(), tc.wantCalls)
		})
	}
}

// A client that goes away mid-prefill cancels the prefill call, and Process
// ends quietly: a cancelled stream is how every request ends.
func TestCancellationDuringPrefill(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	stream := newFakeStream(ctx)
	eng := answering(fakeengine.Reply{Block: true})
	stream.in <- headers("POST", "/v1/completions", false)
	stream.in <- body(`{"model":"m","prompt":"p"}`, true)
	srv := New(testTable(t, false, time.Minute), eng, slog.New(slog.DiscardHandler))
	done := make(chan error, 1)
	go func() { done <- srv.Process(stream) }()
	<-stream.out    // headers answer
	<-eng.Blocked() // the prefill runs
	cancel()
	require.Eventually(t, func() bool { return len(eng.Calls()) == 1 }, 5*time.Second, 5*time.Millisecond)
	require.NoError(t, <-done)
	require.ErrorIs(t, eng.Calls()[0].CtxErr, context.Canceled)
}

func TestStreamErrorsAreReturned(t *testing.T) {
	stream := newFakeStream(t.Context())
	stream.recv = errors.New("transport is broken")
	close(stream.in)
	srv := New(testTable(t, false, time.Second), answering(fakeengine.Reply{}), slog.New(slog.DiscardHandler))
	require.ErrorContains(t, srv.Process(stream), "transport is broken")
}

func msgs(m ...*extprocv3.ProcessingRequest) []*extprocv3.ProcessingRequest { return m }

// manyHeaders returns n header name/value pairs.
func manyHeaders(n int) []string {
	var kv []string
	for i := range n {
		kv = append(kv, fmt.Sprintf("x-h-%d", i), "v")
	}
	return kv
}

// A stream keeps the table it started with; SetTable only affects streams
// that start later (config reload swaps it).
func TestSetTableIsPerStream(t *testing.T) {
	old := testTable(t, false, time.Second) // serves model "m" only
	srv := New(old, answering(fakeengine.Reply{Body: kvAnswer}), slog.New(slog.DiscardHandler))

	running := newFakeStream(t.Context())
	done := make(chan error, 1)
	go func() { done <- srv.Process(running) }()
	running.in <- headers("POST", "/v1/chat/completions", false)
	<-running.out

	srv.SetTable(testTable(t, true, time.Second)) // now with a default pool

	running.in <- body(`{"model":"other","messages":[{}]}`, true)
	status, _ := immediateOf(t, <-running.out)
	require.Equal(t, 404, status, "the running stream still uses the old table")
	close(running.in)
	require.NoError(t, <-done)

	later := newFakeStream(t.Context())
	later.in <- headers("POST", "/v1/chat/completions", false)
	later.in <- body(`{"model":"other","messages":[{}]}`, true)
	close(later.in)
	require.NoError(t, srv.Process(later))
	<-later.out
	require.NotNil(t, (<-later.out).GetRequestBody(), "a new stream routes with the new table")
}

// Envoy answers some requests itself before any filter sees them (a path
// it will not normalise, an HTTP/1.0 client); a filter that sends response
// headers then opens the stream with them. pdx passes Envoy's answer on.
func TestEnvoyAnswersBeforeRequestHeaders(t *testing.T) {
	eng := answering(fakeengine.Reply{Body: kvAnswer})
	out := run(t, testTable(t, true, time.Second), eng, responseHeaders, responseBody)
	require.Len(t, out, 1, "the stream ends once Envoy's answer has passed")
	require.NotNil(t, out[0].GetResponseHeaders(), "Envoy's answer goes on unchanged: %v", out[0])
	require.Empty(t, eng.Calls())
}

// A table whose engines serve DP ranks sets one header more on the decode
// request (the rank), so it leaves the client one header less.
func TestHeaderRoomCountsTheRankHeader(t *testing.T) {
	for _, tc := range []struct {
		dpSize     uint32
		wantStatus int // of a request with 95 headers of its own and 2 pseudo-headers
	}{{0, 0}, {2, 431}} {
		t.Run(fmt.Sprintf("dp_size %d", tc.dpSize), func(t *testing.T) {
			table, err := routing.New(&configv1.Config{Pools: []*configv1.Pool{{
				Name: "p", Default: true, Connector: "nixl",
				Prefill: []*configv1.Endpoint{{Address: "127.0.0.1:8100"}},
				Decode:  []*configv1.Endpoint{{Address: "127.0.0.1:8200", DpSize: tc.dpSize}},
			}}})
			require.NoError(t, err)
			require.Equal(t, tc.dpSize > 1, table.Ranked())
			out := run(t, table, answering(fakeengine.Reply{Body: kvAnswer}), headers("POST", "/v1/completions", false, manyHeaders(95)...))
			require.Len(t, out, 1)
			if tc.wantStatus == 0 {
				require.Nil(t, out[0].GetImmediateResponse(), "room for pdx's headers: %v", out[0])
				return
			}
			require.EqualValues(t, tc.wantStatus, out[0].GetImmediateResponse().GetStatus().GetCode())
			require.Contains(t, string(out[0].GetImmediateResponse().GetBody()), "headers_too_large")
		})
	}
}
