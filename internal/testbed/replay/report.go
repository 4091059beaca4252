package replay

import (
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

// Write saves results.json, summary.md and the charts in dir.
func (rep *Report) Write(dir string) error {
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
	if err := os.WriteFile(filepath.Join(dir, "summary.md"), []byte(rep.Summary()), 0o644); err != nil {
		return err
	}
	return rep.Charts(dir)
}

// Summary is the Markdown report: parameters, then one table per trace.
func (rep *Report) Summary() string {
	if rep.Rig == CacheBoundRig {
		return rep.cacheBoundSummary()
	}
	var b strings.Builder
	fmt.Fprintf(&b, "# Trace replay\n\n")
	fmt.Fprintf(&b, "Real Envoy + pdx, %d prefill + %d decode simulated NIXL engines, fresh per run. "+
		"Token scale %d (a 512-token block is %d bytes), time scale %g, %d replay(s) pooled per run. Wall time %.0f s",
		rep.Prefill, rep.Decode, rep.TokenScale, rep.BlockBytes, rep.TimeScale, rep.Repeats, rep.WallSec)
	if rep.Machine != "" {
		fmt.Fprintf(&b, " on %s", rep.Machine)
	}
	b.WriteString(".\n\n")
	if rep.VLLMRouter != "" {
		fmt.Fprintf(&b, "**Peer: vllm-router %s.** The `vllm-router-*` rows put vLLM's own router (NIXL P/D mode, the `--policy` "+
			"under Policies) in front of the engines instead of Envoy + pdx: the same engines (same capacity and counts, fresh per run), "+
			"the same requests at the same schedule. Their prefix hits, request spread and KV rejections are the engines' counters, "+
			"as for pdx's rows. They are not in the replica experiment, whose replicas are pdx's.\n\n", rep.VLLMRouter)
	}
	if rep.hasOracle() {
		b.WriteString("**Oracle.** The `oracle` rows are the yardstick's limit, not a router one can deploy: a P/D router in the harness " +
			"process that reads the simulators' true state (what each engine caches, what it has queued) and sends each request's " +
			"NIXL legs itself, to the prefill engine with the least forecast TTFT and the decode engine with the least KV pull plus " +
			"two decode steps. `oracle-reuse` may also send a request to a decode engine alone (a plain request: the engine " +
			"prefills the prompt's uncached part itself, beside its decode batch) when that is forecast to give the first token " +
			"sooner. Both are greedy (least TTFT for each request, not the best placement for the whole trace; neither weighs the " +
			"TPOT a prompt computed beside a decode batch costs the batch) and have no " +
			"Envoy and pdx in front (`direct-round-robin`, round robin on their path, against pdx's `round-robin` is what that " +
			"path saves); their CPU is the harness's (router cores 0). Each trace's " +
			"second table is every policy's distance from `oracle` at the same point.\n\n")
	}
	fmt.Fprintf(&b, "Engine capacity: `%s`\n\n", compactJSON(rep.Capacity))
	if rep.ExtraPoolYAML != "" {
		fmt.Fprintf(&b, "Added to every pdx policy's pool: `%s`\n\n", strings.TrimSpace(strings.ReplaceAll(rep.ExtraPoolYAML, "\n", "; ")))
	}
	fmt.Fprintf(&b, "Engine times are the reference engine's (enginesim.ReferenceCapacity: Llama-3-8B on one H100) "+
		"multiplied by the time scale, with token counts divided by the token scale: a simulated millisecond of TTFT "+
		"is %g real ms, and a simulated TPOT (per simulated token) is %g real ms per real token.\n\n",
		1/rep.TimeScale, 1/(rep.TimeScale*float64(rep.TokenScale)))
	fmt.Fprintf(&b, "Load = the prefill engines' busy share under round robin: their busy time over "+
		"(engines × the run's prefill window, from the first send to the last first token). "+
		"Goodput = share of requests with TTFT and TPOT both within the SLO: TTFT ≤ %g × and TPOT ≤ %g × "+
		"those of the trace's median request (median prompt, median output) sent alone to an idle rig, uncached. "+
		"Cores: the router's, and this process's (the simulators and the load client, and pdx in pdx's rows, run in it). "+
		"The router is the process in front of the engines: Envoy in pdx's rows (pdx itself runs in this process), vllm-router's "+
		"process in the peer's. Router CPU per request is its core-seconds over the requests: all of vllm-router's routing, but only "+
		"Envoy's share of pdx's, whose own CPU is not separable here (`make bench` measures it).\n\n",
		rep.TTFTFactor, rep.TPOTFactor)
	for _, tr := range rep.Traces {
		rep.traceSummary(&b, tr)
	}
	if len(rep.ReplicaRuns) > 0 {
		fmt.Fprintf(&b, "## Prefix affinity vs pdx replicas (%s, load %.0f%%)\n\n", rep.ReplicaRuns[0].Trace, 100*rep.ReplicaRuns[0].TargetLoad)
		if rep.VLLMRouter != "" {
			b.WriteString("pdx's profiles only: vllm-router has no pdx replicas.\n\n")
		}
		fmt.Fprintf(&b, "| policy | replicas | prefix hit (prefill) | prefix hit (all) | TTFT p90 ms | goodput |\n|---|---:|---:|---:|---:|---:|\n")
		for _, r := range rep.ReplicaRuns {
			fmt.Fprintf(&b, "| %s | %d | %.1f%% | %.1f%% | %.0f | %.1f%% |\n", r.Policy, r.Replicas,
				100*r.PrefixHitRate, 100*r.PrefixHitRateAll, r.TTFT.P90, 100*r.Goodput)
		}
		b.WriteString("\n")
	}
	fmt.Fprintf(&b, "## Policies\n\n")
	for _, name := range slices.Sorted(maps.Keys(rep.Policies)) {
		yaml := strings.TrimSpace(strings.ReplaceAll(rep.Policies[name], "\n", "; ")) // a peer's is its policy
		if yaml == "" {
			fmt.Fprintf(&b, "- **%s**: pdx's defaults (no picker lines)\n", name)
			continue
		}
		fmt.Fprintf(&b, "- **%s**: `%s`\n", name, yaml)
	}
	return b.String()
}

func (rep *Report) traceSummary(b *strings.Builder, tr TraceReport) {
	if w := tr.Workload; w != nil {
		fmt.Fprintf(b, "## %s (%s)\n\n", tr.Name, w)
		fmt.Fprintf(b, "The contexts together are %d tokens, %.1f× the prefill engines' KV (%d engines × %d real tokens). ",
			w.Tenants*w.ContextTokens(), w.KVRatio, rep.Prefill, rep.kvTokens())
	} else {
		fmt.Fprintf(b, "## %s (`%s`)\n\n", tr.Name, tr.Path)
	}
	fmt.Fprintf(b, "First %d requests (native %.2f req/s); median prompt %d tokens, mean %d, median output %d. "+
		"Idle uncached median request: TTFT %.0f ms, TPOT %.1f ms. **SLO: TTFT ≤ %.0f ms, TPOT ≤ %.1f ms** "+
		"(real: %.1f s, %.0f ms per token). "+
		"Calibration: round robin at %.2f req/s was %.0f%% busy.\n\n",
		tr.Requests, tr.NativeRate, tr.MedianInput, tr.MeanInput, tr.MedianOutput,
		ms(tr.Probe.TTFT), ms(tr.Probe.TPOT), ms(tr.SLO.TTFT), ms(tr.SLO.TPOT),
		tr.SLO.TTFT.Seconds()/rep.TimeScale, ms(tr.SLO.TPOT)/(rep.TimeScale*float64(rep.TokenScale)), tr.GuessRate, 100*tr.GuessBusy)
	fmt.Fprintf(b, "| load: target → RR busy | rate req/s | policy | TTFT p50/p90/p99 ms | E2E p50/p90/p99 ms | TPOT p50/p90/p99 ms | goodput | prefix hit (prefill / all) | req/prefill (CV) | req/decode (CV) | errors: 429 / broken | mix-ups | KV rejected | router / harness cores | router CPU ms/req |\n")
	fmt.Fprintf(b, "|---|---:|---|---|---|---|---:|---|---|---|---|---:|---:|---|---:|\n")
	for _, r := range rep.Runs {
		if r.Trace != tr.Name {
			continue
		}
		fmt.Fprintf(b, "| %.0f%% → %.0f%% | %.2f | %s | %s | %s | %s | %.1f%% | %.1f%% / %.1f%% | %s (%.2f) | %s (%.2f) | %d / %d | %d | %d | %.2f / %.2f | %.2f |\n",
			100*r.TargetLoad, 100*r.RRBusyShare, r.Rate, r.Policy, pct(r.TTFT, 0), pct(r.E2E, 0), pct(r.TPOT, 1), 100*r.Goodput,
			100*r.PrefixHitRate, 100*r.PrefixHitRateAll, intList(r.Engines.PrefillRequests), r.PrefillCV,
			intList(r.Engines.DecodeRequests), r.DecodeCV, r.Shed, r.Broken, r.MixUps, r.Engines.Rejected, r.CPU.Router, r.CPU.Harness, r.CPU.RouterMsPerRequest)
	}
	b.WriteString("\n")
	selfCheckSummary(b, rep.Runs, tr.Name)
	rep.decodeAloneSummary(b, tr)
	rep.oracleSummary(b, tr)
	for _, r := range rep.Runs {
		if r.Trace == tr.Name && len(r.ErrorSamples) > 0 {
			fmt.Fprintf(b, "- %s at %.0f%%: %s\n", r.Policy, 100*r.TargetLoad, strings.Join(r.ErrorSamples, "; "))
		}
	}
}

// oracleSummary is the table of every policy's distance from the
// oracle's run at the same point, when the oracle ran on the trace.
func (rep *Report) oracleSummary(b *strings.Builder, tr TraceReport) {
	var rows []RunResult
	for _, r := range rep.Runs {
		if r.Trace == tr.Name && r.VsOracle != nil {
			rows = append(rows, r)
		}
	}
	if len(rows) == 0 {
		return
	}
	fmt.Fprintf(b, "Distance from the oracle at the same point: TTFT as a multiple of the oracle's (1 = as fast), goodput and prefix hit "+
		"(prefill engines) in points above the oracle's (0 = as good, negative = worse). %s\n\n", regretLegend)
	fmt.Fprintf(b, "| load: target → RR busy | policy | TTFT p50 × oracle | TTFT p90 × oracle | goodput − oracle | prefix hit − oracle | prefills misplaced |\n")
	fmt.Fprintf(b, "|---|---|---:|---:|---:|---:|---|\n")
	for _, r := range rows {
		g := r.VsOracle
		fmt.Fprintf(b, "| %.0f%% → %.0f%% | %s | %.2f | %.2f | %+.1f | %+.1f | %s |\n",
			100*r.TargetLoad, 100*r.RRBusyShare, r.Policy, g.TTFTP50, g.TTFTP90, g.GoodputPoints, g.PrefixHitPoints, regretCell(r.Placement))
	}
	b.WriteString("\n")
	rep.oracleRegret(b, tr.Name)
}

// selfCheckSummary says how placement's predictions of cached prompt
// tokens fared against the engines' reports on trace, for the runs that
// recorded them (Rig.PromptTokensDetails).
func selfCheckSummary(b *strings.Builder, runs []RunResult, trace string) {
	var cells []string
	for _, r := range runs {
		if c := r.SelfCheck; r.Trace == trace && c != nil {
			cells = append(cells, fmt.Sprintf("%s x%d at %s: %d / %d (%.2f)", r.Policy, r.Replicas, loadLabel(r),
				c.PredictedCachedTokens, c.ReportedCachedTokens, c.Ratio))
		}
	}
	if len(cells) > 0 {
		fmt.Fprintf(b, "Placement's self-check (the engines report what they found cached: `--prompt-tokens-details`): prompt tokens pdx "+
			"predicted its prefills would find cached / the engines reported cached (`%s`, every replica's), and their ratio: %s.\n\n",
			cachedTokensMetric, strings.Join(cells, "; "))
	}
}

// regretLegend says what the distance tables' last column is.
const regretLegend = "Prefills misplaced: the share of prefill legs whose engine, as the leg arrived, was forecast by the simulators' " +
	"true state to answer it later than another by more than the oracle's tie (a trace block's prefill), with what those " +
	"waited and computed more than on the best engine, and the mean excess over all prefills (a placement is judged at " +
	"its arrival: of prefills placed at once, the first to arrive finds the idle engine); and the prompt tokens they would " +
	"find cached where they came against those held on the engine holding the most of each (\"hit … of … held\"), and the " +
	"share of prefills that came where less was held (\"left a cache\"; \"misplaced too\": and were misplaced)."

// regretCell is a distance table's prefills misplaced.
func regretCell(r *Regret) string {
	if r == nil {
		return "–"
	}
	return fmt.Sprintf("%.0f%% (wait %+.0f, compute %+.0f ms); mean %+.1f ms; hit %.2f%% of %.2f%% held, %.1f%% left a cache (%.1f%% misplaced too)",
		100*r.Misplaced, r.WaitMs, r.ComputeMs, r.MeanExcessMs, 100*r.HitTaken, 100*r.HitBest, 100*r.LeftCache, 100*r.LeftMisplaced)
}

// oracleRegret says how the oracle's own prefills were judged on trace:
// it places by the same forecasts, so what it misplaces is what the
// judging itself counts (placements overtaken on their way).
func (rep *Report) oracleRegret(b *strings.Builder, trace string) {
	var cells []string
	for _, r := range rep.Runs {
		if r.Trace == trace && r.Oracle && r.Placement != nil {
			cells = append(cells, fmt.Sprintf("%s at %s: %s", r.Policy, loadLabel(r), regretCell(r.Placement)))
		}
	}
	if len(cells) > 0 {
		fmt.Fprintf(b, "The oracle's own prefills, judged alike: %s.\n\n", strings.Join(cells, "; "))
	}
}

// decodeAloneSummary is how many of oracle-reuse's requests went
// decode-alone, when it ran on the trace: the oracle is the prefill
// engines' only sender, one prefill leg a P/D request.
func (rep *Report) decodeAloneSummary(b *strings.Builder, tr TraceReport) {
	n := 0
	for _, r := range rep.Runs {
		if r.Trace == tr.Name && r.Policy == OracleReuseProfile {
			fmt.Fprintf(b, "- %s at %.0f%%: %d of %d requests decode-alone\n", r.Policy, 100*r.TargetLoad,
				max(r.Requests-sumInts(r.Engines.PrefillRequests), 0), r.Requests)
			n++
		}
	}
	if n > 0 {
		b.WriteString("\n")
	}
}

// hasOracle reports whether the oracle ran.
func (rep *Report) hasOracle() bool {
	return slices.ContainsFunc(rep.Runs, func(r RunResult) bool { return r.Oracle })
}

// kvTokens is one engine's KV in real tokens, from the capacity reported.
func (rep *Report) kvTokens() int {
	c, ok := rep.Capacity.(enginesim.Capacity)
	if !ok {
		return 0
	}
	return c.KVBlocks * c.BlockTokens * rep.TokenScale
}

func pct(p Percentiles, prec int) string {
	return fmt.Sprintf("%.*f / %.*f / %.*f", prec, p.P50, prec, p.P90, prec, p.P99)
}

func sumInts(xs []int) int {
	n := 0
	for _, x := range xs {
		n += x
	}
	return n
}

func intList(xs []int) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = fmt.Sprint(x)
	}
	return strings.Join(s, ",")
}

