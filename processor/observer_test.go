package processor

import (
	"context"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/pdx-router/pdx/internal/metrics"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// routedMetadata routes one request on srv and returns the dynamic
// metadata of its routing answer, as Envoy forwards it to the
// observability pass.
func routedMetadata(t *testing.T, srv *Server) *corev3.Metadata {
	t.Helper()
	seeObserver(t, srv)
	out := runOn(t, srv, headers("POST", "/v1/chat/completions", false, "x-request-id", "client-1"), body(chatHi, true))
	require.Len(t, out, 2)
	md := out[1].GetDynamicMetadata()
	require.NotNil(t, md, "the routing answer leaves metadata")
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
		RequestMetadataNamespace: md.GetFields()[RequestMetadataNamespace].GetStructValue(),
	}}
}

// seeObserver gives srv a stream of the observability pass, for a request
// it did not route: from then on its routing answers carry the metadata.
func seeObserver(t *testing.T, srv *Server) {
	t.Helper()
	require.Empty(t, runOn(t, srv, respHeaders(nil, "200", false)))
}

func observed(md *corev3.Metadata, r *extprocv3.ProcessingRequest) *extprocv3.ProcessingRequest {
	r.ObservabilityMode, r.MetadataContext = true, md
	return r
}

func respHeaders(md *corev3.Metadata, status string, endOfStream bool, kv ...string) *extprocv3.ProcessingRequest {
	hs := []*corev3.HeaderValue{{Key: ":status", RawValue: []byte(status)}}
	for i := 0; i+1 < len(kv); i += 2 {
		hs = append(hs, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return observed(md, &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: hs}, EndOfStream: endOfStream},
	}})
}

func respBody(md *corev3.Metadata, b string, endOfStream bool) *extprocv3.ProcessingRequest {
	return observed(md, &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{Body: []byte(b), EndOfStream: endOfStream},
	}})
}

func respTrailers(md *corev3.Metadata) *extprocv3.ProcessingRequest {
	return observed(md, &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{
		ResponseTrailers: &extprocv3.HttpTrailers{},
	}})
}

const (
	jsonAnswer = `{"id":"1","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":9,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":8}}}`
	sseAnswer  = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":4}}\n\ndata: [DONE]\n\n"
)

// The agent APIs' streams, as vLLM writes them.
const (
	responsesAnnounced = "event: response.created\ndata: {\"response\":{\"usage\":null},\"type\":\"response.created\"}\n\n" +
		"event: response.in_progress\ndata: {\"response\":{\"usage\":null},\"type\":\"response.in_progress\"}\n\n"
	responsesOutput = "event: response.output_text.delta\ndata: {\"delta\":\"hi\",\"type\":\"response.output_text.delta\"}\n\n" +
		"event: response.completed\ndata: {\"response\":{\"usage\":{\"input_tokens\":9,\"input_tokens_details\":{\"cached_tokens\":8},\"output_tokens\":4,\"total_tokens\":13}},\"type\":\"response.completed\"}\n\n"
	messagesStream = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":1,\"output_tokens\":0}}}\n\n" +
		"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\"},\"usage\":{\"input_tokens\":1,\"output_tokens\":4,\"cache_read_input_tokens\":8}}\n\n" +
		"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
)

// tokens reads pdx_tokens_total of pool p by kind.
func tokens(t *testing.T, m *metrics.Metrics) map[string]float64 {
	t.Helper()
	families, err := m.Registry().Gather()
	require.NoError(t, err)
	out := map[string]float64{}
	for _, f := range families {
		if f.GetName() != "pdx_tokens_total" {
			continue
		}
		for _, s := range f.GetMetric() {
			labels := map[string]string{}
			for _, lp := range s.GetLabel() {
				labels[lp.GetName()] = lp.GetValue()
			}
			out[labels["pool"]+"/"+labels["connector"]+"/"+labels["kind"]] = s.GetCounter().GetValue()
		}
	}
	return out
}

