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
	"github.com/pdx-router/pdx/internal/usage"
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
	at := r.prefill.answeredAt
	if at.IsZero() || pool.Traits.Concurrent {
		at = time.Now()
	}
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
	first          time.Time         // the response's first body byte
	usage          *usage.Reader     // nil: the body is not read (encoded)
}

// message takes one message and reports whether more are wanted.
func (o *observer) message(msg *extprocv3.ProcessingRequest) bool {
	switch m := msg.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		if !o.headers(msg, m.ResponseHeaders) {
			return false
		}
		if m.ResponseHeaders.GetEndOfStream() {
			o.finish(time.Now())
			return false
		}
	case *extprocv3.ProcessingRequest_ResponseBody:
		if !o.routed {
			return false
		}
		b := m.ResponseBody.GetBody()
		if o.first.IsZero() && len(b) > 0 {
			o.firstByte(time.Now())
		}
		if o.usage != nil {
			_, _ = o.usage.Write(b)
		}
		if m.ResponseBody.GetEndOfStream() {
			o.finish(time.Now())
			return false
		}
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		if o.routed {
			o.finish(time.Now())
		}
		return false
	}
	// Request phases, if the filter sends them, carry nothing of the
	// answer: wait for it.
	return true
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
	if enc := header(h, "content-encoding"); enc == "" || enc == "identity" {
		o.usage = usage.NewReader(strings.HasPrefix(header(h, "content-type"), "text/event-stream"))
	}
	return true
}

// firstByte records the hand-off, which ends at the response's first byte.
func (o *observer) firstByte(now time.Time) {
	o.first = now
	// The times come from the replica that routed the request; another
	// host's clock may be behind.
	if handoff, ttft := now.Sub(o.handoff), now.Sub(o.start); handoff >= 0 && ttft >= 0 {
		o.pool.FirstByte(handoff, ttft)
	}
	o.span("pdx.handoff", o.handoff, now)
}

// finish records the decode, from the first byte to the end, and the
// answer's usage.
func (o *observer) finish(now time.Time) {
	if !o.first.IsZero() {
		o.pool.DecodeDone(now.Sub(o.first))
		o.span("pdx.decode", o.first, now)
	}
	if o.usage == nil {
		return
	}
	if u, ok := o.usage.Usage(); ok {
		o.pool.Tokens(u.Prompt, u.Cached, u.Completion)
	}
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
