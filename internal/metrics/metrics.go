// Package metrics is pdx's Prometheus instrumentation. Every Metrics value
// has its own registry, so several pdx servers in one process (tests) never
// share or collide on a metric.
//
// The request path pays for an atomic add or a histogram observation per
// metric and nothing more: the children of each pool's label values are
// resolved once and cached (see Pool), and endpoint health is read from the
// pickers only when Prometheus scrapes.
package metrics

import (
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/routing"
)

// Request outcomes besides the error codes of pdx's answers.
const (
	OutcomeRouted        = "routed"         // sent to a decode endpoint after its prefill
	OutcomeFallback      = "fallback"       // sent to a decode endpoint without prefill
	OutcomePassThrough   = "pass_through"   // on a pass-through path, sent to a decode endpoint as it was
	OutcomeAnswered      = "answered"       // answered by pdx (GET /v1/models, or a prefill that finished it)
	OutcomeEnvoyAnswered = "envoy_answered" // Envoy answered itself before pdx routed it (its 413, 408)
	OutcomeIncomplete    = "incomplete"     // the stream ended before pdx answered
	OutcomeError         = "error"          // any error code, where the code is too many labels
	ResultOK             = "ok"             // a prefill (attempt) that succeeded
)

// Histogram buckets, in seconds. pdx's own latency includes the prefill of
// sequential connectors; decode latencies run to minutes of generation.
var (
	routeBuckets  = []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60}
	decodeBuckets = []float64{.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}
)

// Metrics are one pdx server's metrics. The zero value is not usable; a nil
// *Metrics records nothing.
type Metrics struct {
	reg *prometheus.Registry

	requests   *prometheus.CounterVec   // pool, connector, outcome
	routeDur   *prometheus.HistogramVec // pool, connector, outcome
	prefillDur *prometheus.HistogramVec // pool, connector, outcome
	attempts   *prometheus.CounterVec   // pool, endpoint, result
	ttfb       *prometheus.HistogramVec // pool, connector
	decodeDur  *prometheus.HistogramVec // pool, connector
	handoff    *prometheus.HistogramVec // pool, connector
	ttft       *prometheus.HistogramVec // pool, connector
	tokens     *prometheus.CounterVec   // pool, connector, kind
	decisions  *prometheus.CounterVec   // pool, decision
	repicks    *prometheus.CounterVec   // pool, moved
	tokenSrc   *prometheus.CounterVec   // pool, source
	renderErrs *prometheus.CounterVec   // pool, reason
	scrapes    *prometheus.CounterVec   // endpoint
	served     *prometheus.CounterVec   // pool, endpoint, fallback
	flowWait   *prometheus.HistogramVec // pool, leg, band, outcome
	sessions   *prometheus.CounterVec   // pool, leg, outcome
	loraPicks  *prometheus.CounterVec   // pool, leg, outcome
	checks     *prometheus.CounterVec   // pool, result
	cached     *prometheus.CounterVec   // pool, endpoint, source
	inFlight   prometheus.Gauge

	// pools maps a pool name to its resolved children. It is replaced, never
	// changed, so readers need no lock; mu serializes the writers.
	pools atomic.Pointer[map[string]*Pool]
	mu    sync.Mutex
	// none counts requests that never got a pool.
	none *Pool
}

