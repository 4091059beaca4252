package loadtest

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
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
	fmt.Fprintf(w, "# pdx load results\n\n%s, %s, Envoy %s.\n\n", rep.Started.Format("2006-01-02 15:04 MST"), rep.Machine, rep.Envoy)
	for _, prof := range rep.Profiles {
		fmt.Fprintf(w, "## Engines: %s (%s)\n\n", prof.Name, prof.Describe)
		fmt.Fprintln(w, "| scenario | conc | body | stream | req/s | p50 ms | p90 ms | p99 ms | +p50 ms | +p99 ms | pdx CPU s/1k | Envoy CPU s/1k | pdx peak RSS MiB | errors |")
		fmt.Fprintln(w, "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
		for _, p := range rep.Points {
			if p.Profile != prof.Name {
				continue
			}
			added := func(v float64) string {
				if p.Scenario == Floor {
					return "-"
				}
				return fmt.Sprintf("%+.2f", v)
			}
			fmt.Fprintf(w, "| %s | %d | %s | %t | %.0f | %.2f | %.2f | %.2f | %s | %s | %.3f | %.3f | %.1f | %d |\n",
				p.Scenario, p.Concurrency, size(p.BodyBytes), p.Stream, p.Throughput, p.P50Ms, p.P90Ms, p.P99Ms,
				added(p.AddedP50Ms), added(p.AddedP99Ms), p.PdxCPUPer1k, p.EnvoyCPUPer1k, p.PdxPeakRSSMiB, p.Errors)
		}
		fmt.Fprintln(w)
	}
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

func size(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%dM", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%dK", n>>10)
	}
	return fmt.Sprint(n)
}
