package processor

import (
	"context"
	"log/slog"
	"net/http"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

func bodyTimeoutTable(t *testing.T, d time.Duration) *routing.Table {
	t.Helper()
	table, err := routing.New(&configv1.Config{RequestBodyTimeout: durationpb.New(d), Pools: []*configv1.Pool{{
		Name: "p", Models: []string{"m"}, Connector: "nixl",
		Prefill:        []*configv1.Endpoint{{Address: "127.0.0.1:8100"}},
		Decode:         []*configv1.Endpoint{{Address: "127.0.0.1:8200"}},
		PrefillTimeout: durationpb.New(time.Second),
	}}})
	require.NoError(t, err)
	return table
}

// A body that does not arrive in time gets 408, whether it never comes
// (BUFFERED: Envoy sends nothing while it buffers) or trickles in chunks
// (FULL_DUPLEX_STREAMED).
func TestBodyTimeout(t *testing.T) {
	const timeout = 100 * time.Millisecond
	full := filterextprocv3.ProcessingMode_FULL_DUPLEX_STREAMED
	for _, tc := range []struct {
		name    string
		headers *extprocv3.ProcessingRequest
		trickle bool
	}{
		{name: "buffered body never complete", headers: headers("POST", "/v1/chat/completions", false)},
		{name: "full-duplex chunks trickling", headers: withProtocol(headers("POST", "/v1/chat/completions", false), full, filterextprocv3.ProcessingMode_NONE), trickle: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			stream := newFakeStream(t.Context())
			eng := answering(fakeengine.Reply{Body: kvAnswer})
			srv := New(bodyTimeoutTable(t, timeout), eng, slog.New(slog.DiscardHandler))
			done := make(chan error, 1)
			start := time.Now()
			go func() { done <- srv.Process(stream) }()
			stream.in <- tc.headers
			stop := make(chan struct{})
			var trickled sync.WaitGroup
			if tc.trickle {
				trickled.Go(func() {
					for {
						select {
						case stream.in <- body(`{`, false):
						case <-stop:
							return
						}
						time.Sleep(10 * time.Millisecond)
					}
				})
			}
			var last *extprocv3.ProcessingResponse
			for last = next(t, stream); last.GetImmediateResponse() == nil; last = next(t, stream) {
			}
			close(stop)
			trickled.Wait()
			status, b := immediateOf(t, last)
			require.Equal(t, 408, status)
			require.Equal(t, "request_timeout", b.Error.Code)
			require.Contains(t, b.Error.Message, "within 100ms")
			require.GreaterOrEqual(t, time.Since(start), timeout)
			close(stream.in) // Envoy ends the stream after the local reply
			require.NoError(t, <-done)
			require.Empty(t, eng.Calls())
		})
	}

	t.Run("a body in time is routed", func(t *testing.T) {
		out := run(t, bodyTimeoutTable(t, time.Minute), answering(fakeengine.Reply{Body: kvAnswer}),
			headers("POST", "/v1/chat/completions", false), body(chatBody, true))
		require.Len(t, out, 2)
		require.NotNil(t, out[1].GetRequestBody().GetResponse().GetBodyMutation())
	})
}

// Envoy answers a body over its own buffer limit with a 413 of its own
// while pdx waits for the body; the local reply's response headers reach
// pdx, which passes them on and is done.
func TestEnvoyAnswersWhilePdxWaitsForTheBody(t *testing.T) {
	status := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte("413")}}},
	}}}
	for _, table := range []*routing.Table{testTable(t, true, time.Second), concurrentTable()} {
		out := run(t, table, answering(fakeengine.Reply{}), headers("POST", "/v1/chat/completions", false), status, responseBody)
		require.Len(t, out, 2, "the stream ends after the local reply's headers")
		require.NotNil(t, out[1].GetResponseHeaders())
		set := setHeaders(out[1].GetResponseHeaders().GetResponse().GetHeaderMutation())
		require.Len(t, set, 1, "Envoy's answer goes on, with nothing but the client's request id: %v", set)
		require.Regexp(t, "^[0-9a-f-]{36}$", set["x-request-id"])
	}
}

// concurrentTable is a table whose pool has a concurrent connector: pdx asks
// Envoy for the response headers.
func concurrentTable() *routing.Table {
	return routing.NewTable(routing.Limits{}, concurrentPool(concurrentConnector{outcome: make(chan error, 1), ended: make(chan error, 1)}, time.Minute, decodeEP8200))
}

