// Package connectors holds pdx's KV connectors: how the prefill request is
// derived from the client's body, what is read back from the prefill engine,
// and how the decode body is derived, for each engine's KV transfer protocol.
//
// A connector is a stateless strategy. It holds only immutable configuration;
// everything that belongs to one request comes in as arguments and goes out as
// results. That is what makes it impossible for concurrent requests to swap
// prompts or KV parameters, the bug this project exists to avoid.
package connectors

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/pdx-router/pdx/internal/jsonedit"
)

// Endpoint is an engine picked for one leg of a request.
type Endpoint struct {
	// Address is a literal "ip:port".
	Address string
}

// Request is one client request as a connector sees it.
type Request struct {
	// ID is the request id sent to the engines on both legs (X-Request-Id).
	ID string
	// Path is the OpenAI API path, e.g. "/v1/chat/completions".
	Path string
	// Body is the client's parsed JSON body.
	Body jsonedit.Object
	// Prefill and Decode are the endpoints picked for the two legs.
	Prefill, Decode Endpoint
}

// Decode is what Envoy sends to the decode endpoint.
type Decode struct {
	// Body replaces the client's body.
	Body []byte
}

// Connector prepares the decode leg of one request, calling the prefill engine
// as its protocol requires.
type Connector interface {
	Prepare(ctx context.Context, engine Engine, req *Request) (Decode, error)
}

// Engine sends requests to inference engines.
type Engine interface {
	// Post sends body to path on endpoint with the given X-Request-Id and
	// returns the answer's body. A non-2xx answer is an *EngineError.
	Post(ctx context.Context, endpoint Endpoint, path, requestID string, body []byte) ([]byte, error)
}

// EngineError reports a prefill call that did not produce a usable answer.
type EngineError struct {
	Endpoint Endpoint
	// Status is the engine's HTTP status, or 0 when none was received.
	Status int
	// Message describes what was wrong, e.g. the engine's error text.
	Message string
	Err     error
}

func (e *EngineError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "prefill engine %s", e.Endpoint.Address)
	if e.Status != 0 {
		fmt.Fprintf(&b, " answered %d", e.Status)
	}
	if e.Message != "" {
		b.WriteString(": ")
		b.WriteString(e.Message)
	}
	if e.Err != nil {
		b.WriteString(": ")
		b.WriteString(e.Err.Error())
	}
	return b.String()
}

func (e *EngineError) Unwrap() error { return e.Err }

// ErrBadAnswer marks a prefill answer that does not follow the protocol.
var ErrBadAnswer = errors.New("invalid prefill answer")

// registry maps connector names to their strategies. It is written only here,
// at package initialization, and never changed.
var registry = map[string]Connector{
	"nixl": NIXL{},
}

// Lookup returns the connector registered under name.
func Lookup(name string) (Connector, bool) {
	c, ok := registry[name]
	return c, ok
}

// Names lists the registered connector names, sorted.
func Names() []string {
	names := make([]string, 0, len(registry))
	for name := range registry {
		names = append(names, name)
	}
	slices.Sort(names)
	return names
}
