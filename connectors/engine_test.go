package connectors

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/jsonedit"
)

// TestMain fails the package if a test leaves a goroutine behind, such as a
// concurrent connector's prefill that outlives its request.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// engineCall is one call a fakeEngine received.
type engineCall struct {
	method string // http.MethodPost or http.MethodGet
	// endpoint is a POST's endpoint; a GET's is endpoint.Endpoint{Address: address}.
	endpoint  endpoint.Endpoint
	path      string
	requestID string // POST only
	body      string // POST only
}

// reply programs a fakeEngine's answer to the calls of one method, address
// and path.
type reply struct {
	body string
	err  error
	// block makes the call wait for its ctx to end and then fail with an
	// *engines.Error wrapping ctx.Err(), as engines.HTTP does.
	block bool
	// fn, when set, computes the answer from the call.
	fn func(engineCall) ([]byte, error)
}

// fakeEngine is the [Engine] of the connector tests. It records every call
// and answers as programmed with on; calls nobody programmed fail with a 404
// *engines.Error. It is safe for concurrent use.
type fakeEngine struct {
	mu      sync.Mutex
	replies map[string]reply
	calls   []engineCall
	// blocked receives each call that starts waiting for its ctx.
	blocked chan engineCall
}

func newFakeEngine() *fakeEngine {
	return &fakeEngine{replies: map[string]reply{}, blocked: make(chan engineCall, 1024)}
}

func replyKey(method, address, path string) string { return method + " " + address + path }

// on programs the answer to method calls of address+path and returns e.
func (e *fakeEngine) on(method, address, path string, r reply) *fakeEngine {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.replies[replyKey(method, address, path)] = r
	return e
}

// Post implements [Engine].
func (e *fakeEngine) Post(ctx context.Context, ep endpoint.Endpoint, path, requestID string, body net.Buffers) ([]byte, error) {
	return e.do(ctx, engineCall{method: http.MethodPost, endpoint: ep, path: path, requestID: requestID, body: string(bytes.Join(body, nil))})
}

// Get implements [Engine].
func (e *fakeEngine) Get(ctx context.Context, address, path string) ([]byte, error) {
	return e.do(ctx, engineCall{method: http.MethodGet, endpoint: endpoint.Endpoint{Address: address}, path: path})
}

func (e *fakeEngine) do(ctx context.Context, c engineCall) ([]byte, error) {
	e.mu.Lock()
	e.calls = append(e.calls, c)
	r, ok := e.replies[replyKey(c.method, c.endpoint.Address, c.path)]
	e.mu.Unlock()
	switch {
	case !ok:
		return nil, &engines.Error{Endpoint: c.endpoint, Status: 404, Message: fmt.Sprintf("fake engine: nothing programmed for %s %s%s", c.method, c.endpoint.Address, c.path)}
	case r.block:
		select {
		case e.blocked <- c:
		default:
		}
		<-ctx.Done()
		return nil, &engines.Error{Endpoint: c.endpoint, Err: ctx.Err()}
	case r.fn != nil:
		return r.fn(c)
	case r.err != nil:
		return nil, r.err
	}
	return []byte(r.body), nil
}

// recorded returns a copy of the calls received so far.
func (e *fakeEngine) recorded() []engineCall {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.calls)
}

// Test endpoints.
var (
	testPrefill = endpoint.Endpoint{Address: "10.0.0.1:8100", KVAddress: "10.0.0.1:21001"}
	testDecode  = endpoint.Endpoint{Address: "10.0.0.2:8200", KVAddress: "10.0.0.2:22001"}
)

// newRequest returns a request for the client body on the test endpoints.
func newRequest(t *testing.T, client string) *Request {
	t.Helper()
	obj, err := jsonedit.Parse([]byte(client))
	require.NoError(t, err)
	return &Request{ID: "req-1", Path: "/v1/chat/completions", Body: obj, Prefill: testPrefill, Decode: testDecode}
}

// prefillOutcome receives the one outcome of a concurrent prefill and checks
// that no second one follows.
func prefillOutcome(t *testing.T, ch <-chan error) error {
	t.Helper()
	require.NotNil(t, ch, "a concurrent connector returns a prefill channel")
	require.Equal(t, 1, cap(ch), "buffered: the prefill never waits for a reader")
	var err error
	select {
	case err = <-ch:
	case <-time.After(5 * time.Second):
		t.Fatal("no prefill outcome")
	}
	select {
	case again := <-ch:
		t.Fatalf("a second prefill outcome: %v", again)
	case <-time.After(20 * time.Millisecond):
	}
	return err
}

// requireEngineError checks that err is an *engines.Error naming ep.
func requireEngineError(t *testing.T, err error, ep endpoint.Endpoint) *engines.Error {
	t.Helper()
	require.Error(t, err)
	ee, ok := errors.AsType[*engines.Error](err)
	require.True(t, ok, "want an *engines.Error, got %T: %v", err, err)
	require.Equal(t, ep, ee.Endpoint)
	return ee
}
