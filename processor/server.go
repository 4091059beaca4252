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
	defer req.close()
	defer req.decode.End(picker.Released)
	// While a concurrent prefill runs, pdx must hear both Envoy and the
	// prefill, so Recv moves to a goroutine; other requests never pay for it.
	var received chan recvResult
	var deadline *bodyDeadline
	defer func() { deadline.stop() }()
	for {
		var resp *extprocv3.ProcessingResponse
		if received == nil && req.prefill.pending == nil {
			msg := first
			if first != nil {
				first = nil
			} else {
				msg, err = stream.Recv()
				if deadline.interrupted() {
					return nil // the body timed out, and pdx has answered so
				}
				if err != nil {
					return streamErr(ctx, err)
				}
			}
			resp = req.handle(ctx, msg)
		} else {
			if received == nil {
				received = make(chan recvResult, 1)
				go receive(ctx, stream, received)
			}
			select {
			case r := <-received:
				if r.err != nil {
					return streamErr(ctx, r.err)
				}
				resp = req.handle(ctx, r.msg)
			case err := <-req.prefill.pending:
				resp = req.prefillDone(ctx, err)
			case <-ctx.Done():
				return nil // the stream is over; receive may have left quietly
			}
		}
		if resp != nil {
			if err := stream.Send(resp); err != nil {
				return streamErr(ctx, err)
			}
			// A FULL_DUPLEX_STREAMED body follows the answer to its headers.
			for _, more := range req.takeQueued() {
				if err := stream.Send(more); err != nil {
					return streamErr(ctx, err)
				}
			}
			req.sent()
		}
		if req.finished() {
			// Nothing more is asked of pdx. The request's state goes now;
			// its stream stays open until Envoy ends it with the response,
			// so that the decode endpoint's in-flight count is exact (unless
			// the table says to end it now). A drain ends it cleanly, and
			// Envoy goes on with the generation. The count may move to the
			// decode endpoint that served (served.go); the deferred end
			// ends it. The request's record waits for the response's end
			// when Envoy sends pdx the response.
			hold := req.decode.Open() && !req.table.Limits().EndStreamsAtRouting
			if !hold || !req.observesResponse() {
				req.close()
			}
			if hold {
				s.hold(ctx, stream, received, req)
			}
			req.close() // once the response is over, when pdx saw it
			return nil
		}
		deadline = req.awaitBody(ctx, stream, deadline)
	}
}

// hold waits until Envoy ends the stream (its request is over), the
// server drains, or the stream breaks, passing on what Envoy still sends
// (the response phases a FULL_DUPLEX_STREAMED filter sends) unchanged.
// received, when not nil, already has the stream's messages.
func (s *Server) hold(ctx context.Context, stream extprocv3.ExternalProcessor_ProcessServer, received chan recvResult, req *request) {
	req.body = streamedBody{} // only the routed request's phases are left
	if received == nil {
		received = make(chan recvResult, 1)
		go receive(ctx, stream, received)
	}
	for {
		select {
		case r := <-received:
			if r.err != nil {
				return
			}
			req.obs.message(r.msg)
			resp, err := req.dispatch(ctx, r.msg)
			if err != nil {
				return // not a message of a routed request: leave it to Envoy
			}
			if resp != nil && stream.Send(resp) != nil {
				return
			}
		case <-ctx.Done():
			return
		case <-s.draining:
			return
		}
	}
}

// bodyDeadline answers 408 when a request's body has not arrived within the
// table's body timeout. Its timer fires while Process waits in Recv, and
// the timer's function answers: Process itself is blocked, and Envoy keeps
// the stream open for as long as the client trickles. Process stops the
// timer before it handles anything Recv returns, so the two never touch the
// request at once.
type bodyDeadline struct {
	at    time.Time
	timer *time.Timer
	fired chan struct{} // closed once the timer's answer is sent
}

// awaitBody arms d while the request waits for its body (a new deadline
// from the request's start, or the one it has), and stops it otherwise. It
// returns the deadline in force, nil once the body is in.
func (r *request) awaitBody(ctx context.Context, stream extprocv3.ExternalProcessor_ProcessServer, d *bodyDeadline) *bodyDeadline {
	if r.state != stateRequestBody {
		d.stop()
		return nil
	}
	if d == nil {
		timeout := r.table.Limits().BodyTimeout
		d = &bodyDeadline{at: r.start.Add(timeout), fired: make(chan struct{})}
		d.timer = time.AfterFunc(time.Until(d.at), func() {
			err := fmt.Errorf("%w: the request body did not arrive within %s", errBodyTimeout, timeout)
			_ = stream.Send(r.fail(ctx, err)) // Envoy then ends the stream
			close(d.fired)
		})
		return d
	}
	d.timer.Reset(time.Until(d.at))
	return d
}

// interrupted stops the timer; it reports whether the timer had fired, and
// then waits for its answer to be sent: the request is over.
func (d *bodyDeadline) interrupted() bool {
	if d == nil || d.timer.Stop() {
		return false
	}
	<-d.fired
	return true
}

// stop stops the timer for good.
func (d *bodyDeadline) stop() {
	if d != nil {
		d.timer.Stop()
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
