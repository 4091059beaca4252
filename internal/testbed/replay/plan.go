// Package replay replays the Mooncake FAST'25 traces, and a generated
// cache-bound multi-tenant workload, through a real Envoy and pdx against
// simulated engines, once per placement policy at each load point, and
// reports latency, goodput, prefix-cache hits and load spread; a peer
// profile puts vLLM's own router in front of the same engines instead, and
// the oracle profile a router that reads the simulators' true state, the
// yardstick's limit, which every other run is compared with. See
// cmd/pdx-replay and `make replay`.
//
// Workloads: a Mooncake trace file, or the tenants workload (Tenants,
// TenantsFor), generated in the same form: llm-d's 150 tenants, each
// request its tenant's shared context and a question of its own, the
// contexts together twice the prefill engines' KV, tenants uniform,
// arrivals Poisson; it runs at fewer loads (TraceFile.Loads), as each
// costs about a Mooncake trace's.
//
// Scaling: token counts are divided by a token scale (a 512-token block of
// the trace becomes 512/scale simulated tokens of 4 bytes), and the
// engines' capacity is enginesim.ReferenceCapacity(tokenScale, timeScale),
// fixed before any policy was tuned: a scaled request takes timeScale
// times as long as the real one would on the reference engine. Prompts are
// synthesized from hash_ids, one deterministic text block per id.
//
// Load: a point's load is round robin's prefill busy share. Each trace is
// calibrated once (round robin at a guess, from an idle probe), each
// point's rate is the guess scaled to its target and corrected while round
// robin misses it; every policy at a point replays the same schedule, the
// trace window's arrival times compressed to the point's rate.
//
// SLOs: multiples of the TTFT and TPOT that the trace's median request
// (uncached) gets from an idle rig, so they scale with both scales.
//
// Rigs: the reference rig above, and the cache-bound rig (CacheBound,
// cachebound.go), where the prefix cache decides: engines whose KV holds a
// fifth of what the conversation trace touches, prefill engines computing
// two prompts at once, fixed arrival speedups instead of calibrated loads,
// goodput at a fixed TTFT bound; its report is its own
// (cacheBoundSummary).
//
// Oracle: an in-process P/D router (oracle.go) that picks, per request,
// the prefill engine with the least forecast TTFT and the decode engine
// with the least pull plus two decode steps, from enginesim's forecasts of
// the engines' true state. Greedy, with no Envoy and pdx in front (the
// direct-round-robin profile measures what that saves); pdx never ships
// it. Each run's VsOracle is its distance from the oracle's at the
// same point.
package replay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"time"
)

// TraceFile is a named trace: a Mooncake file, or a generated workload.
type TraceFile struct {
	Name, Path string
	// Tenants, when set, generates the trace (the tenants workload)
	// instead of reading Path.
	Tenants *Tenants
	// Loads, when set, replace the plan's loads for this trace (a costly
	// trace may run at fewer).
	Loads []float64
	// Requests, when set, replaces the plan's window for this trace.
	Requests int
}

// read is the trace's first n requests.
func (tf TraceFile) read(n int) ([]TraceRequest, error) {
	if tf.Tenants != nil {
		return tf.Tenants.Trace(n)
	}
	return ReadTrace(tf.Path, n)
}

// loads are the trace's load points.
func (tf TraceFile) loads(plan []float64) []float64 {
	if len(tf.Loads) > 0 {
		return tf.Loads
	}
	return plan
}

// Plan is a whole replay grid.
type Plan struct {
	Rig    Rig
	Traces []TraceFile
	// Profiles are the policies compared; round robin, the load
	// reference, runs first at every point whether listed or not.
	Profiles []Profile
	// Loads are the target round-robin prefill busy shares, e.g. 0.5
	// (a trace's own TraceFile.Loads replace them).
	Loads []float64
	// Speedups, when set, fix each load point's arrivals instead: the
	// trace's own rate times Speedups[i] at Loads[i], which then only
	// names the busy share the point was chosen for. No calibration, and
	// round robin runs only when among Profiles (its busy share is the
	// point's measured load).
	Speedups []float64
	// Requests is the trace window: its first Requests requests.
	Requests int
	// ReplicaCounts are the pdx replica counts of the affinity experiment
	// (conversation trace, middle load, round robin, pdx-default,
	// prefix-affinity and precise; never a peer or the oracle, which have
	// no pdx); empty skips it.
	// Every other run has one replica.
	ReplicaCounts []int
	// ReplicaPolicies, when set, are the profiles of the affinity
	// experiment (those among Profiles); by default every pdx profile that
	// places by prefix.
	ReplicaPolicies []string
	// TTFTFactor and TPOTFactor set the SLOs as multiples of an idle
	// engine's uncached TTFT and TPOT for the trace's median request;
	// SLO, when set, is the SLO instead.
	TTFTFactor, TPOTFactor float64
	SLO                    *SLO
	// Tolerance is how far a point's measured round-robin busy share may
	// miss its target before the rate is corrected once (0: never).
	Tolerance float64
	// Repeats replays each run that many times on fresh stacks and pools
	// the outcomes (default 1): near saturation one replay's tail latency
	// varies by tens of percent.
	Repeats int
	// ExtraPoolYAML is added to every pdx profile's pool config, round
	// robin's too (e.g. "saturation: {disabled: true}"): an experiment's
	// knob that leaves the profile table alone.
	ExtraPoolYAML string
	Progress      io.Writer
}

