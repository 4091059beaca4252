package processor

import (
	"context"
	"errors"
	"strings"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/flowcontrol"
	"github.com/pdx-router/pdx/internal/metrics"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/placement"
	"github.com/pdx-router/pdx/internal/routing"
)

// recorder is what a request tells its metrics and trace, as it happens.
// It only records: the answers pdx gives are the request's alone. What it
// returns is the trace context the request's engine calls carry.
type recorder interface {
	// begin starts the record at the request headers and returns the
	// request's trace context.
	begin(ctx context.Context, h *extprocv3.HttpHeaders) traceContext
	// message notes a message from Envoy (the decode's response phases).
	message(msg *extprocv3.ProcessingRequest)
	// pool notes the pool the request's model named.
	pool(p *routing.Pool)
	// attemptStarted notes a prefill attempt on ep and returns the context
	// to run it in, carrying the attempt's span.
	attemptStarted(ctx context.Context, p *routing.Pool, ep endpoint.Endpoint) context.Context
	// attemptEnded notes the attempt's result: metrics.ResultOK or the
	// error code the failure maps to.
	attemptEnded(p *routing.Pool, ep endpoint.Endpoint, result string, err error)
	// decided notes the disaggregation decider's decision (placement.go);
	// "" for a pool without a prefill leg.
	decided(p *routing.Pool, reason string)
	// repicked notes a decode picked again after its prefill (Settle);
	// moved: to another endpoint.
	repicked(p *routing.Pool, moved bool)
	// waited notes a request that waited for room on leg, or was refused
	// it (err), in the band of priority.
	waited(p *routing.Pool, leg string, priority int, d time.Duration, err error)
	// renderFailed notes a render that failed, by reason (placement.RenderForbidden
	// or RenderError).
	renderFailed(p *routing.Pool, reason string)
	// picked notes how a pick of leg (prefill, decode) went for the
	// request's LoRA adapter.
	picked(p *routing.Pool, leg string, o picker.LoRAOutcome)
	// tokenized notes where placement got the prompt's tokens
	// (placement's sources).
	tokenized(p *routing.Pool, source string)
	// checked notes placement's self-check of a prefill.
	checked(p *routing.Pool, c placement.Check)
	// session notes what became of the request's session on a pick of
	// its leg of role: every pick, a prefill's retries too; nothing for a
	// request without one (picker.NoSession).
	session(p *routing.Pool, role picker.Role, outcome picker.SessionOutcome)
	// routed notes that pdx sent the request on to decode.
	routed(decode endpoint.Endpoint)
	// served notes the decode endpoint that answered, as Envoy told it;
	// fallback: not the one pdx picked first.
	served(p *routing.Pool, endpoint string, fallback bool)
	// failed notes the error code pdx answered with.
	failed(code string)
	// end reports the request when its stream ends.
	end(e ending)
}

// traceContext is a request's trace: its id for the logs, and the W3C
// headers that make the request's span the decode request's parent.
type traceContext struct {
	id      string
	headers []traceHeader
}

type traceHeader struct{ name, value string }

// ending is how a request ended.
type ending struct {
	// outcome is the metrics outcome; "" for a request pdx failed, whose
	// outcome is the error code.
	outcome string
	// decoded: the request went to a decode engine, whose answer was timed.
	decoded, failed    bool
	clientID, engineID string
}

// newRecorder returns what records a request started at start: nothing
// with metrics and tracing off.
func newRecorder(m *metrics.Metrics, t trace.Tracer, start time.Time) recorder {
	if m == nil && t == nil {
		return noRecord{}
	}
	m.StreamStarted()
	return &observation{metrics: m, tracer: t, start: start}
}

// noRecord records nothing.
type noRecord struct{}

func (noRecord) begin(context.Context, *extprocv3.HttpHeaders) traceContext { return traceContext{} }
func (noRecord) message(*extprocv3.ProcessingRequest)                       {}
func (noRecord) pool(*routing.Pool)                                         {}
func (noRecord) attemptStarted(ctx context.Context, _ *routing.Pool, _ endpoint.Endpoint) context.Context {
	return ctx
}
func (noRecord) attemptEnded(*routing.Pool, endpoint.Endpoint, string, error) {}
func (noRecord) decided(*routing.Pool, string)                                {}
func (noRecord) repicked(*routing.Pool, bool)                                 {}
func (noRecord) picked(*routing.Pool, string, picker.LoRAOutcome)             {}
func (noRecord) tokenized(*routing.Pool, string)                              {}
func (noRecord) renderFailed(*routing.Pool, string)                           {}
func (noRecord) waited(*routing.Pool, string, int, time.Duration, error)      {}
func (noRecord) session(*routing.Pool, picker.Role, picker.SessionOutcome)    {}
func (noRecord) routed(endpoint.Endpoint)                                     {}
func (noRecord) served(*routing.Pool, string, bool)                           {}
func (noRecord) checked(*routing.Pool, placement.Check)                       {}
func (noRecord) failed(string)                                                {}
func (noRecord) end(ending)                                                   {}

