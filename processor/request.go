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
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/jsonedit"
	"github.com/pdx-router/pdx/internal/routing"
)

// state is the phase a request is in.
type state int

const (
	// stateRequestHeaders waits for the request headers, the first message.
	stateRequestHeaders state = iota
	// stateRequestBody waits for the buffered body of an inference request.
	stateRequestBody
	// stateRouted has sent the decode mutation; only response phases follow.
	stateRouted
	// statePassThrough is a request pdx does not route; it is left untouched.
	statePassThrough
	// stateFailed has sent an ImmediateResponse.
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
	case stateFailed:
		return "failed"
	}
	return fmt.Sprintf("state(%d)", int(s))
}

// request is everything pdx knows about one HTTP request. It is created in
// Process and dies with the stream.
type request struct {
	table  *routing.Table
	engine connectors.Engine
	log    *slog.Logger

	state state
	id    string // X-Request-Id for both legs
	path  string // without the query string
	start time.Time

	// The context of the request's prefill attempts, and what it runs on.
	prefillCtx    context.Context
	cancelPrefill context.CancelFunc
	prefillPool   *routing.Pool
	prefillOn     connectors.Endpoint
	// A concurrent connector's prefill, still running while Envoy sends the
	// decode; nil once its outcome is in (or for sequential connectors).
	prefill <-chan error
	// heldHeaders is set while pdx withholds its answer to the decode's
	// response headers until the prefill has succeeded.
	heldHeaders bool
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

func newRequest(table *routing.Table, engine connectors.Engine, log *slog.Logger) *request {
	return &request{table: table, engine: engine, log: log, start: time.Now()}
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

// close ends whatever of the request still runs.
func (r *request) close() {
	if r.cancelPrefill != nil {
		r.cancelPrefill()
	}
}

// finished reports whether pdx has nothing left to do for the request: it
// has been routed, no prefill runs on, and Envoy will send no response phase
// (the Envoy configs pdx ships skip them, and pdx asks for response headers
// only in tables with concurrent connectors).
func (r *request) finished() bool {
	return r.state == stateRouted && r.prefill == nil && !r.heldHeaders && !r.table.HasConcurrent()
}

// pendingPrefill is the channel of a concurrent prefill still running, or nil.
func (r *request) pendingPrefill() <-chan error { return r.prefill }

// prefillDone takes a concurrent prefill's outcome. On failure the client
// gets pdx's error instead of the decode's answer: Envoy is still waiting for
// the decode's response headers, either with pdx holding its answer to them
// or before they arrived, and an ImmediateResponse then resets the decode.
// Neither a retry nor the fallback is possible any more: the decode is on
// its way, waiting for this prefill's KV.
func (r *request) prefillDone(ctx context.Context, err error) *extprocv3.ProcessingResponse {
	r.prefill = nil
	r.cancelPrefill()
	r.report(ctx, r.prefillPool, r.prefillOn, err)
	if err != nil {
		return r.handleErr(ctx, r.prefillErr(r.prefillPool, r.prefillOn, err))
	}
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
	return e.immediateResponse()
}

func (r *request) dispatch(ctx context.Context, msg *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, error) {
	if r.state == stateFailed {
		// pdx has answered the client; whatever Envoy still sends is moot.
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
		case statePassThrough:
			return r.passRequestBody(m.RequestBody), nil
		case stateRequestBody:
			if r.duplex() {
				return r.bodyChunk(ctx, m.RequestBody)
			}
			return r.requestBody(ctx, m.RequestBody)
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
		if r.state != stateRouted && r.state != statePassThrough {
			return nil, protocolError("response headers", r.state)
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
		if r.state != stateRouted && r.state != statePassThrough {
			return nil, protocolError("response body", r.state)
		}
		return r.passResponseBody(m.ResponseBody), nil
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		if r.state != stateRouted && r.state != statePassThrough {
			return nil, protocolError("response trailers", r.state)
		}
		return continueResponseTrailers(), nil
	}
	// Flow-control messages and kinds newer than pdx carry no request phase.
	return nil, nil
}

// Inference paths pdx routes; everything else passes through untouched.
var inferencePaths = map[string]bool{
	"/v1/chat/completions": true,
	"/v1/completions":      true,
}

func (r *request) requestHeaders(h *extprocv3.HttpHeaders) (*extprocv3.ProcessingResponse, error) {
	path, _, _ := strings.Cut(header(h, ":path"), "?")
	r.path = path
	r.id = requestID(header(h, "x-request-id"))
	r.log = r.log.With(slog.String("request_id", r.id), slog.String("path", path))

	if !inferencePaths[path] {
		r.state = statePassThrough
		return passThroughHeaders(), nil
	}
	if method := header(h, ":method"); method != "POST" {
		return nil, &apiError{status: 405, typ: typeInvalidRequest, code: "method_not_allowed",
			msg: fmt.Sprintf("%s %s is not supported; use POST", method, path), allow: "POST"}
	}
	if enc := header(h, "content-encoding"); enc != "" && !strings.EqualFold(enc, "identity") {
		return nil, &apiError{status: 415, typ: typeInvalidRequest, code: "unsupported_content_encoding",
			msg: fmt.Sprintf("content-encoding %q is not supported; send the JSON body uncompressed", enc)}
	}
	if h.GetEndOfStream() {
		return nil, badRequest("missing_body", "the request has no body; send a JSON object")
	}
	if err := r.checkBodyMode(); err != nil {
		return nil, err
	}
	r.state = stateRequestBody
	if r.duplex() {
		// The answer waits for the body: it carries the decode endpoint.
		return nil, nil
	}
	if r.table.HasConcurrent() {
		return routeHeadersHoldingResponse(), nil
	}
	return routeHeaders(), nil
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
	return r.route(ctx, b.GetBody())
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
	pool, ok := r.table.Lookup(model)
	if !ok {
		return nil, &apiError{status: 404, typ: typeInvalidRequest, code: "model_not_found",
			msg: fmt.Sprintf("the model %q does not exist", model)}
	}
	r.obs.pool = pool
	if err := validate(body, r.path, pool); err != nil {
		return nil, err
	}
	creq := &connectors.Request{ID: r.id, Path: r.path, Body: body}
	// A discovered pool may have no decode endpoint at the moment: 503.
	if creq.Decode, err = pool.PickDecode(); err != nil {
		return nil, err
	}
	var decode connectors.Decode
	if connectors.Prefills(pool.Connector) {
		decode, err = r.prefillWithRetries(ctx, pool, creq)
	} else {
		decode, err = pool.Connector.Prepare(ctx, r.engine, creq)
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
	r.prefill = decode.Prefill
	if decode.RequestID != "" {
		r.id = decode.RequestID
	}
	r.state = stateRouted
	r.log.LogAttrs(ctx, slog.LevelDebug, "routed",
		slog.String("model", model), slog.String("pool", pool.Name),
		slog.String("prefill", creq.Prefill.Address), slog.String("decode", creq.Decode.Address),
		slog.Duration("elapsed", time.Since(r.start)))
	return r.routed(decode.Body, bytes.Equal(decode.Body, raw), creq.Decode), nil
}

func modelOf(body jsonedit.Object) (string, error) {
	raw, ok := body.Raw("model")
	if !ok {
		return "", badRequest("missing_model", `the request has no "model"`)
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

// requestID keeps a client's X-Request-Id when it is sane and otherwise makes
// one: engines use it as a key, so it must be printable and bounded.
func requestID(client string) string {
	if n := len(client); n > 0 && n <= 128 && printable(client) {
		return client
	}
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
