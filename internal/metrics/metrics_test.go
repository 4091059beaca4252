package metrics

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/placement"
	"github.com/pdx-router/pdx/internal/routing"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func testTable(t *testing.T) *routing.Table {
	t.Helper()
	cfg, err := config.Parse([]byte(`
pools:
- name: a
  models: [ma]
  connector: nixl
  prefill: [{address: 10.0.0.1:8000}, {address: 10.0.0.2:8000}]
  decode: [{address: 10.0.0.3:8000}]
  eject_after_failures: 1
- name: b
  default: true
  connector: none
  decode: [{address: 10.0.1.3:8000}]
`))
	require.NoError(t, err)
	table, err := routing.New(cfg)
	require.NoError(t, err)
	return table
}

func TestRequestOutcomes(t *testing.T) {
	m := New()
	table := testTable(t)
	a, b := table.Pools()[0], table.Pools()[1]

	m.Pool(a).Request(OutcomeRouted, 30*time.Millisecond)
	m.Pool(a).Request(OutcomeRouted, 40*time.Millisecond)
	m.Pool(a).Request(OutcomeFallback, time.Second)
	m.Pool(a).Request("prefill_failed", 2*time.Second)
	m.Pool(b).Request(OutcomeRouted, time.Millisecond)
	m.Pool(nil).Request(OutcomePassThrough, 0)
	m.Pool(nil).Request("invalid_json", time.Millisecond)
	m.Pool(nil).Request(OutcomeIncomplete, 0)

	require.NoError(t, testutil.CollectAndCompare(m.requests, strings.NewReader(`
# HELP pdx_requests_total Requests by pool, connector and outcome: routed, fallback, pass_through, answered, envoy_answered, incomplete, or the error code pdx answered with.
# TYPE pdx_requests_total counter
pdx_requests_total{connector="",outcome="incomplete",pool=""} 1
pdx_requests_total{connector="",outcome="invalid_json",pool=""} 1
pdx_requests_total{connector="",outcome="pass_through",pool=""} 1
pdx_requests_total{connector="nixl",outcome="fallback",pool="a"} 1
pdx_requests_total{connector="nixl",outcome="prefill_failed",pool="a"} 1
pdx_requests_total{connector="nixl",outcome="routed",pool="a"} 2
pdx_requests_total{connector="none",outcome="fallback",pool="b"} 0
pdx_requests_total{connector="none",outcome="routed",pool="b"} 1
`)))
	// One duration per answered request; error codes share one series.
	require.Equal(t, map[string]uint64{
		"a/routed": 2, "a/fallback": 1, "a/error": 1, "b/routed": 1, "/error": 1,
	}, histogramCounts(t, m, "pdx_request_duration_seconds", "pool", "outcome"))
}

func TestPrefillAndAttempts(t *testing.T) {
	m := New()
	table := testTable(t)
	a := m.Pool(table.Pools()[0])
	a.Attempt("10.0.0.1:8000", "prefill_unavailable")
	a.Attempt("10.0.0.2:8000", ResultOK)
	a.Attempt("10.0.0.9:8000", ResultOK) // an endpoint discovered after the table was built
	a.Attempt("10.0.0.9:8000", ResultOK)
	a.Prefill(ResultOK, 50*time.Millisecond)
	a.Prefill("prefill_timeout", 30*time.Second)

	require.NoError(t, testutil.CollectAndCompare(m.attempts, strings.NewReader(`
# HELP pdx_prefill_attempts_total Prefill calls by pool, prefill endpoint and result (ok or an error code).
# TYPE pdx_prefill_attempts_total counter
pdx_prefill_attempts_total{endpoint="10.0.0.1:8000",pool="a",result="ok"} 0
pdx_prefill_attempts_total{endpoint="10.0.0.1:8000",pool="a",result="prefill_unavailable"} 1
pdx_prefill_attempts_total{endpoint="10.0.0.2:8000",pool="a",result="ok"} 1
pdx_prefill_attempts_total{endpoint="10.0.0.9:8000",pool="a",result="ok"} 2
`)))
	require.Equal(t, map[string]uint64{"a/ok": 1, "a/prefill_timeout": 1},
		histogramCounts(t, m, "pdx_prefill_duration_seconds", "pool", "outcome"))
}