func compactJSON(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	return string(b)
}

// cacheBoundSummary is the cache-bound rig's report (CacheBound): its
// parameters, then per trace a row per policy, point and replica count
// with what the rig is for (goodput, prefix hit, TTFT, the engines' true
// service rate, the violations), and every row's distance from the
// oracle.
func (rep *Report) cacheBoundSummary() string {
	var b strings.Builder
	c, _ := rep.Capacity.(enginesim.Capacity)
	fmt.Fprintf(&b, "# Trace replay: the cache-bound rig\n\n")
	fmt.Fprintf(&b, "Real Envoy + pdx, %d prefill + %d decode simulated NIXL engines, fresh per run, where the prefix cache decides "+
		"(`pdx-replay --rig %s`; every parameter is in `replay.DefaultCacheBound`). Token scale %d. %d replay(s) pooled per row. Wall time %.0f s",
		rep.Prefill, rep.Decode, CacheBoundRig, rep.TokenScale, rep.Repeats, rep.WallSec)
	if rep.Machine != "" {
		fmt.Fprintf(&b, " on %s", rep.Machine)
	}
	b.WriteString(".\n\n")
	fmt.Fprintf(&b, "**Engines.** KV: %d blocks of %d simulated tokens (%d real, one trace block) each, least recently used "+
		"evicted among the blocks no request holds. Prefill: %d prompts at once, each %.0f ms plus its uncached tokens at %.0f a second "+
		"(%.0f real), as if alone; the rest wait FIFO. Decode steps and KV pulls: the reference engine's (enginesim.ReferenceCapacity) "+
		"at time scale %g. Capacity: `%s`\n\n",
		c.KVBlocks, c.BlockTokens, c.BlockTokens*rep.TokenScale, max(c.PrefillSlots, 1), ms(c.PrefillOverhead), c.PrefillTokensPerSec,
		c.PrefillTokensPerSec*float64(rep.TokenScale), rep.TimeScale, compactJSON(rep.Capacity))
	if rep.DecodeKVBlocks > 0 {
		fmt.Fprintf(&b, "**Decode engines' KV: %d blocks** each instead (`--decode-kv-blocks`): a decode waits, FIFO, until the KV of its "+
			"prompt and whole output fits.\n\n", rep.DecodeKVBlocks)
	}
	if rep.VLLMRouter != "" {
		fmt.Fprintf(&b, "**Peer: vllm-router %s** in NIXL P/D mode in front of the same engines instead of Envoy + pdx. ", rep.VLLMRouter)
	}
	if rep.hasOracle() {
		b.WriteString("**Oracle:** the yardstick's limit, a P/D router in the harness process that reads the simulators' true state and " +
			"sends each prefill to the engine with the least forecast TTFT (see docs/placement.md).")
	}
	b.WriteString("\n\n")
	fmt.Fprintf(&b, "Load: arrivals are the trace's own timestamps compressed by each point's speedup over the window's native rate (%s), "+
		"the same schedule for every policy at a point; a point's load is round robin's prefill busy share there (each engine's busy "+
		"slot time over its slots, over the prefill window from the first send to the last first token). Prefix hit: the share of "+
		"the prefill engines' prompt tokens found cached. Prefill service: the engines' true rate per slot (and overhead), then the "+
		"rate they delivered (their uncached tokens over busy slot time less the overheads: below the true one by timers waking "+
		"late on a busy machine). A learned rate is read against these. Mix-ups and KV rejections must be 0.\n\n", floatList(rep.Speedups, "×"))
	for _, tr := range rep.Traces {
		rep.cacheBoundTrace(&b, tr, c)
	}
	fmt.Fprintf(&b, "## Policies\n\n")
	for _, name := range slices.Sorted(maps.Keys(rep.Policies)) {
		yaml := strings.TrimSpace(strings.ReplaceAll(rep.Policies[name], "\n", "; "))
		if yaml == "" {
			fmt.Fprintf(&b, "- **%s**: pdx's defaults (no picker lines)\n", name)
			continue
		}
		fmt.Fprintf(&b, "- **%s**: `%s`\n", name, yaml)
	}
	return b.String()
}

