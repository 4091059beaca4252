package processor

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/metrics"
	"github.com/pdx-router/pdx/internal/routing"
)

// Option configures a Server.
type Option func(*Server)

// WithMetrics records every request in m.
func WithMetrics(m *metrics.Metrics) Option {
	return func(s *Server) { s.metrics = m }
}

// WithTracerProvider traces every request with tp: a span per request, a
// child span per prefill attempt, and W3C traceparent headers on the
// prefill and decode requests. A nil tp (the default) traces nothing and
// leaves the client's traceparent as it is.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return func(s *Server) {
		if tp != nil {
			s.tracer = tp.Tracer("github.com/pdx-router/pdx/processor")
		}
	}
}

// observation is what pdx records of one request for its metrics and trace
// while the request runs; it lives in the request, and is reported when the
// stream ends. With metrics and tracing off it costs nil checks.
type observation struct {
	metrics *metrics.Metrics
	tracer  trace.Tracer

	// Times are durations since the request's start; zero means not yet.
	pool     *routing.Pool // once the model named it
	fallback bool          // decoded without prefill
	code     string        // the error code pdx answered with
	answered time.Duration // pdx's routing answer or error

	prefilled                bool          // an attempt has ended
	prefillStart, prefillEnd time.Duration // first attempt's start, last one's end
	prefillResult            string        // ok or the last attempt's error code
	attempting               bool          // an attempt is in flight
	attemptPool              *routing.Pool
	attemptOn                string

	headersAt, doneAt time.Duration // decode response headers, end of response

	span    trace.Span // the request's; nil when tracing is off
	attempt trace.Span // the prefill attempt in flight
}

func (o *observation) on() bool { return o.metrics != nil || o.tracer != nil }

// startObservation counts the stream in flight.
func (r *request) startObservation(m *metrics.Metrics, t trace.Tracer) {
	r.obs.metrics, r.obs.tracer = m, t
	m.StreamStarted()
}

// observeMessage notes what a message from Envoy says about the request and
// returns the state the request was in before it.
func (r *request) observeMessage(ctx context.Context, msg *extprocv3.ProcessingRequest) state {
	o := &r.obs
	if !o.on() {
		return r.state
	}
	switch m := msg.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		if o.tracer != nil && o.span == nil && r.state == stateRequestHeaders {
			r.startSpan(ctx, m.RequestHeaders)
		}
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		o.headersAt = time.Since(r.start)
		if m.ResponseHeaders.GetEndOfStream() {
			o.doneAt = o.headersAt
		}
	case *extprocv3.ProcessingRequest_ResponseBody:
		if m.ResponseBody.GetEndOfStream() {
			o.doneAt = time.Since(r.start)
		}
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		o.doneAt = time.Since(r.start)
	}
	return r.state
}

// startSpan starts the request's span, a child of the client's traceparent
// if it sent one.
func (r *request) startSpan(ctx context.Context, h *extprocv3.HttpHeaders) {
	parent := propagation.TraceContext{}.Extract(ctx, headerCarrier{h})
	_, r.obs.span = r.obs.tracer.Start(parent, "pdx.request",
		trace.WithSpanKind(trace.SpanKindServer),
		trace.WithTimestamp(r.start),
		trace.WithAttributes(
			attribute.String("http.request.method", header(h, ":method")),
			attribute.String("url.path", pathOf(h)),
		))
	r.log = r.log.With(slog.String("trace_id", r.obs.span.SpanContext().TraceID().String()))
}

// pathOf is the request's path without its query, which may hold secrets.
func pathOf(h *extprocv3.HttpHeaders) string {
	path, _, _ := strings.Cut(header(h, ":path"), "?")
	return path
}

// observeAnswer notes pdx's answer to a message that found the request in
// state was. When it routes the request, the decode request gets the
// request span as its parent.
func (r *request) observeAnswer(was state, resp *extprocv3.ProcessingResponse) {
	o := &r.obs
	routed := func(s state) bool { return s == stateRouted || s == statePassThrough }
	if !o.on() || routed(was) || !routed(r.state) {
		return
	}
	o.answered = time.Since(r.start)
	if o.attempting && r.prefill == nil {
		// A concurrent connector that finished its prefill in Prepare.
		r.attemptDone(o.attemptPool, endpoint.Endpoint{Address: o.attemptOn}, nil)
	}
	if o.span == nil {
		return
	}
	hm := headerMutation(resp)
	if hm == nil {
		return
	}
	for _, h := range hm.GetSetHeaders() {
		if h.GetHeader().GetKey() == DestinationHeader {
			o.span.SetAttributes(attribute.String("pdx.decode.endpoint", string(h.GetHeader().GetRawValue())))
		}
	}
	carrier := propagation.MapCarrier{}
	propagation.TraceContext{}.Inject(trace.ContextWithSpan(context.Background(), o.span), carrier)
	for k, v := range carrier {
		hm.SetHeaders = append(hm.SetHeaders, setHeader(k, v))
	}
}

