package processor

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/metrics"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/placement"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// placementTable is a nixl pool of one prefill (127.0.0.1:1) and one decode
// (127.0.0.1:9) endpoint, with pool lines extra.
func placementTable(t *testing.T, extra string) (*routing.Table, *routing.Pool) {
	t.Helper()
	cfg, err := config.Parse([]byte(`
pools:
- name: p
  default: true
  connector: nixl
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:9}]
` + extra))
	require.NoError(t, err)
	table, err := routing.New(cfg)
	require.NoError(t, err)
	pool, _ := table.Pool("p")
	return table, pool
}

// chatOf is a chat request whose user message is n bytes of text.
func chatOf(n int, seed string) string {
	return fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":%q}]}`, strings.Repeat(seed, n/len(seed)+1)[:n])
}

var (
	prefillEP = endpoint.Endpoint{Address: "127.0.0.1:1"}
	decodeEP  = endpoint.Endpoint{Address: "127.0.0.1:9"}
)

func TestDisaggregationDecider(t *testing.T) {
	long := chatOf(4000, "the quick brown fox ") // ~1,000 tokens
	for _, tc := range []struct {
		name string
		pool string
		// before runs before the request (a warm cache, a saturated leg).
		before      func(t *testing.T, table *routing.Table, pool *routing.Pool)
		body        string
		wantPrefill bool
	}{
		{name: "off: every request is disaggregated", body: chatBody, wantPrefill: true},
		{name: "short prompt decodes alone", pool: "disaggregation: {min_uncached_tokens: 64}",
			body: chatBody},
		{name: "long prompt is disaggregated", pool: "disaggregation: {min_uncached_tokens: 64}",
			body: long, wantPrefill: true},
		{name: "a prompt the decode engine holds decodes alone", pool: "disaggregation: {min_uncached_tokens: 64}",
			before: func(t *testing.T, table *routing.Table, pool *routing.Pool) {
				run(t, table, answering(fakeengine.Reply{Body: kvAnswer}), headers("POST", "/v1/chat/completions", false), body(long, true))
			},
			body: long},
		{name: "saturated prefill leg, decode has room", pool: "disaggregation: {when_prefill_saturated: true}",
			before: func(t *testing.T, table *routing.Table, pool *routing.Pool) {
				pool.Prefill.Set.Observe(prefillEP.Address, picker.Load{Waiting: 9, At: time.Now()})
			},
			body: long},
	} {
		t.Run(tc.name, func(t *testing.T) {
			table, pool := placementTable(t, "  "+tc.pool)
			if tc.before != nil {
				tc.before(t, table, pool)
			}
			eng := answering(fakeengine.Reply{Body: kvAnswer})
			out := run(t, table, eng, headers("POST", "/v1/chat/completions", false), body(tc.body, true))
			require.Len(t, out, 2)
			br := out[1].GetRequestBody().GetResponse()
			require.Equal(t, decodeEP.Address, setHeaders(br.GetHeaderMutation())[DestinationHeader])
			decodeBody := string(br.GetBodyMutation().GetBody())
			if tc.wantPrefill {
				require.Len(t, eng.Calls(), 1)
				require.Contains(t, decodeBody, "kv_transfer_params")
				return
			}
			require.Empty(t, eng.Calls(), "no prefill")
			require.NotContains(t, decodeBody, "kv_transfer_params", "the decode engine computes the prompt")
		})
	}
}