// Report is everything a grid measured, with its parameters.
type Report struct {
	// Rig names the rig (Rig.Name): "" for the reference rig.
	Rig        string            `json:"rig,omitempty"`
	TokenScale int               `json:"token_scale"`
	TimeScale  float64           `json:"time_scale"`
	BlockBytes int               `json:"block_bytes"`
	Prefill    int               `json:"prefill_engines"`
	Decode     int               `json:"decode_engines"`
	Capacity   any               `json:"engine_capacity"`
	Policies   map[string]string `json:"policies"`
	Loads      []float64         `json:"target_loads"`
	// Speedups are the load points' fixed arrival speedups (Plan.Speedups).
	Speedups []float64 `json:"speedups,omitempty"`
	// SLO factors: multiples of the idle uncached median request's TTFT
	// and TPOT (see Plan).
	TTFTFactor float64 `json:"ttft_slo_factor"`
	TPOTFactor float64 `json:"tpot_slo_factor"`
	Repeats    int     `json:"repeats"`
	// ExtraPoolYAML was added to every pdx policy's pool
	// (Plan.ExtraPoolYAML).
	ExtraPoolYAML string `json:"extra_pool_yaml,omitempty"`
	// DecodeKVBlocks is the decode engines' KV in blocks where it is not
	// Capacity's (Rig.DecodeCapacity); 0 otherwise.
	DecodeKVBlocks int `json:"decode_kv_blocks,omitempty"`
	// PromptTokensDetails: the engines reported what they found cached
	// (Rig.PromptTokensDetails).
	PromptTokensDetails bool `json:"prompt_tokens_details,omitempty"`
	// VLLMRouter is the version of the vllm-router that served the peer
	// profiles' runs; empty when none ran.
	VLLMRouter string        `json:"vllm_router,omitempty"`
	Traces     []TraceReport `json:"traces"`
	Runs       []RunResult   `json:"runs"`
	// ReplicaRuns are the affinity experiment's runs (the one-replica
	// ones are also in Runs).
	ReplicaRuns []RunResult `json:"replica_runs,omitempty"`
	WallSec     float64     `json:"wall_s"`
	Machine     string      `json:"machine,omitempty"`
}

// TraceReport is a trace's window, its reference request, SLOs and
// calibration.
type TraceReport struct {
	Name string `json:"name"`
	Path string `json:"path,omitempty"`
	// Workload is a generated trace's parameters (the tenants workload).
	Workload *Tenants `json:"workload,omitempty"`
	Requests int      `json:"requests"`
	// NativeRate is the window's own arrival rate.
	NativeRate float64 `json:"native_rate_rps"`
	// Median and mean scaled request, in simulated tokens.
	MedianInput, MeanInput, MedianOutput int
	// DistinctBlocks are the trace blocks the window touches;
	// UnlimitedHit the share of its prompt tokens one unlimited prefix
	// cache would hold (UnlimitedCacheHit).
	DistinctBlocks int     `json:"distinct_blocks"`
	UnlimitedHit   float64 `json:"unlimited_cache_hit"`
	Probe          Probe   `json:"probe"`
	SLO            SLO     `json:"slo"`
	// Calibration: round robin at GuessRate measured GuessBusy.
	GuessRate float64 `json:"guess_rate_rps"`
	GuessBusy float64 `json:"guess_busy_share"`
	// Loads are the trace's target loads (the plan's, unless the trace
	// has its own); Rates their arrival rates, in that order.
	Loads []float64 `json:"target_loads"`
	Rates []float64 `json:"rates_rps"`
}

// maxCorrections bounds the extra round-robin runs that steer a load
// point to its target busy share.
const maxCorrections = 2