// headerMutation is the header mutation of pdx's routing answer: in the
// body answer (BUFFERED) or the headers answer (FULL_DUPLEX_STREAMED).
func headerMutation(resp *extprocv3.ProcessingResponse) *extprocv3.HeaderMutation {
	var cr *extprocv3.CommonResponse
	switch {
	case resp.GetRequestBody() != nil:
		cr = resp.GetRequestBody().GetResponse()
	case resp.GetRequestHeaders() != nil:
		cr = resp.GetRequestHeaders().GetResponse()
	}
	if cr == nil {
		return nil
	}
	if cr.HeaderMutation == nil {
		cr.HeaderMutation = &extprocv3.HeaderMutation{}
	}
	return cr.HeaderMutation
}

// observeFailure notes the error code pdx answered with.
func (r *request) observeFailure(code string) {
	o := &r.obs
	o.code = code
	if o.answered == 0 {
		o.answered = time.Since(r.start)
	}
}

// startAttempt notes a prefill attempt on ep and returns the context to run
// it in: with tracing, one carrying the attempt's span, whose traceparent
// the engine client sends.
func (r *request) startAttempt(ctx context.Context, pool *routing.Pool, ep endpoint.Endpoint) context.Context {
	o := &r.obs
	if !o.on() {
		return ctx
	}
	now := time.Now()
	if !o.attempting && !o.prefilled {
		o.prefillStart = now.Sub(r.start)
	}
	o.attempting, o.attemptPool, o.attemptOn = true, pool, ep.Address
	if o.span == nil {
		return ctx
	}
	ctx, o.attempt = o.tracer.Start(trace.ContextWithSpan(ctx, o.span), "pdx.prefill",
		trace.WithSpanKind(trace.SpanKindClient),
		trace.WithTimestamp(now),
		trace.WithAttributes(
			attribute.String("pdx.pool", pool.Name),
			attribute.String("pdx.connector", pool.ConnectorName),
			attribute.String("pdx.endpoint", ep.Address),
		))
	return ctx
}

// attemptDone notes the outcome of the prefill attempt in flight.
func (r *request) attemptDone(pool *routing.Pool, ep endpoint.Endpoint, err error) {
	o := &r.obs
	if !o.attempting {
		return
	}
	result := metrics.ResultOK
	if err != nil {
		result = toAPIError(r.prefillErr(pool, ep, err)).code
	}
	now := time.Now()
	o.attempting, o.prefilled = false, true
	o.prefillEnd, o.prefillResult = now.Sub(r.start), result
	o.metrics.Pool(pool).Attempt(ep.Address, result)
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

// endObservation reports the request when its stream ends.
func (r *request) endObservation() {
	o := &r.obs
	if !o.on() {
		return
	}
	o.metrics.StreamEnded()
	if o.attempting {
		// A concurrent prefill still running: the request ended without it.
		r.attemptDone(o.attemptPool, endpoint.Endpoint{Address: o.attemptOn}, context.Canceled)
	}
	outcome := metrics.OutcomeIncomplete
	switch r.state {
	case stateRouted:
		outcome = metrics.OutcomeRouted
		if o.fallback {
			outcome = metrics.OutcomeFallback
		}
	case statePassThrough:
		outcome = metrics.OutcomePassThrough
	case stateAnswered:
		outcome = metrics.OutcomeAnswered
	case stateEnvoyAnswered:
		outcome = metrics.OutcomeEnvoyAnswered
	case stateFailed:
		outcome = o.code
	}
	if o.metrics != nil {
		pm := o.metrics.Pool(o.pool)
		pm.Request(outcome, o.answered)
		if o.prefilled {
			pm.Prefill(o.prefillResult, o.prefillEnd-o.prefillStart)
		}
		if r.state == stateRouted && o.headersAt > 0 {
			pm.DecodeHeaders(o.headersAt)
		}
		if r.state == stateRouted && o.doneAt > 0 {
			pm.DecodeDone(o.doneAt)
		}
	}
	if s := o.span; s != nil {
		s.SetAttributes(attribute.String("pdx.request_id", r.clientID), attribute.String("pdx.outcome", outcome))
		if r.id != "" {
			s.SetAttributes(attribute.String("pdx.engine_request_id", r.id))
		}
		if o.pool != nil {
			s.SetAttributes(attribute.String("pdx.pool", o.pool.Name), attribute.String("pdx.connector", o.pool.ConnectorName))
		}
		if r.state == stateFailed {
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
