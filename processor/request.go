package processor

import (
	"context"
	"log/slog"
	"sync"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/flowcontrol"
	"github.com/pdx-router/pdx/internal/metrics"
	"github.com/pdx-router/pdx/internal/placement"
	"github.com/pdx-router/pdx/internal/routing"
)

// request is everything pdx knows about one HTTP request. It is created in
// Process and dies with the stream. Its state is grouped by concern: what
// the request is (its ids and path), its prefill (prefill.go), its
// FULL_DUPLEX_STREAMED body (duplex.go) and what is recorded of it
// (observe.go). Where it goes is no state: the handlers decide it and
// answer at once (mutation.go).
type request struct {
	// What the request runs with, the same for every request of a stream.
	table *routing.Table
	env   connectors.Env
	log   *slog.Logger
	bg    *sync.WaitGroup // the server's background work: releases
	start time.Time

	state state
	// clientID is the client's X-Request-Id (or the one Envoy made): pdx's
	// logs, traces and the response carry it. id is the X-Request-Id the
	// engines get: fresh per request, since clients' ids may repeat.
	clientID string
	id       string
	path     string // without the query string
	// subset is the gateway's subset hint: the decode endpoints the request
	// may go to; nil: any (subset.go).
	subset []string
	// headers are the request's headers until its pool reads its session
	// from them; session is its key there, 0 for none (session.go).
	headers *extprocv3.HttpHeaders
	session uint64
	// adapter is the LoRA adapter the request's model names in its pool,
	// "" for a base model (routing.Pool.Adapter).
	adapter string

	// fallback: the prefill failed, and the decode computes the prompt.
	fallback bool
	prefill  prefillRun
	// filter is the ext_proc filter's configuration as Envoy sent it on
	// the stream's first message (nil from older Envoys): its body modes.
	filter *extprocv3.ProtocolConfiguration
	body   streamedBody
	// obs records the request; it never changes an answer.
	obs recorder
	// trace is the request's trace context, which the decode request
	// carries; empty when tracing is off.
	trace traceContext
	// flow is what flow control knows of the request (flow.go).
	flow flowcontrol.Request
	// placed is where the request goes (package placement): its decode
	// lease counts it on its decode endpoint until its stream ends, or
	// until it is detached (letGo); its decodes are the ones pdx named,
	// its pick first and then the ones Envoy may retry on (the pool's
	// decode_fallbacks); pool is the pool it was placed in. The decode
	// that served is told by Envoy with the response headers (served.go).
	placed placement.Placement
	pool   *routing.Pool
	// headersDue: pdx asked Envoy for the response headers, which have not
	// come yet; responded: they came.
	headersDue, responded bool
	// observed: Envoy has an observability pass, which the routing answer
	// tells what it needs (observer.go).
	observed bool
}

func newRequest(table *routing.Table, env connectors.Env, log *slog.Logger, bg *sync.WaitGroup, start time.Time, obs recorder) *request {
	return &request{table: table, env: env, log: log, bg: bg, start: start, obs: obs}
}

// handle answers one message. A nil answer means the message needs none.
func (r *request) handle(ctx context.Context, msg *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
	r.obs.message(msg)
	resp, err := r.dispatch(ctx, msg)
	if err != nil {
		return r.fail(ctx, err)
	}
	return resp
}

// fail answers the request with err's error: the one place where an error
// becomes the client's answer.
func (r *request) fail(ctx context.Context, err error) *extprocv3.ProcessingResponse {
	r.enter(stateFailed)
	e := toAPIError(err)
	r.obs.failed(e.code)
	r.log.LogAttrs(ctx, e.logLevel(), "request failed",
		slog.Int("status", e.status), slog.String("code", e.code), slog.String("error", err.Error()),
		slog.Duration("elapsed", time.Since(r.start)))
	return e.immediateResponse(r.clientID, connectors.AnthropicPath(r.path))
}

// dispatch is the request's state machine: it hands each message to the
// handler of its kind and phase. A message that Envoy may send in a phase
// where pdx does not expect it (the response headers of Envoy's own local
// reply while pdx waits for the body) is passed on; only ones that cannot
// happen in Envoy's protocol are errors.
func (r *request) dispatch(ctx context.Context, msg *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, error) {
	if r.state == stateEnvoyAnswered {
		// Envoy's own answer goes on: a FULL_DUPLEX_STREAMED response
		// body reaches the client only as pdx sends it back.
		switch m := msg.GetRequest().(type) {
		case *extprocv3.ProcessingRequest_ResponseBody:
			return r.passResponseBody(m.ResponseBody), nil
		case *extprocv3.ProcessingRequest_ResponseTrailers:
			return continueResponseTrailers(), nil
		}
		return nil, nil
	}
	if r.state.over() {
		// The client has pdx's answer; whatever Envoy still sends is moot.
		return nil, nil
	}
	if pc := msg.GetProtocolConfig(); pc != nil {
		r.filter = pc
	}
	switch m := msg.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		if r.state != stateRequestHeaders {
			return nil, protocolError("request headers", r.state)
		}
		subset, err := subsetHint(msg.GetMetadataContext())
		if err != nil {
			return nil, err
		}
		r.subset = subset
		return r.requestHeaders(ctx, m.RequestHeaders)
	case *extprocv3.ProcessingRequest_RequestBody:
		return r.onRequestBody(ctx, m.RequestBody)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		if r.state == stateRequestHeaders {
			return nil, protocolError("request trailers", r.state)
		}
		if r.state.awaitingBody() && r.duplex() {
			return r.bodyEnded(ctx, true)
		}
		return continueRequestTrailers(), nil
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return r.onResponseHeaders(ctx, msg), nil
	case *extprocv3.ProcessingRequest_ResponseBody:
		if r.state == stateRequestHeaders {
			return nil, protocolError("response body", r.state)
		}
		return r.afterResponseHeaders(r.passResponseBody(m.ResponseBody)), nil
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		if r.state == stateRequestHeaders {
			return nil, protocolError("response trailers", r.state)
		}
		return r.afterResponseHeaders(continueResponseTrailers()), nil
	}
	// Flow-control messages and kinds newer than pdx carry no request phase.
	return nil, nil
}

