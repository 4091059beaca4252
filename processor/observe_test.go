package processor

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/pdx-router/pdx/internal/metrics"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// runOn feeds msgs to a Process call of srv and returns its answers.
func runOn(t *testing.T, srv *Server, msgs ...*extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
	t.Helper()
	stream := newFakeStream(t.Context())
	for _, m := range msgs {
		stream.in <- m
	}
	close(stream.in)
	require.NoError(t, srv.Process(stream))
	requireLegsEnded(t, srv.Table())
	close(stream.out)
	var out []*extprocv3.ProcessingResponse
	for r := range stream.out {
		out = append(out, r)
	}
	return out
}

const chatHi = `{"model":"m","messages":[{"role":"user","content":"hi"}]}`

func TestMetricsRecordOutcomes(t *testing.T) {
	eng := retryEngine(answer(500), answerOK, answerRefused)
	m := metrics.New()
	srv := New(retryTable(t, "  prefill_attempts: 2\n"), eng, slog.New(slog.DiscardHandler), WithMetrics(m))
	chat := func(b string) { runOn(t, srv, headers("POST", "/v1/chat/completions", false), body(b, true)) }

	chat(chatHi)                                             // .1 fails with 500, .2 serves it
	chat(chatHi)                                             // .3 refuses, .1 fails, no attempt left
	chat(`{"model":"m","messages":[{"role":"user"}],"n":0}`) // rejected after the pool is known
	chat(`{"model":`)                                        // rejected before
	runOn(t, srv, headers("GET", "/v1/models", true))        // answered by pdx

	require.NoError(t, testutil.GatherAndCompare(m.Registry(), strings.NewReader(`
# HELP pdx_requests_total Requests by pool, connector and outcome: routed, fallback, pass_through, answered, envoy_answered, incomplete, or the error code pdx answered with.
# TYPE pdx_requests_total counter
pdx_requests_total{connector="",outcome="answered",pool=""} 1
pdx_requests_total{connector="",outcome="invalid_json",pool=""} 1
pdx_requests_total{connector="",outcome="pass_through",pool=""} 0
pdx_requests_total{connector="nixl",outcome="fallback",pool="p"} 0
pdx_requests_total{connector="nixl",outcome="invalid_value",pool="p"} 1
pdx_requests_total{connector="nixl",outcome="prefill_failed",pool="p"} 1
pdx_requests_total{connector="nixl",outcome="routed",pool="p"} 1
# HELP pdx_prefill_attempts_total Prefill calls by pool, prefill endpoint and result (ok or an error code).
# TYPE pdx_prefill_attempts_total counter
pdx_prefill_attempts_total{endpoint="127.0.0.1:1",pool="p",result="ok"} 0
pdx_prefill_attempts_total{endpoint="127.0.0.1:1",pool="p",result="prefill_failed"} 2
pdx_prefill_attempts_total{endpoint="127.0.0.1:2",pool="p",result="ok"} 1
pdx_prefill_attempts_total{endpoint="127.0.0.1:3",pool="p",result="ok"} 0
pdx_prefill_attempts_total{endpoint="127.0.0.1:3",pool="p",result="prefill_unavailable"} 1
# HELP pdx_streams_in_flight ext_proc streams (requests) pdx is serving now.
# TYPE pdx_streams_in_flight gauge
pdx_streams_in_flight 0
`), "pdx_requests_total", "pdx_prefill_attempts_total", "pdx_streams_in_flight"))
	require.Equal(t, map[string]uint64{"p/ok": 1, "p/prefill_failed": 1}, histogramCounts(t, m, "pdx_prefill_duration_seconds"))
	require.Equal(t, map[string]uint64{"p/routed": 1, "p/error": 2, "/error": 1}, histogramCounts(t, m, "pdx_request_duration_seconds"))
}

func TestMetricsRecordFallback(t *testing.T) {
	eng := retryEngine(answerRefused, answerRefused, answerRefused)
	m := metrics.New()
	srv := New(retryTable(t, "  on_prefill_failure: fallback\n"), eng, slog.New(slog.DiscardHandler), WithMetrics(m))
	out := runOn(t, srv, headers("POST", "/v1/chat/completions", false), body(chatHi, true))
	require.NotNil(t, out[1].GetRequestBody(), "routed to the decode")
	require.Equal(t, 1.0, requests(t, m, "fallback"))
	require.Equal(t, map[string]uint64{"p/prefill_unavailable": 1}, histogramCounts(t, m, "pdx_prefill_duration_seconds"))
	require.Equal(t, map[string]uint64{"p/fallback": 1}, histogramCounts(t, m, "pdx_request_duration_seconds"))
}

