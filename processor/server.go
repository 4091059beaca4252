// Package processor is pdx's Envoy external processor. Each HTTP request is
// one ext_proc stream; Process creates the request's only state, a *request,
// and drives it through the stream's messages. Nothing of a request is kept
// outside that call.
package processor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/metrics"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/routing"
)

// Server implements Envoy's ExternalProcessor service.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer

	table atomic.Pointer[routing.Table]
	env   connectors.Env
	log   *slog.Logger
	// bg is the work requests leave behind: telling engines to let go of
	// what they hold for a decode that will not come.
	bg sync.WaitGroup
	// draining is closed by Drain: streams held open until their response
	// ends (see hold) end at once.
	draining  chan struct{}
	drainOnce sync.Once

	metrics *metrics.Metrics // nil: none (see observe.go)
	tracer  trace.Tracer     // nil: no tracing
	// observed is set once an observability pass's stream has come
	// (observer.go): from then on routing answers carry what it needs.
	observed atomic.Bool
}

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

// New returns a server routing by table and calling engines through engine.
func New(table *routing.Table, engine connectors.Engine, log *slog.Logger, opts ...Option) *Server {
	s := &Server{env: connectors.Env{Engine: engine, EngineIDs: connectors.NewEngineIDs(0)}, log: log, draining: make(chan struct{})}
	for _, opt := range opts {
		opt(s)
	}
	s.table.Store(table)
	s.metrics.Warm(table)
	return s
}

// Table is the routing table new streams use.
func (s *Server) Table() *routing.Table { return s.table.Load() }

// SetTable replaces the routing table for streams that start from now on.
func (s *Server) SetTable(t *routing.Table) {
	s.metrics.Warm(t)
	s.table.Store(t)
}

// Drain ends the streams of requests whose decode is under way, which
// pdx holds open only to count them, so that a graceful stop waits just for
// requests pdx is still working on.
func (s *Server) Drain() {
	s.drainOnce.Do(func() { close(s.draining) })
}

