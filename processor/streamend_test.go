package processor

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// When pdx ends a routed request's stream (routing.StreamEnd): by default
// as soon as it needs nothing more of the request and the decode engine's
// fresh metrics take over its count, so that the generation no longer
// depends on pdx; else when Envoy ends it with the response.
func TestStreamEnd(t *testing.T) {
	for _, tc := range []struct {
		name   string
		config string // end_streams_at_routing, and more of the pool
		fresh  bool   // the decode engine's metrics are fresh
		// response: Envoy sends the response headers after the routing
		// answers, before pdx may end the stream.
		response bool
		ends     bool // pdx ends the stream itself
		pending  bool // the decode counts as detached
	}{
		{name: "default, fresh metrics", fresh: true, ends: true, pending: true},
		{name: "default, no metrics", fresh: false, ends: false},
		{name: "default, fallbacks: at the response headers", config: "  decode_fallbacks: 1\n", fresh: true,
			response: true, ends: true, pending: true},
		{name: "held with the response", config: "end_streams_at_routing: false\n", fresh: true, ends: false},
		{name: "at routing, uncounted", config: "end_streams_at_routing: true\n", fresh: false, ends: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			top, pool := "", tc.config
			if len(tc.config) > 0 && tc.config[0] != ' ' {
				top, pool = tc.config, ""
			}
			cfg, err := config.Parse([]byte(top + `
pools:
- name: p
  default: true
  connector: nixl
` + pool + `  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:11}, {address: 127.0.0.1:12}]
  decode_picker: {policy: least_request}
`))
			require.NoError(t, err)
			table, err := routing.New(cfg)
			require.NoError(t, err)
			decode := &table.Pools()[0].Decode
			if tc.fresh {
				for _, ep := range decode.Endpoints() {
					decode.Set.Observe(ep.Address, picker.Load{At: time.Now()})
				}
			}

			stream := newFakeStream(t.Context())
			stream.in <- headers("POST", "/v1/completions", false)
			stream.in <- body(`{"model":"m","prompt":"hi"}`, true)
			srv := New(table, answering(fakeengine.Reply{Body: kvAnswer}), slog.New(slog.DiscardHandler))
			done := make(chan error, 1)
			go func() { done <- srv.Process(stream) }()
			<-stream.out
			routed := <-stream.out // the routing answers
			decodedOn, _, _ := strings.Cut(setHeaders(routed.GetRequestBody().GetResponse().GetHeaderMutation())[DestinationHeader], ",")
			require.NotEmpty(t, decodedOn)
			if tc.response {
				requireRunning(t, done, "before the response headers pdx asked for")
				stream.in <- responseFrom("200", decodedOn)
				<-stream.out
			}
			if tc.ends {
				select {
				case err := <-done:
					require.NoError(t, err)
				case <-time.After(10 * time.Second):
					t.Fatal("pdx holds the stream")
				}
			} else {
				requireRunning(t, done, "while Envoy has not ended the stream")
				close(stream.in)
				require.NoError(t, <-done)
			}
			requireLegsEnded(t, table)
			if tc.pending {
				// The detached decode counts on its endpoint until the
				// engine's next sample: a pick goes elsewhere.
				for range 3 {
					l, ok := decode.Pick(picker.Request{})
					require.True(t, ok)
					l.End(picker.Released)
					require.NotEqual(t, decodedOn, l.Endpoint().Address, "the detached decode still counts where it went")
				}
			}
		})
	}
}

// requireRunning checks that Process has not returned, a while after the
// stream's last answer.
func requireRunning(t *testing.T, done <-chan error, when string) {
	t.Helper()
	select {
	case err := <-done:
		t.Fatalf("pdx ended the stream %s (%v)", when, err)
	case <-time.After(100 * time.Millisecond):
	}
}

// With a concurrent connector pdx reads the decode's response headers (a
// failed prefill replaces the decode's answer): once they have passed and
// the prefill is over, pdx ends the stream too, the decode detached.
func TestConcurrentStreamEndsAtTheResponse(t *testing.T) {
	conn := concurrentConnector{outcome: make(chan error, 1), ended: make(chan error, 1)}
	decodeEP := endpoint.Endpoint{Address: "127.0.0.1:8200"}
	table := routing.NewTable(routing.Limits{}, concurrentPool(conn, time.Minute, decodeEP))
	table.Pools()[0].Decode.Set.Observe(decodeEP.Address, picker.Load{At: time.Now()})
	stream := newFakeStream(t.Context())
	done := make(chan error, 1)
	go func() {
		done <- New(table, answering(fakeengine.Reply{}), slog.New(slog.DiscardHandler)).Process(stream)
	}()
	stream.in <- headers("POST", "/v1/chat/completions", false)
	next(t, stream)
	stream.in <- body(chatBody, true)
	next(t, stream)
	requireRunning(t, done, "while the prefill runs")
	stream.in <- responseHeaders
	conn.outcome <- nil
	require.NotNil(t, next(t, stream).GetResponseHeaders())
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("pdx holds the stream after the response headers")
	}
	requireLegsEnded(t, table)
}