// TestMetricsConcurrentPrefill: with a concurrent connector Envoy sends the
// decode's response headers to pdx, so the decode's latencies are seen; the
// prefill attempt is counted when its outcome arrives, after the routing.
func TestMetricsConcurrentPrefill(t *testing.T) {
	m, stream, conn, done, _ := concurrentMetricsStream(t)
	require.Equal(t, 0.0, attempts(t, m, "127.0.0.1:8100", "ok"), "the prefill still runs")
	stream.in <- responseHeaders
	conn.outcome <- nil
	require.NotNil(t, next(t, stream).GetResponseHeaders())
	stream.in <- &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: []byte("{}"), EndOfStream: true}}}
	next(t, stream)
	close(stream.in)
	require.NoError(t, <-done)

	require.Equal(t, 1.0, requests(t, m, "routed"))
	require.Equal(t, 1.0, attempts(t, m, "127.0.0.1:8100", "ok"))
	require.Equal(t, map[string]uint64{"p/ok": 1}, histogramCounts(t, m, "pdx_prefill_duration_seconds"))
	require.Equal(t, map[string]uint64{"p/": 1}, histogramCounts(t, m, "pdx_decode_ttfb_seconds"))
	require.Equal(t, map[string]uint64{"p/": 1}, histogramCounts(t, m, "pdx_decode_duration_seconds"))
}

// TestMetricsConcurrentPrefillCancelled: a request that ends while its
// concurrent prefill runs counts that attempt as cancelled.
func TestMetricsConcurrentPrefillCancelled(t *testing.T) {
	m, _, _, done, cancel := concurrentMetricsStream(t)
	cancel()
	require.NoError(t, <-done)
	require.Equal(t, 1.0, attempts(t, m, "127.0.0.1:8100", "cancelled"))
	require.Equal(t, map[string]uint64{"p/cancelled": 1}, histogramCounts(t, m, "pdx_prefill_duration_seconds"))
	require.Equal(t, 0.0, counterValue(t, m, "pdx_streams_in_flight", nil))
}

// concurrentMetricsStream runs Process with metrics for a concurrent
// connector's pool and sends the request phase, which routes at once.
func concurrentMetricsStream(t *testing.T) (*metrics.Metrics, *fakeStream, concurrentConnector, chan error, context.CancelFunc) {
	t.Helper()
	conn := concurrentConnector{outcome: make(chan error, 1), ended: make(chan error, 1)}
	table := routing.NewTable(routing.Limits{}, concurrentPool(conn, time.Minute, decodeEP8200))
	m := metrics.New()
	ctx, cancel := context.WithCancel(t.Context())
	t.Cleanup(cancel)
	stream := newFakeStream(ctx)
	done := make(chan error, 1)
	go func() {
		done <- New(table, answering(fakeengine.Reply{}), slog.New(slog.DiscardHandler), WithMetrics(m)).Process(stream)
	}()
	stream.in <- headers("POST", "/v1/chat/completions", false)
	next(t, stream)
	stream.in <- body(chatBody, true)
	next(t, stream)
	return m, stream, conn, done, cancel
}

func requests(t *testing.T, m *metrics.Metrics, outcome string) float64 {
	return counterValue(t, m, "pdx_requests_total", map[string]string{"pool": "p", "outcome": outcome})
}

func attempts(t *testing.T, m *metrics.Metrics, endpoint, result string) float64 {
	return counterValue(t, m, "pdx_prefill_attempts_total", map[string]string{"endpoint": endpoint, "result": result})
}

// counterValue is the value of the first counter or gauge series of name
// with the given label values, 0 if there is none.
func counterValue(t *testing.T, m *metrics.Metrics, name string, match map[string]string) float64 {
	t.Helper()
	families, err := m.Registry().Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	series:
		for _, s := range f.GetMetric() {
			for _, lp := range s.GetLabel() {
				if want, ok := match[lp.GetName()]; ok && want != lp.GetValue() {
					continue series
				}
			}
			return s.GetCounter().GetValue() + s.GetGauge().GetValue()
		}
	}
	return 0
}

// histogramCounts returns the sample counts of the histogram name by
// "pool/outcome" (outcome empty when it has no such label).
func histogramCounts(t *testing.T, m *metrics.Metrics, name string) map[string]uint64 {
	t.Helper()
	families, err := m.Registry().Gather()
	require.NoError(t, err)
	out := map[string]uint64{}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, s := range f.GetMetric() {
			labels := map[string]string{}
			for _, lp := range s.GetLabel() {
				labels[lp.GetName()] = lp.GetValue()
			}
			if n := s.GetHistogram().GetSampleCount(); n > 0 {
				out[labels["pool"]+"/"+labels["outcome"]] = n
			}
		}
	}
	return out
}