// releaseEngine answers prefills with kvAnswer after running onPrefill,
// and the decode engine, whose calls are releases, with {}.
func releaseEngine(onPrefill func()) *fakeengine.Engine {
	return fakeengine.New().
		On(http.MethodPost, "", "", fakeengine.Reply{Fn: func(context.Context, fakeengine.Call) ([]byte, error) {
			onPrefill()
			return []byte(kvAnswer), nil
		}}).
		On(http.MethodPost, "127.0.0.1:8200", "", fakeengine.Reply{Body: `{}`})
}

// releases returns the calls e's decode engine received.
func releases(e *fakeengine.Engine) []fakeengine.Call {
	var out []fakeengine.Call
	for _, c := range e.Calls() {
		if c.Endpoint.Address == "127.0.0.1:8200" {
			out = append(out, c)
		}
	}
	return out
}

// A client that goes away after its NIXL prefill finished, before pdx could
// hand Envoy the decode, leaves KV blocks on the prefill engine: pdx sends
// the decode engine a one-token decode that frees them.
func TestReleaseWhenTheClientLeavesAfterThePrefill(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	stream := newFakeStream(ctx)
	eng := releaseEngine(cancel)
	srv := New(testTable(t, true, time.Minute), eng, slog.New(slog.DiscardHandler))
	stream.in <- headers("POST", "/v1/completions", false)
	stream.in <- body(`{"model":"m","prompt":"p","max_tokens":50,"stream":true}`, true)
	require.NoError(t, srv.Process(stream))
	wait, stop := context.WithTimeout(context.Background(), 10*time.Second)
	defer stop()
	require.NoError(t, srv.Wait(wait))
	decodes := releases(eng)
	require.Len(t, decodes, 1)
	d := decodes[0]
	require.Equal(t, "/v1/completions", d.Path)
	require.JSONEq(t, `{"model":"m","prompt":"p","max_tokens":1,"stream":false,
		"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[[1]],"remote_request_id":"r","remote_host":"127.0.0.1","remote_port":8100}}`, d.Body)

	// Routed as usual, nothing is released: the decode reads the blocks.
	eng = releaseEngine(func() {})
	srv = New(testTable(t, true, time.Minute), eng, slog.New(slog.DiscardHandler))
	stream = newFakeStream(t.Context())
	stream.in <- headers("POST", "/v1/completions", false)
	stream.in <- body(`{"model":"m","prompt":"p"}`, true)
	close(stream.in)
	require.NoError(t, srv.Process(stream))
	require.NoError(t, srv.Wait(wait))
	require.Empty(t, releases(eng))
}

// A TensorRT-LLM context server that finished the request answers the
// client: pdx sends that answer itself, and no generation request.
func TestAnsweredByThePrefill(t *testing.T) {
	table, err := routing.New(&configv1.Config{Pools: []*configv1.Pool{{
		Name: "t", Default: true, Connector: "trtllm",
		Prefill:        []*configv1.Endpoint{{Address: "127.0.0.1:8100"}},
		Decode:         []*configv1.Endpoint{{Address: "127.0.0.1:8200"}},
		PrefillTimeout: durationpb.New(time.Second),
	}}})
	require.NoError(t, err)
	eng := answering(fakeengine.Reply{Body: `{"id":"c","object":"text_completion","choices":[{"index":0,"text":"done","finish_reason":"stop"}]}`})
	out := run(t, table, eng, headers("POST", "/v1/completions", false, "x-request-id", "mine"), body(`{"model":"m","prompt":"p"}`, true))
	require.Len(t, out, 2)
	ir := out[1].GetImmediateResponse()
	require.NotNil(t, ir)
	require.EqualValues(t, 200, ir.GetStatus().GetCode())
	hs := setHeaders(ir.GetHeaders())
	require.Equal(t, "application/json", hs["content-type"])
	require.Equal(t, "mine", hs["x-request-id"])
	require.JSONEq(t, `{"id":"c","object":"text_completion","choices":[{"index":0,"text":"done","finish_reason":"stop"}]}`, string(ir.GetBody()))
	require.Len(t, eng.Calls(), 1)
}

// roundRobin is a leg picking among eps in turn.
func roundRobin(eps ...endpoint.Endpoint) picker.Leg {
	l, err := picker.NewLeg(picker.NewSet(eps, picker.Options{}), &configv1.Picker{Policy: picker.RoundRobinPolicy}, picker.RoleDecode)
	if err != nil {
		panic(err)
	}
	return l
}
