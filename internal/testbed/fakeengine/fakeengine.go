// Package fakeengine is the engine of unit tests: stand-ins for the
// inference engines pdx calls through connectors.Engine, so that connector
// and processor tests run without HTTP.
//
// [Engine] answers as a test programs it and records every call; [Fixed]
// answers every call with the same bytes and records nothing, for
// benchmarks and allocation counts.
//
// The package imports neither connectors nor processor: their own internal
// tests import it. Its types satisfy connectors.Engine structurally.
package fakeengine

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"slices"
	"sync"

	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
)

// Call is one call an [Engine] received.
type Call struct {
	Method string // http.MethodPost or http.MethodGet
	// Endpoint is a POST's endpoint; a GET's is endpoint.Endpoint{Address: address}.
	Endpoint  endpoint.Endpoint
	Path      string
	RequestID string        // POST only
	Rank      endpoint.Rank // POST only: the DP rank named, if any
	Body      string        // POST only, its pieces joined
	// CtxErr is, for a call a Block reply held, ctx.Err() when the wait
	// ended: what tells a test the call was ended by its context.
	CtxErr error
}

// Reply programs an [Engine]'s answer to the calls of one method, address
// and path. The first of these that is set decides: Block, Fn, Err, Body
// (an empty Reply answers an empty body).
type Reply struct {
	Body string
	Err  error
	// Block makes the call wait for its ctx to end and then fail with an
	// *engines.Error wrapping ctx.Err(), as engines.HTTP does. The call is
	// sent on [Engine.Blocked] when it starts waiting and recorded, with
	// CtxErr, when the wait ends, so that a test seeing it in [Engine.Calls]
	// knows the call is over.
	Block bool
	// Fn, when set, computes the answer from the call.
	Fn func(ctx context.Context, c Call) ([]byte, error)
}

// blockedBuffer is how many held calls [Engine.Blocked] buffers; later ones
// are not sent, so that a test that does not read it never holds a call.
const blockedBuffer = 1024

// Engine is a programmable, recording engine. Calls nobody programmed with
// [Engine.On] fail with a 404 *engines.Error naming the call. The zero
// Engine is ready to use; it is safe for concurrent use.
type Engine struct {
	mu      sync.Mutex
	replies map[route]Reply
	calls   []Call
	// blocked is made on first use: fuzz tests make an engine per input,
	// which would each allocate the buffer.
	blocked chan Call
}

type route struct{ method, address, path string }

// New returns an Engine with nothing programmed.
func New() *Engine { return &Engine{} }

// On programs the answer to method calls of address and path, and returns
// e. An empty address or path matches any; a call gets the reply of the
// most specific match: its address and path, its address and any path, any
// address and its path, then any address and path.
func (e *Engine) On(method, address, path string, r Reply) *Engine {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.replies == nil {
		e.replies = map[route]Reply{}
	}
	e.replies[route{method, address, path}] = r
	return e
}

// Post implements connectors.Engine.
func (e *Engine) Post(ctx context.Context, ep endpoint.Endpoint, path, requestID string, rank endpoint.Rank, body net.Buffers) ([]byte, error) {
	return e.do(ctx, Call{Method: http.MethodPost, Endpoint: ep, Path: path, RequestID: requestID, Rank: rank, Body: string(bytes.Join(body, nil))})
}

// Get implements connectors.Engine.
func (e *Engine) Get(ctx context.Context, address, path string) ([]byte, error) {
	return e.do(ctx, Call{Method: http.MethodGet, Endpoint: endpoint.Endpoint{Address: address}, Path: path})
}

func (e *Engine) do(ctx context.Context, c Call) ([]byte, error) {
	e.mu.Lock()
	r, ok := e.reply(c)
	var blocked chan Call
	if ok && r.Block {
		blocked = e.blockedLocked()
	} else {
		e.calls = append(e.calls, c)
	}
	e.mu.Unlock()
	switch {
	case !ok:
		return nil, &engines.Error{Endpoint: c.Endpoint, Status: 404, Message: fmt.Sprintf("fake engine: nothing programmed for %s %s%s", c.Method, c.Endpoint.Address, c.Path)}
	case r.Block:
		select {
		case blocked <- c:
		default:
		}
		<-ctx.Done()
		c.CtxErr = ctx.Err()
		e.mu.Lock()
		e.calls = append(e.calls, c)
		e.mu.Unlock()
		return nil, &engines.Error{Endpoint: c.Endpoint, Err: c.CtxErr}
	case r.Fn != nil:
		return r.Fn(ctx, c)
	case r.Err != nil:
		return nil, r.Err
	}
	return []byte(r.Body), nil
}

// reply looks up c's reply, most specific first; e.mu is held.
func (e *Engine) reply(c Call) (Reply, bool) {
	for _, k := range [...]route{
		{c.Method, c.Endpoint.Address, c.Path},
		{c.Method, c.Endpoint.Address, ""},
		{c.Method, "", c.Path},
		{c.Method, "", ""},
	} {
		if r, ok := e.replies[k]; ok {
			return r, true
		}
	}
	return Reply{}, false
}

// Blocked returns the channel that receives each call a Block reply holds,
// as it starts waiting: a test reading it knows the call is in flight.
func (e *Engine) Blocked() <-chan Call {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.blockedLocked()
}

func (e *Engine) blockedLocked() chan Call {
	if e.blocked == nil {
		e.blocked = make(chan Call, blockedBuffer)
	}
	return e.blocked
}

// Calls returns a copy of the calls recorded so far, in the order they were
// recorded (held calls when they ended).
func (e *Engine) Calls() []Call {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.calls)
}

// Fixed answers every POST with PostAnswer and every GET with GetAnswer, at
// once, and records nothing: benchmarks and allocation tests measure the
// caller's work, not a fake's. A value with no lock or map, its calls do not
// allocate; the callers must not change the answers they get.
type Fixed struct {
	PostAnswer, GetAnswer []byte
}

// Post implements connectors.Engine.
func (f Fixed) Post(context.Context, endpoint.Endpoint, string, string, endpoint.Rank, net.Buffers) ([]byte, error) {
	return f.PostAnswer, nil
}

// Get implements connectors.Engine.
func (f Fixed) Get(context.Context, string, string) ([]byte, error) { return f.GetAnswer, nil }
