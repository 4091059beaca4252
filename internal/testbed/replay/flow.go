package replay

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// The flow-control experiment: tenants that share one saturated pool,
// side by side with and without pdx's flow control telling them apart.
// Every request is a prompt of its own (no prefix is shared, so placement
// plays no part), and every run starts a fresh rig.
const (
	flowInputTokens  = 2048 // real tokens of every prompt
	flowOutputTokens = 64
	// flowSaturation keeps the engines' own queues short, so that the wait
	// is pdx's, where flow control orders it: an engine holding
	// prefill_max_in_flight (FlowPlan.MaxInFlight) of pdx's prefills is
	// saturated, and the decode leg is left to its metrics. (The simulator, like
	// vLLM, runs every request it is sent at once, sharing its compute,
	// up to max_num_seqs: its waiting count, the default signal, stays
	// 0.) KV usage is no signal here: unique prompts fill the caches.
	flowSaturation = "saturation: {prefill_max_in_flight: %d, kv_usage: 1, max_queue_time: %s}\n"
	// flowCalibration is the burst that measures the rig's capacity, per
	// prefill engine.
	flowCalibration = 50

	// The priority experiment's scenarios with bands, which its goals read.
	scenarioBands = "bands: chat 10, batch -1 (sheddable)"
	scenarioLocal = "bands, and chat prefilled on its decode engine while the prefill engine is saturated"
)

// FlowPlan is the flow-control experiment's parameters.
type FlowPlan struct {
	Rig Rig
	// Window is how long the priority runs send (default 20 s); the
	// fairness runs send for half of it.
	Window time.Duration
	// MaxInFlight is the pool's saturation.prefill_max_in_flight (default
	// 1): how many of pdx's prefills an engine runs at once, the rest
	// waiting in pdx. Fewer: a critical request waits behind fewer batch
	// prefills, and the engine runs less at once.
	MaxInFlight int
	Progress    io.Writer
}

// FlowReport is the experiment's result.
type FlowReport struct {
	Prefill      int     `json:"prefill_engines"`
	Decode       int     `json:"decode_engines"`
	TokenScale   int     `json:"token_scale"`
	TimeScale    float64 `json:"time_scale"`
	InputTokens  int     `json:"input_tokens"`
	OutputTokens int     `json:"output_tokens"`
	// Capacity is the rig's throughput of the experiment's requests, in
	// requests a second, from a burst with saturation off.
	Capacity float64 `json:"capacity_rps"`
	WindowS  float64 `json:"window_s"`
	// MaxInFlight is the pool's saturation.prefill_max_in_flight.
	MaxInFlight int       `json:"prefill_max_in_flight"`
	Runs        []FlowRun `json:"runs"`
	WallSec     float64   `json:"wall_s"`
	Machine     string    `json:"machine,omitempty"`
}

// FlowRun is one run: a scenario's tenants and what each got.
type FlowRun struct {
	Experiment string       `json:"experiment"`
	Scenario   string       `json:"scenario"`
	PoolYAML   string       `json:"pool_yaml"`
	Tenants    []FlowTenant `json:"tenants"`
}

// FlowTenant is one tenant of a run.
type FlowTenant struct {
	Name      string  `json:"name"`
	Objective string  `json:"objective,omitempty"`
	Flow      string  `json:"flow,omitempty"`
	Rate      float64 `json:"rate_rps"`
	// FromS and ToS bound the tenant's sending, in seconds from the run's
	// start.
	FromS    float64     `json:"from_s"`
	ToS      float64     `json:"to_s"`
	Requests int         `json:"requests"`
	OK       int         `json:"ok"`
	Shed     int         `json:"shed_429"`
	Broken   int         `json:"broken"`
	MixUps   int         `json:"mix_ups"`
	TTFT     Percentiles `json:"ttft"`
	// TPOT is the time per output token after the first: what prompts
	// computed on the decode engine cost its batch.
	TPOT Percentiles `json:"tpot"`
	// Served counts the tenant's requests whose first token came while
	// every tenant was still sending (the run's shortest sending span):
	// its service while all compete. Share is its share of all tenants'.
	Served int     `json:"served"`
	Share  float64 `json:"share"`
}

// tenant is a tenant's traffic: Poisson arrivals at rate in [from, to).
type tenant struct {
	name, objective, flow string
	rate                  float64
	from, to              time.Duration
}

