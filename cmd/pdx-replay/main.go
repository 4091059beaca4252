// Command pdx-replay replays the Mooncake FAST'25 traces, and a generated
// cache-bound multi-tenant workload, through a real Envoy and pdx against
// simulated engines, once per placement policy at each load point (vLLM's
// own router over the same engines among them, and an oracle that reads
// the simulators' state as the yardstick's limit), and writes
// results.json, summary.md and charts. With --rig cachebound it replays
// the cache-bound rig instead (replay.CacheBound), where the prefix cache
// decides. See `make replay`.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/pdx-router/pdx/internal/testbed/envoyproc"
	"github.com/pdx-router/pdx/internal/testbed/replay"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "pdx-replay:", err)
		os.Exit(1)
	}
}

// traceDir is where the traces live, relative to the repository.
const traceDir = "../shared/traces"

func run(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("pdx-replay", flag.ContinueOnError)
	var (
		plan   replay.Plan
		out    = fs.String("out", "bench/replay", "directory for results.json, summary.md and the charts")
		traces = fs.String("traces", "conversation="+traceDir+"/mooncake-conversation.jsonl,synthetic="+traceDir+"/mooncake-synthetic.jsonl,"+replay.TenantsTrace,
			"name=path of each Mooncake trace, or "+replay.TenantsTrace+" for the generated multi-tenant workload (sized for the rig)")
		policies = fs.String("policies", "round-robin,least-request,llm-d-default,pdx-default,"+replay.PreciseProfile+","+replay.PreciseReuseProfile+",vllm-router-cache-aware,vllm-router-kv-aware,"+replay.OracleProfile+","+replay.OracleReuseProfile,
			"placement policies (round-robin always runs: it defines the load); "+replay.PreciseProfile+" is pdx's defaults placing by the engines' KV events, "+replay.PreciseReuseProfile+" that with decode-side reuse; vllm-router-cache-aware, vllm-router-kv-aware (placing by the engines' KV events) and vllm-router-round-robin are vLLM's own router over the same engines; "+
				replay.OracleProfile+" reads the simulators' true state, the yardstick's limit, and "+replay.OracleReuseProfile+" may also serve a request on a decode engine alone (the TTFT limit, TPOT not weighed); "+
				replay.DirectRoundRobinProfile+" is round robin on the oracle's path, without Envoy and pdx (against round-robin: what the path costs)")
		loads          = fs.String("loads", "0.5,0.75,0.9", "target round-robin prefill busy shares")
		tenantLoads    = fs.String("tenant-loads", "", "target loads of the "+replay.TenantsTrace+" trace (default: the middle of --loads; it costs as much per load as a Mooncake trace)")
		tenantKVRatio  = fs.Float64("tenant-kv-ratio", replay.TenantKVRatio, "the "+replay.TenantsTrace+" trace's contexts together over the prefill engines' KV (llm-d's regime below 1: they fit the engines together, not one engine; 2 was the earlier default)")
		tenantRequests = fs.Int("tenant-requests", 2000, "window of the "+replay.TenantsTrace+" trace: its 150 tenants are each visited about N/150 times, so that first visits (misses no policy avoids) are a few percent of requests, as in llm-d's long runs")
		replicas       = fs.String("replicas", "1,3", "pdx replica counts of the prefix-affinity experiment (empty skips it)")
		quick          = fs.Bool("quick", false, "a short smoke run: 150 requests, the middle load only, no replica experiment")
		flow           = fs.Bool("flow", false, "run the flow-control experiment instead (tenants sharing a saturated pool: priorities, fairness), into <out>/flow")
		flowWindow     = fs.Duration("flow-window", 20*time.Second, "how long each priority run of --flow sends (its fairness runs: half)")
		flowInFlight   = fs.Int("flow-max-in-flight", 1, "--flow's saturation.prefill_max_in_flight: how many prefills an engine runs at once, the rest waiting in pdx")
		rig            = fs.String("rig", "", "replay a named rig instead of the reference grid: "+replay.CacheBoundRig+
			" (3+3 engines whose KV holds a fifth of what the conversation trace touches, 2 prefill slots, the trace's own bursts, goodput at TTFT ≤ 0.5 s; its own policies, loads and window, which --policies, --loads (among its points), --requests, --repeats, --replicas and --quick change; default --out bench/replay/"+replay.CacheBoundRig+")")
	)
	decodeKV := fs.Int("decode-kv-blocks", 0, "with --rig "+replay.CacheBoundRig+": each decode engine's KV in blocks (default: the prefill engines'), so that decodes wait for KV and the decode leg's placement shows")
	fs.IntVar(&plan.Requests, "requests", 500, "trace window: the first N requests of each trace")
	fs.IntVar(&plan.Rig.Prefill, "prefill", 4, "prefill engines")
	fs.IntVar(&plan.Rig.Decode, "decode", 4, "decode engines")
	fs.IntVar(&plan.Rig.Scale.TokenScale, "token-scale", 16, "real tokens per simulated token")
	fs.Float64Var(&plan.Rig.TimeScale, "time-scale", 0.0625, "simulated time per real time: ReferenceCapacity multiplies the reference engine's times by it (below 1: faster)")
	fs.Float64Var(&plan.TTFTFactor, "ttft-slo", 5, "TTFT SLO, as a multiple of the idle uncached TTFT of the median prompt")
	fs.Float64Var(&plan.TPOTFactor, "tpot-slo", 2, "TPOT SLO, as a multiple of the idle TPOT")
	fs.Float64Var(&plan.Tolerance, "tolerance", 0.05, "correct a point's rate once when round robin misses its target busy share by more")
	fs.StringVar(&plan.ExtraPoolYAML, "pool-yaml", "", `YAML lines added to every policy's pool, e.g. "saturation: {disabled: true}"`)
	fs.IntVar(&plan.Repeats, "repeats", 1, "fresh replays pooled per run (the grid's time grows with it)")
	fs.BoolVar(&plan.Rig.PromptTokensDetails, "prompt-tokens-details", false, "the engines report the prompt tokens they found cached in each answer (vLLM's --enable-prompt-tokens-details): pdx learns from them, and each pdx run records its self-check, what it predicted cached against what the engines reported")
	fs.StringVar(&plan.Rig.EnvoyBin, "envoy-bin", "", "Envoy binary (default: $ENVOY_BIN or the one `make envoy` installs)")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of the harness process (pdx, the simulators, the client) to this file")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if *rig != "" {
		cb, err := rigOf(*rig, set, *policies, *loads, *replicas, *quick, *decodeKV, plan)
		if err != nil {
			return err
		}
		p, err := cb.Plan()
		if err != nil {
			return err
		}
		p.ExtraPoolYAML, p.Rig.EnvoyBin, p.Rig.PromptTokensDetails = plan.ExtraPoolYAML, plan.Rig.EnvoyBin, plan.Rig.PromptTokensDetails
		if !set["out"] {
			*out = filepath.Join("bench", "replay", *rig)
		}
		return replayPlan(ctx, p, *out)
	}
	if set["decode-kv-blocks"] {
		return fmt.Errorf("--decode-kv-blocks: only with --rig %s", replay.CacheBoundRig)
	}
	if *flow {
		return runFlow(ctx, replay.FlowPlan{Rig: plan.Rig, Window: *flowWindow, MaxInFlight: *flowInFlight, Progress: os.Stdout}, filepath.Join(*out, "flow"))
	}
	var err error
	if plan.Loads, err = floats("loads", *loads); err != nil {
		return err
	}
	if *quick {
		plan.Loads = plan.Loads[len(plan.Loads)/2:][:1]
	}
	perTenant := plan.Loads[len(plan.Loads)/2:][:1]
	if *tenantLoads != "" {
		if perTenant, err = floats("tenant-loads", *tenantLoads); err != nil {
			return err
		}
	}
	if *quick {
		*tenantRequests = 150
	}
	if plan.Traces, err = traceFiles(*traces, replay.TenantsFor(plan.Rig, *tenantKVRatio), perTenant, *tenantRequests); err != nil {
		return err
	}
	if plan.ReplicaCounts, err = ints("replicas", *replicas); err != nil {
		return err
	}
	if plan.Profiles, err = replay.SelectProfiles(replay.Profiles(plan.Rig.Scale), split(*policies)); err != nil {
		return fmt.Errorf("--policies: %w", err)
	}
	if *quick {
		plan.Requests = 150
		plan.ReplicaCounts = nil
	}
	return replayPlan(ctx, plan, *out)
}

