package processor

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/jsonedit"
	"github.com/pdx-router/pdx/internal/routing"
)

// state is the phase a request is in.
type state int

const (
	// stateRequestHeaders waits for the request headers, the first message.
	stateRequestHeaders state = iota
	// stateRequestBody waits for the body of a request pdx routes.
	stateRequestBody
	// stateRouted has sent the decode mutation; only response phases follow.
	stateRouted
	// statePassThrough has sent a request on a pass-through path to a
	// decode endpoint; only response phases follow.
	statePassThrough
	// stateAnswered has answered the request itself (GET /v1/models, or a
	// prefill that finished the request).
	stateAnswered
	// stateEnvoyAnswered: Envoy answered the client itself (a local reply
	// such as its 413) before pdx had routed the request.
	stateEnvoyAnswered
	// stateFailed has sent an ImmediateResponse with an error.
	stateFailed
)

func (s state) String() string {
	switch s {
	case stateRequestHeaders:
		return "request_headers"
	case stateRequestBody:
		return "request_body"
	case stateRouted:
		return "routed"
	case statePassThrough:
		return "pass_through"
	case stateAnswered:
		return "answered"
	case stateEnvoyAnswered:
		return "envoy_answered"
	case stateFailed:
		return "failed"
	}
	return fmt.Sprintf("state(%d)", int(s))
}

// over reports whether pdx has given the request its answer (or Envoy has).
func (s state) over() bool {
	return s == stateAnswered || s == stateEnvoyAnswered || s == stateFailed
}

// request is everything pdx knows about one HTTP request. It is created in
// Process and dies with the stream.
type request struct {
	table *routing.Table
	env   connectors.Env
	log   *slog.Logger
	bg    *sync.WaitGroup // the server's background work: releases

	state state
	// passThrough: the path is one that a pool serves as it is.
	passThrough bool
	// clientID is the client's X-Request-Id (or the one Envoy made): pdx's
	// logs, traces and the response carry it. id is the X-Request-Id the
	// engines get: fresh per request, since clients' ids may repeat.
	clientID string
	id       string
	path     string // without the query string
	start    time.Time

	// The context of the request's prefill attempts, and what it runs on.
	prefillCtx    context.Context
	cancelPrefill context.CancelFunc
	prefillPool   *routing.Pool
	prefillOn     endpoint.Endpoint
	// A concurrent connector's prefill, still running while Envoy sends the
	// decode; nil once its outcome is in (or for sequential connectors).
	prefill <-chan error
	// heldHeaders is set while pdx withholds its answer to the decode's
	// response headers until the prefill has succeeded.
	heldHeaders bool
	// prepared is the decode a connector prepared, kept until pdx knows
	// whether the engines can let go of what they hold for it (see close).
	prepared *prepared
	// obs is what metrics and tracing record of the request (observe.go).
	obs observation

	// protocol is the filter's configuration as Envoy sent it on the
	// stream's first message (nil from older Envoys): its body modes.
	protocol *extprocv3.ProtocolConfiguration
	// A FULL_DUPLEX_STREAMED body (see duplex.go): the chunks received so
	// far, their length, and whether trailers ended the body.
	chunks   [][]byte
	bodyLen  int
	trailers bool
	// queued are answers to send after the one handle returned.
	queued []*extprocv3.ProcessingResponse
}

// prepared is a decode that a connector whose engines hold work for it
// prepared: what Release needs should the decode never come.
type prepared struct {
	releaser  connectors.Releaser
	req       *connectors.Request
	decode    connectors.Decode
	delivered bool // Envoy has the decode
}

func newRequest(table *routing.Table, env connectors.Env, log *slog.Logger, bg *sync.WaitGroup) *request {
	return &request{table: table, env: env, log: log, bg: bg, start: time.Now()}
}

// handle answers one message. A nil answer means the message needs none.
func (r *request) handle(ctx context.Context, msg *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
	was := r.observeMessage(ctx, msg)
	resp, err := r.dispatch(ctx, msg)
	if err != nil {
		return r.handleErr(ctx, err)
	}
	r.observeAnswer(was, resp)
	return resp
}

