package processor

import (
	"fmt"
	"log/slog"
	"slices"
)

// state is the phase a request is in. Every change of phase goes through
// enter, which holds it to transitions.
type state int

const (
	// stateRequestHeaders waits for the request headers, the first message.
	stateRequestHeaders state = iota
	// stateRequestBody waits for the body of a request pdx routes.
	stateRequestBody
	// statePassThroughBody waits for the body of a request on a path that
	// a pool serves as it is.
	statePassThroughBody
	// statePrefilling has sent the decode mutation while a concurrent
	// connector's prefill still runs; the decode's response headers have
	// not come.
	statePrefilling
	// stateHoldingResponse: the concurrent prefill still runs and the
	// decode's response headers have come. pdx withholds its answer to
	// them, and queues its answers to the response phases after them,
	// until the prefill's outcome is in: the client then sees either the
	// decode's output or pdx's error.
	stateHoldingResponse
	// stateRouted has sent the decode mutation, and nothing of pdx's
	// runs for the request any more; only response phases follow.
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

var stateNames = [...]string{
	stateRequestHeaders:  "request_headers",
	stateRequestBody:     "request_body",
	statePassThroughBody: "pass_through_body",
	statePrefilling:      "prefilling",
	stateHoldingResponse: "holding_response",
	stateRouted:          "routed",
	statePassThrough:     "pass_through",
	stateAnswered:        "answered",
	stateEnvoyAnswered:   "envoy_answered",
	stateFailed:          "failed",
}

func (s state) String() string {
	if s >= 0 && int(s) < len(stateNames) {
		return stateNames[s]
	}
	return fmt.Sprintf("state(%d)", int(s))
}

// transitions are the phases each phase may move to: the request's
// lifecycle in one place. Any phase before the client has its answer may
// fail, and Envoy may answer the client itself while pdx waits for a
// request's headers or body.
var transitions = [...][]state{
	stateRequestHeaders: {stateRequestBody, statePassThroughBody, statePassThrough, stateAnswered, stateEnvoyAnswered, stateFailed},
	stateRequestBody:    {stateRouted, statePrefilling, stateAnswered, stateEnvoyAnswered, stateFailed},
	// A pass-through request is routed at its body.
	statePassThroughBody: {statePassThrough, stateEnvoyAnswered, stateFailed},
	// The prefill's outcome, or the decode's response headers before it.
	statePrefilling:      {stateRouted, stateHoldingResponse, stateFailed},
	stateHoldingResponse: {stateRouted, stateFailed},
	stateRouted:          {},
	statePassThrough:     {},
	stateAnswered:        {},
	stateEnvoyAnswered:   {},
	stateFailed:          {},
}

// strictTransitions makes enter panic on a transition the table does not
// allow. The processor's tests set it; in production a stray transition
// is logged, and the request goes on in the phase its handler chose.
var strictTransitions = false

// enter moves the request to phase next.
func (r *request) enter(next state) {
	if !slices.Contains(transitions[r.state], next) {
		if strictTransitions {
			panic(fmt.Sprintf("processor: request moved from %s to %s", r.state, next))
		}
		r.log.Error("request moved between phases out of order", slog.String("from", r.state.String()), slog.String("to", next.String()))
	}
	r.state = next
}

// over reports whether pdx has given the request its answer (or Envoy has).
func (s state) over() bool {
	return s == stateAnswered || s == stateEnvoyAnswered || s == stateFailed
}

// awaitingBody reports whether the request waits for its body.
func (s state) awaitingBody() bool {
	return s == stateRequestBody || s == statePassThroughBody
}

// prefilling reports whether a concurrent connector's prefill still runs
// for a request whose decode Envoy has.
func (s state) prefilling() bool {
	return s == statePrefilling || s == stateHoldingResponse
}

// decoded reports whether the request went to a decode engine with pdx's
// decode mutation.
func (s state) decoded() bool {
	return s == statePrefilling || s == stateHoldingResponse || s == stateRouted
}