// replayPlan runs a plan and writes its report to out.
func replayPlan(ctx context.Context, plan replay.Plan, out string) error {
	if plan.Rig.EnvoyBin == "" {
		var err error
		if plan.Rig.EnvoyBin, err = envoyproc.Binary(); err != nil {
			return err
		}
	}
	plan.Progress = os.Stdout

	rep, err := replay.Run(ctx, plan)
	if rep != nil {
		rep.Machine = fmt.Sprintf("%s/%s, %d CPUs, %s", runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), runtime.Version())
		if werr := rep.Write(out); werr != nil {
			return errors.Join(err, werr)
		}
		fmt.Printf("wrote %s in %s\n", filepath.Join(out, "{results.json,summary.md,*.png}"), time.Duration(rep.WallSec*float64(time.Second)).Round(time.Second))
		if err == nil {
			err = rep.Violations()
		}
	}
	return err
}

// rigQuickRequests is a --quick run's window on a named rig: enough
// conversation turns for the cache to decide (a window of 200 reuses
// little: one unlimited cache would hit 6% of its tokens, 16% of 500's),
// the engines' KV sized to it.
const rigQuickRequests = 500

// rigOf is the named rig, changed by the flags set that apply to it (a
// flag that does not fails, naming the rig). base holds the parsed flags
// of Plan's own.
func rigOf(name string, set map[string]bool, policies, loads, replicas string, quick bool, decodeKV int, base replay.Plan) (replay.CacheBound, error) {
	if name != replay.CacheBoundRig {
		return replay.CacheBound{}, fmt.Errorf("--rig: unknown rig %q (known: %s)", name, replay.CacheBoundRig)
	}
	for _, f := range []string{"traces", "tenant-loads", "tenant-kv-ratio", "tenant-requests", "prefill", "decode", "token-scale",
		"time-scale", "ttft-slo", "tpot-slo", "tolerance", "flow", "flow-window", "flow-max-in-flight"} {
		if set[f] {
			return replay.CacheBound{}, fmt.Errorf("--%s: the %s rig sets it itself (replay.DefaultCacheBound)", f, name)
		}
	}
	cb := replay.DefaultCacheBound(traceDir)
	all := cb.Points
	if quick {
		cb.Points = cb.Points[len(cb.Points)/2:][:1]
		cb.Requests, cb.ReplicaCounts, cb.Repeats = rigQuickRequests, nil, 1
	}
	if set["policies"] {
		cb.Policies = split(policies)
	}
	if set["loads"] {
		want, err := floats("loads", loads)
		if err != nil {
			return cb, err
		}
		if cb.Points, err = rigPoints(all, want); err != nil {
			return cb, err
		}
	}
	if set["requests"] {
		cb.Requests = base.Requests
	}
	if set["repeats"] {
		cb.Repeats = base.Repeats
	}
	if set["decode-kv-blocks"] {
		if decodeKV <= 0 {
			return cb, fmt.Errorf("--decode-kv-blocks: %d is not a number of blocks", decodeKV)
		}
		cb.DecodeKVBlocks = decodeKV
	}
	if set["replicas"] {
		var err error
		if cb.ReplicaCounts, err = ints("replicas", replicas); err != nil {
			return cb, err
		}
		// The replica runs are of the rig's replica policies that
		// --policies runs: with none of them, they would not run at all.
		if len(cb.ReplicaCounts) > 0 && !slices.ContainsFunc(cb.ReplicaPolicies, func(p string) bool { return slices.Contains(cb.Policies, p) }) {
			return cb, fmt.Errorf("--replicas: the %s rig runs replicas of %s, and --policies has none of them", name, strings.Join(cb.ReplicaPolicies, ", "))
		}
	}
	return cb, nil
}