// New returns metrics registered on a registry of their own, along with the
// Go runtime's and the process's.
func New() *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdx_requests_total",
			Help: "Requests by pool, connector and outcome: routed, fallback, pass_through, answered, envoy_answered, incomplete, or the error code pdx answered with.",
		}, []string{"pool", "connector", "outcome"}),
		routeDur: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "pdx_request_duration_seconds",
			Help:    "Time from the request headers reaching pdx to pdx's routing answer or error (the latency pdx adds, prefill included for sequential connectors).",
			Buckets: routeBuckets,
		}, []string{"pool", "connector", "outcome"}),
		prefillDur: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "pdx_prefill_duration_seconds",
			Help:    "Time a request spent in prefill, all attempts together, by the outcome of its last attempt (ok or an error code).",
			Buckets: routeBuckets,
		}, []string{"pool", "connector", "outcome"}),
		attempts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdx_prefill_attempts_total",
			Help: "Prefill calls by pool, prefill endpoint and result (ok or an error code).",
		}, []string{"pool", "endpoint", "result"}),
		ttfb: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "pdx_decode_ttfb_seconds",
			Help:    "Time from the request headers to the decode's response headers; observed only when Envoy sends response headers to pdx (tables with a concurrent connector).",
			Buckets: decodeBuckets,
		}, []string{"pool", "connector"}),
		decodeDur: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "pdx_decode_duration_seconds",
			Help:    "Decode: from the decode response's first body byte to its end; observed when Envoy shows pdx the response body (the observability pass).",
			Buckets: decodeBuckets,
		}, []string{"pool", "connector"}),
		handoff: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "pdx_handoff_duration_seconds",
			Help:    "Hand-off: from the prefill's answer (sequential connectors) or pdx's routing answer (concurrent connectors: sglang, mooncake with vllm; and requests decoded without prefill) to the decode response's first body byte; observed by the observability pass.",
			Buckets: routeBuckets,
		}, []string{"pool", "connector"}),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "pdx_ttft_seconds",
			Help:    "Time to first token as the gateway sees it: from the request headers reaching pdx to the decode response's first body byte; observed by the observability pass.",
			Buckets: decodeBuckets,
		}, []string{"pool", "connector"}),
		tokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdx_tokens_total",
			Help: "Tokens the decode engines reported in their answers' usage, by kind: prompt, cached (prompt tokens the engine did not compute: KV handed off or prefix-cached; reported only by engines that give prompt_tokens_details) and completion. Streamed answers report usage only when the client asked for stream_options.include_usage.",
		}, []string{"pool", "connector", "kind"}),
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdx_disaggregation_decisions_total",
			Help: "Requests of pools with a prefill leg by the disaggregation decider's decision: disaggregated, or decode-only because short_uncached or prefill_saturated.",
		}, []string{"pool", "decision"}),
		repicks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdx_decode_repicks_total",
			Help: "Decodes picked again once their prefill had answered (pools whose connector's decode body names no decode engine: nixl, http, mooncake with a non-vLLM protocol), by whether the decode moved to another endpoint than the first pick's (moved=true) or stayed (moved=false).",
		}, []string{"pool", "moved"}),
		tokenSrc: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdx_prompt_tokens_total",
			Help: "Requests of pools that render their prompts (render, on with kv_events) by where placement got the prompt's tokens: render (the engines' render API: exact, matched against the engines' KV events) or estimate (the render failed or was late: 4 bytes a token, placed by what pdx sent where).",
		}, []string{"pool", "source"}),
		renderErrs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdx_render_failures_total",
			Help: "Renders of prompts (pools that render, on with kv_events) that failed, by reason: forbidden (the render server answered 403: vLLM serves its render API only when started with --enable-scale-out) or error (any other failure, a late answer included); such requests are placed by the estimate.",
		}, []string{"pool", "reason"}),
		scrapes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdx_engine_metrics_failures_total",
			Help: "Scrapes of an engine's metrics that failed (unreachable, slow, malformed); its endpoint is picked by pdx's in-flight counts meanwhile.",
		}, []string{"endpoint"}),
		served: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdx_decode_served_total",
			Help: "Decode answers by pool, the decode endpoint that served (as Envoy reports it) and whether it was pdx's first choice (fallback=first) or one Envoy retried on (fallback=fallback); counted only when Envoy sends pdx the response headers with upstream.address (the decode-fallback profile).",
		}, []string{"pool", "endpoint", "fallback"}),
		flowWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "pdx_flow_control_wait_seconds",
			Help:    "Requests that waited for room on a saturated leg, or were refused it, by pool, leg (prefill, decode), band (their objective's priority) and outcome: admitted, timed_out (429), full (429: the pool's queue at its bound), displaced (429: a higher band took the place), cancelled (the client went away).",
			Buckets: routeBuckets,
		}, []string{"pool", "leg", "band", "outcome"}),
		sessions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdx_session_picks_total",
			Help: "Picks of requests that named a session (pools with session_affinity), by leg (prefill, decode) and outcome: kept (the session's first engine by its rendezvous order among the leg's, for a prefill its decode engine's group's) or moved (that engine could not take it: saturated, ejected, outside the gateway's subset hint or tried, and the next in the session's order did).",
		}, []string{"pool", "leg", "outcome"}),
		loraPicks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdx_lora_picks_total",
			Help: "Picks for requests naming a LoRA adapter, by pool, leg (prefill, decode) and outcome: loaded (an endpoint with the adapter loaded, by its vllm:lora_requests_info or what pdx sent it), free_slot (one with fewer adapters than max_lora), blind (neither was usable; picked as any request).",
		}, []string{"pool", "leg", "outcome"}),
		checks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdx_placement_checks_total",
			Help: "Placement's self-check: prefills of pools that render their prompts, by how the prefill engine's own count (its answer's usage) bore out placement's prediction: match; tokens_mismatch (the engine counted other prompt tokens than the render gave: a chat template or tokenizer that is not the engines'); cached_mismatch (it found more or less of the prompt cached, beyond a block, than its KV events said it held: events late or quiet, or of another block size); untrusted (placed by what pdx sent, the engines' word untrusted for a while after most of the last judged prefills mismatched).",
		}, []string{"pool", "result"}),
		cached: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pdx_placement_cached_tokens_total",
			Help: "Prompt tokens of prefills found cached on each prefill endpoint, as placement predicted them (source=predicted: the engine's KV events with kv_events, else what pdx sent there) and as the engine reported them in its answer (source=reported: usage.prompt_tokens_details.cached_tokens, vLLM's --enable-prompt-tokens-details); counted for engines that report them. Their ratio is placement's prediction error per engine.",
		}, []string{"pool", "endpoint", "source"}),
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "pdx_streams_in_flight",
			Help: "ext_proc streams (requests) pdx is serving now.",
		}),
	}
	m.reg.MustRegister(m.requests, m.routeDur, m.prefillDur, m.attempts, m.ttfb, m.decodeDur, m.handoff, m.ttft, m.tokens, m.decisions, m.repicks, m.tokenSrc, m.renderErrs, m.scrapes, m.served, m.flowWait, m.sessions, m.loraPicks, m.checks, m.cached, m.inFlight,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m.none = &Pool{m: m}
	m.none.passThrough = m.requests.WithLabelValues("", "", OutcomePassThrough)
	m.pools.Store(&map[string]*Pool{})
	return m
}