// RunFlow runs the experiment.
func RunFlow(ctx context.Context, p FlowPlan) (*FlowReport, error) {
	began := time.Now()
	if p.Window <= 0 {
		p.Window = 20 * time.Second
	}
	if p.MaxInFlight <= 0 {
		p.MaxInFlight = 1
	}
	// One engine of each role: the heavy tenant sends at six times the
	// rig's capacity, which a larger rig's load client and Envoy could not
	// on a small machine.
	p.Rig.Prefill, p.Rig.Decode = 1, 1
	rep := &FlowReport{
		Prefill: p.Rig.Prefill, Decode: p.Rig.Decode, TokenScale: p.Rig.Scale.TokenScale, TimeScale: p.Rig.TimeScale,
		InputTokens: flowInputTokens, OutputTokens: flowOutputTokens, WindowS: p.Window.Seconds(),
		MaxInFlight: p.MaxInFlight,
	}
	c, err := p.capacity(ctx)
	if err != nil {
		return nil, fmt.Errorf("calibration: %w", err)
	}
	rep.Capacity = c
	p.logf("capacity: %.1f req/s of %d-token prompts\n", c, flowInputTokens)

	// Priority: a latency-critical tenant at 30% of capacity, and a batch
	// tenant's burst at twice capacity through the middle half.
	w := p.Window
	chat := tenant{name: "chat", objective: "chat", rate: 0.3 * c, to: w}
	batch := tenant{name: "batch", objective: "batch", rate: 2 * c, from: w / 4, to: 3 * w / 4}
	sat := fmt.Sprintf(flowSaturation, p.MaxInFlight, "30s")
	bands := sat + "flow_control: {objectives: [{name: chat, priority: 10}, {name: batch, priority: -1}]}\n"
	oneBand := sat + "flow_control: {}\n"
	// Conditional disaggregation by band: the critical tenant's prompts go
	// to the decode engine alone while the prefill engine is saturated.
	local := bands + "disaggregation: {when_prefill_saturated: true, prefill_saturated_min_priority: 1}\n"
	// Fairness: two tenants of one band at 10:1, each above its half.
	fw := w / 2
	heavy := tenant{name: "heavy", flow: "heavy", rate: 6 * c, to: fw}
	light := tenant{name: "light", flow: "light", rate: 0.6 * c, to: fw}
	fsat := fmt.Sprintf(flowSaturation, p.MaxInFlight, "10s") + "flow_control: {}\n"
	noFlows := func(t tenant) tenant { t.flow = ""; return t }
	for _, s := range []struct {
		experiment, scenario, pool string
		tenants                    []tenant
	}{
		{"priority", "critical alone", bands, []tenant{chat}},
		{"priority", "one band (flow control without objectives)", oneBand, []tenant{chat, batch}},
		{"priority", scenarioBands, bands, []tenant{chat, batch}},
		{"priority", scenarioLocal, local, []tenant{chat, batch}},
		{"fairness", "one flow (no fairness ids)", fsat, []tenant{noFlows(heavy), noFlows(light)}},
		{"fairness", "round robin across fairness ids", fsat, []tenant{heavy, light}},
	} {
		run, err := p.run(ctx, s.experiment, s.scenario, s.pool, s.tenants)
		if err != nil {
			return rep, fmt.Errorf("%s, %s: %w", s.experiment, s.scenario, err)
		}
		rep.Runs = append(rep.Runs, run)
		for _, t := range run.Tenants {
			p.logf("  %-9s %-44s %-6s %6.1f req/s: %5d sent, %5d ok, %4d 429, %d broken, %d mix-ups; TTFT p50/p90 %6.0f/%6.0f ms; served while all sent %5d (%.0f%%)\n",
				s.experiment, s.scenario, t.Name, t.Rate, t.Requests, t.OK, t.Shed, t.Broken, t.MixUps, t.TTFT.P50, t.TTFT.P90, t.Served, 100*t.Share)
		}
	}
	rep.WallSec = time.Since(began).Seconds()
	return rep, nil
}

func (p FlowPlan) logf(format string, args ...any) {
	if p.Progress != nil {
		fmt.Fprintf(p.Progress, format, args...)
	}
}

// capacity sends a burst with saturation off and returns how many
// requests a second the rig served.
func (p FlowPlan) capacity(ctx context.Context) (float64, error) {
	n := flowCalibration * p.Rig.Prefill
	reqs, at := p.schedule([]tenant{{name: "burst"}}, n)
	d, err := p.Rig.start(ctx, Profile{Name: "flow", PoolYAML: "saturation: {disabled: true}\n"}, 1)
	if err != nil {
		return 0, err
	}
	defer d.Close()
	client := newClient()
	defer client.CloseIdleConnections()
	outs, _ := sendAll(ctx, client, d.URL(), reqs, at)
	var last time.Duration
	ok := 0
	for _, o := range outs {
		if o.OK() {
			ok++
			last = max(last, o.Sent+o.TTFT)
		}
	}
	if ok < n || last <= 0 {
		return 0, fmt.Errorf("%d of %d burst requests served", ok, n)
	}
	return float64(ok) / last.Seconds(), nil
}

