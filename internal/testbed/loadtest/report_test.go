package loadtest

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestHandoffProblem(t *testing.T) {
	for _, tc := range []struct {
		name string
		p    Point
		want string
	}{
		{"pdx, a pull per answer", Point{Scenario: PD, Answered: 10, KVPulled: 10}, ""},
		{"peer, a pull per answer", Point{Scenario: PeerCacheAware, Answered: 10, KVPulled: 10}, ""},
		{"a failed request's decode pulled", Point{Scenario: PeerRoundRobin, Answered: 10, Errors: 2, KVPulled: 11}, ""},
		{"an answer without a pull", Point{Scenario: PD, Answered: 10, KVPulled: 9}, "9 KV pulls for 10 answers"},
		{"more pulls than requests", Point{Scenario: PeerRoundRobin, Answered: 10, Errors: 1, KVPulled: 12}, "12 KV pulls for 10 answers"},
		{"the floor pulls none", Point{Scenario: Floor, Answered: 10}, ""},
		{"a pull without a prefill", Point{Scenario: NoPrefill, Answered: 10, KVPulled: 1}, "1 KV pulls without a prefill"},
		{"refusals", Point{Scenario: PD, Answered: 10, KVPulled: 10, EngineRejected: 3}, "3 refused by the engines"},
		{"a prefill of more than one token", Point{Scenario: PeerRoundRobin, Answered: 10, KVPulled: 10, OddPrefills: 1}, "1 prefills that generated more than one token or streamed"},
		{"both", Point{Scenario: NoPrefillDuplex, Answered: 10, KVPulled: 2, EngineRejected: 1}, "2 KV pulls without a prefill, 1 refused by the engines"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, tc.p.handoffProblem())
		})
	}
}

// TestMarkdownPeer checks the peer section's rows and ratios, and the
// engines' check in the header.
func TestMarkdownPeer(t *testing.T) {
	pt := func(sc Scenario, rps, cpu float64) Point {
		return Point{Profile: ZeroLatency.Name, Scenario: sc, Concurrency: 64, BodyBytes: 1024,
			Throughput: rps, P50Ms: 10, P99Ms: 20, RouterCPUPer1k: cpu, Answered: 5, KVPulled: 5}
	}
	pd := pt(PD, 900, 1.2)
	rr := pt(PeerRoundRobin, 1200, 0.6)
	ca := pt(PeerCacheAware, 0, 0) // nothing answered in its window
	for _, tc := range []struct {
		name   string
		points []Point
		want   []string // lines of the output
		absent []string
	}{
		{
			name:   "pdx and both peers",
			points: []Point{pd, rr, ca},
			want: []string{
				"| 64 | 1K | false | pdx + Envoy | 900 | 10.00 | 20.00 | 1.200 | | |",
				fmt.Sprintf("| | | | vllm-router round_robin | 1200 | 10.00 | 20.00 | 0.600 | %.2f | %.2f |", 1.2/0.6, 900.0/1200),
				"| | | | vllm-router cache_aware | 0 | 10.00 | 20.00 | 0.000 | - | - |",
				"The engines' check: every answer of pdx and the peers had its KV pulled, the other scenarios pulled none, no engine refused anything, and every prefill generated one token, unstreamed.",
			},
		},
		{
			name:   "without the peer",
			points: []Point{pd},
			absent: []string{"## Peer", "vllm-router"},
		},
		{
			name:   "a peer's answer without a pull",
			points: []Point{pd, func() Point { p := rr; p.KVPulled = 4; return p }()},
			want:   []string{"**The engines' check failed** at 1 points: zero vllm-router-round-robin c=64 body=1K stream=false: 4 KV pulls for 5 answers."},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep := &Report{Profiles: []Profile{ZeroLatency}, Points: tc.points}
			if len(tc.points) > 1 {
				rep.VLLMRouter = "0.1.17"
			}
			requireMarkdown(t, rep, tc.want, tc.absent)
		})
	}
}

// requireMarkdown checks that rep's Markdown has every line of want and
// none of the strings of absent.
func requireMarkdown(t *testing.T, rep *Report, want, absent []string) {
	t.Helper()
	var b strings.Builder
	rep.Markdown(&b)
	lines := strings.Split(b.String(), "\n")
	for _, w := range want {
		require.Contains(t, lines, w, b.String())
	}
	for _, a := range absent {
		require.NotContains(t, b.String(), a)
	}
}