// Registry is where the metrics are registered; tests gather from it.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Handler serves the metrics in Prometheus's exposition formats.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg})
}

// StreamStarted and StreamEnded count the ext_proc streams in flight.
func (m *Metrics) StreamStarted() {
	if m != nil {
		m.inFlight.Inc()
	}
}

// StreamEnded is StreamStarted's counterpart.
func (m *Metrics) StreamEnded() {
	if m != nil {
		m.inFlight.Dec()
	}
}

// Warm resolves the children of table's pools ahead of their first request.
func (m *Metrics) Warm(table *routing.Table) {
	if m == nil || table == nil {
		return
	}
	for _, p := range table.Pools() {
		m.Pool(p)
	}
}

// Pool returns the metrics of p, or of requests that have no pool when p is
// nil. It does not allocate once p's children are resolved.
func (m *Metrics) Pool(p *routing.Pool) *Pool {
	if m == nil {
		return nil
	}
	if p == nil {
		return m.none
	}
	if pm := (*m.pools.Load())[p.Name]; pm != nil && pm.connector == p.ConnectorName {
		return pm
	}
	return m.addPool(p)
}

func (m *Metrics) addPool(p *routing.Pool) *Pool {
	m.mu.Lock()
	defer m.mu.Unlock()
	old := *m.pools.Load()
	if pm := old[p.Name]; pm != nil && pm.connector == p.ConnectorName {
		return pm
	}
	pm := &Pool{m: m, name: p.Name, connector: p.ConnectorName}
	// Resolved now, so that the common outcomes' series exist (at 0) from
	// the start and cost no lookup later.
	pm.routed = m.requests.WithLabelValues(p.Name, p.ConnectorName, OutcomeRouted)
	pm.fallback = m.requests.WithLabelValues(p.Name, p.ConnectorName, OutcomeFallback)
	pm.routedDur = m.routeDur.WithLabelValues(p.Name, p.ConnectorName, OutcomeRouted)
	if p.Traits.Prefills {
		pm.prefillOK = m.prefillDur.WithLabelValues(p.Name, p.ConnectorName, ResultOK)
		ok := map[string]prometheus.Counter{}
		for _, ep := range p.Prefill.Set.Endpoints() {
			ok[ep.Address] = m.attempts.WithLabelValues(p.Name, ep.Address, ResultOK)
		}
		pm.attemptOK.Store(&ok)
	}
	next := make(map[string]*Pool, len(old)+1)
	for k, v := range old {
		next[k] = v
	}
	next[p.Name] = pm
	m.pools.Store(&next)
	return pm
}

