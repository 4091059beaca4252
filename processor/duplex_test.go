package processor

import (
	"log/slog"
	"strconv"
	"strings"
	"testing"
	"time"

	filterextprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// withProtocol adds the protocol_config Envoy sends on a stream's first
// message; it is how pdx learns the body modes.
func withProtocol(m *extprocv3.ProcessingRequest, request, response filterextprocv3.ProcessingMode_BodySendMode) *extprocv3.ProcessingRequest {
	m.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: request, ResponseBodyMode: response}
	return m
}

// duplexHeaders are request headers from a filter in FULL_DUPLEX_STREAMED mode.
func duplexHeaders(method, path string, endOfStream bool, extra ...string) *extprocv3.ProcessingRequest {
	return withProtocol(headers(method, path, endOfStream, extra...), filterextprocv3.ProcessingMode_FULL_DUPLEX_STREAMED, filterextprocv3.ProcessingMode_NONE)
}

// chunks cuts s into body messages of at most n bytes; the last one ends
// the stream if endOfStream.
func chunks(s string, n int, endOfStream bool) []*extprocv3.ProcessingRequest {
	var out []*extprocv3.ProcessingRequest
	for len(s) > n {
		out = append(out, body(s[:n], false))
		s = s[n:]
	}
	return append(out, body(s, endOfStream))
}

// runMany is run for more messages and answers than a fakeStream buffers.
func runMany(t *testing.T, table *routing.Table, eng connectors.Engine, msgs ...*extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
	t.Helper()
	stream := &fakeStream{ctx: t.Context(), in: make(chan *extprocv3.ProcessingRequest, len(msgs)), out: make(chan *extprocv3.ProcessingResponse, 1024)}
	for _, m := range msgs {
		stream.in <- m
	}
	close(stream.in)
	require.NoError(t, New(table, eng, slog.New(slog.DiscardHandler)).Process(stream))
	requireLegsEnded(t, table)
	close(stream.out)
	var out []*extprocv3.ProcessingResponse
	for r := range stream.out {
		out = append(out, r)
	}
	return out
}

// streamed returns the body chunks of answers, in order, and checks that
// each is a request-body StreamedBodyResponse of allowed size.
func streamed(t *testing.T, answers []*extprocv3.ProcessingResponse) ([]byte, []bool) {
	t.Helper()
	var b []byte
	var eos []bool
	for _, a := range answers {
		sr := a.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		require.NotNil(t, sr, "want a streamed body chunk, got %v", a)
		require.LessOrEqual(t, len(sr.GetBody()), streamedChunkBytes)
		b = append(b, sr.GetBody()...)
		eos = append(eos, sr.GetEndOfStream())
	}
	return b, eos
}