// TestObserverStream feeds the observability pass's messages to Process:
// pdx answers none of them, and records the hand-off, the decode and the
// usage of routed requests' successful answers only.
func TestObserverStream(t *testing.T) {
	chunked := func(md *corev3.Metadata, s string, n int) []*extprocv3.ProcessingRequest {
		var out []*extprocv3.ProcessingRequest
		for len(s) > n {
			out = append(out, respBody(md, s[:n], false))
			s = s[n:]
		}
		return append(out, respBody(md, s, true))
	}
	for _, tc := range []struct {
		name       string
		msgs       func(md *corev3.Metadata) []*extprocv3.ProcessingRequest
		wantTokens map[string]float64
		// wantFirst: the hand-off and TTFT were observed; wantDecode: the
		// decode too.
		wantFirst, wantDecode bool
	}{
		{"json", func(md *corev3.Metadata) []*extprocv3.ProcessingRequest {
			return append([]*extprocv3.ProcessingRequest{respHeaders(md, "200", false, "content-type", "application/json")}, chunked(md, jsonAnswer, 25)...)
		}, map[string]float64{"p/nixl/prompt": 9, "p/nixl/cached": 8, "p/nixl/completion": 4}, true, true},
		{"sse ended by trailers", func(md *corev3.Metadata) []*extprocv3.ProcessingRequest {
			return []*extprocv3.ProcessingRequest{
				respHeaders(md, "200", false, "content-type", "text/event-stream; charset=utf-8"),
				respBody(md, sseAnswer[:30], false), respBody(md, sseAnswer[30:], false), respTrailers(md),
			}
		}, map[string]float64{"p/nixl/prompt": 9, "p/nixl/cached": 0, "p/nixl/completion": 4}, true, true},
		{"sse without include_usage", func(md *corev3.Metadata) []*extprocv3.ProcessingRequest {
			return []*extprocv3.ProcessingRequest{
				respHeaders(md, "200", false, "content-type", "text/event-stream"),
				respBody(md, "data: {\"choices\":[]}\n\ndata: [DONE]\n\n", true),
			}
		}, map[string]float64{}, true, true},
		{"responses stream: usage under response, first token after the announcements", func(md *corev3.Metadata) []*extprocv3.ProcessingRequest {
			return []*extprocv3.ProcessingRequest{
				respHeaders(md, "200", false, "content-type", "text/event-stream"),
				respBody(md, responsesAnnounced, false),
				respBody(md, responsesOutput, true),
			}
		}, map[string]float64{"p/nixl/prompt": 9, "p/nixl/cached": 8, "p/nixl/completion": 4}, true, true},
		{"responses stream ended before any token", func(md *corev3.Metadata) []*extprocv3.ProcessingRequest {
			return []*extprocv3.ProcessingRequest{
				respHeaders(md, "200", false, "content-type", "text/event-stream"),
				respBody(md, responsesAnnounced, true),
			}
		}, map[string]float64{}, false, false},
		{"messages stream: message_delta's usage, cached tokens outside input_tokens", func(md *corev3.Metadata) []*extprocv3.ProcessingRequest {
			return []*extprocv3.ProcessingRequest{
				respHeaders(md, "200", false, "content-type", "text/event-stream; charset=utf-8"),
				respBody(md, messagesStream, true),
			}
		}, map[string]float64{"p/nixl/prompt": 9, "p/nixl/cached": 8, "p/nixl/completion": 4}, true, true},
		{"encoded body: times only", func(md *corev3.Metadata) []*extprocv3.ProcessingRequest {
			return []*extprocv3.ProcessingRequest{
				respHeaders(md, "200", false, "content-type", "application/json", "content-encoding", "gzip"),
				respBody(md, jsonAnswer, true),
			}
		}, map[string]float64{}, true, true},
		{"engine error", func(md *corev3.Metadata) []*extprocv3.ProcessingRequest {
			return []*extprocv3.ProcessingRequest{respHeaders(md, "503", false), respBody(md, jsonAnswer, true)}
		}, map[string]float64{}, false, false},
		{"answered by pdx: no pool", func(*corev3.Metadata) []*extprocv3.ProcessingRequest {
			return []*extprocv3.ProcessingRequest{respHeaders(nil, "200", false), respBody(nil, jsonAnswer, true)}
		}, map[string]float64{}, false, false},
		{"headers end the response", func(md *corev3.Metadata) []*extprocv3.ProcessingRequest {
			return []*extprocv3.ProcessingRequest{respHeaders(md, "204", true)}
		}, map[string]float64{}, false, false},
		{"stream ends mid-body", func(md *corev3.Metadata) []*extprocv3.ProcessingRequest {
			return []*extprocv3.ProcessingRequest{respHeaders(md, "200", false), respBody(md, jsonAnswer[:20], false)}
		}, map[string]float64{}, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := metrics.New()
			srv := New(testTable(t, false, time.Minute), answering(fakeengine.Reply{Body: kvAnswer}), slog.New(slog.DiscardHandler), WithMetrics(m))
			md := routedMetadata(t, srv)
			time.Sleep(2 * time.Millisecond) // a hand-off that takes time
			out := runOn(t, srv, tc.msgs(md)...)
			require.Empty(t, out, "nothing is answered on an observability stream")
			require.Equal(t, tc.wantTokens, tokens(t, m))
			first, decode := map[string]uint64{}, map[string]uint64{}
			if tc.wantFirst {
				first = map[string]uint64{"p/": 1}
			}
			if tc.wantDecode {
				decode = map[string]uint64{"p/": 1}
			}
			require.Equal(t, first, histogramCounts(t, m, "pdx_handoff_duration_seconds"))
			require.Equal(t, first, histogramCounts(t, m, "pdx_ttft_seconds"))
			require.Equal(t, decode, histogramCounts(t, m, "pdx_decode_duration_seconds"))
			require.Equal(t, 1.0, requests(t, m, "routed"), "the observability stream is no request of its own")
		})
	}
}