// Pool holds one pool's resolved children. A nil *Pool records nothing.
type Pool struct {
	m               *Metrics
	name, connector string

	routed, fallback, passThrough prometheus.Counter
	routedDur, prefillOK          prometheus.Observer
	// attemptOK is the "ok" attempt counter by endpoint address; replaced,
	// never changed, when an endpoint appears (discovery).
	attemptOK atomic.Pointer[map[string]prometheus.Counter]
	// Histograms seen only in some setups or on failures: resolved on first
	// use, so that the others do not export empty series.
	ttfb, decodeDur, fallbackDur, errorDur atomic.Pointer[prometheus.Observer]
	handoff, ttft                          atomic.Pointer[prometheus.Observer]
	tokens                                 atomic.Pointer[[3]prometheus.Counter]    // prompt, cached, completion
	sessions                               atomic.Pointer[[2][2]prometheus.Counter] // by leg (picker.Role), kept and moved
}

// Request counts a finished request by outcome and, for requests pdx routed
// or failed (routed > 0), observes the time it took to answer them.
func (p *Pool) Request(outcome string, routed time.Duration) {
	if p == nil {
		return
	}
	switch {
	case outcome == OutcomeRouted && p.routed != nil:
		p.routed.Inc()
		p.routedDur.Observe(routed.Seconds())
	case outcome == OutcomeFallback && p.fallback != nil:
		p.fallback.Inc()
		p.observer(&p.fallbackDur, p.m.routeDur, OutcomeFallback).Observe(routed.Seconds())
	case outcome == OutcomePassThrough && p.passThrough != nil:
		p.passThrough.Inc()
	default:
		// Errors and the rare outcomes: a lookup, off the common path.
		p.m.requests.WithLabelValues(p.name, p.connector, outcome).Inc()
		if routed > 0 {
			// One histogram for all errors: a code each is too many series.
			p.observer(&p.errorDur, p.m.routeDur, OutcomeError).Observe(routed.Seconds())
		}
	}
}

// Prefill observes the time a request spent in prefill; outcome is ResultOK
// or the error code of its last attempt.
func (p *Pool) Prefill(outcome string, d time.Duration) {
	if p == nil {
		return
	}
	if outcome == ResultOK && p.prefillOK != nil {
		p.prefillOK.Observe(d.Seconds())
		return
	}
	p.m.prefillDur.WithLabelValues(p.name, p.connector, outcome).Observe(d.Seconds())
}

// Checked counts one prefill's self-check verdict (placement.Check*; ""
// none) and, where its engine reports them, the cached tokens placement
// predicted and the engine reported on it.
func (p *Pool) Checked(endpoint, result string, reports bool, predicted, reported int) {
	if p == nil {
		return
	}
	if result != "" {
		p.m.checks.WithLabelValues(p.name, result).Inc()
	}
	if reports {
		p.m.cached.WithLabelValues(p.name, endpoint, "predicted").Add(float64(predicted))
		p.m.cached.WithLabelValues(p.name, endpoint, "reported").Add(float64(reported))
	}
}

// Attempt counts one prefill call to endpoint; result is ResultOK or an
// error code.
func (p *Pool) Attempt(endpoint, result string) {
	if p == nil {
		return
	}
	if result == ResultOK {
		if m := p.attemptOK.Load(); m != nil {
			if c := (*m)[endpoint]; c != nil {
				c.Inc()
				return
			}
		}
		p.addEndpoint(endpoint).Inc()
		return
	}
	p.m.attempts.WithLabelValues(p.name, endpoint, result).Inc()
}

