// Package loadtest is pdx's load harness: closed-loop load through a real
// Envoy, pdx (as its own process) and simulated engines, with Envoy alone
// as the floor and vLLM's own router as the peer, reporting latency,
// throughput, CPU and memory per scenario.
package loadtest

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

// Profile is a set of engine latencies.
type Profile struct {
	Name   string           `json:"name"`
	Engine enginesim.Config `json:"-"`
	// Describe says what the latencies are, for the report.
	Describe string `json:"describe"`
}

// The profiles the harness knows.
var (
	// ZeroLatency engines answer at once: all time is the routers'.
	ZeroLatency = Profile{Name: "zero", Describe: "engines answer at once"}
	// Realistic is in the range of an 8B model on one H100: prefill at
	// ~50k prompt tokens/s, first token after 15 ms, 8 ms per further token.
	Realistic = Profile{Name: "realistic", Engine: enginesim.Config{
		PrefillLatency: 10 * time.Millisecond, PrefillPerToken: 20 * time.Microsecond,
		DecodeLatency: 15 * time.Millisecond, DecodePerToken: 8 * time.Millisecond,
	}, Describe: "prefill 10ms + 20us/token, first token 15ms, 8ms/token"}
)

// Plan is what one run measures.
type Plan struct {
	PdxBin, EnvoyBin string
	// Observer adds the observability pass (envoy.Config's Observer) to the
	// Envoys with ext_proc.
	Observer bool
	// VLLMRouter adds the peer scenarios: vllm-router (installed, see
	// package vllmrouter) on the same engines and load.
	VLLMRouter bool
	Profiles   []Profile
	// Each profile sweeps Concurrency at SweepBody bytes, and Bodies at
	// SizeConcurrency, for every Streams value, every scenario.
	Concurrency     []int
	SweepBody       int
	Bodies          []int
	SizeConcurrency int
	Streams         []bool
	Warmup, Window  time.Duration
	// Memory measures pdx's live heap with MemoryConcurrency requests
	// parked in pdx (a long prefill), per body size in MemoryBodies.
	MemoryConcurrency int
	MemoryBodies      []int
	// ParkedPrefill is the prefill latency that holds requests inside pdx
	// while Memory and OpenStreams measure it (default 5s).
	ParkedPrefill time.Duration
	// OpenStreams is how many concurrent ext_proc streams one pdx is
	// given at once, straight over gRPC (0 skips it).
	OpenStreams int
	// GoalRounds repeats, with the zero-latency engines, the floor and
	// pdx's whole path side by side at the points issue 23's goals name
	// (GoalShapes), this many rounds: one run's point is too noisy on a
	// shared machine to hold a goal to (0 skips them).
	GoalRounds int
	// GoalWindow is the goal points' window, Window when 0: at 512
	// clients a request takes seconds, and a window shorter than that can
	// close before any completes.
	GoalWindow time.Duration
	// SaveProfile, when set, receives pdx's CPU profiles of the
	// zero-latency, whole-answer points at SizeConcurrency and SweepBody,
	// and its heap profiles with requests parked (see Memory).
	SaveProfile func(name string, profile []byte) error
	// Progress receives a line per point.
	Progress io.Writer
}

// Point is one measured load level of one scenario.
type Point struct {
	Profile     string   `json:"profile"`
	Scenario    Scenario `json:"scenario"`
	Concurrency int      `json:"concurrency"`
	BodyBytes   int      `json:"body_bytes"`
	Stream      bool     `json:"stream"`

	Requests   int     `json:"requests"`
	Errors     int     `json:"errors"`
	FirstError string  `json:"first_error,omitempty"`
	Seconds    float64 `json:"seconds"`
	// WarmupSeconds is how long it took every client to get an answer.
	WarmupSeconds float64 `json:"warmup_seconds"`
	Throughput    float64 `json:"throughput_rps"`
	P50Ms         float64 `json:"p50_ms"`
	P90Ms         float64 `json:"p90_ms"`
	P99Ms         float64 `json:"p99_ms"`
	MeanMs        float64 `json:"mean_ms"`
	MaxMs         float64 `json:"max_ms"`
	TTFBP50Ms     float64 `json:"ttfb_p50_ms"`
	// Round is the goal round of a Report.Goals point (1 on), 0 for the
	// sweeps' points.
	Round int `json:"round,omitempty"`
	// Added latency against the floor at the same load.
	AddedP50Ms float64 `json:"added_p50_ms"`
	AddedP90Ms float64 `json:"added_p90_ms"`
	AddedP99Ms float64 `json:"added_p99_ms"`
	// CPU seconds per 1,000 requests, of the pdx and Envoy processes that
	// serve the scenario (0 for one that does not), and of the whole
	// router: pdx and its Envoy, the floor's Envoy, or the peer's process.
	PdxCPUPer1k    float64 `json:"pdx_cpu_s_per_1k"`
	EnvoyCPUPer1k  float64 `json:"envoy_cpu_s_per_1k"`
	RouterCPUPer1k float64 `json:"router_cpu_s_per_1k"`
	// Peak RSS of pdx, and of the whole router (as for its CPU: sampled
	// together, the peak of their sum).
	PdxPeakRSSMiB    float64 `json:"pdx_peak_rss_mib"`
	RouterPeakRSSMiB float64 `json:"router_peak_rss_mib"`
	// Answered counts the point's successful requests, warm-up and the
	// window's tail included: what the engines' counts are checked against.
	Answered int `json:"answered"`
	// Engines' counts over the point, warm-up included: decodes whose KV
	// was pulled from a prefill (one per answer of a disaggregated
	// scenario), and refusals.
	KVPulled       int `json:"kv_pulled"`
	EngineRejected int `json:"engine_rejected"`
	// OddPrefills counts prefill legs the engines served but a router
	// should not send: more than one token generated, or streamed (vLLM
	// serves both; a streamed NIXL prefill hands off nothing).
	OddPrefills int `json:"odd_prefills"`
}