// TestObserverStreamEndsEarly: pdx ends the stream of a response it does
// not record at once, reading nothing more, so Envoy stops sending.
func TestObserverStreamEndsEarly(t *testing.T) {
	srv := New(testTable(t, false, time.Minute), answering(fakeengine.Reply{Body: kvAnswer}), slog.New(slog.DiscardHandler), WithMetrics(metrics.New()))
	stream := newFakeStream(t.Context())
	stream.in <- respHeaders(nil, "200", false)
	stream.in <- respBody(nil, "x", false)
	require.NoError(t, srv.Process(stream))
	require.Len(t, stream.in, 1, "the body was never read")
}

// TestObserverMetadataOnceObserved: routing answers leave the pass's
// metadata only once pdx has seen a stream of it, so that routing without
// one pays nothing.
func TestObserverMetadataOnceObserved(t *testing.T) {
	srv := New(testTable(t, false, time.Minute), answering(fakeengine.Reply{Body: kvAnswer}), slog.New(slog.DiscardHandler), WithMetrics(metrics.New()))
	route := func() map[string]*structpb.Value {
		out := runOn(t, srv, headers("POST", "/v1/chat/completions", false, "x-request-id", "client-1"), body(chatHi, true))
		require.Len(t, out, 2)
		return out[1].GetDynamicMetadata().GetFields()[RequestMetadataNamespace].GetStructValue().GetFields()
	}
	require.Equal(t, []string{"request_id"}, slices.Sorted(maps.Keys(route())), "no pass seen: the request id alone")
	seeObserver(t, srv)
	require.Equal(t, []string{"connector", "handoff_ns", "pool", "request_id", "start_ns"}, slices.Sorted(maps.Keys(route())))
}