// sent notes that the answer handle returned has reached Envoy: a decode
// prepared by then is Envoy's to send.
func (r *request) sent() {
	if p := r.prepared; p != nil && (r.state == stateRouted) {
		p.delivered = true
		if r.prefill == nil {
			r.prepared = nil // a sequential prefill: nothing left to release
		}
	}
}

// close ends whatever of the request still runs. A prepared decode that
// Envoy never got, and the legs of a concurrent prefill the request did not
// wait for (the client went away), leave work on the engines: they are
// told to let go of it.
func (r *request) close() {
	if r.cancelPrefill != nil {
		r.cancelPrefill()
	}
	if p := r.prepared; p != nil && (!p.delivered || r.prefill != nil) {
		r.release("the request ended before its decode")
	}
}

// releaseTimeout bounds a release, which runs after the request is over.
const releaseTimeout = 5 * time.Second

// release tells the engines to let go of the prepared decode's work, in the
// background: the request has no one to wait for it.
func (r *request) release(why string) {
	p := r.prepared
	r.prepared = nil
	if p == nil || p.releaser == nil {
		return
	}
	log, env := r.log, r.env
	r.bg.Go(func() {
		ctx, cancel := context.WithTimeout(context.Background(), releaseTimeout)
		defer cancel()
		if err := p.releaser.Release(ctx, env, p.req, p.decode); err != nil {
			log.LogAttrs(ctx, slog.LevelWarn, "releasing the engines' work failed", slog.String("why", why), slog.String("error", err.Error()))
			return
		}
		log.LogAttrs(ctx, slog.LevelInfo, "released the engines' work", slog.String("why", why),
			slog.String("prefill", p.req.Prefill.Address), slog.String("decode", p.req.Decode.Address))
	})
}

// finished reports whether pdx has nothing left to do for the request: it
// has answered it, or routed it with no prefill running on and no response
// phase to come (the Envoy configs pdx ships skip them, and pdx asks for
// response headers only in tables with concurrent connectors).
func (r *request) finished() bool {
	switch r.state {
	case stateAnswered, stateEnvoyAnswered:
		return true
	case statePassThrough:
		return true
	case stateRouted:
		return r.prefill == nil && !r.heldHeaders && !r.table.HasConcurrent()
	}
	return false
}

// pendingPrefill is the channel of a concurrent prefill still running, or nil.
func (r *request) pendingPrefill() <-chan error { return r.prefill }

// prefillDone takes a concurrent prefill's outcome. On failure the client
// gets pdx's error instead of the decode's answer: Envoy is still waiting for
// the decode's response headers, either with pdx holding its answer to them
// or before they arrived, and an ImmediateResponse then resets the decode.
// Neither a retry nor the fallback is possible any more: the decode is on
// its way, waiting for this prefill's KV, and its engine is told to let go.
func (r *request) prefillDone(ctx context.Context, err error) *extprocv3.ProcessingResponse {
	r.prefill = nil
	r.cancelPrefill()
	r.report(ctx, r.prefillPool, r.prefillOn, err)
	if err != nil {
		r.release("the prefill failed after its decode was sent")
		return r.handleErr(ctx, r.prefillErr(r.prefillPool, r.prefillOn, err))
	}
	r.prepared = nil
	r.log.LogAttrs(ctx, slog.LevelDebug, "prefill done", slog.Duration("elapsed", time.Since(r.start)))
	if r.heldHeaders {
		r.heldHeaders = false
		return continueResponseHeaders()
	}
	return nil
}

func (r *request) handleErr(ctx context.Context, err error) *extprocv3.ProcessingResponse {
	r.state = stateFailed
	e := toAPIError(err)
	r.observeFailure(e.code)
	r.log.LogAttrs(ctx, e.logLevel(), "request failed",
		slog.Int("status", e.status), slog.String("code", e.code), slog.String("error", err.Error()),
		slog.Duration("elapsed", time.Since(r.start)))
	return e.immediateResponse(r.clientID)
}