// cacheBoundTrace is a trace's part of the cache-bound rig's report.
func (rep *Report) cacheBoundTrace(b *strings.Builder, tr TraceReport, c enginesim.Capacity) {
	fmt.Fprintf(b, "## %s (`%s`)\n\n", tr.Name, tr.Path)
	fmt.Fprintf(b, "First %d requests (native %.2f req/s; rates %s req/s); median prompt %d simulated tokens, mean %d, median output %d. "+
		"They touch %d distinct trace blocks: each engine's KV holds %.0f%% of them. One unlimited prefix cache in front of every "+
		"request would find %.1f%% of their prompt tokens cached. Idle uncached median request: TTFT %.0f ms. **Goodput: %s** "+
		"(streamed).\n\n",
		tr.Requests, tr.NativeRate, floatList(tr.Rates, ""), tr.MedianInput, tr.MeanInput, tr.MedianOutput,
		tr.DistinctBlocks, 100*ratio(float64(c.KVBlocks), float64(tr.DistinctBlocks)), 100*tr.UnlimitedHit, ms(tr.Probe.TTFT), tr.SLO)
	rows := rep.cacheBoundRows(tr.Name)
	spread := rep.Repeats > 1
	if spread {
		b.WriteString("Pooled over the replays, each replay's own figures in brackets.\n\n")
	}
	fmt.Fprintf(b, "| load: target → RR busy | policy | pdx replicas | goodput | prefix hit (prefill) | TTFT p50 / p90 ms | busy | errors: 429 / broken | mix-ups | KV rejected | prefill service: true → delivered tok/s per slot; pdx's learned |\n")
	fmt.Fprintf(b, "|---|---|---:|---|---|---|---:|---|---:|---:|---|\n")
	for _, r := range rows {
		goodput, hit := fmt.Sprintf("%.1f%%", 100*r.Goodput), fmt.Sprintf("%.1f%%", 100*r.PrefixHitRate)
		ttft := fmt.Sprintf("%.0f / %.0f", r.TTFT.P50, r.TTFT.P90)
		if spread && len(r.PerRepeat) > 1 {
			goodput += " (" + repeatList(r.PerRepeat, func(x RepeatResult) string { return fmt.Sprintf("%.1f", 100*x.Goodput) }) + ")"
			hit += " (" + repeatList(r.PerRepeat, func(x RepeatResult) string { return fmt.Sprintf("%.1f", 100*x.PrefixHitRate) }) + ")"
			ttft += " (" + repeatList(r.PerRepeat, func(x RepeatResult) string { return fmt.Sprintf("%.0f / %.0f", x.TTFT.P50, x.TTFT.P90) }) + ")"
		}
		learned := ""
		if l := r.Learned; l != nil {
			learned = fmt.Sprintf("; %.0f + %.1f ms, a queued token %.0f/s (the whole queue's %.0f/s), %.1f slots (%.0f prefills), %.3f of pdx's tokens an engine's",
				l.PromptTokensPerS, l.OverheadMs, l.WaitingTokensPerS, l.AheadTokensPerS, l.Slots, l.Samples, l.TokenScale)
		}
		fmt.Fprintf(b, "| %s | %s | %d | %s | %s | %s | %.0f%% | %d / %d | %d | %d | %.0f + %.0f ms → %.0f%s |\n",
			loadLabel(r), r.Policy, r.Replicas, goodput, hit, ttft, 100*r.BusyShare, r.Shed, r.Broken, r.MixUps, r.Engines.Rejected,
			r.Service.TokensPerSec, r.Service.OverheadMs, r.Service.DeliveredTokensPerSec, learned)
	}
	b.WriteString("\n")
	selfCheckSummary(b, rows, rows[0].Trace)
	var far []RunResult
	for _, r := range rows {
		if r.VsOracle != nil {
			far = append(far, r)
		}
	}
	if len(far) > 0 {
		b.WriteString("Distance from the oracle at the same point: TTFT as a multiple of the oracle's (1 = as fast), goodput and prefix " +
			"hit (prefill engines) in points above the oracle's (0 = as good, negative = worse). " + regretLegend + "\n\n")
		fmt.Fprintf(b, "| load: target → RR busy | policy | pdx replicas | TTFT p50 × oracle | TTFT p90 × oracle | goodput − oracle | prefix hit − oracle | prefills misplaced |\n")
		fmt.Fprintf(b, "|---|---|---:|---:|---:|---:|---:|---|\n")
		for _, r := range far {
			g := r.VsOracle
			fmt.Fprintf(b, "| %s | %s | %d | %.2f | %.2f | %+.1f | %+.1f | %s |\n",
				loadLabel(r), r.Policy, r.Replicas, g.TTFTP50, g.TTFTP90, g.GoodputPoints, g.PrefixHitPoints, regretCell(r.Placement))
		}
		b.WriteString("\n")
		rep.oracleRegret(b, rows[0].Trace)
	}
	for _, r := range rows {
		if len(r.ErrorSamples) > 0 {
			fmt.Fprintf(b, "- %s x%d at %.0f%%: %s\n", r.Policy, r.Replicas, 100*r.TargetLoad, strings.Join(r.ErrorSamples, "; "))
		}
	}
}