func TestLoRAPicks(t *testing.T) {
	m := New()
	a := m.Pool(testTable(t).Pools()[0])
	a.LoRAPick("decode", picker.LoRALoaded)
	a.LoRAPick("decode", picker.LoRALoaded)
	a.LoRAPick("prefill", picker.LoRAFreeSlot)
	a.LoRAPick("prefill", picker.LoRABlind)
	a.LoRAPick("prefill", picker.LoRANone) // a base-model request: not a LoRA pick
	m.Pool(nil).LoRAPick("decode", picker.LoRALoaded)
	require.NoError(t, testutil.CollectAndCompare(m.loraPicks, strings.NewReader(`
# HELP pdx_lora_picks_total Picks for requests naming a LoRA adapter, by pool, leg (prefill, decode) and outcome: loaded (an endpoint with the adapter loaded, by its vllm:lora_requests_info or what pdx sent it), free_slot (one with fewer adapters than max_lora), blind (neither was usable; picked as any request).
# TYPE pdx_lora_picks_total counter
pdx_lora_picks_total{leg="decode",outcome="loaded",pool="a"} 2
pdx_lora_picks_total{leg="prefill",outcome="blind",pool="a"} 1
pdx_lora_picks_total{leg="prefill",outcome="free_slot",pool="a"} 1
`)))
}

func TestDecodeLatenciesOnlyWhenObserved(t *testing.T) {
	m := New()
	a := m.Pool(testTable(t).Pools()[0])
	require.Empty(t, histogramCounts(t, m, "pdx_decode_ttfb_seconds", "pool"), "no empty series before an observation")
	a.DecodeHeaders(200 * time.Millisecond)
	a.DecodeDone(3 * time.Second)
	require.Equal(t, map[string]uint64{"a": 1}, histogramCounts(t, m, "pdx_decode_ttfb_seconds", "pool"))
	require.Equal(t, map[string]uint64{"a": 1}, histogramCounts(t, m, "pdx_decode_duration_seconds", "pool"))
}

func TestStreamsInFlight(t *testing.T) {
	m := New()
	m.StreamStarted()
	m.StreamStarted()
	m.StreamEnded()
	require.Equal(t, 1.0, testutil.ToFloat64(m.inFlight))
}

// TestEndpointHealthy reads the pickers at scrape time: an ejection shows
// without any call on the request path.
func TestEndpointHealthy(t *testing.T) {
	m := New()
	table := testTable(t)
	m.CollectEndpoints(func() *routing.Table { return table })
	a := table.Pools()[0]
	a.Prefill.Report(a.Prefill.Set.Endpoints()[1], false) // eject_after_failures: 1
	require.NoError(t, testutil.GatherAndCompare(m.Registry(), strings.NewReader(`
# HELP pdx_endpoint_healthy 1 if the endpoint is admitted by its pool's picker, 0 while passive health checking has ejected it (decode endpoints are never ejected).
# TYPE pdx_endpoint_healthy gauge
pdx_endpoint_healthy{endpoint="10.0.0.1:8000",pool="a",role="prefill"} 1
pdx_endpoint_healthy{endpoint="10.0.0.2:8000",pool="a",role="prefill"} 0
pdx_endpoint_healthy{endpoint="10.0.0.3:8000",pool="a",role="decode"} 1
pdx_endpoint_healthy{endpoint="10.0.1.3:8000",pool="b",role="decode"} 1
`), "pdx_endpoint_healthy"))
}

// TestEndpointListedTwice exports one series for an endpoint a picker
// holds twice (a registry refuses duplicates, failing the whole scrape).
func TestEndpointListedTwice(t *testing.T) {
	m := New()
	eps := []endpoint.Endpoint{{Address: "10.0.0.1:8000"}, {Address: "10.0.0.1:8000"}}
	table := routing.NewTable(routing.Limits{}, &routing.Pool{Pool: &placement.Pool{Name: "p", Prefill: roundRobin(eps...), Decode: roundRobin(eps...)}, Default: true})
	m.CollectEndpoints(func() *routing.Table { return table })
	n, err := testutil.GatherAndCount(m.Registry(), "pdx_endpoint_healthy")
	require.NoError(t, err)
	require.Equal(t, 2, n, "one prefill and one decode series")
}