func (p *Pool) addEndpoint(endpoint string) prometheus.Counter {
	c := p.m.attempts.WithLabelValues(p.name, endpoint, ResultOK)
	p.m.mu.Lock()
	defer p.m.mu.Unlock()
	next := map[string]prometheus.Counter{endpoint: c}
	if old := p.attemptOK.Load(); old != nil {
		for k, v := range *old {
			next[k] = v
		}
	}
	p.attemptOK.Store(&next)
	return c
}

// Decision counts a decision of the disaggregation decider.
func (p *Pool) Decision(decision string) {
	if p != nil && p.name != "" {
		p.m.decisions.WithLabelValues(p.name, decision).Inc()
	}
}

// DecodeRepick counts a decode picked again after its prefill; moved: to
// another endpoint.
func (p *Pool) DecodeRepick(moved bool) {
	if p != nil && p.name != "" {
		p.m.repicks.WithLabelValues(p.name, strconv.FormatBool(moved)).Inc()
	}
}

// LoRAPick counts a pick of leg for a request naming a LoRA adapter.
func (p *Pool) LoRAPick(leg string, o picker.LoRAOutcome) {
	if p != nil && p.name != "" && o != picker.LoRANone {
		p.m.loraPicks.WithLabelValues(p.name, leg, o.String()).Inc()
	}
}

// Tokenized counts where a request's prompt tokens came from.
func (p *Pool) Tokenized(source string) {
	if p != nil && p.name != "" {
		p.m.tokenSrc.WithLabelValues(p.name, source).Inc()
	}
}

// RenderFailed counts a failed render by reason.
func (p *Pool) RenderFailed(reason string) {
	if p != nil && p.name != "" {
		p.m.renderErrs.WithLabelValues(p.name, reason).Inc()
	}
}

// Waited records a request that waited for room on leg, or was refused
// it, in the band of priority: outcome is one of pdx_flow_control_wait_seconds's.
func (p *Pool) Waited(leg string, priority int, outcome string, d time.Duration) {
	if p != nil && p.name != "" {
		p.m.flowWait.WithLabelValues(p.name, leg, strconv.Itoa(priority), outcome).Observe(d.Seconds())
	}
}

// Values of pdx_decode_served_total's fallback label.
const (
	ServedFirst    = "first"
	ServedFallback = "fallback"
)

// DecodeServed counts a decode answer from endpoint; fallback: not the
// request's first decode endpoint.
func (p *Pool) DecodeServed(endpoint string, fallback bool) {
	if p == nil || p.name == "" {
		return
	}
	label := ServedFirst
	if fallback {
		label = ServedFallback
	}
	p.m.served.WithLabelValues(p.name, endpoint, label).Inc()
}

// Session counts the pick of a request of a session on its leg of role:
// kept on the session's first engine, or moved.
func (p *Pool) Session(role picker.Role, outcome picker.SessionOutcome) {
	if p == nil || p.name == "" || outcome == picker.NoSession || role > picker.RoleDecode {
		return
	}
	c := p.sessions.Load()
	if c == nil {
		// Resolved together on first use: pools without sessions export
		// none.
		c = new([2][2]prometheus.Counter)
		for _, role := range []picker.Role{picker.RolePrefill, picker.RoleDecode} {
			for i, o := range []picker.SessionOutcome{picker.SessionKept, picker.SessionMoved} {
				c[role][i] = p.m.sessions.WithLabelValues(p.name, role.String(), o.String())
			}
		}
		p.sessions.Store(c)
	}
	if outcome == picker.SessionKept {
		c[role][0].Inc()
	} else {
		c[role][1].Inc()
	}
}

// ScrapeFailed counts a failed scrape of the metrics of the engine at
// endpoint.
func (m *Metrics) ScrapeFailed(endpoint string) {
	if m != nil {
		m.scrapes.WithLabelValues(endpoint).Inc()
	}
}

// DecodeHeaders observes the time until the decode's response headers.
func (p *Pool) DecodeHeaders(d time.Duration) {
	if p != nil {
		p.observer(&p.ttfb, p.m.ttfb, "").Observe(d.Seconds())
	}
}

// DecodeDone observes the decode: from its response's first body byte to
// its end.
func (p *Pool) DecodeDone(d time.Duration) {
	if p != nil {
		p.observer(&p.decodeDur, p.m.decodeDur, "").Observe(d.Seconds())
	}
}

