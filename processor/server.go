// Package processor is pdx's Envoy external processor. Each HTTP request is
// one ext_proc stream; Process creates the request's only state, a *request,
// and drives it through the stream's messages. Nothing of a request is kept
// outside that call.
package processor

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sync/atomic"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/metrics"
	"github.com/pdx-router/pdx/internal/routing"
)

// Server implements Envoy's ExternalProcessor service.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer

	table  atomic.Pointer[routing.Table]
	engine connectors.Engine
	log    *slog.Logger

	metrics *metrics.Metrics // nil: none (see observe.go)
	tracer  trace.Tracer     // nil: no tracing
}

// New returns a server routing by table and calling engines through engine.
func New(table *routing.Table, engine connectors.Engine, log *slog.Logger, opts ...Option) *Server {
	s := &Server{engine: engine, log: log}
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

// Process implements [extprocv3.ExternalProcessorServer].
func (s *Server) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	ctx := stream.Context()
	req := newRequest(s.table.Load(), s.engine, s.log)
	defer req.close()
	req.startObservation(s.metrics, s.tracer)
	defer req.endObservation()
	// While a concurrent prefill runs, pdx must hear both Envoy and the
	// prefill, so Recv moves to a goroutine; other requests never pay for it.
	var received chan recvResult
	for {
		var resp *extprocv3.ProcessingResponse
		if received == nil && req.pendingPrefill() == nil {
			msg, err := stream.Recv()
			if err != nil {
				return streamErr(ctx, err)
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
			case err := <-req.pendingPrefill():
				resp = req.prefillDone(ctx, err)
			case <-ctx.Done():
				return nil // the stream is over; receive may have left quietly
			}
		}
		if resp == nil {
			continue
		}
		if err := stream.Send(resp); err != nil {
			return streamErr(ctx, err)
		}
		// A FULL_DUPLEX_STREAMED body follows the answer to its headers.
		for _, more := range req.takeQueued() {
			if err := stream.Send(more); err != nil {
				return streamErr(ctx, err)
			}
		}
		if req.finished() {
			// Nothing more is asked of pdx. Ending the stream now frees the
			// request from pdx: the generation that follows does not break
			// if pdx restarts, and a drain waits only for prefills.
			return nil
		}
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