// observation records one request in metrics (when m is set) and a trace
// (when tracer is): a span for the request, a child span per prefill
// attempt.
type observation struct {
	metrics *metrics.Metrics
	tracer  trace.Tracer
	start   time.Time

	chosen   *routing.Pool // once the model named it
	code     string        // the error code pdx answered with
	answered time.Time     // pdx's routing answer or error; zero: not yet

	prefilled                bool      // an attempt has ended
	prefillStart, prefillEnd time.Time // first attempt's start, last one's end
	prefillResult            string    // ok or the last attempt's error code
	attempting               bool      // an attempt is in flight

	// response is the decode's response, when Envoy sends this stream
	// the response phases (the InferencePool integrations'
	// FULL_DUPLEX_STREAMED response).
	response decodeResponse

	span    trace.Span // the request's; nil when tracing is off
	attempt trace.Span // the prefill attempt in flight
}

var _ recorder = (*observation)(nil)

// begin starts the request's span, a child of the client's traceparent if
// it sent one.
func (o *observation) begin(ctx context.Context, h *extprocv3.HttpHeaders) traceContext {
	if o.tracer == nil || o.span != nil {
		return traceContext{}
	}
	parent := propagation.TraceContext{}.Extract(ctx, headerCarrier{h})
	_, o.span = o.tracer.Start(parent, "pdx.request",
		trace.WithSpanKind(trace.SpanKindServer),
		trace.WithTimestamp(o.start),
		trace.WithAttributes(
			attribute.String("http.request.method", header(h, ":method")),
			attribute.String("url.path", pathOf(h)),
		))
	carrier := propagation.MapCarrier{}
	propagation.TraceContext{}.Inject(trace.ContextWithSpan(context.Background(), o.span), carrier)
	tc := traceContext{id: o.span.SpanContext().TraceID().String()}
	for _, name := range []string{"traceparent", "tracestate"} {
		if v := carrier.Get(name); v != "" {
			tc.headers = append(tc.headers, traceHeader{name, v})
		}
	}
	return tc
}

// pathOf is the request's path without its query, which may hold secrets.
func pathOf(h *extprocv3.HttpHeaders) string {
	path, _, _ := strings.Cut(header(h, ":path"), "?")
	return path
}

func (o *observation) message(msg *extprocv3.ProcessingRequest) {
	o.response.read(msg, time.Now(), o.metrics != nil)
}

func (o *observation) pool(p *routing.Pool) { o.chosen = p }

// handoff is when the request's hand-off began (see handoffStart).
func (o *observation) handoff() time.Time {
	var prefilled time.Time
	if o.prefilled && o.prefillResult == metrics.ResultOK {
		prefilled = o.prefillEnd
	}
	return handoffStart(o.chosen != nil && o.chosen.Traits.Concurrent, prefilled, o.answered)
}

func (o *observation) tokenized(p *routing.Pool, source string) {
	o.metrics.Pool(p).Tokenized(source)
	if o.span != nil {
		o.span.SetAttributes(attribute.String("pdx.prompt_tokens", source))
	}
}

func (o *observation) renderFailed(p *routing.Pool, reason string) {
	o.metrics.Pool(p).RenderFailed(reason)
}

func (o *observation) waited(p *routing.Pool, leg string, priority int, d time.Duration, err error) {
	outcome := "admitted"
	switch {
	case errors.Is(err, flowcontrol.ErrTimedOut):
		outcome = "timed_out"
	case errors.Is(err, flowcontrol.ErrFull):
		outcome = "full"
	case errors.Is(err, flowcontrol.ErrDisplaced):
		outcome = "displaced"
	case err != nil:
		outcome = "cancelled"
	}
	o.metrics.Pool(p).Waited(leg, priority, outcome, d)
	if o.span != nil {
		o.span.AddEvent("waited for room", trace.WithAttributes(attribute.String("pdx.leg", leg),
			attribute.Int("pdx.band", priority), attribute.String("pdx.outcome", outcome)))
	}
}

func (o *observation) session(p *routing.Pool, role picker.Role, outcome picker.SessionOutcome) {
	if outcome == picker.NoSession {
		return
	}
	o.metrics.Pool(p).Session(role, outcome)
	if o.span != nil {
		o.span.SetAttributes(attribute.String("pdx.session."+role.String(), outcome.String()))
	}
}

func (o *observation) picked(p *routing.Pool, leg string, lo picker.LoRAOutcome) {
	if lo == picker.LoRANone {
		return
	}
	o.metrics.Pool(p).LoRAPick(leg, lo)
	if o.span != nil {
		o.span.SetAttributes(attribute.String("pdx."+leg+".lora", lo.String()))
	}
}