// Wait waits until the work requests left behind is done, or ctx ends.
func (s *Server) Wait(ctx context.Context) error {
	done := make(chan struct{})
	go func() {
		s.bg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Process implements [extprocv3.ExternalProcessorServer].
func (s *Server) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	growStack()
	ctx := stream.Context()
	start := time.Now()
	first, err := stream.Recv()
	if err != nil {
		return streamErr(ctx, err)
	}
	if first.GetObservabilityMode() {
		return s.observe(ctx, stream, first)
	}
	req := newRequest(s.table.Load(), s.env, s.log, &s.bg, start, newRecorder(s.metrics, s.tracer, start))
	req.observed = s.observed.Load()
	received := make(chan recvResult, 1)
	go receive(ctx, stream, received)
	return s.serve(ctx, stream, req, first, received)
}

// serve is a routing stream's one loop. It answers what comes, one at a
// time: Envoy's messages (first, then those from received), a concurrent
// prefill's outcome while the request is prefilling, the end of the time
// its body may take while it waits for it. Once pdx has nothing left to do
// for the request, the request's state goes; a routed request's stream
// ends then too, its decode detached (request.letGo), or, when the decode
// cannot be detached or pdx still reads the response, stays open until
// Envoy ends it with the response, so that the decode endpoint's in-flight
// count is exact, passing on the response phases Envoy still sends. A
// drain ends that hold cleanly, and Envoy goes on with the generation.
func (s *Server) serve(ctx context.Context, stream extprocv3.ExternalProcessor_ProcessServer, req *request, first *extprocv3.ProcessingRequest, received <-chan recvResult) error {
	// The request's record ends with the stream, or, for a held stream
	// whose response Envoy does not send pdx, once it is routed.
	closed := false
	defer func() {
		if !closed {
			req.close()
		}
		req.placed.Decode.End(picker.Released)
	}()
	holding := false
	var drained <-chan struct{} // the server's draining, once holding
	deadline := bodyDeadline{}
	defer deadline.stop()
	ev := event{recv: recvResult{msg: first}, received: true}
	for {
		resp, end, err := react(ctx, stream, req, ev, holding, deadline.timeout)
		if end {
			return err
		}
		if resp != nil {
			if err := send(stream, req, resp); err != nil {
				if holding {
					return nil
				}
				return streamErr(ctx, err)
			}
		}
		if holding && req.letGo() {
			return nil // the response headers pdx asked for came
		}
		if !holding && req.finished() {
			// Nothing more is asked of pdx. The decode count may move to
			// the decode endpoint that served (served.go).
			if !req.placed.Decode.Open() || req.letGo() {
				return nil
			}
			if !req.observesResponse() && !req.responded {
				// Unless the response is under way, which the record
				// follows to its end.
				req.close()
				closed = true
			}
			holding, drained = true, s.draining
			req.body = streamedBody{}
		}
		deadline.follow(req)
		ev = nextEvent(ctx, req, received, &deadline, drained)
	}
}

// react answers one event; end reports that the stream is over for pdx,
// err what Process returns then. While holding, only the routed request's
// response phases are left, and anything else is left to Envoy.
func react(ctx context.Context, stream extprocv3.ExternalProcessor_ProcessServer, req *request, ev event, holding bool, bodyTimeout time.Duration) (resp *extprocv3.ProcessingResponse, end bool, err error) {
	switch {
	case ev.received && ev.recv.err != nil:
		if holding {
			return nil, true, nil
		}
		return nil, true, streamErr(ctx, ev.recv.err)
	case ev.received && holding:
		req.obs.message(ev.recv.msg)
		resp, err := req.dispatch(ctx, ev.recv.msg)
		return resp, err != nil, nil
	case ev.received:
		return req.handle(ctx, ev.recv.msg), false, nil
	case ev.prefilled:
		return req.prefillDone(ctx, ev.prefillErr), false, nil
	case ev.expired:
		// Envoy keeps the stream open for as long as the client trickles:
		// pdx answers, and Envoy then ends the stream.
		err := fmt.Errorf("%w: the request body did not arrive within %s", errBodyTimeout, bodyTimeout)
		_ = stream.Send(req.fail(ctx, err))
	}
	// The body timed out, the server drains, or the stream is over
	// (receive may have left quietly).
	return nil, true, nil
}

// send sends resp and the answers queued behind it: a
// FULL_DUPLEX_STREAMED body follows the answer to its headers.
func send(stream extprocv3.ExternalProcessor_ProcessServer, req *request, resp *extprocv3.ProcessingResponse) error {
	if err := stream.Send(resp); err != nil {
		return err
	}
	for _, more := range req.takeQueued() {
		if err := stream.Send(more); err != nil {
			return err
		}
	}
	req.sent()
	return nil
}

// event is what serve takes next: a message from Envoy (or the stream's
// end), a concurrent prefill's outcome, the body deadline, or else the end
// of the stream or a drain.
type event struct {
	recv       recvResult
	received   bool
	prefilled  bool
	prefillErr error
	expired    bool
}

// nextEvent waits for serve's next event. Messages Envoy sent come first: what
// it sent before it ended the stream is handled, as a stream read in order
// would.
func nextEvent(ctx context.Context, req *request, received <-chan recvResult, deadline *bodyDeadline, drained <-chan struct{}) event {
	select {
	case r := <-received:
		return event{recv: r, received: true}
	default:
	}
	var prefilled <-chan error
	if req.state.prefilling() {
		prefilled = req.prefill.pending
	}
	select {
	case r := <-received:
		return event{recv: r, received: true}
	case err := <-prefilled:
		return event{prefilled: true, prefillErr: err}
	case <-deadline.expired():
		return event{expired: true}
	case <-drained:
	case <-ctx.Done():
	}
	return event{}
}

// bodyDeadline is the time a request's body may take to arrive, from the
// request's start (the table's body timeout): pdx answers 408 when it
// expires while the request waits for its body.
type bodyDeadline struct {
	timer   *time.Timer // nil while not armed
	timeout time.Duration
}

// follow arms d while the request waits for its body, and stops it once
// the body is in.
func (d *bodyDeadline) follow(r *request) {
	switch waiting := r.state.awaitingBody(); {
	case waiting && d.timer == nil:
		d.timeout = r.table.Limits().BodyTimeout
		d.timer = time.NewTimer(time.Until(r.start.Add(d.timeout)))
	case !waiting && d.timer != nil:
		d.stop()
	}
}

// expired is the deadline's channel; nil, which never receives, while it
// is not armed.
func (d *bodyDeadline) expired() <-chan time.Time {
	if d.timer == nil {
		return nil
	}
	return d.timer.C
}

func (d *bodyDeadline) stop() {
	if d.timer != nil {
		d.timer.Stop()
		d.timer = nil
	}
}

type recvResult struct {
	msg *extprocv3.ProcessingRequest
	err error
}

// receive passes the stream's messages to out until the stream ends. It
// exits at the latest when the stream's context ends after Process returns.
func receive(ctx context.Context, stream extprocv3.ExternalProcessor_ProcessServer, out chan<- recvResult) {
	for {
		msg, err := stream.Recv()
		select {
		case out <- recvResult{msg, err}:
		case <-ctx.Done():
			return
		}
		if err != nil {
			return
		}
	}
}

// streamErr turns the end of a stream into the value Process returns. Envoy
// closes or resets the stream when its request ends; that is normal.
func streamErr(ctx context.Context, err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, context.Canceled) || ctx.Err() != nil {
		return nil
	}
	if c := status.Code(err); c == codes.Canceled || c == codes.DeadlineExceeded {
		return nil
	}
	return err
}

// growStack grows the stream's goroutine stack while it is shallow. A
// routed request's work (its body's parse, placement, the prefill call,
// the decode body) needs 16–32 KiB of stack under gRPC's frames, more than
// a new goroutine starts with, and growing it there copies every frame
// below: 14% of pdx's CPU at 1 KiB prompts under load with no growStack,
// 7% with an 8 KiB frame (which took the stack to 16 KiB, so it grew once
// more in the prefill body's edit). A 16 KiB frame takes it to 32 KiB in
// one small copy. BenchmarkProcess runs each stream on a new goroutine to
// show it.
//
//go:noinline
func growStack() byte {
	var frame [16 << 10]byte
	return keepFrame(frame[:])
}

//go:noinline
func keepFrame(b []byte) byte { return b[len(b)-1] }