// Run measures the grid. A config error of any profile fails it before
// anything starts; a failing run ends it with what was measured so far.
func Run(ctx context.Context, p Plan) (*Report, error) {
	began := time.Now()
	if len(p.Speedups) > 0 && len(p.Speedups) != len(p.Loads) {
		return nil, fmt.Errorf("%d speedups for %d loads", len(p.Speedups), len(p.Loads))
	}
	profiles := p.Profiles
	if len(p.Speedups) == 0 {
		profiles = withRoundRobin(p.Profiles, Profiles(p.Rig.Scale))
	} else if len(profiles) == 0 {
		return nil, errors.New("no policy")
	}
	profiles = slices.Clone(profiles)
	for i := range profiles {
		if profiles[i].pdx() {
			profiles[i].PoolYAML = lines(strings.TrimSpace(profiles[i].PoolYAML), p.ExtraPoolYAML)
		}
	}
	if err := p.Rig.CheckProfiles(profiles); err != nil {
		return nil, err
	}
	_, capacity := p.Rig.options(profiles[0], 1)
	rep := &Report{
		Rig: p.Rig.Name, Speedups: p.Speedups,
		TokenScale: p.Rig.Scale.TokenScale, TimeScale: p.Rig.TimeScale, BlockBytes: p.Rig.Scale.BlockBytes(),
		Prefill: p.Rig.Prefill, Decode: p.Rig.Decode, Capacity: capacity, Loads: p.Loads,
		Policies: map[string]string{}, TTFTFactor: p.TTFTFactor, TPOTFactor: p.TPOTFactor,
		Repeats: max(p.Repeats, 1), ExtraPoolYAML: p.ExtraPoolYAML, PromptTokensDetails: p.Rig.PromptTokensDetails,
	}
	if d := p.Rig.DecodeCapacity; d != nil {
		rep.DecodeKVBlocks = d.KVBlocks
	}
	for _, pr := range profiles {
		rep.Policies[pr.Name] = pr.Config()
	}
	defer func() { rep.WallSec = time.Since(began).Seconds() }()
	for _, tf := range p.Traces {
		if err := p.runTrace(ctx, tf, profiles, rep); err != nil {
			return rep, fmt.Errorf("trace %s: %w", tf.Name, err)
		}
	}
	return rep, nil
}

// Violations is an error listing the runs with broken requests (5xx, no
// answer, a stream cut short), cross-request mix-ups or KV hand-offs the
// engines refused, none of which a policy may cause; nil when there are
// none. Requests shed with 429 are a policy's outcome, not a violation.
func (rep *Report) Violations() error {
	var bad []string
	for _, r := range append(rep.Runs, rep.ReplicaRuns...) {
		if r.Broken > 0 || r.MixUps > 0 || r.Engines.Rejected > 0 {
			bad = append(bad, fmt.Sprintf("%s/%s x%d at %.0f%%: %d broken, %d mix-ups, %d KV rejections",
				r.Trace, r.Policy, r.Replicas, 100*r.TargetLoad, r.Broken, r.MixUps, r.Engines.Rejected))
		}
	}
	if len(bad) == 0 {
		return nil
	}
	return fmt.Errorf("%d runs went wrong:\n  %s", len(bad), strings.Join(bad, "\n  "))
}

// withRoundRobin puts round robin first among ps.
func withRoundRobin(ps, all []Profile) []Profile {
	out := []Profile{all[0]}
	for _, p := range ps {
		if p.Name != all[0].Name {
			out = append(out, p)
		}
	}
	return out
}

// runTrace probes, calibrates and runs every load point of one trace.
func (p Plan) runTrace(ctx context.Context, tf TraceFile, profiles []Profile, rep *Report) error {
	reqs, tr, err := p.prepare(ctx, tf)
	if err != nil {
		return err
	}
	tr.Loads = tf.loads(p.Loads)
	if len(p.Speedups) == 0 {
		if err := p.calibrate(ctx, &tr, profiles[0], reqs); err != nil {
			return err
		}
	}
	for k, load := range tr.Loads {
		var point []RunResult
		rest, rate := profiles, tr.NativeRate*p.speedup(k)
		if len(p.Speedups) == 0 {
			rr, err := p.steer(ctx, tf.Name, profiles[0], load, tr.GuessRate*load/tr.GuessBusy, reqs, tr.SLO)
			if err != nil {
				return err
			}
			point, rest, rate = append(point, rr), profiles[1:], rr.Rate
		}
		tr.Rates = append(tr.Rates, rate)
		for _, pr := range rest {
			res, err := p.runOne(ctx, tf.Name, pr, 1, rate, reqs, tr.SLO)
			if err != nil {
				return err
			}
			point = append(point, res)
		}
		var rrBusy float64 // the point's load; 0 when round robin did not run
		if i := slices.IndexFunc(point, func(r RunResult) bool { return r.Policy == "round-robin" }); i >= 0 {
			rrBusy = point[i].BusyShare
		}
		for i := range point {
			point[i].TargetLoad, point[i].RRBusyShare = load, rrBusy
			if v := point[i].VLLMRouter; v != "" {
				rep.VLLMRouter = v
			}
		}
		compareToOracle(point)
		rep.Runs = append(rep.Runs, point...)
	}
	rep.Traces = append(rep.Traces, tr)
	return p.replicaRuns(ctx, tf, profiles, reqs, tr, rep)
}

