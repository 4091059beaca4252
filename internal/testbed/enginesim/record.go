package enginesim

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
)

// Record is what the simulator saw of one inference request or KV transfer.
type Record struct {
	RequestID   string `json:"request_id"` // X-Request-Id header received
	Path        string `json:"path"`
	Kind        string `json:"kind"`        // one of the Kind constants
	Fingerprint string `json:"fingerprint"` // Fingerprint of the prompt (for a pull: of the KV's prompt)
	KV          string `json:"kv"`          // for decode-capable engines: "pulled" or "recomputed"; else ""
	KVSource    string `json:"kv_source"`   // HTTP host:port of the prefill engine whose KV a decode pulled (nixl: also when refused)
	// Status is the HTTP status sent, or 499 when the client went away
	// before the response was complete. A refusal sent as an SSE error
	// event after a 200 (an SGLang streaming decode) has the status the
	// event names.
	Status int `json:"status"`
	// DPRank is the data-parallel rank that served an inference request
	// (0 on an engine without DP ranks), and KVSourceRank, for a decode
	// that took KV, the prefill engine's rank whose KV it was.
	DPRank       int `json:"dp_rank"`
	KVSourceRank int `json:"kv_source_rank"`
	// DPRankNamed reports that the request named its rank, rather than
	// leaving it to the engine.
	DPRankNamed bool `json:"dp_rank_named,omitempty"`
	// RID is the request id a client set in the body (SGLang's rid; for
	// KindAbort the rid asked to abort); "" when the engine made one up.
	RID string `json:"rid,omitempty"`
	// Headers are the names of the request's headers, lower case, sorted:
	// what reached the engine of a client's headers.
	Headers []string        `json:"headers,omitempty"`
	Error   string          `json:"error,omitempty"`
	Body    json.RawMessage `json:"body"` // the request body as received (compact)
}

// Record kinds. An inference request refused with an error status is
// KindRejected whatever it asked for, so a test can look for any refusal in
// one place; a refused KV transfer stays KindKVPull or KindKVPush with its
// error status.
const (
	KindPrefill = "prefill"
	KindDecode  = "decode"
	KindPlain   = "plain"   // no KV transfer params
	KindKVPull  = "kv-pull" // a decode took KV from this (prefill) engine
	KindKVPush  = "kv-push" // a prefill sent KV to this (decode) engine: P2P NCCL
	// KindKVRelease is a decode's notification to this (prefill) engine to
	// free KV it will not pull (vLLM NIXL: the decode was aborted before
	// it was scheduled).
	KindKVRelease = "kv-release"
	KindAbort     = "abort" // a call of SGLang's POST /abort_request
	KindRejected  = "rejected"
)

// Values of Record.KV and of the X-Pdx-Sim-Kv header.
const (
	KVPulled     = "pulled"
	KVRecomputed = "recomputed"
)

// maxBody bounds request bodies; prompts of a simulator are small.
const maxBody = 16 << 20

func readBody(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	return io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
}

// recordBody is recordBody(body) unless the engine keeps no records.
func (s *Server) recordBody(body []byte) json.RawMessage {
	if s.cfg.TallyOnly {
		return nil
	}
	return recordBody(body)
}

// recordBody is the body as a compact JSON value. A body that is not JSON is
// kept as a JSON string so Records still marshal.
func recordBody(body []byte) json.RawMessage {
	if len(bytes.TrimSpace(body)) == 0 {
		return nil
	}
	var buf bytes.Buffer
	if err := json.Compact(&buf, body); err == nil {
		return buf.Bytes()
	}
	s, _ := json.Marshal(string(body))
	return s
}

// apiError is an error to send in vLLM's OpenAI error shape.
type apiError struct {
	status int
	msg    string
}

func (e *apiError) Error() string { return e.msg }

func badRequest(format string, args ...any) *apiError {
	return &apiError{status: http.StatusBadRequest, msg: fmt.Sprintf(format, args...)}
}

// asAPIError turns any error into one fit to send; unknown errors are ours.
func asAPIError(err error) *apiError {
	if ae, ok := errors.AsType[*apiError](err); ok {
		return ae
	}
	return &apiError{status: http.StatusInternalServerError, msg: err.Error()}
}

// errorType names the error like vLLM (after the OpenAI SDK's classes) does.
func errorType(status int) string {
	switch status {
	case http.StatusBadRequest:
		return "BadRequestError"
	case http.StatusForbidden:
		return "PermissionDeniedError"
	case http.StatusNotFound:
		return "NotFoundError"
	case http.StatusMethodNotAllowed:
		return "MethodNotAllowedError"
	case http.StatusConflict:
		return "ConflictError"
	case http.StatusBadGateway:
		return "BadGatewayError"
	case http.StatusServiceUnavailable:
		return "ServiceUnavailableError"
	case http.StatusGatewayTimeout:
		return "GatewayTimeoutError"
	}
	return "InternalServerError"
}

type errorBody struct {
	Error errorDetail `json:"error"`
}

type errorDetail struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    int     `json:"code"`
}

func writeError(w http.ResponseWriter, e *apiError) {
	writeJSON(w, e.status, errorBody{Error: errorDetail{Message: e.msg, Type: errorType(e.status), Code: e.status}})
}

// errorMessage extracts the message of an error body, or returns the body.
func errorMessage(body []byte) string {
	var eb errorBody
	if err := json.Unmarshal(body, &eb); err == nil && eb.Error.Message != "" {
		return eb.Error.Message
	}
	return string(bytes.TrimSpace(body))
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		status, b = http.StatusInternalServerError, []byte(`{"error":{"message":"encoding response failed","type":"InternalServerError","param":null,"code":500}}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}