func TestMarkdownEnvoyAtPdxRate(t *testing.T) {
	pt := func(sc Scenario, rps, envoyCPU float64) Point {
		return Point{Profile: ZeroLatency.Name, Scenario: sc, Concurrency: 512, BodyBytes: 32 << 10, Throughput: rps, EnvoyCPUPer1k: envoyCPU}
	}
	pd, floor, paced := pt(PD, 400, 0.9), pt(Floor, 1000, 0.3), pt(FloorAtPdxRate, 398, 0.45)
	for _, tc := range []struct {
		name   string
		points []Point
		want   string // a line of the output; "" when there is no table
	}{
		{"both floors", []Point{floor, pd, paced}, "| zero | 512 | 32K | false | 400 / 0.900 | 1000 / 0.300 | 398 / 0.450 | 3.00 | 2.00 |"},
		{"without the paced floor", []Point{floor, pd}, ""},
		{"the paced floor of another point", []Point{floor, pd, func() Point { p := paced; p.Concurrency = 64; return p }()}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep := &Report{Profiles: []Profile{ZeroLatency}, Points: tc.points}
			var b strings.Builder
			rep.Markdown(&b)
			if tc.want == "" {
				require.NotContains(t, b.String(), "## pdx's Envoy and Envoy alone")
				return
			}
			require.Contains(t, strings.Split(b.String(), "\n"), tc.want)
		})
	}
}

func TestMarkdownGoals(t *testing.T) {
	pt := func(round int, sc Scenario, body int, pdxCPU, envoyCPU, p99 float64) Point {
		return Point{Profile: ZeroLatency.Name, Scenario: sc, Round: round, Concurrency: 512, BodyBytes: body,
			Throughput: 1000, PdxCPUPer1k: pdxCPU, EnvoyCPUPer1k: envoyCPU, P99Ms: p99, Answered: 5, KVPulled: map[Scenario]int{PD: 5}[sc]}
	}
	const k32, k1 = 32 << 10, 1 << 10
	goals := []Point{
		pt(1, Floor, k1, 0, 0.100, 10), pt(1, PD, k1, 0.130, 0.250, 20),
		pt(1, Floor, k32, 0, 0.200, 10), pt(1, PD, k32, 0.400, 0.500, 15),
		pt(2, Floor, k1, 0, 0.100, 10), pt(2, PD, k1, 0.150, 0.190, 30),
		pt(2, Floor, k32, 0, 0.200, 10), pt(2, PD, k32, 0.500, 0.420, 25),
		pt(3, Floor, k1, 0, 0.100, 10), pt(3, PD, k1, 0.140, 0.210, 40),
		pt(3, Floor, k32, 0, 0.100, 10), pt(3, PD, k32, 0.300, 0.300, 35),
	}
	for _, tc := range []struct {
		name   string
		goals  []Point
		want   []string
		absent []string
	}{
		{
			name:  "three rounds",
			goals: goals,
			want: []string{
				"| 512 | 1K | 1 | 1000 / 0.100 | 1000 / 0.130 / 0.250 | 1.30 | 2.50 | 2.00 | 0 |",
				"| 512 | 32K | 3 | 1000 / 0.100 | 1000 / 0.300 / 0.300 | 3.00 | 3.00 | 3.50 | 0 |",
				// 1 KiB: pdx 1.3, 1.5, 1.4; Envoy 2.5, 1.9, 2.1; p99 2, 3, 4.
				"| 512 | 1K | 3 | 1.40 (1.30–1.50) | ≤ 1.43: met | 2.10 (1.90–2.50) | ≤ 2.00: not met | 3.00 (2.00–4.00) |",
				// 32 KiB: pdx 2, 2.5, 3; Envoy 2.5, 2.1, 3.
				"| 512 | 32K | 3 | 2.50 (2.00–3.00) | ≤ 2.27: not met | 2.50 (2.10–3.00) | ≤ 2.00: not met | 2.50 (1.50–3.50) |",
			},
		},
		{
			name:   "a pdx point without its floor is left out",
			goals:  append([]Point{pt(1, PD, k1, 0.9, 0.9, 90)}, goals[:2]...),
			want:   []string{"| 512 | 1K | 1 | 1.30 (1.30–1.30) | ≤ 1.43: met | 2.50 (2.50–2.50) | ≤ 2.00: not met | 2.00 (2.00–2.00) |"},
			absent: []string{"| 512 | 32K |", "0.900"},
		},
		{
			name:   "no goal rounds",
			absent: []string{"## Issue 23's goals"},
		},
		{
			name:  "a goal round's engines' check",
			goals: []Point{goals[0], func() Point { p := goals[1]; p.KVPulled = 4; return p }()},
			want:  []string{"**The engines' check failed** at 1 points: goal round 1 pdx c=512 body=1K: 4 KV pulls for 5 answers."},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep := &Report{Profiles: []Profile{ZeroLatency}, Goals: tc.goals}
			requireMarkdown(t, rep, tc.want, tc.absent)
		})
	}
}

func TestMedian(t *testing.T) {
	for _, tc := range []struct {
		xs   []float64
		want float64
	}{
		{[]float64{3}, 3},
		{[]float64{3, 1, 2}, 2},
		{[]float64{4, 1, 3, 2}, 2.5},
	} {
		require.Equal(t, tc.want, median(tc.xs), "%v", tc.xs)
	}
}