// TestReloadedPool gets fresh children when a pool's connector changes.
func TestReloadedPool(t *testing.T) {
	m := New()
	table := testTable(t)
	a := table.Pools()[0]
	m.Warm(table)
	first := m.Pool(a)
	require.Same(t, first, m.Pool(a), "resolved once")
	changed := &routing.Pool{Pool: &placement.Pool{Name: a.Name, Prefill: a.Prefill, Decode: a.Decode}, ConnectorName: "http", Connector: a.Connector}
	second := m.Pool(changed)
	require.NotSame(t, first, second)
	second.Request(OutcomeRouted, time.Millisecond)
	require.Equal(t, 1.0, testutil.ToFloat64(m.requests.WithLabelValues("a", "http", OutcomeRouted)))
}

// TestHotPathDoesNotAllocate covers what every routed request records.
func TestHotPathDoesNotAllocate(t *testing.T) {
	m := New()
	table := testTable(t)
	m.Warm(table)
	a := table.Pools()[0]
	allocs := testing.AllocsPerRun(100, func() {
		m.StreamStarted()
		p := m.Pool(a)
		p.Attempt("10.0.0.1:8000", ResultOK)
		p.Prefill(ResultOK, time.Millisecond)
		p.Request(OutcomeRouted, time.Millisecond)
		p.DecodeHeaders(time.Millisecond)
		m.StreamEnded()
	})
	require.Zero(t, allocs)
}

func TestNilRecordsNothing(t *testing.T) {
	var m *Metrics
	m.StreamStarted()
	m.Warm(testTable(t))
	p := m.Pool(nil)
	require.Nil(t, p)
	p.Request(OutcomeRouted, time.Second)
	p.Attempt("x", ResultOK)
	p.Prefill(ResultOK, time.Second)
	p.DecodeHeaders(time.Second)
	p.DecodeDone(time.Second)
	p.FirstByte(time.Second, time.Second)
	p.Tokens(1, 1, 1)
	p.LoRAPick("decode", picker.LoRALoaded)
	require.Nil(t, m.Named("a", "nixl"))
	m.StreamEnded()
}

// TestObservabilityPass: the pass's stream names its request's pool by
// name; a pool of this server's table gets its resolved children, which
// then record the split and the tokens without allocating, and one it does
// not know (another replica's newer table) is recorded all the same.
func TestObservabilityPass(t *testing.T) {
	m := New()
	table := testTable(t)
	m.Warm(table)
	require.Same(t, m.Pool(table.Pools()[0]), m.Named("a", "nixl"))
	require.NotSame(t, m.Pool(table.Pools()[0]), m.Named("a", "sglang"), "another connector: other series")

	a := m.Named("a", "nixl")
	a.FirstByte(10*time.Millisecond, 300*time.Millisecond)
	a.DecodeDone(2 * time.Second)
	a.Tokens(100, 99, 7)
	a.Tokens(10, 0, 3)
	m.Named("new", "sglang").Tokens(5, 0, 1)
	require.Equal(t, map[string]uint64{"a": 1}, histogramCounts(t, m, "pdx_handoff_duration_seconds", "pool"))
	require.Equal(t, map[string]uint64{"a": 1}, histogramCounts(t, m, "pdx_ttft_seconds", "pool"))
	require.Equal(t, map[string]uint64{"a": 1}, histogramCounts(t, m, "pdx_decode_duration_seconds", "pool"))
	require.NoError(t, testutil.GatherAndCompare(m.Registry(), strings.NewReader(`
# HELP pdx_tokens_total Tokens the decode engines reported in their answers' usage, by kind: prompt, cached (prompt tokens the engine did not compute: KV handed off or prefix-cached; reported only by engines that give prompt_tokens_details) and completion. Streamed answers report usage only when the client asked for stream_options.include_usage.
# TYPE pdx_tokens_total counter
pdx_tokens_total{connector="nixl",kind="cached",pool="a"} 99
pdx_tokens_total{connector="nixl",kind="completion",pool="a"} 10
pdx_tokens_total{connector="nixl",kind="prompt",pool="a"} 110
pdx_tokens_total{connector="sglang",kind="cached",pool="new"} 0
pdx_tokens_total{connector="sglang",kind="completion",pool="new"} 1
pdx_tokens_total{connector="sglang",kind="prompt",pool="new"} 5
`), "pdx_tokens_total"))
	allocs := testing.AllocsPerRun(100, func() {
		p := m.Named("a", "nixl")
		p.FirstByte(time.Millisecond, time.Millisecond)
		p.DecodeDone(time.Millisecond)
		p.Tokens(1, 1, 1)
	})
	require.Zero(t, allocs)
}