// onRequestBody takes a chunk of the request body: the body pdx routes
// the request at, or, once it is routed, one pdx leaves as it is.
func (r *request) onRequestBody(ctx context.Context, b *extprocv3.HttpBody) (*extprocv3.ProcessingResponse, error) {
	switch r.state {
	case stateRequestBody, statePassThroughBody:
		if r.duplex() {
			return r.bodyChunk(ctx, b)
		}
		return r.requestBody(ctx, b)
	case statePrefilling, stateHoldingResponse, stateRouted, statePassThrough:
		return r.passRequestBody(b), nil
	}
	return nil, protocolError("request body", r.state)
}

// onResponseHeaders takes the response headers: the decode's, or those of
// an answer Envoy gave the client itself.
func (r *request) onResponseHeaders(ctx context.Context, msg *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
	r.headersDue, r.responded = false, true
	switch r.state {
	case stateRequestHeaders, stateRequestBody, statePassThroughBody:
		// Envoy's own answer: before pdx has the request's headers (a path
		// Envoy refuses to normalise, an HTTP/1.0 client) when the filter
		// sends response headers, or while pdx waits for the body (a body
		// over Envoy's buffer limit).
		return r.envoyAnswered(ctx, msg.GetResponseHeaders())
	case statePrefilling:
		// The decode answered before its KV is known to be complete
		// (SGLang streams headers at once).
		r.enter(stateHoldingResponse)
		return nil
	}
	r.served(ctx, msg)
	return r.responseHeaders()
}

// afterResponseHeaders answers a response phase that follows the headers:
// at once, or after them while pdx holds its answer to them.
func (r *request) afterResponseHeaders(resp *extprocv3.ProcessingResponse) *extprocv3.ProcessingResponse {
	if r.state == stateHoldingResponse {
		r.prefill.heldAfter = append(r.prefill.heldAfter, resp)
		return nil
	}
	return resp
}

// envoyAnswered passes on the response headers of an answer Envoy gave
// the client itself while pdx waited for the body (its 413 for a body over
// its buffer limit, its 408): the request is over.
func (r *request) envoyAnswered(ctx context.Context, h *extprocv3.HttpHeaders) *extprocv3.ProcessingResponse {
	r.enter(stateEnvoyAnswered)
	r.log.LogAttrs(ctx, slog.LevelInfo, "Envoy answered the request itself",
		slog.String("status", header(h, ":status")), slog.Duration("elapsed", time.Since(r.start)))
	return r.responseHeaders()
}

// sent notes that the answer handle returned has reached Envoy: a decode
// whose prefill is over is Envoy's to send, and leaves the engines nothing
// to let go of.
func (r *request) sent() {
	if r.state == stateRouted {
		r.prefill.prepared = nil
	}
}

// finished reports whether pdx has nothing left to do for the request: it
// has answered it, or routed it with no prefill running on and no response
// phase to come but those it only passes on (the Envoy configs pdx ships
// skip them, and pdx asks for response headers only in tables with
// concurrent connectors or decode fallbacks).
func (r *request) finished() bool {
	switch r.state {
	case stateEnvoyAnswered:
		// Unless Envoy's answer's body passes through pdx.
		return !r.duplexResponse()
	case stateAnswered, statePassThrough:
		return true
	case stateRouted:
		// A concurrent prefill's failure replaces the decode's answer
		// until its response headers have passed.
		return !r.table.HasConcurrent() || !r.headersDue
	}
	return false
}

// letGo reports whether pdx may end the stream of its routed request now,
// leaving Envoy the rest (routing.StreamEnd): by default once pdx has
// nothing more to read of it and its decode's count is detached, so that
// the generation no longer depends on pdx living.
func (r *request) letGo() bool {
	switch r.table.Limits().StreamEnd {
	case routing.EndAtRouting:
		return true
	case routing.EndWithResponse:
		return false
	}
	return !r.headersDue && !r.observesResponse() && r.placed.Decode.Detach()
}

// close ends whatever of the request still runs but its decode, and
// records it. Process calls it once.
func (r *request) close() {
	if pf := &r.prefill; r.state.prefilling() {
		// The request ended without the concurrent prefill's outcome.
		err := context.Canceled
		r.obs.attemptEnded(pf.pool, pf.on, toAPIError(r.prefillErr(pf.pool, pf.on, err)).code, err)
	}
	r.prefill.stop(r)
	r.obs.end(r.ending())
}

// ending is what the request's record says when its stream ends.
func (r *request) ending() ending {
	var outcome string
	switch r.state {
	case statePrefilling, stateHoldingResponse, stateRouted:
		outcome = metrics.OutcomeRouted
		if r.fallback {
			outcome = metrics.OutcomeFallback
		}
	case statePassThrough:
		outcome = metrics.OutcomePassThrough
	case stateAnswered:
		outcome = metrics.OutcomeAnswered
	case stateEnvoyAnswered:
		outcome = metrics.OutcomeEnvoyAnswered
	case stateFailed:
		outcome = "" // the error's code, which obs.failed has
	default:
		outcome = metrics.OutcomeIncomplete
	}
	return ending{outcome: outcome, decoded: r.state.decoded(), failed: r.state == stateFailed,
		clientID: r.clientID, engineID: r.id}
}