// dispatch is the request's state machine: it hands each message to the
// handler of its kind and phase. A message that Envoy may send in a phase
// where pdx does not expect it (the response headers of Envoy's own local
// reply while pdx waits for the body) is passed on; only ones that cannot
// happen in Envoy's protocol are errors.
func (r *request) dispatch(ctx context.Context, msg *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, error) {
	if r.state.over() {
		// The client has its answer; whatever Envoy still sends is moot.
		return nil, nil
	}
	if pc := msg.GetProtocolConfig(); pc != nil {
		r.protocol = pc
	}
	switch m := msg.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		if r.state != stateRequestHeaders {
			return nil, protocolError("request headers", r.state)
		}
		return r.requestHeaders(m.RequestHeaders)
	case *extprocv3.ProcessingRequest_RequestBody:
		switch r.state {
		case stateRequestBody:
			if r.duplex() {
				return r.bodyChunk(ctx, m.RequestBody)
			}
			return r.requestBody(ctx, m.RequestBody)
		case stateRouted, statePassThrough:
			return r.passRequestBody(m.RequestBody), nil
		}
		return nil, protocolError("request body", r.state)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		if r.state == stateRequestHeaders {
			return nil, protocolError("request trailers", r.state)
		}
		if r.state == stateRequestBody && r.duplex() {
			return r.bodyEnded(ctx, true)
		}
		return continueRequestTrailers(), nil
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		switch r.state {
		case stateRequestHeaders:
			return nil, protocolError("response headers", r.state)
		case stateRequestBody:
			return r.envoyAnswered(ctx, m.ResponseHeaders), nil
		}
		if r.prefill != nil {
			// The decode answered before its KV is known to be complete
			// (SGLang streams headers at once): hold the answer, so the
			// client sees either the decode's output or pdx's error.
			r.heldHeaders = true
			return nil, nil
		}
		return continueResponseHeaders(), nil
	case *extprocv3.ProcessingRequest_ResponseBody:
		if r.state == stateRequestHeaders {
			return nil, protocolError("response body", r.state)
		}
		return r.passResponseBody(m.ResponseBody), nil
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		if r.state == stateRequestHeaders {
			return nil, protocolError("response trailers", r.state)
		}
		return continueResponseTrailers(), nil
	}
	// Flow-control messages and kinds newer than pdx carry no request phase.
	return nil, nil
}

// envoyAnswered passes on the response headers of an answer Envoy gave
// the client itself while pdx waited for the body (its 413 for a body over
// its buffer limit, its 408): the request is over.
func (r *request) envoyAnswered(ctx context.Context, h *extprocv3.HttpHeaders) *extprocv3.ProcessingResponse {
	r.state = stateEnvoyAnswered
	r.log.LogAttrs(ctx, slog.LevelInfo, "Envoy answered the request itself",
		slog.String("status", header(h, ":status")), slog.Duration("elapsed", time.Since(r.start)))
	return continueResponseHeaders()
}

// Generation APIs pdx routes with a prefill.
var inferencePaths = map[string]bool{
	"/v1/chat/completions": true,
	"/v1/completions":      true,
}

// modelsPath is where OpenAI clients list the models; pdx answers it from
// its pools unless a pool passes it through.
const modelsPath = "/v1/models"