// Memory is pdx's memory with requests parked in it.
type Memory struct {
	BodyBytes   int     `json:"body_bytes"`
	InFlight    int     `json:"in_flight"`
	IdleHeapMiB float64 `json:"idle_heap_mib"`
	HeapMiB     float64 `json:"heap_mib"`
	RSSMiB      float64 `json:"rss_mib"`
	// PerRequestBytes is (heap - idle heap) / in flight; the goal is at
	// most 2 x body + 16 KiB.
	PerRequestBytes int64 `json:"per_request_bytes"`
	GoalBytes       int64 `json:"goal_bytes"`
}

// Report is a run's results.
type Report struct {
	Started time.Time `json:"started"`
	Machine string    `json:"machine"`
	Envoy   string    `json:"envoy"`
	// VLLMRouter is the peer's version, when measured.
	VLLMRouter string    `json:"vllm_router,omitempty"`
	Profiles   []Profile `json:"profiles"`
	// The body size of the concurrency sweep, the concurrency of the size
	// sweep.
	SweepBody       int      `json:"sweep_body_bytes"`
	SizeConcurrency int      `json:"size_concurrency"`
	Points          []Point  `json:"points"`
	Memory          []Memory `json:"memory,omitempty"`
	Streams         *Streams `json:"streams,omitempty"`
	// Goals are the goal rounds' points (Plan.GoalRounds), in the order
	// measured.
	Goals []Point `json:"goals,omitempty"`
}

// Run measures plan.
func Run(ctx context.Context, plan Plan) (*Report, error) {
	if plan.ParkedPrefill == 0 {
		plan.ParkedPrefill = 5 * time.Second
	}
	defer debugClient.CloseIdleConnections()
	rep := &Report{Started: time.Now().UTC(), Profiles: plan.Profiles, SweepBody: plan.SweepBody, SizeConcurrency: plan.SizeConcurrency}
	for _, prof := range plan.Profiles {
		if err := runProfile(ctx, plan, prof, rep); err != nil {
			return rep, fmt.Errorf("profile %s: %w", prof.Name, err)
		}
	}
	if len(plan.MemoryBodies) > 0 {
		if err := runMemory(ctx, plan, rep); err != nil {
			return rep, fmt.Errorf("memory: %w", err)
		}
	}
	if plan.OpenStreams > 0 {
		if err := runStreams(ctx, plan, rep); err != nil {
			return rep, fmt.Errorf("streams: %w", err)
		}
	}
	return rep, nil
}

type shape struct {
	c, body int
	stream  bool
}

func (p Plan) shapes() []shape {
	var out []shape
	seen := map[shape]bool{}
	add := func(s shape) {
		if !seen[s] {
			seen[s] = true
			out = append(out, s)
		}
	}
	for _, stream := range p.Streams {
		for _, c := range p.Concurrency {
			add(shape{c, p.SweepBody, stream})
		}
		for _, b := range p.Bodies {
			add(shape{p.SizeConcurrency, b, stream})
		}
	}
	return out
}

// scenarios are the plan's, in order.
func (p Plan) scenarios() []Scenario {
	var out []Scenario
	for _, sc := range Scenarios {
		if p.VLLMRouter || !sc.Peer() {
			out = append(out, sc)
		}
	}
	return out
}

