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
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/placement"
	"github.com/pdx-router/pdx/internal/routing"
)

// modelsPath is where OpenAI clients list the models; pdx answers it from
// its pools unless a pool passes it through.
const modelsPath = "/v1/models"

// requestHeaders decides what the path is for, and asks Envoy for the body
// of a request pdx routes.
func (r *request) requestHeaders(ctx context.Context, h *extprocv3.HttpHeaders) (*extprocv3.ProcessingResponse, error) {
	path, _, _ := strings.Cut(header(h, ":path"), "?")
	r.path = path
	r.headers = h
	r.clientID = clientRequestID(header(h, "x-request-id"))
	r.id = newRequestID()
	r.log = r.log.With(slog.String("request_id", r.clientID), slog.String("path", path))
	if r.trace = r.obs.begin(ctx, h); r.trace.id != "" {
		r.log = r.log.With(slog.String("trace_id", r.trace.id))
	}

	method := header(h, ":method")
	passThrough := false
	switch {
	case connectors.Routed(path):
		if method != "POST" {
			return nil, &apiError{status: 405, typ: typeInvalidRequest, code: "method_not_allowed",
				msg: fmt.Sprintf("%s %s is not supported; use POST", method, path), allow: "POST"}
		}
	case r.table.PassesThrough(path):
		passThrough = true
	case path == modelsPath:
		if method != "GET" {
			return nil, &apiError{status: 405, typ: typeInvalidRequest, code: "method_not_allowed",
				msg: fmt.Sprintf("%s %s is not supported; use GET", method, path), allow: "GET"}
		}
		return r.models(), nil
	default:
		return nil, &apiError{status: 404, typ: typeInvalidRequest, code: "not_found",
			msg: fmt.Sprintf("no API at %s: pdx serves POST %s and GET %s", path, strings.Join(connectors.RoutedPaths(), ", POST "), modelsPath)}
	}
	if err := r.checkHeaderRoom(h); err != nil {
		return nil, err
	}
	if err := r.flowHeaders(h); err != nil {
		return nil, err
	}
	if passThrough && h.GetEndOfStream() {
		// No body (GET): the decode endpoint is known now.
		pool, _ := r.table.PassThrough(path, "")
		return r.passHeaders(pool)
	}
	if !passThrough {
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
	if passThrough {
		r.enter(statePassThroughBody)
	} else {
		r.enter(stateRequestBody)
	}
	// Also with decode fallbacks: the response headers tell which decode
	// served (served.go). A FULL_DUPLEX_STREAMED filter is configured to
	// send them (pdx's answer to the headers comes with the body).
	r.headersDue = (r.table.HasConcurrent() || r.table.MaxDecodeFallbacks() > 0) && !passThrough
	if r.duplex() {
		// The answer waits for the body: it carries the decode endpoint.
		return nil, nil
	}
	if r.headersDue {
		return routeHeadersHoldingResponse(), nil
	}
	return routeHeaders(), nil
}

// checkHeaderRoom refuses a request whose headers leave no room for pdx's
// within Envoy's limits: Envoy would refuse the mutation and answer 503
// itself, which looks like a router fault and invites retries. What pdx
// sets is the decode endpoint (replacing any client's), content-length and
// x-request-id (replacing those there are) and, with tracing on, the W3C
// trace headers; the count is that of Envoy's header map, pseudo-headers
// and the headers Envoy added included.
func (r *request) checkHeaderRoom(h *extprocv3.HttpHeaders) error {
	lim := r.table.Limits()
	all := h.GetHeaders().GetHeaders()
	size := 0
	for _, hv := range all {
		size += len(hv.GetKey()) + len(hv.GetRawValue()) + len(hv.GetValue())
	}
	count, own := len(all), size
	add := func(name string, bytes int) {
		size += len(name) + bytes
		if !hasHeader(h, name) {
			count++
		}
	}
	// The decode endpoint, and the fallbacks after it.
	add(DestinationHeader, (1+r.table.MaxDecodeFallbacks())*len("[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:65535,"))
	add("content-length", 10)
	add("x-request-id", 36)
	if r.table.Ranked() {
		add(RankHeader, 4)
	}
	for _, th := range r.trace.headers {
		add(th.name, len(th.value))
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

// requestBody routes a BUFFERED request once Envoy has its whole body.
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

// bodyDone routes a request whose body has arrived (BUFFERED, or the last
// of a FULL_DUPLEX_STREAMED body) and answers with what it decided.
func (r *request) bodyDone(ctx context.Context, raw []byte) (*extprocv3.ProcessingResponse, error) {
	if r.state == statePassThroughBody {
		d, err := r.passBody(raw)
		if err != nil {
			return nil, err
		}
		r.enter(statePassThrough)
		return r.answer(d), nil
	}
	d, answer, err := r.routeBody(ctx, raw)
	switch {
	case err != nil:
		return nil, err
	case answer != nil:
		r.enter(stateAnswered)
		return immediate(200, answer.ContentType, answer.Body, "pdx_answered_by_prefill", r.clientID), nil
	case r.prefill.pending != nil:
		r.enter(statePrefilling)
	default:
		r.enter(stateRouted)
	}
	return r.answer(d), nil
}

// routeBody parses a complete request body, runs the prefill and decides
// the decode request, or the answer a connector had from the prefill alone.
func (r *request) routeBody(ctx context.Context, raw []byte) (decision, *connectors.Answer, error) {
	body, model, pool, err := r.parseBody(raw)
	if err != nil {
		return decision{}, nil, err
	}
	if connectors.APIOf(r.path) == connectors.APIResponses {
		body = storeOff(body)
	}
	creq := &connectors.Request{ID: r.id, Path: r.path, Body: body, KVHosts: pool.KVHosts}
	r.flow.Bytes = len(raw)
	h, err := r.handoff(ctx, pool, creq, model)
	if err != nil {
		return decision{}, nil, err
	}
	if h.Held != nil {
		r.prefill.prepared = &prepared{held: h.Held, req: creq}
	}
	if ctx.Err() != nil {
		// The client went away while the prefill ran; its KV is released
		// when Process ends.
		return decision{}, nil, ctx.Err()
	}
	if h.Answer != nil {
		r.log.LogAttrs(ctx, slog.LevelDebug, "answered by the prefill", slog.String("pool", pool.Name),
			slog.String("prefill", creq.Prefill.Address), slog.Duration("elapsed", time.Since(r.start)))
		return decision{}, h.Answer, nil
	}
	if h.Prefill != nil {
		r.prefill.pending = h.Prefill.Done()
	}
	d := h.Decode
	if d.RequestID != "" {
		r.id = d.RequestID
	}
	r.log.LogAttrs(ctx, slog.LevelDebug, "routed",
		slog.String("model", model), slog.String("pool", pool.Name), slog.String("engine_request_id", r.id),
		slog.String("prefill", creq.Prefill.Address), slog.String("decode", creq.Decode.Address),
		slog.Duration("elapsed", time.Since(r.start)))
	return decision{decode: creq.Decode, rank: d.Rank, body: d.Body, unchanged: bytes.Equal(d.Body, raw), pool: pool}, nil, nil
}

// storeOff is a Responses body with "store" false, which pdx sends both
// legs: pdx holds no responses and routes no GET /v1/responses/{id}, so a
// response stored on an engine could never be read, and vLLM never frees
// one (serving.py: the store "may cause a memory leak"). vLLM itself
// ignores store unless VLLM_ENABLE_RESPONSES_API_STORE is set
// (_create_responses: "we opted to implicitly disable store and process
// the request anyway").
func storeOff(body jsonedit.Object) jsonedit.Object {
	if raw, ok := body.Raw("store"); ok && string(raw) == "false" {
		return body
	}
	edited, err := jsonedit.Parse(body.Edited(jsonedit.Set("store", []byte("false"))))
	if err != nil {
		return body // cannot happen: an edit of a valid object is one
	}
	return edited
}

// parseBody parses a routed request's body, and finds and checks it
// against the pool of its model.
func (r *request) parseBody(raw []byte) (jsonedit.Object, string, *routing.Pool, error) {
	body, err := jsonedit.Parse(raw)
	if err != nil {
		return jsonedit.Object{}, "", nil, bodyError(err)
	}
	model, err := modelOf(body)
	if err != nil {
		return jsonedit.Object{}, "", nil, err
	}
	if model == "" {
		return jsonedit.Object{}, "", nil, badRequest("missing_model", `the request has no "model"`)
	}
	pool, ok := r.table.Lookup(model)
	if !ok {
		return jsonedit.Object{}, "", nil, modelNotFound(model)
	}
	r.obs.pool(pool)
	if err := validate(body, r.path, pool); err != nil {
		return jsonedit.Object{}, "", nil, err
	}
	return body, model, pool, nil
}

// handoff places the request and hands it over to its decode: after its
// prefill, or to compute the prompt itself when the decider says so or the
// prefill failed on a pool that falls back.
func (r *request) handoff(ctx context.Context, pool *routing.Pool, creq *connectors.Request, model string) (connectors.Handoff, error) {
	r.session = r.sessionIn(pool)
	r.adapter = pool.Adapter(model)
	r.pool = pool
	// A discovered pool may have no decode endpoint at the moment: 503.
	err := r.place(ctx, pool, creq, model)
	r.obs.session(pool, picker.RoleDecode, r.placed.Decode.Session())
	if err != nil {
		return connectors.Handoff{}, err
	}
	var h connectors.Handoff
	reason := r.placed.Reason
	switch reason {
	case placement.ReasonDisaggregated:
		h, err = r.prefillWithRetries(ctx, pool, creq)
	case "":
		h, err = pool.Connector.Prepare(ctx, r.env, creq)
	default:
		h = r.decodeAlone(creq)
	}
	// A concurrent connector picked in Prepare.
	r.placed.Release()
	r.obs.decided(pool, reason)
	if err != nil && pool.Fallback && fallbackable(ctx, err) {
		// The decode engine can compute the prompt itself: slower, but the
		// client gets an answer.
		r.log.LogAttrs(ctx, slog.LevelWarn, "prefill failed, decoding without it",
			slog.String("pool", pool.Name), slog.String("error", err.Error()))
		r.fallback = true
		h, err = r.decodeAlone(creq), nil
		reason = ""
	}
	if err == nil && h.Answer == nil {
		// A prefill that has answered leaves the decode free to move; a
		// decode-alone one stays where the decider counted its cache.
		again := reason == placement.ReasonDisaggregated && h.Prefill == nil
		moved := r.placed.Settle(creq, again)
		if moved {
			h.Decode.Rank = creq.DecodeRank
		}
		if again && pool.LateDecode {
			r.obs.repicked(pool, moved)
		}
	}
	return h, err
}

// decodeAlone is the hand-off of a request whose decode engine computes
// the prompt itself: the client's body, protocol fields stripped, naming
// no DP rank.
func (r *request) decodeAlone(creq *connectors.Request) connectors.Handoff {
	r.placed.Decode.DropRank()
	return connectors.Handoff{Decode: connectors.Decode{Body: connectors.Plain(creq.Body)}}
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