// FirstByte observes, at the decode response's first body byte, the
// hand-off (since the prefill's answer, or pdx's routing answer) and the
// time to first token (since the request headers).
func (p *Pool) FirstByte(handoff, ttft time.Duration) {
	if p != nil {
		p.observer(&p.handoff, p.m.handoff, "").Observe(handoff.Seconds())
		p.observer(&p.ttft, p.m.ttft, "").Observe(ttft.Seconds())
	}
}

// Token kinds of pdx_tokens_total.
const (
	TokensPrompt     = "prompt"
	TokensCached     = "cached"
	TokensCompletion = "completion"
)

// Tokens counts the usage a decode engine reported.
func (p *Pool) Tokens(prompt, cached, completion int64) {
	if p == nil {
		return
	}
	c := p.tokens.Load()
	if c == nil {
		c = &[3]prometheus.Counter{
			p.m.tokens.WithLabelValues(p.name, p.connector, TokensPrompt),
			p.m.tokens.WithLabelValues(p.name, p.connector, TokensCached),
			p.m.tokens.WithLabelValues(p.name, p.connector, TokensCompletion),
		}
		p.tokens.Store(c)
	}
	c[0].Add(float64(prompt))
	c[1].Add(float64(cached))
	c[2].Add(float64(completion))
}

// Named returns the metrics of the pool called name with connector, as
// another stream of the same request named them (the observability pass
// reads them from Envoy's dynamic metadata): the resolved ones when this
// server's table has that pool, else ones that resolve their children on
// each use.
func (m *Metrics) Named(name, connector string) *Pool {
	if m == nil {
		return nil
	}
	if pm := (*m.pools.Load())[name]; pm != nil && pm.connector == connector {
		return pm
	}
	return &Pool{m: m, name: name, connector: connector}
}

// observer returns the child of vec for p's labels and outcome (none when
// outcome is empty), resolving it on first use. Resolving twice is harmless:
// vec returns the same child.
func (p *Pool) observer(cache *atomic.Pointer[prometheus.Observer], vec *prometheus.HistogramVec, outcome string) prometheus.Observer {
	if o := cache.Load(); o != nil {
		return *o
	}
	var o prometheus.Observer
	if outcome == "" {
		o = vec.WithLabelValues(p.name, p.connector)
	} else {
		o = vec.WithLabelValues(p.name, p.connector, outcome)
	}
	cache.Store(&o)
	return o
}

// CollectEndpoints exports pdx_endpoint_healthy for the pools of the table
// that current returns, read from the pickers at scrape time.
func (m *Metrics) CollectEndpoints(current func() *routing.Table) {
	m.reg.MustRegister(&endpointCollector{current: current})
}

var (
	healthyDesc = prometheus.NewDesc("pdx_endpoint_healthy",
		"1 if the endpoint is admitted by its pool's picker, 0 while passive health checking has ejected it (decode endpoints are never ejected).",
		[]string{"pool", "role", "endpoint"}, nil)
	waitingDesc = prometheus.NewDesc("pdx_flow_control_waiting",
		"Requests waiting for room on a saturated leg of the pool now, by band (their objective's priority).",
		[]string{"pool", "band"}, nil)
	serviceDesc = prometheus.NewDesc("pdx_prefill_service_rate_tokens_per_second",
		"What placement has learned of each prefill endpoint from pdx's timed prefills (the forecast policy's model), in tokens a second: what a token in the engine before a call costs it (kind=ahead), what a token it waits for before a slot frees costs (kind=waiting), and the rate one prompt computes at (kind=prompt); +Inf where the fit finds no cost; the seed's until the endpoint has answered.",
		[]string{"pool", "endpoint", "kind"}, nil)
	slotsDesc = prometheus.NewDesc("pdx_prefill_service_slots",
		"How many prompts each prefill endpoint has been seen computing at once while others waited (its metrics' running requests), which the forecast policy's model reads; 1 before its metrics have shown it.",
		[]string{"pool", "endpoint"}, nil)
	tokenScaleDesc = prometheus.NewDesc("pdx_prefill_tokens_per_engine_token",
		"How many of pdx's prompt tokens (a prompt's bytes over 4, in which it hashes prompts into blocks) each pool's prefill engines count as one of theirs, learned from the usage.prompt_tokens of the prefills pdx calls: pdx's record of what each engine holds is that many of its blocks for each of the engine's. 1 until an engine answered.",
		[]string{"pool"}, nil)
	overheadDesc = prometheus.NewDesc("pdx_prefill_service_overhead_seconds",
		"What placement has learned of each prefill endpoint's fixed cost of a prefill call (the forecast policy's model).",
		[]string{"pool", "endpoint"}, nil)
	endpointKVDesc = prometheus.NewDesc("pdx_endpoint_kv_capacity_blocks",
		"How many of its pool's prefix blocks (prefix_block_tokens, unset the engines' own KV block) each engine's KV cache holds, as its metrics said (vLLM's vllm:cache_config_info, SGLang's sglang:max_total_num_tokens): placement counts what pdx sent the endpoint as cached only while it is among that many blocks sent there last. Absent while the engine has not said, or when its cache outgrows what pdx remembers sending.",
		[]string{"pool", "role", "endpoint"}, nil)
	inFlightDesc = prometheus.NewDesc("pdx_endpoint_in_flight",
		"Requests this pdx counts on the endpoint: prefills running (with config peers, the other replicas' too), and decodes whose stream it holds until Envoy finishes their response (a decode detached at routing is the engine's metrics' to count).",
		[]string{"pool", "role", "endpoint"}, nil)
)