// cacheBoundRows are a trace's runs, each point's one-replica runs then
// its runs at more replicas.
func (rep *Report) cacheBoundRows(trace string) []RunResult {
	var loads []float64
	for _, r := range rep.Runs {
		if r.Trace == trace && !slices.Contains(loads, r.TargetLoad) {
			loads = append(loads, r.TargetLoad)
		}
	}
	var rows []RunResult
	for _, load := range loads {
		for _, r := range rep.Runs {
			if r.Trace == trace && r.TargetLoad == load {
				rows = append(rows, r)
			}
		}
		for _, r := range rep.ReplicaRuns {
			if r.Trace == trace && r.TargetLoad == load && r.Replicas > 1 {
				rows = append(rows, r)
			}
		}
	}
	return rows
}

// loadLabel is a row's load: the point's target, then round robin's busy
// share there ("–" when round robin did not run).
func loadLabel(r RunResult) string {
	if r.RRBusyShare <= 0 {
		return fmt.Sprintf("%.0f%% → –", 100*r.TargetLoad)
	}
	return fmt.Sprintf("%.0f%% → %.0f%%", 100*r.TargetLoad, 100*r.RRBusyShare)
}

func repeatList(xs []RepeatResult, f func(RepeatResult) string) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = f(x)
	}
	return strings.Join(s, "; ")
}

func floatList(xs []float64, suffix string) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = fmt.Sprintf("%.4g%s", x, suffix)
	}
	return strings.Join(s, ", ")
}
