package processor

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/placement"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// concurrentConnector plays SGLang: the decode body comes back at once and
// the prefill's outcome arrives later, from the test.
type concurrentConnector struct {
	outcome  chan error
	ended    chan error    // the prefill context's end, when it ends first
	released chan struct{} // one value per Release call
}

// releaseCounter counts Release calls, one value each.
type releaseCounter chan struct{}

func (r releaseCounter) Release(context.Context, connectors.Env) error {
	if r != nil {
		r <- struct{}{}
	}
	return nil
}

// outcome is a prefill's outcome channel as connectors.Pending.
type outcome <-chan error

func (o outcome) Done() <-chan error { return o }

func (c concurrentConnector) Prepare(ctx context.Context, _ connectors.Env, _ *connectors.Request) (connectors.Handoff, error) {
	done := make(chan error, 1)
	go func() {
		select {
		case err := <-c.outcome:
			done <- err
		case <-ctx.Done():
			c.ended <- context.Cause(ctx)
			done <- &engines.Error{Err: ctx.Err()}
		}
	}()
	return connectors.Handoff{Decode: connectors.Decode{Body: []byte(`{"model":"m","bootstrap_room":7}`)},
		Prefill: outcome(done), Held: releaseCounter(c.released)}, nil
}

// concurrentTraits are SGLang's.
var concurrentTraits = connectors.Traits{Prefills: true, Concurrent: true}

// decodeEP8200 is the decode endpoint of concurrentPool's tests.
var decodeEP8200 = endpoint.Endpoint{Address: "127.0.0.1:8200"}

// concurrentPool is the default pool of a concurrent connector conn, one
// attempt of timeout on the prefill endpoint 127.0.0.1:8100, decoding on
// decode.
func concurrentPool(conn connectors.Connector, timeout time.Duration, decode endpoint.Endpoint) *routing.Pool {
	return &routing.Pool{
		Pool: &placement.Pool{Name: "p", Prefills: true,
			Prefill: roundRobin(endpoint.Endpoint{Address: "127.0.0.1:8100"}), Decode: roundRobin(decode)},
		Default: true, ConnectorName: "sglang", Connector: conn, Traits: concurrentTraits, PrefillTimeout: timeout, AttemptTimeout: timeout, Attempts: 1,
	}
}

// concurrentStream starts Process on a stream for a concurrent connector and
// sends the request phase.
func concurrentStream(t *testing.T, timeout time.Duration) (*fakeStream, concurrentConnector, context.CancelFunc, chan error) {
	t.Helper()
	conn := concurrentConnector{outcome: make(chan error, 1), ended: make(chan error, 1), released: make(chan struct{}, 4)}
	table := routing.NewTable(routing.Limits{}, concurrentPool(conn, timeout, decodeEP8200))
	ctx, cancel := context.WithCancel(t.Context())
	stream := newFakeStream(ctx)
	done := make(chan error, 1)
	srv := New(table, answering(fakeengine.Reply{}), slog.New(slog.DiscardHandler))
	go func() { done <- srv.Process(stream) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
		requireLegsEnded(t, table)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		require.NoError(t, srv.Wait(ctx))
	})

	stream.in <- headers("POST", "/v1/chat/completions", false)
	hr := next(t, stream)
	require.Equal(t, holdResponseMode, hr.GetModeOverride(), "response headers are asked for")
	stream.in <- body(chatBody, true)
	br := next(t, stream)
	require.Equal(t, "127.0.0.1:8200", setHeaders(br.GetRequestBody().GetResponse().GetHeaderMutation())[DestinationHeader])
	return stream, conn, cancel, done
}

func next(t *testing.T, s *fakeStream) *extprocv3.ProcessingResponse {
	t.Helper()
	select {
	case r := <-s.out:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("no answer from Process")
		return nil
	}
}

func requireNoAnswer(t *testing.T, s *fakeStream) {
	t.Helper()
	select {
	case r := <-s.out:
		t.Fatalf("unexpected answer %v", r)
	case <-time.After(50 * time.Millisecond):
	}
}

