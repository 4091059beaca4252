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
	"net"

	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/jsonedit"
)

// Request is one client request as a connector sees it.
type Request struct {
	// ID is the request id sent to the engines on both legs (X-Request-Id).
	// It is pdx's, fresh per request: clients' ids may repeat, and two
	// requests with one id on one engine collide.
	ID string
	// Path is the OpenAI API path, e.g. "/v1/chat/completions".
	Path string
	// Body is the client's parsed JSON body.
	Body jsonedit.Object
	// Prefill and Decode are the endpoints picked for the two legs.
	Prefill, Decode endpoint.Endpoint
	// PrefillRank and DecodeRank are the data-parallel ranks picked on
	// them; none for an engine without DP ranks (Endpoint.DPSize <= 1).
	PrefillRank, DecodeRank endpoint.Rank
	// KVHosts are the hosts, besides the prefill endpoint's own, that a
	// prefill answer may name as the decode's KV source (the pool's
	// allowed_kv_hosts: NAT, a separate KV network).
	KVHosts endpoint.HostSet
}

// Handoff is what Prepare hands the processor for one request: the decode
// for Envoy (or the client's whole answer), the prefill if it still runs,
// and what the engines hold for the request. It belongs to the request, not
// the connector: the processor keeps it in the request's stream.
type Handoff struct {
	// Decode is what Envoy sends to the decode endpoint; unset with Answer.
	Decode Decode
	// Answer, when set, is the client's whole answer and no decode is sent:
	// the prefill engine finished the request itself (a TensorRT-LLM context
	// answer that ended on EOS or a stop string).
	Answer *Answer
	// Prefill is the prefill still running while Envoy sends the decode,
	// set exactly by the connectors whose Traits are Concurrent (SGLang,
	// upstream Mooncake); nil when the prefill ended within Prepare.
	Prefill Pending
	// Held, when set, is what the engines hold for the request and how to
	// make them let go of it; nil when they hold nothing.
	Held Held
	// Prefilled is what the prefill engine's answer said of the prompt
	// (its usage), for the connectors that read the answer; zero when it
	// said nothing.
	Prefilled Prefilled
}

// Decode is what Envoy sends to the decode endpoint.
type Decode struct {
	// Body replaces the client's body.
	Body []byte
	// RequestID, when set, replaces Request.ID as the decode leg's
	// X-Request-Id (P2P NCCL encodes the engines' addresses in it).
	RequestID string
	// Rank is the DP rank the decode request names in vLLM's
	// X-data-parallel-rank header; none when the engine has no ranks or
	// takes the rank in the body (SGLang).
	Rank endpoint.Rank
}

// Answer is an answer for the client that pdx sends itself.
type Answer struct {
	ContentType string
	Body        []byte
}

// Pending is a prefill that still runs when Prepare returns, under the ctx
// given to Prepare: cancelling it ends the prefill.
type Pending interface {
	// Done delivers the prefill's outcome exactly once (nil on success).
	// It is buffered, so the prefill never waits for a reader.
	Done() <-chan error
}

// Held is what the engines hold for one prepared request (KV blocks kept
// for a decode, a decode's reserved slot), with what telling them to let
// go of it takes. pdx calls Release once it knows the decode will not be
// sent or cannot succeed: the client went away after the prefill, or a
// concurrent prefill failed after its decode was sent. It is best effort,
// runs detached from the request, and returns once done or when ctx ends.
// It may keep the Request it was prepared for: pdx does not change a
// Request once Prepare has returned its hand-off.
type Held interface {
	Release(ctx context.Context, env Env) error
}

// Connector prepares the decode leg of one request, calling the prefill engine
// as its protocol requires.
type Connector interface {
	Prepare(ctx context.Context, env Env, req *Request) (Handoff, error)
}

// Env is what a connector works with besides the request: the client for
// engine calls, and what pdx has learned about the engines (never anything
// about a request). It is shared by all requests and safe for concurrent use.
type Env struct {
	Engine Engine
	// EngineIDs caches the engine ids of Mooncake prefill engines; nil asks
	// the bootstrap server on every request.
	EngineIDs *EngineIDs
}

// Engine sends requests to inference engines.
type Engine interface {
	// Post sends body (its pieces one after another, only read) to path
	// on endpoint with the given X-Request-Id and, when rank is set, the
	// DP rank that is to serve it (vLLM's X-data-parallel-rank), and
	// returns the answer's body. A non-2xx answer is an *engines.Error.
	Post(ctx context.Context, endpoint endpoint.Endpoint, path, requestID string, rank endpoint.Rank, body net.Buffers) ([]byte, error)
	// Get fetches http://address+path (a bootstrap server's, for example)
	// and returns the answer's body. A non-2xx answer is an *engines.Error.
	Get(ctx context.Context, address, path string) ([]byte, error)
}