func runProfile(ctx context.Context, plan Plan, prof Profile, rep *Report) error {
	r, err := startRig(ctx, rigOptions{
		pdxBin: plan.PdxBin, envoyBin: plan.EnvoyBin, engine: prof.Engine,
		prefill: 2, decode: 2, prefillTimeout: 60 * time.Second, observer: plan.Observer,
		peers: plan.VLLMRouter,
	})
	if err != nil {
		return err
	}
	defer r.close()
	if rep.Envoy == "" {
		rep.Envoy = envoyVersion(r)
	}
	if p := r.peers[PeerRoundRobin]; p != nil {
		rep.VLLMRouter = p.Version()
	}
	for _, sh := range plan.shapes() {
		var floor, pd Point
		scenarios := append(plan.scenarios(), FloorAtPdxRate)
		for _, sc := range scenarios {
			rate := 0.0
			if sc == FloorAtPdxRate {
				if pd.Throughput <= 0 {
					continue // nothing to pace it to
				}
				rate = pd.Throughput
			}
			pt, err := measure(ctx, plan, r, prof, sc, sh, rate)
			if err != nil {
				return err
			}
			switch sc {
			case Floor:
				floor = pt
			case PD:
				pd = pt
			}
			if !sc.Floor() {
				pt.addedTo(floor)
			}
			rep.Points = append(rep.Points, pt)
			plan.progress(pt)
		}
	}
	if prof.Name == ZeroLatency.Name {
		return runGoals(ctx, plan, r, prof, rep)
	}
	return nil
}

// GoalShapes are the points issue 23's goals name: 512 clients, 1 KiB and
// 32 KiB prompts, whole answers.
var GoalShapes = []struct{ Concurrency, BodyBytes int }{{512, 1 << 10}, {512, 32 << 10}}

// runGoals measures the goal rounds: in each, at every goal shape, the
// floor and then pdx, so that each round's ratios come from neighbouring
// windows.
func runGoals(ctx context.Context, plan Plan, r *rig, prof Profile, rep *Report) error {
	plan.SaveProfile = nil // the sweeps' profiles stand
	if plan.GoalWindow > 0 {
		plan.Window = plan.GoalWindow
	}
	for round := 1; round <= plan.GoalRounds; round++ {
		for _, g := range GoalShapes {
			sh := shape{c: g.Concurrency, body: g.BodyBytes}
			var floor Point
			for _, sc := range []Scenario{Floor, PD} {
				pt, err := measure(ctx, plan, r, prof, sc, sh, 0)
				if err != nil {
					return fmt.Errorf("goal round %d: %w", round, err)
				}
				pt.Round = round
				if sc == Floor {
					floor = pt
				} else {
					pt.addedTo(floor)
				}
				rep.Goals = append(rep.Goals, pt)
				plan.progress(pt)
			}
		}
	}
	return nil
}

// progress writes a line about pt to plan.Progress.
func (p Plan) progress(pt Point) {
	if p.Progress == nil {
		return
	}
	round := ""
	if pt.Round > 0 {
		round = fmt.Sprintf("goal round %d: ", pt.Round)
	}
	fmt.Fprintf(p.Progress, "%s%-9s %-26s c=%-5d body=%-8d stream=%-5t %8.0f req/s  p50 %7.2fms p99 %8.2fms  +p50 %6.2fms +p99 %7.2fms  cpu/1k pdx %.3fs envoy %.3fs router %.3fs  kv pulled %d of %d answered, rejected %d  errors %d %s%s\n",
		round, pt.Profile, pt.Scenario, pt.Concurrency, pt.BodyBytes, pt.Stream, pt.Throughput, pt.P50Ms, pt.P99Ms,
		pt.AddedP50Ms, pt.AddedP99Ms, pt.PdxCPUPer1k, pt.EnvoyCPUPer1k, pt.RouterCPUPer1k,
		pt.KVPulled, pt.Answered, pt.EngineRejected, pt.Errors, pt.FirstError, mismatch(pt))
}

// addedTo sets p's added latencies against floor's.
func (p *Point) addedTo(floor Point) {
	p.AddedP50Ms = p.P50Ms - floor.P50Ms
	p.AddedP90Ms = p.P90Ms - floor.P90Ms
	p.AddedP99Ms = p.P99Ms - floor.P99Ms
}

// mismatch flags a point the engines' counts disagree with.
func mismatch(p Point) string {
	if pr := p.handoffProblem(); pr != "" {
		return "  ENGINES' CHECK FAILED: " + pr
	}
	return ""
}