func TestFullDuplexRoutes(t *testing.T) {
	small := `{"model":"m","prompt":"hi","stream":true,"max_tokens":9}`
	large := `{"model":"m","prompt":"` + strings.Repeat("long ", 40<<10) + `","max_tokens":9}` // 200 KiB
	tests := []struct {
		name     string
		path     string
		client   string
		chunk    int  // size of Envoy's chunks
		trailers bool // trailers, not the last chunk, end the body
	}{
		{name: "one chunk", path: "/v1/completions", client: small, chunk: 1 << 20},
		{name: "chunks split inside tokens", path: "/v1/completions", client: small, chunk: 7},
		{name: "body ended by trailers", path: "/v1/completions", client: small, chunk: 10, trailers: true},
		{name: "large body both ways", path: "/v1/completions", client: large, chunk: 62000},
		{name: "large body ended by trailers", path: "/v1/completions?x=1", client: large, chunk: 16 << 10, trailers: true},
		{name: "chat", path: "/v1/chat/completions", client: `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, chunk: 5},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			eng := answering(fakeengine.Reply{Body: kvAnswer})
			msgs := msgs(duplexHeaders("POST", tc.path, false, "x-request-id", "client-id", DestinationHeader, "10.6.6.6:80"))
			msgs = append(msgs, chunks(tc.client, tc.chunk, !tc.trailers)...)
			if tc.trailers {
				msgs = append(msgs, requestTrailers)
			}
			out := runMany(t, testTable(t, false, time.Second), eng, msgs...)

			calls := eng.Calls()
			require.Len(t, calls, 1)
			require.Contains(t, calls[0].Body, `"max_tokens":1`, "the prefill got the whole body")
			require.Regexp(t, `^[0-9a-f-]{36}$`, calls[0].RequestID, "engines get pdx's fresh id")

			// The headers answer comes first, once the body has ended.
			hr := out[0].GetRequestHeaders().GetResponse()
			require.NotNil(t, hr, "first answer is to the headers: %v", out[0])
			require.Nil(t, out[0].GetModeOverride(), "Envoy ignores mode overrides in this mode")
			lb := out[0].GetDynamicMetadata().GetFields()[MetadataNamespace].GetStructValue().GetFields()
			require.Equal(t, "127.0.0.1:8200", lb[DestinationHeader].GetStringValue())
			md := out[0].GetDynamicMetadata().GetFields()[RequestMetadataNamespace].GetStructValue().GetFields()
			require.Equal(t, "client-id", md["request_id"].GetStringValue(), "the client's id, for the response")
			require.ElementsMatch(t, clientRoutingHeaders, hr.GetHeaderMutation().GetRemoveHeaders())

			answers := out[1:]
			if tc.trailers {
				require.NotNil(t, out[len(out)-1].GetRequestTrailers(), "trailers answered last")
				answers = out[1 : len(out)-1]
			}
			decodeBody, eos := streamed(t, answers)
			require.Len(t, answers, len(decodeBody)/streamedChunkBytes+1)
			wantEOS := make([]bool, len(eos))
			wantEOS[len(eos)-1] = !tc.trailers
			require.Equal(t, wantEOS, eos, "only the last chunk ends the stream, unless trailers follow")

			require.True(t, strings.HasPrefix(string(decodeBody), tc.client[:len(tc.client)-1]), "the client's body, then kv_transfer_params")
			require.Contains(t, string(decodeBody), `"kv_transfer_params":{"do_remote_prefill":true`)
			hs := setHeaders(hr.GetHeaderMutation())
			require.Equal(t, map[string]string{
				DestinationHeader: "127.0.0.1:8200",
				"content-length":  strconv.Itoa(len(decodeBody)),
				"x-request-id":    calls[0].RequestID,
			}, hs)
		})
	}
}

func TestFullDuplexErrors(t *testing.T) {
	post := duplexHeaders("POST", "/v1/chat/completions", false)
	long := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", 1000) + `"}]}`
	tests := []struct {
		name       string
		maxBody    uint32
		msgs       []*extprocv3.ProcessingRequest
		wantStatus int
		wantCode   string
		wantMsg    string
		wantOut    int // answers in all: the error is the last
	}{
		{
			name: "body over max_body_bytes: answered at the chunk that crosses it", maxBody: 250,
			// Chunks of 100 bytes: the third crosses the limit, the rest are moot.
			msgs:       append(msgs(post), chunks(long, 100, true)...),
			wantStatus: 413, wantCode: "body_too_large", wantMsg: "at least 300 bytes, over the limit of 250", wantOut: 1,
		},
		{
			name: "one byte over max_body_bytes, in the last chunk", maxBody: uint32(len(long)) - 1,
			msgs:       append(msgs(post), chunks(long, 64, true)...),
			wantStatus: 413, wantCode: "body_too_large", wantOut: 1,
		},
		{
			name: "malformed JSON across chunks", msgs: append(msgs(post), chunks(long[:len(long)-1]+`,`, 50, true)...),
			wantStatus: 400, wantCode: "invalid_json", wantOut: 1,
		},
		{
			name: "malformed JSON ended by trailers", msgs: append(append(msgs(post), chunks(`{"model":"m",`, 3, false)...), requestTrailers),
			wantStatus: 400, wantCode: "invalid_json", wantOut: 1,
		},
		{
			name: "no body chunk before the trailers", msgs: msgs(post, requestTrailers),
			wantStatus: 400, wantCode: "invalid_json", wantOut: 1,
		},
		{
			name: "missing model across chunks", msgs: append(msgs(post), chunks(`{"messages":[{"role":"user","content":"hi"}]}`, 4, true)...),
			wantStatus: 400, wantCode: "missing_model", wantOut: 1,
		},
		{
			name: "no body at all", msgs: msgs(duplexHeaders("POST", "/v1/completions", true)),
			wantStatus: 400, wantCode: "missing_body", wantOut: 1,
		},
		{
			name:       "STREAMED body mode cannot be routed",
			msgs:       msgs(withProtocol(headers("POST", "/v1/completions", false), filterextprocv3.ProcessingMode_STREAMED, filterextprocv3.ProcessingMode_NONE)),
			wantStatus: 500, wantCode: "internal_error", wantMsg: "configure request_body_mode BUFFERED or FULL_DUPLEX_STREAMED", wantOut: 1,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			table, err := routing.New(&configv1.Config{MaxBodyBytes: tc.maxBody, Pools: []*configv1.Pool{{
				Name: "p", Models: []string{"m"}, Connector: "nixl",
				Prefill:        []*configv1.Endpoint{{Address: "127.0.0.1:8100"}},
				Decode:         []*configv1.Endpoint{{Address: "127.0.0.1:8200"}},
				PrefillTimeout: durationpb.New(time.Second),
			}}})
			require.NoError(t, err)
			eng := answering(fakeengine.Reply{Body: kvAnswer})
			out := runMany(t, table, eng, tc.msgs...)
			require.Len(t, out, tc.wantOut, "no answer before the error: %v", out)
			status, b := immediateOf(t, out[len(out)-1])
			require.Equal(t, tc.wantStatus, status)
			require.Equal(t, tc.wantCode, b.Error.Code)
			require.Contains(t, b.Error.Message, tc.wantMsg)
			require.Empty(t, eng.Calls(), "no engine was called")
		})
	}
}

// A body of exactly max_body_bytes, in chunks, is routed.
func TestFullDuplexBodyAtLimit(t *testing.T) {
	client := `{"model":"m","prompt":"` + strings.Repeat("y", 500) + `"}`
	table, err := routing.New(&configv1.Config{MaxBodyBytes: uint32(len(client)), Pools: []*configv1.Pool{{
		Name: "p", Models: []string{"m"}, Connector: "nixl",
		Prefill:        []*configv1.Endpoint{{Address: "127.0.0.1:8100"}},
		Decode:         []*configv1.Endpoint{{Address: "127.0.0.1:8200"}},
		PrefillTimeout: durationpb.New(time.Second),
	}}})
	require.NoError(t, err)
	out := runMany(t, table, answering(fakeengine.Reply{Body: kvAnswer}), append(msgs(duplexHeaders("POST", "/v1/completions", false)), chunks(client, 100, true)...)...)
	require.Len(t, out, 2)
	require.NotNil(t, out[0].GetRequestHeaders())
	_, eos := streamed(t, out[1:])
	require.Equal(t, []bool{true}, eos)
}

// Requests pdx does not route: Envoy forwards only what pdx streams back, so
// every chunk is echoed unchanged, in order, with its end_of_stream.
func TestFullDuplexPassThrough(t *testing.T) {
	tests := []struct {
		name string
		msgs []*extprocv3.ProcessingRequest
		want func(t *testing.T, out []*extprocv3.ProcessingResponse)
	}{
		{
			name: "GET without body, routed at once",
			msgs: msgs(duplexHeaders("GET", "/health", true)),
			want: func(t *testing.T, out []*extprocv3.ProcessingResponse) {
				require.Len(t, out, 1)
				hs := setHeaders(out[0].GetRequestHeaders().GetResponse().GetHeaderMutation())
				require.Equal(t, "127.0.0.1:8200", hs[DestinationHeader])
			},
		},
		{
			name: "body that is not JSON: chunks joined and sent on",
			msgs: append(msgs(duplexHeaders("POST", "/v1/embeddings", false)), chunks(`not json, and not ours`, 5, true)...),
			want: func(t *testing.T, out []*extprocv3.ProcessingResponse) {
				require.Len(t, out, 2)
				require.Equal(t, "127.0.0.1:8200", setHeaders(out[0].GetRequestHeaders().GetResponse().GetHeaderMutation())[DestinationHeader])
				b, eos := streamed(t, out[1:])
				require.Equal(t, `not json, and not ours`, string(b))
				require.Equal(t, []bool{true}, eos)
			},
		},
		{
			name: "JSON body stripped, trailers answered",
			msgs: append(append(msgs(duplexHeaders("POST", "/v1/embeddings", false)), chunks(`{"model":"a","bootstrap_host":"10.6.6.6"}`, 4, false)...), requestTrailers),
			want: func(t *testing.T, out []*extprocv3.ProcessingResponse) {
				require.Len(t, out, 3)
				b, eos := streamed(t, out[1:2])
				require.Equal(t, `{"model":"a"}`, string(b))
				require.Equal(t, []bool{false}, eos)
				require.NotNil(t, out[2].GetRequestTrailers())
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			eng := answering(fakeengine.Reply{})
			out := runMany(t, passThroughTable(t), eng, tc.msgs...)
			for _, r := range out {
				require.Nil(t, r.GetImmediateResponse())
			}
			tc.want(t, out)
			require.Empty(t, eng.Calls())
		})
	}
}

func TestFullDuplexOtherPaths(t *testing.T) {
	for _, m := range []*extprocv3.ProcessingRequest{duplexHeaders("POST", "/v1/embeddings", false), duplexHeaders("GET", "/v1/models", true)} {
		out := runMany(t, testTable(t, true, time.Second), answering(fakeengine.Reply{}), m)
		require.Len(t, out, 1)
		require.NotNil(t, out[0].GetImmediateResponse(), "answered at the headers")
	}
}

// A concurrent connector (SGLang) in FULL_DUPLEX_STREAMED mode: the decode
// is routed once the body has ended, and the response headers (which the
// filter must send in this mode) wait for the prefill as in BUFFERED mode.
func TestFullDuplexConcurrentPrefill(t *testing.T) {
	start := func(t *testing.T, first ...*extprocv3.ProcessingRequest) (*fakeStream, concurrentConnector) {
		t.Helper()
		conn := concurrentConnector{outcome: make(chan error, 1), ended: make(chan error, 1)}
		table := routing.NewTable(routing.Limits{}, concurrentPool(conn, time.Minute, decodeEP8200))
		stream := newFakeStream(t.Context())
		done := make(chan error, 1)
		go func() {
			done <- New(table, answering(fakeengine.Reply{}), slog.New(slog.DiscardHandler)).Process(stream)
		}()
		t.Cleanup(func() {
			close(stream.in)
			require.NoError(t, <-done)
		})
		hdr := duplexHeaders("POST", "/v1/chat/completions", false)
		if len(first) > 0 {
			hdr = first[0]
		}
		stream.in <- hdr
		stream.in <- body(chatBody[:10], false)
		requireNoAnswer(t, stream) // the headers answer waits for the body
		stream.in <- body(chatBody[10:], true)
		hr := next(t, stream)
		require.Equal(t, "127.0.0.1:8200", setHeaders(hr.GetRequestHeaders().GetResponse().GetHeaderMutation())[DestinationHeader])
		require.Nil(t, hr.GetModeOverride())
		decodeBody, eos := streamed(t, []*extprocv3.ProcessingResponse{next(t, stream)})
		require.JSONEq(t, `{"model":"m","bootstrap_room":7}`, string(decodeBody))
		require.Equal(t, []bool{true}, eos)
		return stream, conn
	}

	t.Run("response headers wait for the prefill", func(t *testing.T) {
		stream, conn := start(t)
		stream.in <- responseHeaders
		requireNoAnswer(t, stream)
		conn.outcome <- nil
		require.NotNil(t, next(t, stream).GetResponseHeaders())
	})

	t.Run("a response body sent in FULL_DUPLEX_STREAMED mode is echoed", func(t *testing.T) {
		full := filterextprocv3.ProcessingMode_FULL_DUPLEX_STREAMED
		stream, conn := start(t, withProtocol(headers("POST", "/v1/chat/completions", false), full, full))
		conn.outcome <- nil
		stream.in <- responseHeaders
		require.NotNil(t, next(t, stream).GetResponseHeaders())
		for i, chunk := range []string{`{"object":`, `"list"}`} {
			stream.in <- &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: []byte(chunk), EndOfStream: i == 1}}}
			sr := next(t, stream).GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
			require.Equal(t, chunk, string(sr.GetBody()))
			require.Equal(t, i == 1, sr.GetEndOfStream())
		}
	})

	t.Run("prefill fails while the decode runs", func(t *testing.T) {
		stream, conn := start(t)
		conn.outcome <- &engines.Error{Endpoint: endpoint.Endpoint{Address: "127.0.0.1:8100"}, Status: 500, Message: "boom"}
		status, b := immediateOf(t, next(t, stream))
		require.Equal(t, 502, status)
		require.Equal(t, "prefill_failed", b.Error.Code)
	})
}