func (r *request) requestHeaders(h *extprocv3.HttpHeaders) (*extprocv3.ProcessingResponse, error) {
	path, _, _ := strings.Cut(header(h, ":path"), "?")
	r.path = path
	r.clientID = clientRequestID(header(h, "x-request-id"))
	r.id = newRequestID()
	r.log = r.log.With(slog.String("request_id", r.clientID), slog.String("path", path))

	method := header(h, ":method")
	switch {
	case inferencePaths[path]:
		if method != "POST" {
			return nil, &apiError{status: 405, typ: typeInvalidRequest, code: "method_not_allowed",
				msg: fmt.Sprintf("%s %s is not supported; use POST", method, path), allow: "POST"}
		}
	case r.table.PassesThrough(path):
		r.passThrough = true
	case path == modelsPath:
		if method != "GET" {
			return nil, &apiError{status: 405, typ: typeInvalidRequest, code: "method_not_allowed",
				msg: fmt.Sprintf("%s %s is not supported; use GET", method, path), allow: "GET"}
		}
		return r.models(), nil
	default:
		return nil, &apiError{status: 404, typ: typeInvalidRequest, code: "not_found",
			msg: fmt.Sprintf("no API at %s: pdx serves POST /v1/chat/completions, POST /v1/completions and GET /v1/models", path)}
	}
	if err := r.checkHeaderRoom(h); err != nil {
		return nil, err
	}
	if r.passThrough && h.GetEndOfStream() {
		// No body (GET): the decode endpoint is known now.
		pool, _ := r.table.PassThrough(path, "")
		return r.passHeaders(pool)
	}
	if !r.passThrough {
		if enc := header(h, "content-encoding"); enc != "" && !strings.EqualFold(enc, "identity") {
			return nil, &apiError{status: 415, typ: typeInvalidRequest, code: "unsupported_content_encoding",
				msg: fmt.Sprintf("content-encoding %q is not supported; send the JSON body uncompressed", enc)}
		}
		if h.GetEndOfStream() {
			return nil, badRequest("missing_body", "the request has no body; send a JSON object")
		}
	}
	if err := r.checkBodyMode(); err != nil {
		return nil, err
	}
	r.state = stateRequestBody
	if r.duplex() {
		// The answer waits for the body: it carries the decode endpoint.
		return nil, nil
	}
	if r.table.HasConcurrent() && !r.passThrough {
		return routeHeadersHoldingResponse(), nil
	}
	return routeHeaders(), nil
}

// checkHeaderRoom refuses a request whose headers leave no room for pdx's
// within Envoy's limits: Envoy would refuse the mutation and answer 503
// itself, which looks like a router fault and invites retries. What pdx
// sets is the decode endpoint (replacing any client's), content-length and
// x-request-id (replacing those there are) and, with tracing on, W3C trace
// headers; the count is that of Envoy's header map, pseudo-headers and the
// headers Envoy added included.
func (r *request) checkHeaderRoom(h *extprocv3.HttpHeaders) error {
	lim := r.table.Limits()
	all := h.GetHeaders().GetHeaders()
	size := 0
	for _, hv := range all {
		size += len(hv.GetKey()) + len(hv.GetRawValue()) + len(hv.GetValue())
	}
	count, own := len(all), size
	adds := []struct {
		name  string
		bytes int // of the header at most
		on    bool
	}{
		{DestinationHeader, len(DestinationHeader) + len("[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:65535"), true},
		{"content-length", len("content-length") + 10, true},
		{"x-request-id", len("x-request-id") + 36, true},
		{"traceparent", len("traceparent") + 55, r.obs.tracer != nil},
		{"tracestate", len("tracestate") + 512, r.obs.tracer != nil},
	}
	for _, a := range adds {
		if !a.on {
			continue
		}
		size += a.bytes
		if !hasHeader(h, a.name) {
			count++
		}
	}
	if count <= lim.MaxHeaders && size <= lim.MaxHeaderBytes {
		return nil
	}
	return &apiError{status: 431, typ: typeInvalidRequest, code: "headers_too_large",
		msg: fmt.Sprintf("the request has %d headers of %d bytes; with the router's own they would exceed the limit of %d headers or %d bytes: send fewer",
			len(all), own, lim.MaxHeaders, lim.MaxHeaderBytes)}
}

func hasHeader(h *extprocv3.HttpHeaders, name string) bool {
	for _, hv := range h.GetHeaders().GetHeaders() {
		if hv.GetKey() == name {
			return true
		}
	}
	return false
}

func (r *request) requestBody(ctx context.Context, b *extprocv3.HttpBody) (*extprocv3.ProcessingResponse, error) {
	if !b.GetEndOfStream() {
		// Only a buffered body can be rewritten together with the headers.
		return nil, fmt.Errorf("%w: got a partial request body; configure request_body_mode BUFFERED or FULL_DUPLEX_STREAMED", errConfig)
	}
	if n, max := len(b.GetBody()), r.table.MaxBodyBytes(); max > 0 && n > max {
		return nil, &apiError{status: 413, typ: typeInvalidRequest, code: "body_too_large",
			msg: fmt.Sprintf("the request body is %d bytes, over the limit of %d", n, max)}
	}
	return r.bodyDone(ctx, b.GetBody())
}

