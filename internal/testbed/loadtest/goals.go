package loadtest

import (
	"fmt"
	"io"
	"slices"
)

// Issue 23's goals, as ratios to the floor's Envoy in the same run: they
// were filed as pdx ≤ 0.25 ms at 32 KiB and ≤ 0.10 ms at 1 KiB per request
// when the floor's Envoy cost 0.11 and 0.07 ms there (512 clients, at
// d5a531e), and pdx's Envoy ≤ 2× the floor's.
var goalPdxRatio = map[int]float64{32 << 10: 0.25 / 0.11, 1 << 10: 0.10 / 0.07}

const goalEnvoyRatio = 2.0

// goalRow is one shape's ratios over the goal rounds.
type goalRow struct {
	concurrency, body int
	// Per round: pdx ÷ floor's Envoy, pdx's Envoy ÷ floor's Envoy, and
	// pdx's p99 ÷ the floor's.
	pdx, envoy, p99 []float64
	lines           []string // the rounds' table rows
}

// goalRows pairs each goal round's pdx point with the floor measured just
// before it, per shape, in GoalShapes' order.
func (rep *Report) goalRows() []goalRow {
	var rows []goalRow
	for _, g := range GoalShapes {
		row := goalRow{concurrency: g.Concurrency, body: g.BodyBytes}
		var floor *Point
		for i := range rep.Goals {
			p := &rep.Goals[i]
			if p.Concurrency != g.Concurrency || p.BodyBytes != g.BodyBytes {
				continue
			}
			if p.Scenario == Floor {
				floor = p
				continue
			}
			if p.Scenario != PD || floor == nil || floor.Round != p.Round || floor.EnvoyCPUPer1k <= 0 || floor.P99Ms <= 0 {
				continue
			}
			row.pdx = append(row.pdx, p.PdxCPUPer1k/floor.EnvoyCPUPer1k)
			row.envoy = append(row.envoy, p.EnvoyCPUPer1k/floor.EnvoyCPUPer1k)
			row.p99 = append(row.p99, p.P99Ms/floor.P99Ms)
			row.lines = append(row.lines, fmt.Sprintf("| %d | %s | %d | %.0f / %.3f | %.0f / %.3f / %.3f | %.2f | %.2f | %.2f | %d |",
				p.Concurrency, size(p.BodyBytes), p.Round, floor.Throughput, floor.EnvoyCPUPer1k,
				p.Throughput, p.PdxCPUPer1k, p.EnvoyCPUPer1k, row.pdx[len(row.pdx)-1], row.envoy[len(row.envoy)-1], row.p99[len(row.p99)-1], p.Errors))
			floor = nil
		}
		if len(row.pdx) > 0 {
			rows = append(rows, row)
		}
	}
	return rows
}

// goalsMarkdown writes the goal rounds and their medians against the goals.
func (rep *Report) goalsMarkdown(w io.Writer) {
	rows := rep.goalRows()
	if len(rows) == 0 {
		return
	}
	fmt.Fprintln(w, "## Issue 23's goals, round by round")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Zero-latency engines, whole answers. In each round the floor, then pdx's whole path, at each goal point; CPU s per 1,000 requests, and each round's ratios to the floor measured just before it.",
		"The goals as ratios to the floor's Envoy: pdx ≤ 0.25 ms at 32 KiB and ≤ 0.10 ms at 1 KiB were filed where the floor's Envoy cost 0.11 and 0.07 ms (so ≤ 2.27× and ≤ 1.43×); pdx's Envoy ≤ 2×.")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| clients | prompt | round | floor: req/s / Envoy | pdx: req/s / pdx / Envoy | pdx ÷ floor's Envoy | pdx's Envoy ÷ floor's | p99 ÷ floor's | errors |")
	fmt.Fprintln(w, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
	for _, row := range rows {
		for _, l := range row.lines {
			fmt.Fprintln(w, l)
		}
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| clients | prompt | rounds | pdx ÷ floor's Envoy, median (min–max) | goal | pdx's Envoy ÷ floor's | goal | p99 ÷ floor's |")
	fmt.Fprintln(w, "|---:|---:|---:|---:|---|---:|---|---:|")
	for _, row := range rows {
		fmt.Fprintf(w, "| %d | %s | %d | %s | %s | %s | %s | %s |\n", row.concurrency, size(row.body), len(row.pdx),
			spread(row.pdx), goal(row.pdx, goalPdxRatio[row.body]), spread(row.envoy), goal(row.envoy, goalEnvoyRatio), spread(row.p99))
	}
	fmt.Fprintln(w)
}

// spread is xs's median and range.
func spread(xs []float64) string {
	return fmt.Sprintf("%.2f (%.2f–%.2f)", median(xs), slices.Min(xs), slices.Max(xs))
}

// goal says whether the median of xs is at most limit.
func goal(xs []float64, limit float64) string {
	if limit <= 0 {
		return "-"
	}
	verdict := "met"
	if median(xs) > limit {
		verdict = "not met"
	}
	return fmt.Sprintf("≤ %.2f: %s", limit, verdict)
}

// median of xs (the mean of the middle two for an even count).
func median(xs []float64) float64 {
	s := slices.Sorted(slices.Values(xs))
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// goalProblems are the engines' check failures of the goal rounds.
func (rep *Report) goalProblems() []string {
	var out []string
	for _, p := range rep.Goals {
		if pr := p.handoffProblem(); pr != "" {
			out = append(out, fmt.Sprintf("goal round %d %s c=%d body=%s: %s", p.Round, p.Scenario, p.Concurrency, size(p.BodyBytes), pr))
		}
	}
	return out
}
