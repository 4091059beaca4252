package processor

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/testbed/loopback"
)

const (
	clientTraceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	clientSpanID  = "00f067aa0ba902b7"
)

// tracedPrefill is a prefill engine over real HTTP that records the
// traceparent headers it gets.
type tracedPrefill struct {
	srv *httptest.Server
	mu  sync.Mutex
	got []string
}

func startTracedPrefill(t *testing.T) *tracedPrefill {
	p := &tracedPrefill{}
	p.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.mu.Lock()
		p.got = append(p.got, r.Header.Get("traceparent"))
		p.mu.Unlock()
		w.Header().Set("content-type", "application/json")
		fmt.Fprint(w, kvAnswer)
	}))
	t.Cleanup(p.srv.Close)
	return p
}

func (p *tracedPrefill) traceparents() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.got...)
}

// tracedTable is a nixl pool whose first prefill endpoint refuses
// connections and whose second is live.
func tracedTable(t *testing.T, live string) *routing.Table {
	t.Helper()
	dead := loopback.FreeAddr(t)
	cfg, err := config.Parse(fmt.Appendf(nil, `
pools:
- name: p
  default: true
  connector: nixl
  prefill: [{address: %s}, {address: %s}]
  decode: [{address: 127.0.0.1:9}]
  prefill_picker: {policy: round_robin} # the dead endpoint first
`, dead, live))
	require.NoError(t, err)
	table, err := routing.New(cfg)
	require.NoError(t, err)
	return table
}

func tracedRun(t *testing.T, srv *Server) *extprocv3.ProcessingResponse {
	t.Helper()
	out := runOn(t, srv,
		headers("POST", "/v1/chat/completions?key=secret", false, "traceparent", "00-"+clientTraceID+"-"+clientSpanID+"-01", "x-request-id", "client-7"),
		body(chatHi, true))
	require.Len(t, out, 2)
	return out[1]
}

// TestTracing follows one request through pdx: its span is a child of the
// client's traceparent, each prefill attempt a child of it, the prefill
// engine gets its attempt's traceparent over HTTP, and the decode request
// carries the request span's.
func TestTracing(t *testing.T) {
	prefill := startTracedPrefill(t)
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { require.NoError(t, tp.Shutdown(context.Background())) })
	engine := engines.NewHTTP()
	t.Cleanup(engine.CloseIdleConnections)
	srv := New(tracedTable(t, prefill.srv.Listener.Addr().String()), engine, slog.New(slog.DiscardHandler), WithTracerProvider(tp))

	decode := tracedRun(t, srv)

	spans := exp.GetSpans()
	require.Len(t, spans, 3, "the request and two prefill attempts")
	byName := map[string][]tracetest.SpanStub{}
	for _, s := range spans {
		byName[s.Name] = append(byName[s.Name], s)
	}
	req := byName["pdx.request"][0]
	require.Equal(t, clientTraceID, req.SpanContext.TraceID().String())
	require.Equal(t, clientSpanID, req.Parent.SpanID().String(), "child of the client's span")
	require.True(t, req.Parent.IsRemote())
	require.Equal(t, trace.SpanKindServer, req.SpanKind)
	requireAttrs(t, req.Attributes, map[string]string{
		"pdx.pool": "p", "pdx.connector": "nixl", "pdx.outcome": "routed",
		"pdx.decode.endpoint": "127.0.0.1:9", "url.path": "/v1/chat/completions",
		"pdx.request_id": "client-7",
	})
	require.Regexp(t, `^[0-9a-f-]{36}$`, attr(req.Attributes, "pdx.engine_request_id"), "the engines' id, beside the client's")

	attempts := byName["pdx.prefill"]
	require.Len(t, attempts, 2)
	failed, served := attempts[0], attempts[1]
	for _, a := range attempts {
		require.Equal(t, req.SpanContext.SpanID(), a.Parent.SpanID(), "attempts are children of the request span")
		require.Equal(t, trace.SpanKindClient, a.SpanKind)
	}
	requireAttrs(t, failed.Attributes, map[string]string{"pdx.pool": "p", "pdx.connector": "nixl", "pdx.status": "prefill_unavailable"})
	require.Equal(t, otelcodes.Error, failed.Status.Code)
	requireAttrs(t, served.Attributes, map[string]string{
		"pdx.endpoint": prefill.srv.Listener.Addr().String(), "pdx.status": "ok",
	})

	require.Equal(t, []string{"00-" + clientTraceID + "-" + served.SpanContext.SpanID().String() + "-01"}, prefill.traceparents(),
		"the engine's span will be a child of the attempt that reached it")
	require.Equal(t, "00-"+clientTraceID+"-"+req.SpanContext.SpanID().String()+"-01",
		setHeaders(decode.GetRequestBody().GetResponse().GetHeaderMutation())["traceparent"],
		"the decode engine's span will be a child of the request span")
}

// TestTracingOff sends no traceparent of pdx's own: the prefill request gets
// none and the client's reaches the decode untouched.
func TestTracingOff(t *testing.T) {
	prefill := startTracedPrefill(t)
	engine := engines.NewHTTP()
	t.Cleanup(engine.CloseIdleConnections)
	srv := New(tracedTable(t, prefill.srv.Listener.Addr().String()), engine, slog.New(slog.DiscardHandler))

	decode := tracedRun(t, srv)

	require.Equal(t, []string{""}, prefill.traceparents())
	require.NotContains(t, setHeaders(decode.GetRequestBody().GetResponse().GetHeaderMutation()), "traceparent")
}

// attr returns the value of attribute key.
func attr(got []attribute.KeyValue, key string) string {
	for _, kv := range got {
		if string(kv.Key) == key {
			return kv.Value.Emit()
		}
	}
	return ""
}

func requireAttrs(t *testing.T, got []attribute.KeyValue, want map[string]string) {
	t.Helper()
	have := map[string]string{}
	for _, kv := range got {
		have[string(kv.Key)] = kv.Value.Emit()
	}
	for k, v := range want {
		require.Equal(t, v, have[k], "attribute %s in %v", k, have)
	}
}
