package connectors

import (
	"errors"
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
func prefillOutcome(t *testing.T, p Pending) error {
	t.Helper()
	require.NotNil(t, p, "a concurrent connector returns its pending prefill")
	ch := p.Done()
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
