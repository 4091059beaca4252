package processor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"

	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/jsonedit"
	"github.com/pdx-router/pdx/internal/routing"
)

// OpenAI error types.
const (
	typeInvalidRequest = "invalid_request_error"
	typeServer         = "server_error"
)

var (
	errPrefillTimeout = errors.New("prefill timed out")
	errConfig         = errors.New("pdx is misconfigured")
	errProtocol       = errors.New("unexpected ext_proc message")
	errBodyTimeout    = errors.New("the request body did not arrive in time")
	errNoEndpoint     = routing.ErrNoEndpoint // also what a failed pick wraps
)

// apiError is an error with the HTTP answer the client gets for it.
type apiError struct {
	status int
	typ    string
	code   string
	msg    string
	allow  string // the Allow header of a 405
	// retryAfter is the Retry-After header of a 429, in seconds (0: none).
	retryAfter int
}

func (e *apiError) Error() string { return e.msg }

func badRequest(code, msg string) *apiError {
	return &apiError{status: 400, typ: typeInvalidRequest, code: code, msg: msg}
}

func bodyError(err error) *apiError {
	var dup *jsonedit.DuplicateKeyError
	switch {
	case errors.As(err, &dup):
		return badRequest("duplicate_key", err.Error())
	case errors.Is(err, jsonedit.ErrNotObject):
		return badRequest("invalid_json", "the request body must be a JSON object")
	}
	return badRequest("invalid_json", "the request body is not valid JSON")
}

func protocolError(kind string, s state) error {
	return fmt.Errorf("%w: %s in state %s", errProtocol, kind, s)
}

// toAPIError is the one place where a failure becomes the client's answer.
func toAPIError(err error) *apiError {
	if e, ok := errors.AsType[*apiError](err); ok {
		return e
	}
	msg := err.Error()
	switch {
	case errors.Is(err, errPrefillTimeout):
		return &apiError{status: 504, typ: typeServer, code: "prefill_timeout", msg: msg}
	case errors.Is(err, context.Canceled):
		// The client is gone; Envoy drops this answer, but say what happened.
		return &apiError{status: 503, typ: typeServer, code: "cancelled", msg: "request cancelled: " + msg}
	case errors.Is(err, errNoEndpoint):
		return &apiError{status: 503, typ: typeServer, code: "no_endpoint", msg: msg}
	case errors.Is(err, errAttemptTimeout):
		return &apiError{status: 504, typ: typeServer, code: "prefill_timeout", msg: msg}
	case errors.Is(err, errBodyTimeout):
		return &apiError{status: 408, typ: typeInvalidRequest, code: "request_timeout", msg: msg}
	case errors.Is(err, errProtocol), errors.Is(err, errConfig):
		return &apiError{status: 500, typ: typeServer, code: "internal_error", msg: msg}
	}
	if ee, ok := errors.AsType[*engines.Error](err); ok {
		switch {
		case errors.Is(err, engines.ErrBadAnswer):
			return &apiError{status: 502, typ: typeServer, code: "bad_prefill_answer", msg: msg}
		case ee.Status == 0:
			return &apiError{status: 503, typ: typeServer, code: "prefill_unavailable", msg: msg}
		case ee.Status == 400 || ee.Status == 413 || ee.Status == 422:
			// The engine refused the request itself (too long a prompt, a bad
			// parameter): the client can fix it, so say so with the same status.
			return &apiError{status: ee.Status, typ: typeInvalidRequest, code: "prefill_rejected", msg: msg}
		case ee.Status == 429:
			return &apiError{status: 429, typ: typeServer, code: "prefill_overloaded", msg: msg}
		}
		return &apiError{status: 502, typ: typeServer, code: "prefill_failed", msg: msg}
	}
	return &apiError{status: 500, typ: typeServer, code: "internal_error", msg: msg}
}

func (e *apiError) logLevel() slog.Level {
	if e.status >= 500 {
		return slog.LevelWarn
	}
	return slog.LevelInfo
}

// immediateResponse is the error answer Envoy sends the client instead of
// proxying the request: in the shape of the API the client speaks,
// Anthropic's for the Messages API (anthropic), else OpenAI's. The code
// stays in Envoy's details and pdx's logs and metrics either way.
func (e *apiError) immediateResponse(requestID string, anthropic bool) *extprocv3.ProcessingResponse {
	var body []byte
	if anthropic {
		// Anthropic's error body (vLLM's AnthropicErrorResponse too):
		// {"type":"error","error":{"type":...,"message":...}}.
		body, _ = json.Marshal(map[string]any{"type": "error", "error": map[string]any{
			"type":    anthropicType(e.status),
			"message": e.msg,
		}})
	} else {
		body, _ = json.Marshal(map[string]any{"error": map[string]any{
			"message": e.msg,
			"type":    e.typ,
			"code":    e.code,
		}})
	}
	resp := immediate(e.status, "application/json", body, "pdx_"+e.code, requestID)
	hm := resp.GetImmediateResponse().GetHeaders()
	if e.allow != "" {
		hm.SetHeaders = append(hm.SetHeaders, setHeader("allow", e.allow))
	}
	if e.retryAfter > 0 {
		hm.SetHeaders = append(hm.SetHeaders, setHeader("retry-after", strconv.Itoa(e.retryAfter)))
	}
	return resp
}

// anthropicType is the error type Anthropic's API gives a status
// (its errors reference: invalid_request_error 400, authentication_error
// 401, permission_error 403, not_found_error 404, request_too_large 413,
// rate_limit_error 429, api_error 500, timeout_error 504,
// overloaded_error 529); other 4xx are invalid requests, other 5xx
// api_error.
func anthropicType(status int) string {
	switch {
	case status == 401:
		return "authentication_error"
	case status == 403:
		return "permission_error"
	case status == 404:
		return "not_found_error"
	case status == 413:
		return "request_too_large"
	case status == 429:
		return "rate_limit_error"
	case status == 504:
		return "timeout_error"
	case status == 529:
		return "overloaded_error"
	case status < 500:
		return "invalid_request_error"
	}
	return "api_error"
}

// immediate is an answer pdx gives the client itself, which Envoy sends as a
// local reply. details names it in Envoy's logs ("pdx_" and a code); the
// local replies Envoy maps to JSON itself are the others.
func immediate(status int, contentType string, body []byte, details, requestID string) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
		ImmediateResponse: &extprocv3.ImmediateResponse{
			Status: &typev3.HttpStatus{Code: typev3.StatusCode(status)},
			Headers: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
				setHeader("content-type", contentType),
				setHeader("x-request-id", requestID),
			}},
			Body:    body,
			Details: details,
		},
	}}
}
