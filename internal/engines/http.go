// Package engines is pdx's client of the inference engines' HTTP APIs: one
// shared, tuned connection pool, and the error every failed call returns.
package engines

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"time"

	"go.opentelemetry.io/otel/propagation"

	"github.com/pdx-router/pdx/internal/endpoint"
)

// maxAnswerBytes bounds a prefill answer. It is one token plus
// kv_transfer_params (block ids of long prompts run to a few hundred KB).
const maxAnswerBytes = 8 << 20

// HTTP is the [Engine] pdx uses in production: one shared connection pool
// sized for thousands of concurrent prefill calls (conns.go), and
// net/http's client for the few GETs.
type HTTP struct {
	conns  pool
	client *http.Client
}

// NewHTTP returns an engine client with a tuned transport.
func NewHTTP() *HTTP {
	return &HTTP{client: &http.Client{Transport: NewTransport()}}
}

// NewTransport returns the transport for engine GETs (Post has its own
// connections, conns.go). Go's default keeps only 2 idle connections per
// host; under load every further request then dials anew, which costs
// hundreds of milliseconds at p99.
func NewTransport() *http.Transport {
	return &http.Transport{
		Proxy: nil, // engines are addressed directly, never through a proxy
		DialContext: (&net.Dialer{
			Timeout:   5 * time.Second,
			KeepAlive: 30 * time.Second,
		}).DialContext,
		MaxIdleConns:          4096,
		MaxIdleConnsPerHost:   1024,
		IdleConnTimeout:       90 * time.Second,
		ResponseHeaderTimeout: 0, // the request's context bounds the prefill
		ExpectContinueTimeout: 0,
		DisableCompression:    true, // answers are small; gzip only costs CPU
		ForceAttemptHTTP2:     false,
		// GETs and their answers are small.
		WriteBufferSize: 1 << 10,
		ReadBufferSize:  2 << 10,
	}
}

// CloseIdleConnections closes the pool's idle connections.
func (e *HTTP) CloseIdleConnections() {
	e.conns.closeIdle()
	e.client.CloseIdleConnections()
}

// Post implements [Engine].
func (e *HTTP) Post(ctx context.Context, ep endpoint.Endpoint, path, requestID string, rank endpoint.Rank, body net.Buffers) ([]byte, error) {
	if !headerSafe(path) || !headerSafe(requestID) {
		return nil, &Error{Endpoint: ep, Err: fmt.Errorf("%w: %q, %q", errHeaderValue, path, requestID)}
	}
	var length int64
	for _, p := range body {
		length += int64(len(p))
	}
	n, hasRank := rank.Get()
	head := requestHead(ctx, make([]byte, 0, 256), ep.Address, path, requestID, n, hasRank, length)
	status, answer, err := e.conns.post(ctx, ep.Address, head, body)
	if err != nil {
		if status != 0 {
			return nil, &Error{Endpoint: ep, Status: status, Message: "reading answer", Err: err}
		}
		return nil, &Error{Endpoint: ep, Err: err}
	}
	return checkAnswer(ep, status, answer)
}

// RankHeader names the DP rank that is to serve a request. vLLM's OpenAI
// server reads "X-data-parallel-rank" (serving.py,
// _get_data_parallel_rank); header names are case-insensitive, and the
// canonical spelling costs Header.Set no allocation.
const RankHeader = "X-Data-Parallel-Rank"

// do sends req and reads a bounded answer, turning every failure into an
// *Error.
func (e *HTTP) do(req *http.Request, ep endpoint.Endpoint) ([]byte, error) {
	// The W3C traceparent of the span in the request's context (pdx's
	// prefill attempt), so that the engine's span is its child. Without a
	// span, that is with tracing off, this writes nothing.
	propagation.TraceContext{}.Inject(req.Context(), propagation.HeaderCarrier(req.Header))
	resp, err := e.client.Do(req)
	if err != nil {
		return nil, &Error{Endpoint: ep, Err: unwrapURLError(err)}
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(io.LimitReader(resp.Body, maxAnswerBytes+1))
	if err != nil {
		return nil, &Error{Endpoint: ep, Status: resp.StatusCode, Message: "reading answer", Err: unwrapURLError(err)}
	}
	return checkAnswer(ep, resp.StatusCode, answer)
}

// checkAnswer returns an answer read whole with a 2xx status, or the
// error it is.
func checkAnswer(ep endpoint.Endpoint, status int, answer []byte) ([]byte, error) {
	if len(answer) > maxAnswerBytes {
		return nil, &Error{Endpoint: ep, Status: status, Err: fmt.Errorf("%w: answer over %d bytes", ErrBadAnswer, maxAnswerBytes)}
	}
	if status/100 != 2 {
		return nil, &Error{Endpoint: ep, Status: status, Message: engineMessage(answer)}
	}
	return answer, nil
}

// unwrapURLError drops *url.Error's "Post \"http://...\":" prefix, which
// repeats what Error already says; errors.Is still sees the cause.
func unwrapURLError(err error) error {
	if ue, ok := errors.AsType[*url.Error](err); ok {
		return ue.Err
	}
	return err
}

// engineMessage extracts the message of an OpenAI-style error answer
// ({"error":{"message":...}} or vLLM's older {"message":...}), or else a
// short prefix of the answer.
func engineMessage(answer []byte) string {
	var e struct {
		Error   json.RawMessage `json:"error"`
		Message string          `json:"message"`
	}
	if json.Unmarshal(answer, &e) == nil {
		var inner struct {
			Message string `json:"message"`
		}
		if json.Unmarshal(e.Error, &inner) == nil && inner.Message != "" {
			return inner.Message
		}
		if e.Message != "" {
			return e.Message
		}
	}
	const max = 200
	if len(answer) > max {
		return string(answer[:max]) + "..."
	}
	return string(answer)
}

// Get implements [Engine].
func (e *HTTP) Get(ctx context.Context, address, path string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+address+path, nil)
	if err != nil {
		return nil, &Error{Endpoint: endpoint.Endpoint{Address: address}, Err: err}
	}
	return e.do(req, endpoint.Endpoint{Address: address})
}