// histogramCounts gathers the histogram name and returns its sample counts
// keyed by the given labels' values joined with "/".
func histogramCounts(t *testing.T, m *Metrics, name string, labels ...string) map[string]uint64 {
	t.Helper()
	families, err := m.Registry().Gather()
	require.NoError(t, err)
	out := map[string]uint64{}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, metric := range f.GetMetric() {
			var key []string
			for _, l := range labels {
				for _, lp := range metric.GetLabel() {
					if lp.GetName() == l {
						key = append(key, lp.GetValue())
					}
				}
			}
			if n := metric.GetHistogram().GetSampleCount(); n > 0 {
				out[strings.Join(key, "/")] = n
			}
		}
	}
	return out
}

// BenchmarkRecordRouted is what metrics cost a routed request with one
// prefill attempt.
func BenchmarkRecordRouted(b *testing.B) {
	m := New()
	cfg, err := config.Parse([]byte("pools:\n- name: a\n  default: true\n  connector: nixl\n  prefill: [{address: 10.0.0.1:8000}]\n  decode: [{address: 10.0.0.3:8000}]\n"))
	require.NoError(b, err)
	table, err := routing.New(cfg)
	require.NoError(b, err)
	m.Warm(table)
	a := table.Pools()[0]
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			m.StreamStarted()
			p := m.Pool(a)
			p.Attempt("10.0.0.1:8000", ResultOK)
			p.Prefill(ResultOK, time.Millisecond)
			p.Request(OutcomeRouted, 2*time.Millisecond)
			m.StreamEnded()
		}
	})
}

// roundRobin is a leg picking among eps in turn.
func roundRobin(eps ...endpoint.Endpoint) picker.Leg {
	l, err := picker.NewLeg(picker.NewSet(eps, picker.Options{}), &configv1.Picker{Policy: picker.RoundRobinPolicy}, picker.RoleDecode)
	if err != nil {
		panic(err)
	}
	return l
}

// Session picks count by leg and outcome, allocating nothing once the
// pool's first one resolved them; requests without a session count
// nothing, and a pool none of whose requests named one exports nothing.
func TestSessionPicks(t *testing.T) {
	m := New()
	table := testTable(t)
	a := table.Pools()[0]
	m.Pool(table.Pools()[1]).Session(picker.RoleDecode, picker.NoSession)
	m.Pool(a).Session(picker.RoleDecode, picker.SessionKept)
	m.Pool(a).Session(picker.RoleDecode, picker.SessionKept)
	m.Pool(a).Session(picker.RoleDecode, picker.SessionMoved)
	m.Pool(a).Session(picker.RolePrefill, picker.SessionMoved)
	m.Pool(a).Session(picker.RolePrefill, picker.NoSession)
	var none *Pool
	none.Session(picker.RoleDecode, picker.SessionKept)
	require.NoError(t, testutil.CollectAndCompare(m.sessions, strings.NewReader(`
# HELP pdx_session_picks_total Picks of requests that named a session (pools with session_affinity), by leg (prefill, decode) and outcome: kept (the session's first engine by its rendezvous order among the leg's, for a prefill its decode engine's group's) or moved (that engine could not take it: saturated, ejected, outside the gateway's subset hint or tried, and the next in the session's order did).
# TYPE pdx_session_picks_total counter
pdx_session_picks_total{leg="decode",outcome="kept",pool="a"} 2
pdx_session_picks_total{leg="decode",outcome="moved",pool="a"} 1
pdx_session_picks_total{leg="prefill",outcome="kept",pool="a"} 0
pdx_session_picks_total{leg="prefill",outcome="moved",pool="a"} 1
`)))
	require.Zero(t, testing.AllocsPerRun(100, func() { m.Pool(a).Session(picker.RolePrefill, picker.SessionKept) }))
}