// speedup is load point i's fixed arrival speedup, 0 when it has none.
func (p Plan) speedup(i int) float64 {
	if i < len(p.Speedups) {
		return p.Speedups[i]
	}
	return 0
}

// prepare reads and scales a trace window and probes the idle rig for the
// SLOs.
func (p Plan) prepare(ctx context.Context, tf TraceFile) ([]Request, TraceReport, error) {
	n := p.Requests
	if tf.Requests > 0 {
		n = tf.Requests
	}
	raw, err := tf.read(n)
	if err != nil {
		return nil, TraceReport{}, err
	}
	reqs, err := p.Rig.Scale.Requests(raw)
	if err != nil {
		return nil, TraceReport{}, err
	}
	tr := describe(tf, reqs)
	tr.DistinctBlocks, tr.UnlimitedHit = DistinctBlocks(raw), UnlimitedCacheHit(raw)
	if tr.Probe, err = p.Rig.probe(ctx, tr); err != nil {
		return nil, tr, fmt.Errorf("probe: %w", err)
	}
	tr.SLO = SLO{
		TTFT: time.Duration(p.TTFTFactor * float64(tr.Probe.TTFT)),
		TPOT: time.Duration(p.TPOTFactor * float64(tr.Probe.TPOT)),
	}
	if p.SLO != nil {
		tr.SLO = *p.SLO
	}
	p.logf("%s: %d requests, native %.2f req/s; idle TTFT %.0f ms (median prompt %d tokens), TPOT %.1f ms; SLO %s",
		tf.Name, tr.Requests, tr.NativeRate, ms(tr.Probe.TTFT), tr.MedianInput, ms(tr.Probe.TPOT), tr.SLO)
	return reqs, tr, nil
}

// calibrate runs round robin at a first guess of the rate, which says how
// busy a rate keeps the prefill engines.
func (p Plan) calibrate(ctx context.Context, tr *TraceReport, rr Profile, reqs []Request) error {
	// The guess: the mean prompt's uncached prefill keeping the prefill
	// engines 60% busy (cache hits make the real requests cheaper).
	tr.GuessRate = 0.6 * float64(p.Rig.Prefill) / tr.Probe.MeanTTFT.Seconds()
	calib, err := p.runOne(ctx, tr.Name, rr, 1, tr.GuessRate, reqs, tr.SLO)
	if err != nil {
		return err
	}
	if tr.GuessBusy = calib.BusyShare; tr.GuessBusy <= 0 {
		return fmt.Errorf("calibration: round robin at %.2f req/s kept the prefill engines 0%% busy", tr.GuessRate)
	}
	return nil
}

// steer runs round robin at rate and, while its busy share misses load by
// more than the tolerance, again at the rate the last try suggests (busy
// share is not linear in the rate: queues, imbalance). The try closest to
// load is the point's.
func (p Plan) steer(ctx context.Context, trace string, rr Profile, load, rate float64, reqs []Request, slo SLO) (RunResult, error) {
	best, err := p.runOne(ctx, trace, rr, 1, rate, reqs, slo)
	if err != nil {
		return best, err
	}
	last := best
	for range maxCorrections {
		if p.Tolerance <= 0 || math.Abs(last.BusyShare-load) <= p.Tolerance || last.BusyShare <= 0 {
			break
		}
		if last, err = p.runOne(ctx, trace, rr, 1, last.Rate*load/last.BusyShare, reqs, slo); err != nil {
			return best, err
		}
		if math.Abs(last.BusyShare-load) < math.Abs(best.BusyShare-load) {
			best = last
		}
	}
	return best, nil
}