func TestConcurrentPrefill(t *testing.T) {
	t.Run("response headers wait for the prefill", func(t *testing.T) {
		stream, conn, _, _ := concurrentStream(t, time.Minute)
		stream.in <- responseHeaders
		requireNoAnswer(t, stream)
		conn.outcome <- nil
		require.NotNil(t, next(t, stream).GetResponseHeaders(), "headers released once the prefill succeeded")
	})

	t.Run("response phases that stream ahead follow the held headers", func(t *testing.T) {
		// A FULL_DUPLEX_STREAMED response body comes without waiting for
		// the answer to the headers; Envoy takes answers in order.
		stream, conn, _, _ := concurrentStream(t, time.Minute)
		stream.in <- responseHeaders
		stream.in <- responseBody
		stream.in <- &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}}
		requireNoAnswer(t, stream)
		conn.outcome <- nil
		require.NotNil(t, next(t, stream).GetResponseHeaders(), "the headers first")
		require.NotNil(t, next(t, stream).GetResponseBody(), "then the body")
		require.NotNil(t, next(t, stream).GetResponseTrailers(), "then the trailers")
	})

	t.Run("prefill done before the response headers", func(t *testing.T) {
		stream, conn, cancel, done := concurrentStream(t, time.Minute)
		conn.outcome <- nil
		requireNoAnswer(t, stream)
		stream.in <- responseHeaders
		require.NotNil(t, next(t, stream).GetResponseHeaders())
		cancel()
		require.NoError(t, <-done)
		done <- nil
		require.Empty(t, conn.released, "a prefill that succeeded leaves nothing to release")
	})

	t.Run("prefill fails while the decode runs", func(t *testing.T) {
		stream, conn, _, _ := concurrentStream(t, time.Minute)
		conn.outcome <- &engines.Error{Endpoint: endpoint.Endpoint{Address: "127.0.0.1:8100"}, Status: 500, Message: "boom"}
		status, b := immediateOf(t, next(t, stream))
		require.Equal(t, 502, status)
		require.Equal(t, "prefill_failed", b.Error.Code)
		require.Contains(t, b.Error.Message, "pool p: prefill engine 127.0.0.1:8100 answered 500: boom")
		requireReleased(t, conn, "the decode waits for KV that will not come")
		stream.in <- responseHeaders
		requireNoAnswer(t, stream)
	})

	t.Run("prefill fails while the response headers wait", func(t *testing.T) {
		stream, conn, _, _ := concurrentStream(t, time.Minute)
		stream.in <- responseHeaders
		requireNoAnswer(t, stream)
		conn.outcome <- &engines.Error{Err: errors.New("connection refused")}
		status, b := immediateOf(t, next(t, stream))
		require.Equal(t, 503, status)
		require.Equal(t, "prefill_unavailable", b.Error.Code)
	})

	t.Run("prefill timeout", func(t *testing.T) {
		stream, conn, _, _ := concurrentStream(t, 50*time.Millisecond)
		stream.in <- responseHeaders
		status, b := immediateOf(t, next(t, stream))
		require.Equal(t, 504, status)
		require.Equal(t, "prefill_timeout", b.Error.Code)
		require.Contains(t, b.Error.Message, "prefill timed out after 50ms")
		require.ErrorIs(t, <-conn.ended, errPrefillTimeout)
		requireReleased(t, conn, "timed out")
	})

	t.Run("client gone: the prefill is cancelled, the engines released and Process ends", func(t *testing.T) {
		_, conn, cancel, done := concurrentStream(t, time.Minute)
		cancel()
		require.ErrorIs(t, <-conn.ended, context.Canceled)
		require.NoError(t, <-done)
		done <- nil // for the cleanup
		requireReleased(t, conn, "client gone")
	})
}

func requireReleased(t *testing.T, conn concurrentConnector, why string) {
	t.Helper()
	select {
	case <-conn.released:
	case <-time.After(10 * time.Second):
		t.Fatalf("no release: %s", why)
	}
}