// schedule is the tenants' requests in order of arrival and their send
// offsets; burst, when above 0, is that many requests of the first tenant
// at once instead.
func (p FlowPlan) schedule(tenants []tenant, burst int) ([]Request, []time.Duration) {
	type arrival struct {
		at     time.Duration
		tenant int
	}
	var arrivals []arrival
	if burst > 0 {
		for range burst {
			arrivals = append(arrivals, arrival{0, 0})
		}
	}
	rng := rand.New(rand.NewPCG(22, 1))
	for i, t := range tenants {
		if t.rate <= 0 {
			continue
		}
		for at := t.from; ; {
			at += time.Duration(rng.ExpFloat64() / t.rate * float64(time.Second))
			if at >= t.to {
				break
			}
			arrivals = append(arrivals, arrival{at, i})
		}
	}
	slices.SortStableFunc(arrivals, func(a, b arrival) int { return int(a.at - b.at) })
	reqs, at := make([]Request, len(arrivals)), make([]time.Duration, len(arrivals))
	next := int64(-1)
	in, out := p.Rig.Scale.Tokens(flowInputTokens), p.Rig.Scale.Tokens(flowOutputTokens)
	for i, a := range arrivals {
		r := p.Rig.uniqueRequest(in, out, &next)
		r.Index, r.Objective, r.Flow = a.tenant, tenants[a.tenant].objective, tenants[a.tenant].flow
		reqs[i], at[i] = r, a.at
	}
	return reqs, at
}

// run replays the tenants' traffic on a fresh rig with pool.
func (p FlowPlan) run(ctx context.Context, experiment, scenario, pool string, tenants []tenant) (FlowRun, error) {
	reqs, at := p.schedule(tenants, 0)
	d, err := p.Rig.start(ctx, Profile{Name: "flow", PoolYAML: pool}, 1)
	if err != nil {
		return FlowRun{}, err
	}
	defer d.Close()
	client := newClient()
	defer client.CloseIdleConnections()
	outs, _ := sendAll(ctx, client, d.URL(), reqs, at)
	if err := ctx.Err(); err != nil {
		return FlowRun{}, err
	}
	// Service while every tenant competes: up to the first to stop.
	span := tenants[0].to
	for _, t := range tenants {
		span = min(span, t.to)
	}
	run := FlowRun{Experiment: experiment, Scenario: scenario, PoolYAML: strings.TrimSpace(pool)}
	ttfts, tpots := make([][]time.Duration, len(tenants)), make([][]time.Duration, len(tenants))
	for _, t := range tenants {
		run.Tenants = append(run.Tenants, FlowTenant{Name: t.name, Objective: t.objective, Flow: t.flow, Rate: t.rate,
			FromS: t.from.Seconds(), ToS: t.to.Seconds()})
	}
	served := 0
	for i, o := range outs {
		ti := reqs[i].Index
		t := &run.Tenants[ti]
		t.Requests++
		switch {
		case o.MixedUp:
			t.MixUps++
		case o.OK():
			t.OK++
			ttfts[ti] = append(ttfts[ti], o.TTFT)
			if d := o.TPOT(); d > 0 {
				tpots[ti] = append(tpots[ti], d)
			}
			if o.Sent+o.TTFT <= span {
				t.Served++
				served++
			}
		case o.Status == 429:
			t.Shed++
		default:
			t.Broken++
		}
	}
	for i := range run.Tenants {
		run.Tenants[i].TTFT, run.Tenants[i].TPOT = percentiles(ttfts[i]), percentiles(tpots[i])
		if served > 0 {
			run.Tenants[i].Share = float64(run.Tenants[i].Served) / float64(served)
		}
	}
	return run, nil
}

// tenantOf is the named tenant of the run of experiment and scenario.
func (rep *FlowReport) tenantOf(experiment, scenario, name string) (FlowTenant, bool) {
	for _, r := range rep.Runs {
		if r.Experiment == experiment && r.Scenario == scenario {
			for _, t := range r.Tenants {
				if t.Name == name {
					return t, true
				}
			}
		}
	}
	return FlowTenant{}, false
}

// Write writes results.json and summary.md to dir.
func (rep *FlowReport) Write(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	js, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "results.json"), append(js, '\n'), 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "summary.md"), []byte(rep.Summary()), 0o644)
}