func (o *observation) decided(p *routing.Pool, reason string) {
	if reason != "" {
		o.metrics.Pool(p).Decision(reason)
	}
	if o.span != nil && reason != "" {
		o.span.SetAttributes(attribute.String("pdx.disaggregation", reason))
	}
}

func (o *observation) repicked(p *routing.Pool, moved bool) {
	o.metrics.Pool(p).DecodeRepick(moved)
}

func (o *observation) routed(decode endpoint.Endpoint) {
	o.answered = time.Now()
	if o.span != nil {
		o.span.SetAttributes(attribute.String("pdx.decode.endpoint", decode.Address))
	}
}

func (o *observation) checked(p *routing.Pool, c placement.Check) {
	o.metrics.Pool(p).Checked(c.Endpoint, c.Result, c.Reports, c.Cached, c.ReportedCached)
}

func (o *observation) served(p *routing.Pool, endpoint string, fallback bool) {
	o.metrics.Pool(p).DecodeServed(endpoint, fallback)
	if o.span != nil {
		o.span.SetAttributes(attribute.String("pdx.decode.served", endpoint), attribute.Bool("pdx.decode.fallback", fallback))
	}
}

func (o *observation) failed(code string) {
	o.code = code
	if o.answered.IsZero() {
		o.answered = time.Now()
	}
}

func (o *observation) attemptStarted(ctx context.Context, p *routing.Pool, ep endpoint.Endpoint) context.Context {
	now := time.Now()
	if !o.attempting && !o.prefilled {
		o.prefillStart = now
	}
	o.attempting = true
	if o.span == nil {
		return ctx
	}
	ctx, o.attempt = o.tracer.Start(trace.ContextWithSpan(ctx, o.span), "pdx.prefill",
		trace.WithSpanKind(trace.SpanKindClient),
		trace.WithTimestamp(now),
		trace.WithAttributes(
			attribute.String("pdx.pool", p.Name),
			attribute.String("pdx.connector", p.ConnectorName),
			attribute.String("pdx.endpoint", ep.Address),
		))
	return ctx
}

func (o *observation) attemptEnded(p *routing.Pool, ep endpoint.Endpoint, result string, err error) {
	if !o.attempting {
		return
	}
	now := time.Now()
	o.attempting, o.prefilled = false, true
	o.prefillEnd, o.prefillResult = now, result
	o.metrics.Pool(p).Attempt(ep.Address, result)
	if s := o.attempt; s != nil {
		o.attempt = nil
		s.SetAttributes(attribute.String("pdx.status", result))
		if ee, ok := errors.AsType[*engines.Error](err); ok && ee.Status != 0 {
			s.SetAttributes(attribute.Int("http.response.status_code", ee.Status))
		}
		if err != nil {
			s.SetStatus(codes.Error, err.Error())
		}
		s.End(trace.WithTimestamp(now))
	}
}

func (o *observation) end(e ending) {
	// Last: a scrape that finds no stream in flight finds every ended
	// stream's records (e2e's TestMetrics waits for that).
	defer o.metrics.StreamEnded()
	outcome := e.outcome
	if e.failed {
		outcome = o.code
	}
	if o.metrics != nil {
		pm := o.metrics.Pool(o.chosen)
		answered := time.Duration(0)
		if !o.answered.IsZero() {
			answered = o.answered.Sub(o.start)
		}
		pm.Request(outcome, answered)
		if o.prefilled {
			pm.Prefill(o.prefillResult, o.prefillEnd.Sub(o.prefillStart))
		}
		if d := &o.response; e.decoded {
			if !d.headersAt.IsZero() {
				pm.DecodeHeaders(d.headersAt.Sub(o.start))
			}
			d.recordFirstByte(pm, o.start, o.handoff())
			d.recordDone(pm)
		}
	}
	if s := o.span; s != nil {
		s.SetAttributes(attribute.String("pdx.request_id", e.clientID), attribute.String("pdx.outcome", outcome))
		if e.engineID != "" {
			s.SetAttributes(attribute.String("pdx.engine_request_id", e.engineID))
		}
		if o.chosen != nil {
			s.SetAttributes(attribute.String("pdx.pool", o.chosen.Name), attribute.String("pdx.connector", o.chosen.ConnectorName))
		}
		if e.failed {
			s.SetStatus(codes.Error, o.code)
		}
		s.End()
	}
}

// headerCarrier reads W3C trace headers from Envoy's request headers.
type headerCarrier struct{ h *extprocv3.HttpHeaders }

func (c headerCarrier) Get(key string) string { return header(c.h, key) }
func (c headerCarrier) Set(string, string)    {}
func (c headerCarrier) Keys() []string {
	keys := make([]string, 0, len(c.h.GetHeaders().GetHeaders()))
	for _, hv := range c.h.GetHeaders().GetHeaders() {
		keys = append(keys, hv.GetKey())
	}
	return keys
}