// measure runs one scenario at one shape, its clients paced to rate
// requests a second if rate is above 0.
func measure(ctx context.Context, plan Plan, r *rig, prof Profile, sc Scenario, sh shape, rate float64) (Point, error) {
	tg := r.target(sc)
	body := requestBody(tg.model, sh.body, sh.stream)
	client := newClient(sh.c)
	defer client.CloseIdleConnections()
	pdxPid, envoyPid, peerPid := r.servers(sc)

	// CPU is read at the window's edges; RSS is sampled, and pdx profiled,
	// during the window.
	tallyBefore := r.tally()
	var cpu0, cpu1 [3]float64
	read := func(cpu *[3]float64) { *cpu = [3]float64{cpuOf(pdxPid), cpuOf(envoyPid), cpuOf(peerPid)} }
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type peaks struct {
		pdx, router int64
	}
	rssDone := make(chan peaks, 1)
	profDone := make(chan error, 1)
	profile := plan.SaveProfile != nil && pdxPid != 0 && prof.Name == ZeroLatency.Name &&
		sh.c == plan.SizeConcurrency && sh.body == plan.SweepBody && !sh.stream
	started := false // the window started (not when ctx ended first)
	res := closedLoop(ctx, client, tg, body, sh.stream, sh.c, rate, plan.Warmup, plan.Window, func() {
		started = true
		read(&cpu0)
		go func() {
			each, sum := peakRSS(wctx, 100*time.Millisecond, pdxPid, envoyPid, peerPid)
			rssDone <- peaks{each[0], sum}
		}()
		if !profile {
			profDone <- nil
			return
		}
		go func() {
			// The profile outlives the window's context by a moment.
			profDone <- takeProfile(ctx, r.pdx.pprofAt, plan.Window, func(b []byte) error {
				return plan.SaveProfile(fmt.Sprintf("%s-c%d-%dB", sc, sh.c, sh.body), b)
			})
		}()
	})
	read(&cpu1)
	cancel()
	var peak peaks
	if started {
		peak = <-rssDone
		if err := <-profDone; err != nil {
			return Point{}, fmt.Errorf("cpu profile: %w", err)
		}
	}
	tally := r.tally()

	pt := Point{
		Profile: prof.Name, Scenario: sc, Concurrency: sh.c, BodyBytes: sh.body, Stream: sh.stream,
		Requests: res.requests, Answered: res.answered, Errors: res.errors, FirstError: res.firstError,
		Seconds: res.window.Seconds(), WarmupSeconds: res.warmup.Seconds(),
		Throughput: float64(res.requests) / res.window.Seconds(),
		P50Ms:      ms(res.lat.P50), P90Ms: ms(res.lat.P90), P99Ms: ms(res.lat.P99),
		MeanMs: ms(res.lat.Mean), MaxMs: ms(res.lat.Max), TTFBP50Ms: ms(res.ttfb.P50),
		PdxPeakRSSMiB:    float64(peak.pdx) / (1 << 20),
		RouterPeakRSSMiB: float64(peak.router) / (1 << 20),
		KVPulled:         tally.Pulled - tallyBefore.Pulled,
		EngineRejected:   tally.Rejected - tallyBefore.Rejected,
		OddPrefills:      tally.LongPrefill + tally.StreamedPrefill - tallyBefore.LongPrefill - tallyBefore.StreamedPrefill,
	}
	if res.requests > 0 {
		// The window's CPU over the window's requests (requests straddling
		// its edges are few against thousands).
		per1k := func(i int) float64 { return (cpu1[i] - cpu0[i]) / float64(res.requests) * 1000 }
		pt.PdxCPUPer1k, pt.EnvoyCPUPer1k = per1k(0), per1k(1)
		pt.RouterCPUPer1k = per1k(0) + per1k(1) + per1k(2)
	}
	return pt, nil
}

// takeProfile fetches a CPU profile of d from a pprof endpoint.
func takeProfile(ctx context.Context, pprofAddr string, d time.Duration, save func([]byte) error) error {
	secs := max(1, int(d.Seconds())-1) // within the window, whole seconds
	return fetchProfile(ctx, fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", pprofAddr, secs), save)
}

// fetchProfile gets a profile from url and passes it to save.
func fetchProfile(ctx context.Context, url string, save func([]byte) error) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := debugClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("pprof: status %d: %s", resp.StatusCode, b)
	}
	return save(b)
}

func envoyVersion(r *rig) string {
	resp, err := debugClient.Get("http://" + r.envoy.AdminAddr() + "/server_info")
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	var info struct {
		Version string `json:"version"`
	}
	b, _ := io.ReadAll(resp.Body)
	_ = json.Unmarshal(b, &info)
	return info.Version
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