// bodyDone routes a request whose body has arrived.
func (r *request) bodyDone(ctx context.Context, raw []byte) (*extprocv3.ProcessingResponse, error) {
	if r.passThrough {
		return r.passBody(raw)
	}
	return r.route(ctx, raw)
}

// route parses a complete request body, runs the prefill and answers with
// the decode request.
func (r *request) route(ctx context.Context, raw []byte) (*extprocv3.ProcessingResponse, error) {
	body, err := jsonedit.Parse(raw)
	if err != nil {
		return nil, bodyError(err)
	}
	model, err := modelOf(body)
	if err != nil {
		return nil, err
	}
	if model == "" {
		return nil, badRequest("missing_model", `the request has no "model"`)
	}
	pool, ok := r.table.Lookup(model)
	if !ok {
		return nil, modelNotFound(model)
	}
	r.obs.pool = pool
	if err := validate(body, r.path, pool); err != nil {
		return nil, err
	}
	creq := &connectors.Request{ID: r.id, Path: r.path, Body: body, KVHosts: pool.KVHosts}
	// A discovered pool may have no decode endpoint at the moment: 503.
	if creq.Decode, err = pool.PickDecode(); err != nil {
		return nil, err
	}
	var decode connectors.Decode
	if pool.Traits.Prefills {
		decode, err = r.prefillWithRetries(ctx, pool, creq)
	} else {
		decode, err = pool.Connector.Prepare(ctx, r.env, creq)
	}
	switch {
	case err != nil && pool.Fallback && fallbackable(ctx, err):
		// The decode engine can compute the prompt itself: slower, but the
		// client gets an answer.
		r.log.LogAttrs(ctx, slog.LevelWarn, "prefill failed, decoding without it",
			slog.String("pool", pool.Name), slog.String("error", err.Error()))
		decode = connectors.Decode{Body: connectors.Plain(body)}
		r.obs.fallback = true
	case err != nil:
		return nil, err
	}
	if rel, ok := pool.Connector.(connectors.Releaser); ok && !r.obs.fallback {
		r.prepared = &prepared{releaser: rel, req: creq, decode: decode}
	}
	if ctx.Err() != nil {
		// The client went away while the prefill ran; its KV is released
		// when Process ends.
		return nil, ctx.Err()
	}
	if decode.Answer != nil {
		r.state = stateAnswered
		r.log.LogAttrs(ctx, slog.LevelDebug, "answered by the prefill", slog.String("pool", pool.Name),
			slog.String("prefill", creq.Prefill.Address), slog.Duration("elapsed", time.Since(r.start)))
		return immediate(200, decode.Answer.ContentType, decode.Answer.Body, "pdx_answered_by_prefill", r.clientID), nil
	}
	r.prefill = decode.Prefill
	if decode.RequestID != "" {
		r.id = decode.RequestID
	}
	r.state = stateRouted
	r.log.LogAttrs(ctx, slog.LevelDebug, "routed",
		slog.String("model", model), slog.String("pool", pool.Name), slog.String("engine_request_id", r.id),
		slog.String("prefill", creq.Prefill.Address), slog.String("decode", creq.Decode.Address),
		slog.Duration("elapsed", time.Since(r.start)))
	return r.routed(decode.Body, bytes.Equal(decode.Body, raw), creq.Decode), nil
}

// passHeaders routes a request on a pass-through path that has no body,
// at its headers.
func (r *request) passHeaders(pool *routing.Pool) (*extprocv3.ProcessingResponse, error) {
	r.obs.pool = pool
	decode, err := pool.PickDecode()
	if err != nil {
		return nil, err
	}
	r.state = statePassThrough
	return passThroughHeaders(decode, r.id, r.clientID), nil
}