// With prefill_saturated_min_priority, only bands at or above it go to the
// decode engine alone while the prefill leg is saturated; the others wait
// for it (here: are refused at once).
func TestPrefillSaturatedMinPriority(t *testing.T) {
	const pool = `  saturation: {action: reject}
  flow_control: {objectives: [{name: chat, priority: 10}, {name: low, priority: 1}, {name: batch, priority: -1}]}
  disaggregation: {when_prefill_saturated: true, prefill_saturated_min_priority: 1}`
	long := chatOf(4000, "the quick brown fox ")
	for _, tc := range []struct {
		objective   string
		decodeAlone bool
	}{
		{objective: "chat", decodeAlone: true},
		{objective: "low", decodeAlone: true},
		{objective: "", decodeAlone: false}, // priority 0
		{objective: "batch", decodeAlone: false},
	} {
		t.Run(orNone(tc.objective), func(t *testing.T) {
			table, p := placementTable(t, pool)
			p.Prefill.Set.Observe(prefillEP.Address, picker.Load{Waiting: 9, At: time.Now()})
			eng := answering(fakeengine.Reply{Body: kvAnswer})
			var extra []string
			if tc.objective != "" {
				extra = []string{ObjectiveHeader, tc.objective}
			}
			out := run(t, table, eng, headers("POST", "/v1/chat/completions", false, extra...), body(long, true))
			require.Len(t, out, 2)
			require.Empty(t, eng.Calls(), "no prefill either way")
			if !tc.decodeAlone {
				status, e := immediateOf(t, out[1])
				require.Equal(t, 429, status)
				require.Contains(t, e.Error.Message, "every prefill engine of pool p is saturated")
				return
			}
			br := out[1].GetRequestBody().GetResponse()
			require.Equal(t, decodeEP.Address, setHeaders(br.GetHeaderMutation())[DestinationHeader])
			require.NotContains(t, string(br.GetBodyMutation().GetBody()), "kv_transfer_params")
		})
	}
}

func orNone(s string) string {
	if s == "" {
		return "none"
	}
	return s
}

func TestShedding(t *testing.T) {
	saturate := func(pool *routing.Pool) {
		pool.Decode.Set.Observe(decodeEP.Address, picker.Load{Waiting: 5, At: time.Now()})
	}
	t.Run("reject answers 429 at once", func(t *testing.T) {
		table, pool := placementTable(t, "  saturation: {action: reject}")
		saturate(pool)
		eng := answering(fakeengine.Reply{Body: kvAnswer})
		out := run(t, table, eng, headers("POST", "/v1/chat/completions", false), body(chatBody, true))
		require.Len(t, out, 2)
		status, e := immediateOf(t, out[1])
		require.Equal(t, 429, status)
		require.Equal(t, "overloaded", e.Error.Code)
		require.Equal(t, "1", setHeaders(out[1].GetImmediateResponse().GetHeaders())["retry-after"])
		require.Empty(t, eng.Calls(), "nothing reaches an engine")
	})
	t.Run("queue answers 429 when no room comes", func(t *testing.T) {
		table, pool := placementTable(t, "  saturation: {action: queue, max_queue_time: 50ms}")
		saturate(pool)
		start := time.Now()
		out := run(t, table, answering(fakeengine.Reply{Body: kvAnswer}), headers("POST", "/v1/chat/completions", false), body(chatBody, true))
		status, e := immediateOf(t, out[1])
		require.Equal(t, 429, status)
		require.Contains(t, e.Error.Message, "none had room within 50ms")
		require.GreaterOrEqual(t, time.Since(start), 50*time.Millisecond, "it waited")
	})
	t.Run("queue routes once room comes", func(t *testing.T) {
		table, pool := placementTable(t, "  saturation: {action: queue, max_queue_time: 1m}")
		saturate(pool)
		time.AfterFunc(30*time.Millisecond, func() {
			pool.Decode.Set.Observe(decodeEP.Address, picker.Load{Waiting: 1, At: time.Now()})
		})
		out := run(t, table, answering(fakeengine.Reply{Body: kvAnswer}), headers("POST", "/v1/chat/completions", false), body(chatBody, true))
		require.Equal(t, decodeEP.Address, setHeaders(out[1].GetRequestBody().GetResponse().GetHeaderMutation())[DestinationHeader])
	})
	t.Run("a saturated prefill leg is waited for too", func(t *testing.T) {
		table, pool := placementTable(t, "  saturation: {action: reject}")
		pool.Prefill.Set.Observe(prefillEP.Address, picker.Load{KVUsage: 0.95, At: time.Now()})
		out := run(t, table, answering(fakeengine.Reply{Body: kvAnswer}), headers("POST", "/v1/chat/completions", false), body(chatBody, true))
		status, e := immediateOf(t, out[1])
		require.Equal(t, 429, status)
		require.Contains(t, e.Error.Message, "every prefill engine of pool p is saturated")
	})
	t.Run("stale metrics never shed", func(t *testing.T) {
		table, pool := placementTable(t, "  saturation: {action: reject}")
		pool.Decode.Set.Observe(decodeEP.Address, picker.Load{Waiting: 50, At: time.Now().Add(-time.Minute)})
		out := run(t, table, answering(fakeengine.Reply{Body: kvAnswer}), headers("POST", "/v1/chat/completions", false), body(chatBody, true))
		require.NotNil(t, out[1].GetRequestBody())
	})
}

