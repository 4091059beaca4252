package processor

import (
	"context"
	"log/slog"
	"strconv"
	"strings"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/pdx-router/pdx/internal/metrics"
	"github.com/pdx-router/pdx/internal/routing"
)

// The observability pass: a second ext_proc filter, after pdx's routing
// one, in observability_mode. Envoy sends it the decode's response (headers,
// body chunks, trailers) without waiting for answers, so nothing it does
// sits on the request's path. Its stream may reach another pdx replica than
// the request's routing stream: what it needs of the request comes in the
// dynamic metadata the routing answer left in namespace pdx, which the
// filter forwards.
//
// Keys of that metadata, besides request_id.
const (
	metaPool      = "pool"
	metaConnector = "connector"
	// metaStart and metaHandoff are Unix times in nanoseconds, as decimal
	// strings (a Struct's numbers are doubles, too coarse): the request
	// headers reaching pdx, and the start of the hand-off.
	metaStart   = "start_ns"
	metaHandoff = "handoff_ns"
)

// handOff adds to the routing answer's metadata md what the observability
// pass needs of a request routed to pool: its pool, its times, its trace.
// pdx adds it once it has seen a stream of the pass (which is optional in
// Envoy's config), so that without one routing pays nothing for it; the
// first requests a pdx routes before that go unrecorded.
// The hand-off starts at the prefill's answer; for a concurrent connector,
// whose prefill runs on, and a request decoded without prefill, at this
// answer.
func (r *request) handOff(md *structpb.Struct, pool *routing.Pool) {
	at := handoffStart(pool.Traits.Concurrent, r.prefill.answeredAt, time.Now())
	ns := md.GetFields()[RequestMetadataNamespace].GetStructValue().GetFields()
	ns[metaPool] = structpb.NewStringValue(pool.Name)
	ns[metaConnector] = structpb.NewStringValue(pool.ConnectorName)
	ns[metaStart] = structpb.NewStringValue(strconv.FormatInt(r.start.UnixNano(), 10))
	ns[metaHandoff] = structpb.NewStringValue(strconv.FormatInt(at.UnixNano(), 10))
	for _, h := range r.trace.headers {
		ns[h.name] = structpb.NewStringValue(h.value)
	}
}

// observe serves a stream of the observability pass, whose first message
// is msg. Envoy ignores answers on it, so pdx sends none; it ends the
// stream once it has what it records (closing it tells Envoy to send no
// more). Nothing on this stream can fail the request: the filter has
// failure_mode_allow.
func (s *Server) observe(ctx context.Context, stream extprocv3.ExternalProcessor_ProcessServer, msg *extprocv3.ProcessingRequest) error {
	if s.metrics == nil && s.tracer == nil {
		return nil // nothing to record
	}
	if !s.observed.Swap(true) {
		s.log.LogAttrs(ctx, slog.LevelInfo, "the observability pass is on: routing answers carry its metadata from now on")
	}
	o := observer{metrics: s.metrics, tracer: s.tracer}
	if !o.message(msg) {
		return nil
	}
	// A drain ends the stream, as it ends held routing streams: a graceful
	// stop must not wait for generations to end.
	received := make(chan recvResult, 1)
	go receive(ctx, stream, received)
	for {
		select {
		case r := <-received:
			if r.err != nil {
				return streamErr(ctx, r.err)
			}
			if !o.message(r.msg) {
				return nil
			}
		case <-ctx.Done():
			return nil
		case <-s.draining:
			return nil
		}
	}
}

// observer is what the observability pass knows of one response. It keeps
// no body: chunks are scanned in place by the usage reader.
type observer struct {
	metrics *metrics.Metrics
	tracer  trace.Tracer

	routed         bool          // the response headers are a routed request's
	pool           *metrics.Pool // nil with metrics off
	poolName, conn string
	start, handoff time.Time
	trace          trace.SpanContext // the request's span, when traced
	response       decodeResponse
}

// message takes one message and reports whether more are wanted.
func (o *observer) message(msg *extprocv3.ProcessingRequest) bool {
	h := msg.GetResponseHeaders()
	switch {
	case h != nil:
		if !o.headers(msg, h) {
			return false
		}
	case msg.GetResponseBody() != nil || msg.GetResponseTrailers() != nil:
		if !o.routed {
			return false
		}
	default:
		// Request phases, if the filter sends them, carry nothing of the
		// answer: wait for it.
		return true
	}
	now := time.Now()
	first, ended := o.response.read(msg, now, true)
	if first {
		o.response.recordFirstByte(o.pool, o.start, o.handoff)
		o.span("pdx.handoff", o.handoff, now)
	}
	if ended {
		o.response.recordDone(o.pool)
		if f := o.response.firstAt; !f.IsZero() {
			o.span("pdx.decode", f, now)
		}
	}
	return !ended
}

// headers reads the response headers and the request's metadata; false
// for a response that is not a routed request's decode answering 2xx.
func (o *observer) headers(msg *extprocv3.ProcessingRequest, h *extprocv3.HttpHeaders) bool {
	md := msg.GetMetadataContext().GetFilterMetadata()[RequestMetadataNamespace].GetFields()
	o.poolName, o.conn = md[metaPool].GetStringValue(), md[metaConnector].GetStringValue()
	if o.poolName == "" || !strings.HasPrefix(header(h, ":status"), "2") {
		// pdx answered the request itself, failed it, or the engine did.
		return false
	}
	start, err1 := strconv.ParseInt(md[metaStart].GetStringValue(), 10, 64)
	handoff, err2 := strconv.ParseInt(md[metaHandoff].GetStringValue(), 10, 64)
	if err1 != nil || err2 != nil {
		return false
	}
	o.routed, o.start, o.handoff = true, time.Unix(0, start), time.Unix(0, handoff)
	o.pool = o.metrics.Named(o.poolName, o.conn)
	if o.tracer != nil {
		carrier := propagation.MapCarrier{}
		for _, k := range []string{"traceparent", "tracestate"} {
			if v := md[k].GetStringValue(); v != "" {
				carrier[k] = v
			}
		}
		o.trace = trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), carrier))
	}
	return true
}

// span records a finished span, a child of the request's.
func (o *observer) span(name string, from, to time.Time) {
	if o.tracer == nil || !o.trace.IsValid() {
		return
	}
	_, s := o.tracer.Start(trace.ContextWithRemoteSpanContext(context.Background(), o.trace), name,
		trace.WithTimestamp(from),
		trace.WithAttributes(attribute.String("pdx.pool", o.poolName), attribute.String("pdx.connector", o.conn)))
	s.End(trace.WithTimestamp(to))
}