// BenchmarkProcessObserved is BenchmarkProcess with metrics on, as pdx serve
// runs (tracing off).
func BenchmarkProcessObserved(b *testing.B) {
	table := testTable(b, true, time.Minute)
	srv := New(table, instantEngine, slog.New(slog.DiscardHandler), WithMetrics(metrics.New()))
	hdr := headers("POST", "/v1/chat/completions", false, "x-request-id", "bench")
	bd := body(fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"%s"}],"max_tokens":16}`, strings.Repeat("x", 1<<10)), true)
	b.SetBytes(1 << 10)
	b.ReportAllocs()
	for b.Loop() {
		stream := newFakeStream(b.Context())
		stream.in <- hdr
		stream.in <- bd
		close(stream.in)
		if err := srv.Process(stream); err != nil {
			b.Fatal(err)
		}
		<-stream.out
		if r := <-stream.out; r.GetRequestBody().GetResponse().GetBodyMutation() == nil {
			b.Fatal("no decode mutation")
		}
	}
}

// TestRequestLogsCarryRequestID: every line pdx logs about a request names
// it, and its trace when tracing is on, so that one grep finds its story.
func TestRequestLogsCarryRequestID(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	eng := retryEngine(answer(500), answerOK, answerOK)
	tp := sdktrace.NewTracerProvider()
	t.Cleanup(func() { require.NoError(t, tp.Shutdown(context.Background())) })
	srv := New(retryTable(t, ""), eng, log, WithTracerProvider(tp))
	runOn(t, srv, headers("POST", "/v1/chat/completions", false, "x-request-id", "req-1"), body(chatHi, true))
	runOn(t, srv, headers("POST", "/v1/chat/completions", false, "x-request-id", "req-2"), body(`{"model":`, true))

	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	require.GreaterOrEqual(t, len(lines), 3, "a failed attempt, a routing and an error: %s", buf.String())
	for _, line := range lines {
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &rec))
		require.Contains(t, []any{"req-1", "req-2"}, rec["request_id"], line)
		require.Len(t, rec["trace_id"], 32, line)
	}
}

// TestRecordingDoesNotChangeAnswers runs the same streams with nothing
// recorded, with metrics and with tracing: the answers are the same, but
// for the trace headers the routed request carries with tracing on (and
// the engines' request id, fresh per request).
func TestRecordingDoesNotChangeAnswers(t *testing.T) {
	id := []string{"x-request-id", "client-1"}
	chat := headers("POST", "/v1/chat/completions", false, id...)
	for _, tc := range []struct {
		name         string
		prefill      string // the prefill engine's answer
		msgs         []*extprocv3.ProcessingRequest
		wantTraceHdr int
	}{
		{"routed", kvAnswer, msgs(chat, body(chatHi, true), responseHeaders), 1},
		{"bad prefill answer", "{", msgs(chat, body(chatHi, true)), 0},
		{"bad body", kvAnswer, msgs(chat, body(`{"model":`, true)), 0},
		{"bad model", kvAnswer, msgs(chat, body(`{"model":"x"}`, true)), 0},
		{"models", kvAnswer, msgs(headers("GET", "/v1/models", true, id...)), 0},
		{"no such path", kvAnswer, msgs(headers("GET", "/metrics", true, id...)), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			answers := func(opts ...Option) ([]*extprocv3.ProcessingResponse, int) {
				// A table each: round robin must pick the same endpoints.
				table := testTable(t, false, time.Minute)
				out := runOn(t, New(table, answering(fakeengine.Reply{Body: tc.prefill}), slog.New(slog.DiscardHandler), opts...), tc.msgs...)
				traced := 0
				for _, resp := range out {
					for _, hm := range []*extprocv3.HeaderMutation{
						resp.GetRequestHeaders().GetResponse().GetHeaderMutation(),
						resp.GetRequestBody().GetResponse().GetHeaderMutation(),
					} {
						if hm == nil {
							continue
						}
						kept := hm.SetHeaders[:0]
						for _, h := range hm.SetHeaders {
							switch h.GetHeader().GetKey() {
							case "traceparent", "tracestate":
								traced++
								continue
							case "x-request-id":
								h.Header.RawValue = []byte("engine-id")
							}
							kept = append(kept, h)
						}
						hm.SetHeaders = kept
					}
					// /v1/models says when it was asked, to the second.
					if ir := resp.GetImmediateResponse(); ir != nil {
						ir.Body = createdAt.ReplaceAll(ir.GetBody(), []byte(`"created":0`))
					}
					// The observability pass's times differ; its trace
					// context is the request's, present only when traced.
					md := resp.GetDynamicMetadata().GetFields()[RequestMetadataNamespace].GetStructValue().GetFields()
					for k := range md {
						switch k {
						case metaStart, metaHandoff:
							md[k] = structpb.NewStringValue("t")
						case "traceparent", "tracestate":
							delete(md, k)
						}
					}
				}
				return out, traced
			}
			plain, traced := answers()
			require.Zero(t, traced)
			withMetrics, traced := answers(WithMetrics(metrics.New()))
			require.Zero(t, traced)
			requireSameAnswers(t, plain, withMetrics)
			withTracing, traced := answers(WithTracerProvider(sdktrace.NewTracerProvider()))
			requireSameAnswers(t, plain, withTracing)
			require.Equal(t, tc.wantTraceHdr, traced, "only the decode request carries the request span's traceparent")
		})
	}
}

var createdAt = regexp.MustCompile(`"created":[0-9]+`)

func requireSameAnswers(t *testing.T, want, got []*extprocv3.ProcessingResponse) {
	t.Helper()
	require.Len(t, got, len(want))
	for i := range want {
		require.True(t, proto.Equal(want[i], got[i]), "answer %d:\nwant %v\ngot  %v", i, want[i], got[i])
	}
}