type endpointCollector struct {
	current func() *routing.Table
}

func (c *endpointCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- healthyDesc
	ch <- inFlightDesc
	ch <- endpointKVDesc
	ch <- waitingDesc
	ch <- serviceDesc
	ch <- overheadDesc
	ch <- slotsDesc
	ch <- tokenScaleDesc
}

func (c *endpointCollector) Collect(ch chan<- prometheus.Metric) {
	t := c.current()
	if t == nil {
		return
	}
	type key struct{ pool, role, endpoint string }
	seen := map[key]bool{} // a config may list an endpoint twice
	for _, p := range t.Pools() {
		if s := p.Saturated; s != nil {
			s.Flow.Waiting(func(priority, n int) {
				ch <- prometheus.MustNewConstMetric(waitingDesc, prometheus.GaugeValue, float64(n), p.Name, strconv.Itoa(priority))
			})
		}
		if p.Traits.Prefills {
			ch <- prometheus.MustNewConstMetric(tokenScaleDesc, prometheus.GaugeValue, p.Prefill.Set.TokenScale(), p.Name)
		}
		for _, side := range []struct {
			role string
			set  *picker.Set
		}{{"prefill", p.Prefill.Set}, {"decode", p.Decode.Set}} {
			for _, ep := range side.set.Endpoints() {
				k := key{p.Name, side.role, ep.Address}
				if seen[k] {
					continue
				}
				seen[k] = true
				v := 0.0
				if side.set.Healthy(ep) {
					v = 1
				}
				ch <- prometheus.MustNewConstMetric(healthyDesc, prometheus.GaugeValue, v, p.Name, side.role, ep.Address)
				ch <- prometheus.MustNewConstMetric(inFlightDesc, prometheus.GaugeValue, float64(side.set.InFlight(ep)), p.Name, side.role, ep.Address)
				if n, ok := side.set.KVBlocks(ep); ok {
					ch <- prometheus.MustNewConstMetric(endpointKVDesc, prometheus.GaugeValue, float64(n), p.Name, side.role, ep.Address)
				}
				if sv, ok := side.set.Service(ep); ok && side.role == "prefill" && p.Traits.Prefills {
					ch <- prometheus.MustNewConstMetric(serviceDesc, prometheus.GaugeValue, sv.AheadRate, p.Name, ep.Address, "ahead")
					ch <- prometheus.MustNewConstMetric(serviceDesc, prometheus.GaugeValue, sv.WaitingRate, p.Name, ep.Address, "waiting")
					ch <- prometheus.MustNewConstMetric(serviceDesc, prometheus.GaugeValue, sv.PromptRate, p.Name, ep.Address, "prompt")
					ch <- prometheus.MustNewConstMetric(overheadDesc, prometheus.GaugeValue, sv.Overhead.Seconds(), p.Name, ep.Address)
					ch <- prometheus.MustNewConstMetric(slotsDesc, prometheus.GaugeValue, float64(sv.Slots), p.Name, ep.Address)
				}
			}
		}
	}
}