// replicaRuns measures prefix affinity as pdx replicas are added, for round
// robin, pdx's default (and its held and uncounted decodes), prefix_affinity
// and precise placement: the conversation trace (the
// first trace without it) at the middle load. A peer has no pdx replicas
// and is not in it.
func (p Plan) replicaRuns(ctx context.Context, tf TraceFile, profiles []Profile, reqs []Request, tr TraceReport, rep *Report) error {
	if len(p.ReplicaCounts) == 0 || len(tr.Loads) == 0 || tf.Name != p.replicaTrace() {
		return nil
	}
	mid := len(tr.Loads) / 2
	load, rate := tr.Loads[mid], tr.Rates[mid]
	names := p.ReplicaPolicies
	if len(names) == 0 {
		names = []string{"round-robin", "pdx-default", "pdx-held", "pdx-uncounted", "prefix-affinity", PreciseProfile, PreciseReuseProfile}
	}
	for _, pr := range profiles {
		if !slices.Contains(names, pr.Name) || !pr.pdx() {
			continue
		}
		for _, n := range p.ReplicaCounts {
			var res RunResult
			i := slices.IndexFunc(rep.Runs, func(r RunResult) bool {
				return r.Trace == tf.Name && r.Policy == pr.Name && r.TargetLoad == load && r.Replicas == n
			})
			if i >= 0 {
				res = rep.Runs[i]
			} else {
				var err error
				if res, err = p.runOne(ctx, tf.Name, pr, n, rate, reqs, tr.SLO); err != nil {
					return err
				}
				res.TargetLoad = load
				res.RRBusyShare = runAt(rep.Runs, tf.Name, "round-robin", load).RRBusyShare
				if o := runAt(rep.Runs, tf.Name, OracleProfile, load); o.Oracle {
					res.VsOracle = vsOracle(res, o)
				}
			}
			rep.ReplicaRuns = append(rep.ReplicaRuns, res)
		}
	}
	return nil
}

// replicaTrace is the trace of the affinity experiment.
func (p Plan) replicaTrace() string {
	for _, t := range p.Traces {
		if t.Name == "conversation" {
			return t.Name
		}
	}
	return p.Traces[0].Name
}

// runAt finds a one-replica run.
func runAt(runs []RunResult, trace, policy string, load float64) RunResult {
	for _, r := range runs {
		if r.Trace == trace && r.Policy == policy && r.TargetLoad == load && r.Replicas == 1 {
			return r
		}
	}
	return RunResult{}
}

// runOne replays reqs at rate under one profile and logs a line.
func (p Plan) runOne(ctx context.Context, trace string, pr Profile, replicas int, rate float64, reqs []Request, slo SLO) (RunResult, error) {
	r := run{trace: trace, profile: pr, replicas: replicas, rate: rate, reqs: reqs, at: Schedule(reqs, rate)}
	var samples []sample
	for range max(p.Repeats, 1) {
		s, err := p.Rig.replay(ctx, r)
		if err != nil {
			return RunResult{}, err
		}
		samples = append(samples, s)
	}
	_, c := p.Rig.engineConfig()
	res := summarizeRun(r, samples, slo, c)
	p.logf("  %-23s x%d %6.2f req/s: busy %3.0f%%  TTFT p50/p90 %6.0f/%6.0f ms  TPOT p50 %5.1f ms  goodput %3.0f%%  hit %3.0f%%  429 %d  broken %d  mix-ups %d  rejected %d  %.1fs  cpu router %.2f (%.2f ms/req) harness %.2f",
		pr.Name, replicas, rate, 100*res.BusyShare, res.TTFT.P50, res.TTFT.P90, res.TPOT.P50, 100*res.Goodput,
		100*res.PrefixHitRate, res.Shed, res.Broken, res.MixUps, res.Engines.Rejected, res.DurationSec, res.CPU.Router, res.CPU.RouterMsPerRequest, res.CPU.Harness)
	return res, nil
}

func (p Plan) logf(format string, args ...any) {
	if p.Progress != nil {
		fmt.Fprintf(p.Progress, format+"\n", args...)
	}
}

// describe is a window's shape: size, native rate, median and mean
// request.
func describe(tf TraceFile, reqs []Request) TraceReport {
	tr := TraceReport{Name: tf.Name, Path: tf.Path, Workload: tf.Tenants, Requests: len(reqs)}
	if span := reqs[len(reqs)-1].At; span > 0 {
		tr.NativeRate = float64(len(reqs)-1) / span.Seconds()
	}
	in, out := make([]int, len(reqs)), make([]int, len(reqs))
	sum := 0
	for i, r := range reqs {
		in[i], out[i] = len(r.Prompt)/bytesPerToken, r.MaxTokens
		sum += in[i]
	}
	slices.Sort(in)
	slices.Sort(out)
	tr.MedianInput, tr.MedianOutput, tr.MeanInput = in[len(in)/2], out[len(out)/2], sum/len(in)
	return tr
}