// rigPoints are the rig's points whose loads are want, in want's order.
func rigPoints(points []replay.CacheBoundPoint, want []float64) ([]replay.CacheBoundPoint, error) {
	var out []replay.CacheBoundPoint
	var known []string
	for _, pt := range points {
		known = append(known, strconv.FormatFloat(pt.Load, 'g', -1, 64))
	}
	for _, w := range want {
		i := slices.IndexFunc(points, func(pt replay.CacheBoundPoint) bool { return pt.Load == w })
		if i < 0 {
			return nil, fmt.Errorf("--loads: the rig has no point at %g (its points: %s)", w, strings.Join(known, ", "))
		}
		out = append(out, points[i])
	}
	return out, nil
}

// runFlow runs the flow-control experiment and writes its report to dir.
func runFlow(ctx context.Context, p replay.FlowPlan, dir string) error {
	if p.Rig.EnvoyBin == "" {
		bin, err := envoyproc.Binary()
		if err != nil {
			return err
		}
		p.Rig.EnvoyBin = bin
	}
	rep, err := replay.RunFlow(ctx, p)
	if rep != nil {
		rep.Machine = fmt.Sprintf("%s/%s, %d CPUs, %s", runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), runtime.Version())
		if werr := rep.Write(dir); werr != nil {
			return errors.Join(err, werr)
		}
		fmt.Printf("wrote %s in %s\n", filepath.Join(dir, "{results.json,summary.md}"), time.Duration(rep.WallSec*float64(time.Second)).Round(time.Second))
	}
	return err
}

