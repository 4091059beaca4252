package loadtest

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// Write stores the report in dir: results.json, summary.md and the charts.
func (rep *Report) Write(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	b, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "results.json"), append(b, '\n'), 0o644); err != nil {
		return err
	}
	var md strings.Builder
	rep.Markdown(&md)
	if err := os.WriteFile(filepath.Join(dir, "summary.md"), []byte(md.String()), 0o644); err != nil {
		return err
	}
	return rep.Charts(dir)
}

// Markdown writes the report as tables.
func (rep *Report) Markdown(w io.Writer) {
	fmt.Fprintf(w, "# pdx load results\n\n%s, %s, Envoy %s", rep.Started.Format("2006-01-02 15:04 MST"), rep.Machine, rep.Envoy)
	if rep.VLLMRouter != "" {
		fmt.Fprintf(w, ", vllm-router %s", rep.VLLMRouter)
	}
	fmt.Fprintln(w, ".")
	fmt.Fprintln(w)
	routers, pd := "pdx and its Envoy for pdx's scenarios, Envoy for the floor", "pdx"
	if rep.hasPeer() {
		routers, pd = routers+", the vllm-router process for the peers", "pdx and the peers"
	}
	fmt.Fprintf(w, "Router CPU and RSS are the whole router's: %s. Answered counts a point's successful requests, warm-up included; in %s each must have had its KV pulled.\n\n", routers, pd)
	var problems []string
	for _, p := range rep.Points {
		if pr := p.handoffProblem(); pr != "" {
			problems = append(problems, fmt.Sprintf("%s %s c=%d body=%s stream=%t: %s", p.Profile, p.Scenario, p.Concurrency, size(p.BodyBytes), p.Stream, pr))
		}
	}
	problems = append(problems, rep.goalProblems()...)
	if len(problems) == 0 {
		fmt.Fprintf(w, "The engines' check: every answer of %s had its KV pulled, the other scenarios pulled none, no engine refused anything, and every prefill generated one token, unstreamed.\n", pd)
	} else {
		fmt.Fprintf(w, "**The engines' check failed** at %d points: %s.\n", len(problems), strings.Join(problems, "; "))
	}
	fmt.Fprintln(w)
	for _, prof := range rep.Profiles {
		fmt.Fprintf(w, "## Engines: %s (%s)\n\n", prof.Name, prof.Describe)
		fmt.Fprintln(w, "| scenario | conc | body | stream | req/s | p50 ms | p90 ms | p99 ms | +p50 ms | +p99 ms | pdx CPU s/1k | Envoy CPU s/1k | router CPU s/1k | pdx peak RSS MiB | router peak RSS MiB | errors | answered | KV pulled | engine rejected |")
		fmt.Fprintln(w, "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
		for _, p := range rep.Points {
			if p.Profile != prof.Name {
				continue
			}
			added := func(v float64) string {
				if p.Scenario.Floor() {
					return "-"
				}
				return fmt.Sprintf("%+.2f", v)
			}
			// pdx and Envoy have no share in the scenarios they do not serve.
			pdx := func(format string, v float64) string {
				if p.Scenario.Floor() || p.Scenario.Peer() {
					return "-"
				}
				return fmt.Sprintf(format, v)
			}
			envoy := "-"
			if !p.Scenario.Peer() {
				envoy = fmt.Sprintf("%.3f", p.EnvoyCPUPer1k)
			}
			fmt.Fprintf(w, "| %s | %d | %s | %t | %.0f | %.2f | %.2f | %.2f | %s | %s | %s | %s | %.3f | %s | %.1f | %d | %d | %d | %d |\n",
				p.Scenario, p.Concurrency, size(p.BodyBytes), p.Stream, p.Throughput, p.P50Ms, p.P90Ms, p.P99Ms,
				added(p.AddedP50Ms), added(p.AddedP99Ms), pdx("%.3f", p.PdxCPUPer1k), envoy, p.RouterCPUPer1k,
				pdx("%.1f", p.PdxPeakRSSMiB), p.RouterPeakRSSMiB, p.Errors, p.Answered, p.KVPulled, p.EngineRejected)
		}
		fmt.Fprintln(w)
	}
	rep.peerMarkdown(w)
	rep.envoyMarkdown(w)
	rep.goalsMarkdown(w)
	if len(rep.Memory) > 0 {
		fmt.Fprintln(w, "## pdx memory with requests parked in prefill")
		fmt.Fprintln(w)
		fmt.Fprintln(w, "| body | in flight | live heap MiB | idle heap MiB | RSS MiB | bytes per request | goal (2 x body + 16 KiB) |")
		fmt.Fprintln(w, "|---:|---:|---:|---:|---:|---:|---:|")
		for _, m := range rep.Memory {
			fmt.Fprintf(w, "| %s | %d | %.1f | %.1f | %.1f | %d | %d |\n", size(m.BodyBytes), m.InFlight, m.HeapMiB, m.IdleHeapMiB, m.RSSMiB, m.PerRequestBytes, m.GoalBytes)
		}
		fmt.Fprintln(w)
	}
	if s := rep.Streams; s != nil {
		fmt.Fprintf(w, "## Concurrent ext_proc streams on one pdx\n\n%d streams over %d gRPC connections: %d routed, %d errors, at most %d open at once; live heap %.1f MiB, RSS %.1f MiB with all open; %.1f s.\n",
			s.Streams, s.Connections, s.Routed, s.Errors, s.MaxOpen, s.HeapMiB, s.RSSMiB, s.Seconds)
		if s.FirstError != "" {
			fmt.Fprintf(w, "\nFirst error: %s\n", s.FirstError)
		}
	}
}

// handoffProblem says how the engines' counts over p disagree with its
// answers, "" when they agree: in a disaggregated scenario each answer's
// decode pulled its KV (a failed request's may have too), in the others
// none did, no engine refused anything, and every prefill was one unstreamed token.
func (p Point) handoffProblem() string {
	var out []string
	switch {
	case !p.Scenario.Disaggregated() && p.KVPulled != 0:
		out = append(out, fmt.Sprintf("%d KV pulls without a prefill", p.KVPulled))
	case p.Scenario.Disaggregated() && (p.KVPulled < p.Answered || p.KVPulled > p.Answered+p.Errors):
		out = append(out, fmt.Sprintf("%d KV pulls for %d answers", p.KVPulled, p.Answered))
	}
	if p.EngineRejected != 0 {
		out = append(out, fmt.Sprintf("%d refused by the engines", p.EngineRejected))
	}
	if p.OddPrefills != 0 {
		out = append(out, fmt.Sprintf("%d prefills that generated more than one token or streamed", p.OddPrefills))
	}
	return strings.Join(out, ", ")
}

// peerMarkdown compares, per profile and point, pdx's full path with the
// peers: one row per router, the ratios on the peers' rows.
func (rep *Report) peerMarkdown(w io.Writer) {
	if !rep.hasPeer() {
		return
	}
	fmt.Fprintf(w, "## Peer: pdx and vllm-router %s\n\n", rep.VLLMRouter)
	fmt.Fprintln(w, "The same P/D path on the same engines and load: Envoy + pdx, and vllm-router (no Envoy) with `--policy round_robin` and `cache_aware`.",
		"Router CPU is the whole router's. The ratios are pdx's over the peer's: of CPU per request (below 1: pdx costs less) and of throughput (above 1: pdx serves more).")
	fmt.Fprintln(w)
	for _, prof := range rep.Profiles {
		var rows []string
		for _, pd := range rep.Points {
			if pd.Profile != prof.Name || pd.Scenario != PD {
				continue
			}
			shape := fmt.Sprintf("%d | %s | %t", pd.Concurrency, size(pd.BodyBytes), pd.Stream)
			rows = append(rows, fmt.Sprintf("| %s | pdx + Envoy | %.0f | %.2f | %.2f | %.3f | | |", shape, pd.Throughput, pd.P50Ms, pd.P99Ms, pd.RouterCPUPer1k))
			for _, p := range rep.Points {
				if p.Profile != pd.Profile || !p.Scenario.Peer() || p.Concurrency != pd.Concurrency || p.BodyBytes != pd.BodyBytes || p.Stream != pd.Stream {
					continue
				}
				rows = append(rows, fmt.Sprintf("| | | | vllm-router %s | %.0f | %.2f | %.2f | %.3f | %s | %s |", peerPolicy[p.Scenario],
					p.Throughput, p.P50Ms, p.P99Ms, p.RouterCPUPer1k, ratio(pd.RouterCPUPer1k, p.RouterCPUPer1k), ratio(pd.Throughput, p.Throughput)))
			}
		}
		if len(rows) == 0 {
			continue
		}
		fmt.Fprintf(w, "### Engines: %s\n\n", prof.Name)
		fmt.Fprintln(w, "| conc | body | stream | router | req/s | p50 ms | p99 ms | router CPU s/1k | CPU pdx/peer | req/s pdx/peer |")
		fmt.Fprintln(w, "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|")
		for _, r := range rows {
			fmt.Fprintln(w, r)
		}
		fmt.Fprintln(w)
	}
}

// envoyMarkdown puts pdx's Envoy next to Envoy alone at the same point,
// once at the floor's own (higher) load and once paced to pdx's.
func (rep *Report) envoyMarkdown(w io.Writer) {
	find := func(pd Point, sc Scenario) (Point, bool) {
		i := slices.IndexFunc(rep.Points, func(p Point) bool {
			return p.Profile == pd.Profile && p.Scenario == sc && p.Concurrency == pd.Concurrency && p.BodyBytes == pd.BodyBytes && p.Stream == pd.Stream
		})
		if i < 0 {
			return Point{}, false
		}
		return rep.Points[i], true
	}
	var rows []string
	for _, pd := range rep.Points {
		if pd.Scenario != PD {
			continue
		}
		floor, ok1 := find(pd, Floor)
		paced, ok2 := find(pd, FloorAtPdxRate)
		if !ok1 || !ok2 {
			continue
		}
		rows = append(rows, fmt.Sprintf("| %s | %d | %s | %t | %.0f / %.3f | %.0f / %.3f | %.0f / %.3f | %s | %s |",
			pd.Profile, pd.Concurrency, size(pd.BodyBytes), pd.Stream, pd.Throughput, pd.EnvoyCPUPer1k,
			floor.Throughput, floor.EnvoyCPUPer1k, paced.Throughput, paced.EnvoyCPUPer1k,
			ratio(pd.EnvoyCPUPer1k, floor.EnvoyCPUPer1k), ratio(pd.EnvoyCPUPer1k, paced.EnvoyCPUPer1k)))
	}
	if len(rows) == 0 {
		return
	}
	fmt.Fprintln(w, "## pdx's Envoy and Envoy alone")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Envoy's CPU per request falls as it gets busier, and the floor serves more than pdx: the floor's clients paced to pdx's throughput (floor-at-pdx-rate) give Envoy alone at pdx's load.")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| engines | conc | body | stream | pdx: req/s / Envoy CPU s/1k | floor | floor at pdx's rate | pdx's Envoy ÷ floor's | ÷ floor's at pdx's rate |")
	fmt.Fprintln(w, "|---|---:|---:|---|---:|---:|---:|---:|---:|")
	for _, r := range rows {
		fmt.Fprintln(w, r)
	}
	fmt.Fprintln(w)
}

func (rep *Report) hasPeer() bool {
	return slices.ContainsFunc(rep.Points, func(p Point) bool { return p.Scenario.Peer() })
}

// ratio is a/b, "-" when b is not positive.
func ratio(a, b float64) string {
	if b <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.2f", a/b)
}

func size(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%dM", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%dK", n>>10)
	}
	return fmt.Sprint(n)
}