// TestObserverHandoffTimes: the hand-off of a sequential connector starts
// at the prefill's answer, within the routing stream, and the observer's
// hand-off and TTFT are measured from the times the routing answer left.
func TestObserverHandoffTimes(t *testing.T) {
	srv := New(testTable(t, false, time.Minute), answering(fakeengine.Reply{Fn: func(ctx context.Context, _ fakeengine.Call) ([]byte, error) {
		time.Sleep(20 * time.Millisecond)
		return []byte(kvAnswer), nil
	}}), slog.New(slog.DiscardHandler), WithMetrics(metrics.New()))
	before := time.Now()
	md := routedMetadata(t, srv).GetFilterMetadata()[RequestMetadataNamespace].GetFields()
	after := time.Now()
	require.Equal(t, "p", md[metaPool].GetStringValue())
	require.Equal(t, "nixl", md[metaConnector].GetStringValue())
	start, handoff := nanos(t, md[metaStart]), nanos(t, md[metaHandoff])
	require.False(t, start.Before(before))
	require.GreaterOrEqual(t, handoff.Sub(start), 20*time.Millisecond, "after the prefill")
	require.False(t, handoff.After(after))
	require.NotContains(t, md, "traceparent", "no trace without tracing")
}

func nanos(t *testing.T, v *structpb.Value) time.Time {
	t.Helper()
	var n int64
	for _, c := range v.GetStringValue() {
		require.True(t, c >= '0' && c <= '9', "decimal nanoseconds: %q", v.GetStringValue())
		n = n*10 + int64(c-'0')
	}
	return time.Unix(0, n)
}

// TestObserverSpans: with tracing, the hand-off and the decode are spans,
// children of the request's span, though recorded on another stream.
func TestObserverSpans(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { require.NoError(t, tp.Shutdown(context.Background())) })
	srv := New(testTable(t, false, time.Minute), answering(fakeengine.Reply{Body: kvAnswer}), slog.New(slog.DiscardHandler), WithTracerProvider(tp))
	md := routedMetadata(t, srv)
	require.Empty(t, runOn(t, srv, respHeaders(md, "200", false), respBody(md, jsonAnswer, true)))

	byName := map[string]tracetest.SpanStub{}
	for _, s := range exp.GetSpans() {
		byName[s.Name] = s
	}
	req := byName["pdx.request"]
	for _, name := range []string{"pdx.handoff", "pdx.decode"} {
		s, ok := byName[name]
		require.True(t, ok, "%s recorded; have %v", name, strings.Join(spanNames(exp.GetSpans()), ","))
		require.Equal(t, req.SpanContext.TraceID(), s.SpanContext.TraceID())
		require.Equal(t, req.SpanContext.SpanID(), s.Parent.SpanID(), "%s is a child of the request span", name)
		require.False(t, s.EndTime.Before(s.StartTime))
	}
	require.False(t, byName["pdx.decode"].StartTime.Before(byName["pdx.handoff"].EndTime), "the decode follows the hand-off")
}

func spanNames(spans tracetest.SpanStubs) []string {
	var out []string
	for _, s := range spans {
		out = append(out, s.Name)
	}
	return out
}

// TestObserverStreamEndsOnDrain: a drain ends the observability stream of
// a response still streaming, as it ends held routing streams.
func TestObserverStreamEndsOnDrain(t *testing.T) {
	m := metrics.New()
	srv := New(testTable(t, false, time.Minute), answering(fakeengine.Reply{Body: kvAnswer}), slog.New(slog.DiscardHandler), WithMetrics(m))
	md := routedMetadata(t, srv)
	stream := newFakeStream(t.Context())
	stream.in <- respHeaders(md, "200", false)
	stream.in <- respBody(md, "data: {}\n\n", false)
	done := make(chan error, 1)
	go func() { done <- srv.Process(stream) }()
	require.Eventually(t, func() bool { return len(histogramCounts(t, m, "pdx_handoff_duration_seconds")) == 1 }, 5*time.Second, time.Millisecond)
	srv.Drain()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(5 * time.Second):
		t.Fatal("the observability stream outlived the drain")
	}
	require.Empty(t, histogramCounts(t, m, "pdx_decode_duration_seconds"), "the decode had not ended")
}