// BenchmarkProcessMegabyte is one whole stream for a 1 MiB chat request, in
// both body modes: what FULL_DUPLEX_STREAMED costs pdx over BUFFERED
// (collecting the chunks, cutting the answer into chunks).
func BenchmarkProcessMegabyte(b *testing.B) {
	client := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", 1<<20) + `"}],"max_tokens":16}`
	for _, mode := range []struct {
		name string
		msgs []*extprocv3.ProcessingRequest
	}{
		{"buffered", msgs(headers("POST", "/v1/chat/completions", false), body(client, true))},
		// Envoy sends what it reads from the client, typically 16 KiB.
		{"full-duplex", append(msgs(duplexHeaders("POST", "/v1/chat/completions", false)), chunks(client, 16<<10, true)...)},
	} {
		b.Run(mode.name, func(b *testing.B) {
			srv := New(testTable(b, true, time.Minute), instantEngine, slog.New(slog.DiscardHandler))
			b.SetBytes(int64(len(client)))
			b.ReportAllocs()
			for b.Loop() {
				stream := &fakeStream{ctx: b.Context(), in: make(chan *extprocv3.ProcessingRequest, len(mode.msgs)), out: make(chan *extprocv3.ProcessingResponse, 64)}
				for _, m := range mode.msgs {
					stream.in <- m
				}
				close(stream.in)
				if err := srv.Process(stream); err != nil {
					b.Fatal(err)
				}
				if n := len(stream.out); n < 2 {
					b.Fatalf("%d answers", n)
				}
			}
		})
	}
}