// traceFiles parses name=path pairs and the tenants workload's name,
// which runs at its own loads and window.
func traceFiles(list string, tenants replay.Tenants, tenantLoads []float64, tenantRequests int) ([]replay.TraceFile, error) {
	var out []replay.TraceFile
	for _, s := range split(list) {
		if s == replay.TenantsTrace {
			out = append(out, replay.TraceFile{Name: s, Tenants: &tenants, Loads: tenantLoads, Requests: tenantRequests})
			continue
		}
		name, path, ok := strings.Cut(s, "=")
		if !ok || name == "" || path == "" {
			return nil, fmt.Errorf("--traces: %q is not name=path or %s", s, replay.TenantsTrace)
		}
		out = append(out, replay.TraceFile{Name: name, Path: path})
	}
	if len(out) == 0 {
		return nil, errors.New("--traces: no trace")
	}
	return out, nil
}

func split(list string) []string {
	var out []string
	for s := range strings.SplitSeq(list, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}

func floats(flagName, list string) ([]float64, error) {
	var out []float64
	for _, s := range split(list) {
		f, err := strconv.ParseFloat(s, 64)
		if err != nil || f <= 0 || f >= 1 {
			return nil, fmt.Errorf("--%s: %q is not a share in (0, 1)", flagName, s)
		}
		out = append(out, f)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("--%s: no value", flagName)
	}
	return out, nil
}

func ints(flagName, list string) ([]int, error) {
	var out []int
	for _, s := range split(list) {
		n, err := strconv.Atoi(s)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("--%s: %q is not a positive number", flagName, s)
		}
		out = append(out, n)
	}
	return out, nil
}