// Summary is the Markdown report.
func (rep *FlowReport) Summary() string {
	var b strings.Builder
	fmt.Fprintf(&b, "# Flow control: tenants sharing a saturated pool\n\n")
	fmt.Fprintf(&b, "Real Envoy + pdx, %d prefill + %d decode simulated NIXL engines, fresh per run; token scale %d, time scale %g. "+
		"Every request is a prompt of its own (%d tokens, %d out: no shared prefix, so placement plays no part). "+
		"Capacity %.1f req/s (a burst of %d with saturation off). The pool's saturation: `prefill_max_in_flight: %d` (the decode leg unbounded). Wall time %.0f s",
		rep.Prefill, rep.Decode, rep.TokenScale, rep.TimeScale, rep.InputTokens, rep.OutputTokens, rep.Capacity, flowCalibration*rep.Prefill, rep.MaxInFlight, rep.WallSec)
	if rep.Machine != "" {
		fmt.Fprintf(&b, " on %s", rep.Machine)
	}
	b.WriteString(".\n\n")
	b.WriteString("Served is a tenant's requests whose first token came while every tenant of the run was still sending, and share its part of all of them: the service each got while all competed.\n\n")
	b.WriteString("| experiment | scenario | tenant | objective / flow | rate req/s | sending s | sent | ok | 429 | broken | mix-ups | TTFT p50/p90/p99 ms | TPOT p50/p90 ms | served (share) |\n")
	b.WriteString("|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---|---|---|\n")
	for _, r := range rep.Runs {
		for _, t := range r.Tenants {
			fmt.Fprintf(&b, "| %s | %s | %s | %s / %s | %.1f | %.0f–%.0f | %d | %d | %d | %d | %d | %.0f / %.0f / %.0f | %.2f / %.2f | %d (%.1f%%) |\n",
				r.Experiment, r.Scenario, t.Name, orDash(t.Objective), orDash(t.Flow), t.Rate, t.FromS, t.ToS, t.Requests, t.OK, t.Shed, t.Broken, t.MixUps,
				t.TTFT.P50, t.TTFT.P90, t.TTFT.P99, t.TPOT.P50, t.TPOT.P90, t.Served, 100*t.Share)
		}
	}
	b.WriteString("\n## The goals\n\n")
	alone, ok1 := rep.tenantOf("priority", "critical alone", "chat")
	before, ok2 := rep.tenantOf("priority", "one band (flow control without objectives)", "chat")
	after, ok3 := rep.tenantOf("priority", scenarioBands, "chat")
	if ok1 && ok2 && ok3 && alone.TTFT.P90 > 0 {
		fmt.Fprintf(&b, "- The critical tenant's TTFT p90 under the batch burst, over its TTFT p90 alone (goal ≤ 1.25): one band %.2f, bands %.2f",
			before.TTFT.P90/alone.TTFT.P90, after.TTFT.P90/alone.TTFT.P90)
		if local, ok := rep.tenantOf("priority", scenarioLocal, "chat"); ok {
			batchQ, _ := rep.tenantOf("priority", scenarioBands, "batch")
			batchL, _ := rep.tenantOf("priority", scenarioLocal, "batch")
			fmt.Fprintf(&b, ", bands with the critical tenant's prompts on its decode engine while the prefill engine is saturated %.2f. "+
				"What that cost the decode engine's batch: the batch tenant's TPOT p90 %.2f ms, against %.2f ms when the critical tenant waits in its band",
				local.TTFT.P90/alone.TTFT.P90, batchL.TPOT.P90, batchQ.TPOT.P90)
		}
		b.WriteString(".\n")
		fmt.Fprintf(&b, "- 429s of the critical (non-sheddable) tenant while the sheddable one waited (goal 0): %d; the batch tenant's 429s: %d.\n",
			after.Shed, func() int {
				t, _ := rep.tenantOf("priority", scenarioBands, "batch")
				return t.Shed
			}())
	}
	for _, sc := range []string{"one flow (no fairness ids)", "round robin across fairness ids"} {
		h, okh := rep.tenantOf("fairness", sc, "heavy")
		l, okl := rep.tenantOf("fairness", sc, "light")
		if okh && okl {
			fmt.Fprintf(&b, "- %s: the heavy tenant's share %.1f%%, the light one's %.1f%% (goal with fairness: each within 10%% of half, 45–55%%).\n",
				sc, 100*h.Share, 100*l.Share)
		}
	}
	return b.String()
}

func orDash(s string) string {
	if s == "" {
		return "–"
	}
	return s
}