// passBody routes a request on a pass-through path once its body is in: to
// the pool of the model it names, with protocol fields stripped from a
// JSON body. Bodies that are not JSON (a form, an audio file) carry no
// protocol fields an engine reads and pass unchanged; one that looks like
// JSON but does not parse could hide them, and is refused.
func (r *request) passBody(raw []byte) (*extprocv3.ProcessingResponse, error) {
	body, model := raw, ""
	if t := bytes.TrimLeft(raw, " \t\r\n"); len(t) > 0 && (t[0] == '{' || t[0] == '[') {
		obj, err := jsonedit.Parse(raw)
		if err != nil {
			return nil, bodyError(err)
		}
		if model, err = modelOf(obj); err != nil {
			return nil, err
		}
		body = connectors.Plain(obj)
	}
	pool, ok := r.table.PassThrough(r.path, model)
	switch {
	case !ok && model != "" && pool == nil:
		return nil, modelNotFound(model)
	case !ok:
		return nil, &apiError{status: 404, typ: typeInvalidRequest, code: "not_found",
			msg: fmt.Sprintf("no API at %s for model %q", r.path, model)}
	}
	r.obs.pool = pool
	decode, err := pool.PickDecode()
	if err != nil {
		return nil, err
	}
	r.state = statePassThrough
	return r.routed(body, bytes.Equal(body, raw), decode), nil
}

// models answers GET /v1/models with the models the pools serve.
func (r *request) models() *extprocv3.ProcessingResponse {
	names, created := r.table.Models()
	type model struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		Created int64  `json:"created"`
		OwnedBy string `json:"owned_by"`
	}
	list := struct {
		Object string  `json:"object"`
		Data   []model `json:"data"`
	}{Object: "list", Data: make([]model, len(names))}
	for i, n := range names {
		list.Data[i] = model{ID: n, Object: "model", Created: created.Unix(), OwnedBy: "pdx"}
	}
	body, _ := json.Marshal(list) // strings and numbers only
	r.state = stateAnswered
	return immediate(200, "application/json", body, "pdx_models", r.clientID)
}

func modelNotFound(model string) *apiError {
	return &apiError{status: 404, typ: typeInvalidRequest, code: "model_not_found",
		msg: fmt.Sprintf("the model %q does not exist", model)}
}

// modelOf returns the body's "model", "" when it is absent or null.
func modelOf(body jsonedit.Object) (string, error) {
	raw, ok := body.Raw("model")
	if !ok || string(raw) == "null" {
		return "", nil
	}
	var model string
	if raw[0] != '"' || json.Unmarshal(raw, &model) != nil {
		return "", badRequest("invalid_type", fmt.Sprintf(`"model" must be a string, got %.40s`, raw))
	}
	if model == "" {
		return "", badRequest("missing_model", `"model" is empty`)
	}
	return model, nil
}

// header returns the value of a request header; Envoy sends raw_value.
func header(h *extprocv3.HttpHeaders, name string) string {
	for _, hv := range h.GetHeaders().GetHeaders() {
		if hv.GetKey() == name {
			if raw := hv.GetRawValue(); raw != nil {
				return string(raw)
			}
			return hv.GetValue()
		}
	}
	return ""
}

// clientRequestID is the client's X-Request-Id when it is sane, for logs
// and the response; otherwise a fresh one.
func clientRequestID(client string) string {
	if n := len(client); n > 0 && n <= 128 && printable(client) {
		return client
	}
	return newRequestID()
}

// newRequestID returns a random UUID (version 4), the id engines get.
func newRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40 // UUID version 4
	b[8] = b[8]&0x3f | 0x80
	var out [36]byte
	hex.Encode(out[0:8], b[0:4])
	out[8] = '-'
	hex.Encode(out[9:13], b[4:6])
	out[13] = '-'
	hex.Encode(out[14:18], b[6:8])
	out[18] = '-'
	hex.Encode(out[19:23], b[8:10])
	out[23] = '-'
	hex.Encode(out[24:], b[10:])
	return string(out[:])
}

func printable(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] <= ' ' || s[i] > '~' {
			return false
		}
	}
	return true
}