// A request counts on its prefill endpoint while the prefill runs, and on
// its decode endpoint until Envoy ends the stream.
func TestInFlightCounts(t *testing.T) {
	table, pool := placementTable(t, "")
	during := -1
	eng := fakeengine.New().On("POST", "", "", fakeengine.Reply{Fn: func(context.Context, fakeengine.Call) ([]byte, error) {
		during = pool.Prefill.Set.InFlight(prefillEP)
		return []byte(kvAnswer), nil
	}})
	stream := newFakeStream(t.Context())
	stream.in <- headers("POST", "/v1/chat/completions", false)
	stream.in <- body(chatBody, true)
	srv := New(table, eng, slog.New(slog.DiscardHandler))
	done := make(chan error, 1)
	go func() { done <- srv.Process(stream) }()
	<-stream.out
	require.NotNil(t, (<-stream.out).GetRequestBody(), "routed")
	require.Equal(t, 1, during)
	require.Equal(t, 0, pool.Prefill.Set.InFlight(prefillEP), "the prefill is over")
	require.Equal(t, 1, pool.Decode.Set.InFlight(decodeEP), "the decode is under way")
	select {
	case err := <-done:
		t.Fatalf("Process returned (%v) before Envoy ended the stream", err)
	case <-time.After(20 * time.Millisecond):
	}
	close(stream.in) // Envoy ends the stream: the response is over
	require.NoError(t, <-done)
	require.Equal(t, 0, pool.Decode.Set.InFlight(decodeEP))
}

func TestDrainEndsHeldStreams(t *testing.T) {
	table, pool := placementTable(t, "")
	stream := newFakeStream(t.Context())
	stream.in <- headers("POST", "/v1/chat/completions", false)
	stream.in <- body(chatBody, true)
	srv := New(table, answering(fakeengine.Reply{Body: kvAnswer}), slog.New(slog.DiscardHandler))
	done := make(chan error, 1)
	go func() { done <- srv.Process(stream) }()
	<-stream.out
	<-stream.out
	srv.Drain()
	require.NoError(t, <-done)
	require.Equal(t, 0, pool.Decode.Set.InFlight(decodeEP))
	close(stream.in)
}

// Requests that fail end their counts too.
func TestInFlightCountsOfFailures(t *testing.T) {
	table, pool := placementTable(t, "")
	out := run(t, table, answering(fakeengine.Reply{Body: `<html>`}), headers("POST", "/v1/chat/completions", false), body(chatBody, true))
	status, _ := immediateOf(t, out[1])
	require.Equal(t, 502, status)
	require.Equal(t, 0, pool.Prefill.Set.InFlight(prefillEP))
	require.Equal(t, 0, pool.Decode.Set.InFlight(decodeEP))
}

func TestMetricsRecordDecisions(t *testing.T) {
	table, pool := placementTable(t, "  disaggregation: {min_uncached_tokens: 64, when_prefill_saturated: true}")
	m := metrics.New()
	srv := New(table, answering(fakeengine.Reply{Body: kvAnswer}), slog.New(slog.DiscardHandler), WithMetrics(m))
	chat := func(b string) { runOn(t, srv, headers("POST", "/v1/chat/completions", false), body(b, true)) }
	chat(chatBody)                             // short
	chat(chatOf(4000, "the quick brown fox ")) // long: disaggregated
	pool.Prefill.Set.Observe(prefillEP.Address, picker.Load{Waiting: 9, At: time.Now()})
	chat(chatOf(4000, "jumps over the lazy dog ")) // long, but the prefill leg is saturated
	for decision, want := range map[string]float64{placement.ReasonShort: 1, placement.ReasonDisaggregated: 1, placement.ReasonPrefillSaturated: 1} {
		require.Equal(t, want, counterValue(t, m, "pdx_disaggregation_decisions_total", map[string]string{"pool": "p", "decision": decision}), decision)
	}
}
