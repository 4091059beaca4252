package replay

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

func TestPercentiles(t *testing.T) {
	ms := func(xs ...int) []time.Duration {
		var out []time.Duration
		for _, x := range xs {
			out = append(out, time.Duration(x)*time.Millisecond)
		}
		return out
	}
	tests := []struct {
		name string
		in   []time.Duration
		want Percentiles
	}{
		{name: "empty", in: nil, want: Percentiles{}},
		{name: "one", in: ms(7), want: Percentiles{P50: 7, P90: 7, P99: 7}},
		// Nearest rank: p50 of 1..10 is the 5th, p90 the 9th, p99 the 10th.
		{name: "ten, unsorted", in: ms(10, 1, 9, 2, 8, 3, 7, 4, 6, 5), want: Percentiles{P50: 5, P90: 9, P99: 10}},
		{name: "hundred", in: func() []time.Duration {
			var d []time.Duration
			for i := 100; i >= 1; i-- {
				d = append(d, time.Duration(i)*time.Millisecond)
			}
			return d
		}(), want: Percentiles{P50: 50, P90: 90, P99: 99}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, percentiles(tc.in))
		})
	}
}

func TestGoodput(t *testing.T) {
	slo := SLO{TTFT: 100 * time.Millisecond, TPOT: 10 * time.Millisecond}
	ok := func(ttft, e2e time.Duration, tokens int) Outcome {
		return Outcome{Status: 200, TTFT: ttft, E2E: e2e, Tokens: tokens, Want: tokens}
	}
	ms := time.Millisecond
	tests := []struct {
		name string
		o    Outcome
		want bool
	}{
		{name: "within both", o: ok(100*ms, 190*ms, 10), want: true}, // TPOT 10 ms
		{name: "TTFT over", o: ok(101*ms, 110*ms, 10), want: false},  // TPOT 1 ms
		{name: "TPOT over", o: ok(50*ms, 150*ms, 10), want: false},   // TPOT 11.1 ms
		{name: "one token, no TPOT", o: ok(90*ms, 90*ms, 1), want: true},
		{name: "failed", o: Outcome{TTFT: ms, E2E: ms, Tokens: 1, Err: "status 503"}, want: false},
		{name: "mixed up", o: Outcome{TTFT: ms, E2E: ms, Tokens: 1, MixedUp: true}, want: false},
	}
	var outs []Outcome
	met := 0
	for _, tc := range tests {
		require.Equal(t, tc.want, slo.Meets(tc.o), tc.name)
		outs = append(outs, tc.o)
		if tc.want {
			met++
		}
	}
	require.InDelta(t, float64(met)/float64(len(outs)), goodput(outs, slo), 1e-9)
	require.Zero(t, goodput(nil, slo))
	ttftOnly := SLO{TTFT: slo.TTFT} // the cache-bound rig's: no TPOT bound
	require.True(t, ttftOnly.Meets(ok(50*ms, 150*ms, 10)), "TPOT 11.1 ms, unbounded")
	require.False(t, ttftOnly.Meets(ok(101*ms, 110*ms, 10)))
	require.Equal(t, 10*ms, ok(100*ms, 190*ms, 10).TPOT())
}

func TestCV(t *testing.T) {
	require.Zero(t, cv([]int{5, 5, 5, 5}))
	require.Zero(t, cv(nil))
	require.Zero(t, cv([]int{0, 0}))
	require.InDelta(t, 1.0, cv([]int{0, 2}), 1e-9)       // mean 1, sd 1
	require.InDelta(t, 0.5, cv([]int{1, 3, 1, 3}), 1e-9) // mean 2, sd 1
}

func TestBusyShare(t *testing.T) {
	outs := []Outcome{
		{Sent: 0, TTFT: time.Second, Tokens: 3},
		{Sent: 3 * time.Second, TTFT: time.Second, Tokens: 1},
		{Sent: 5 * time.Second, Err: "status 503"},
	}
	w := prefillWindow(outs, 9*time.Second)
	require.Equal(t, 4*time.Second, w, "the last first token, not the decode tail")
	require.InDelta(t, 0.5, busyShare(8*time.Second, w, 4), 1e-9)
	require.Equal(t, 9*time.Second, prefillWindow(nil, 9*time.Second))
}

// TestSummarizeRepeats pools the outcomes and sums the engines' counters
// of a run's repeats; the router's cores average over time and its CPU per
// request comes from its core-seconds.
func TestSummarizeRepeats(t *testing.T) {
	s := time.Second
	one := func(ttft, busy, elapsed time.Duration, router float64) sample {
		return sample{
			outs: []Outcome{{Status: 200, TTFT: ttft, E2E: ttft + s, Tokens: 2, Want: 2}},
			engines: EngineStats{PrefillRequests: []int{1, 0}, DecodeRequests: []int{0, 1}, PrefillBusy: busy, PrefillQueryTokens: 10, PrefillHitTokens: 5,
				Prefills: 1, PrefillTokens: 90},
			elapsed:    elapsed,
			cpu:        CPUUse{Router: router, Harness: 0.3},
			vllmRouter: "9.9.9",
		}
	}
	res := summarizeRun(run{trace: "t", profile: Profile{Name: "p", Peer: "cache_aware"}, replicas: 1, rate: 3},
		[]sample{one(s, s, 4*s, 0.1), one(2*s, 3*s, 6*s, 0.6)}, SLO{TTFT: 1500 * time.Millisecond, TPOT: s},
		enginesim.Capacity{PrefillSlots: 2, PrefillTokensPerSec: 100, PrefillOverhead: 100 * time.Millisecond})
	require.Equal(t, 2, res.Requests)
	require.Equal(t, 2, res.Repeats)
	require.Equal(t, []int{2, 0}, res.Engines.PrefillRequests)
	require.InDelta(t, 1.0, res.PrefillCV, 1e-9)
	require.InDelta(t, 0.5, res.PrefixHitRate, 1e-9)
	require.InDelta(t, 0.5, res.Goodput, 1e-9, "one TTFT within 1.5 s, one over")
	// Busy 4 s over 2 engines × (1 s + 2 s) of prefill windows.
	require.InDelta(t, 4.0/6.0, res.BusyShare, 1e-9)
	require.InDelta(t, 0.3, res.CPU.Harness, 1e-9)
	// 0.1 cores for 4 s and 0.6 for 6 s: 4 core-seconds over 10 s and 2
	// requests.
	require.InDelta(t, 0.4, res.CPU.Router, 1e-9)
	require.InDelta(t, 2000, res.CPU.RouterMsPerRequest, 1e-6)
	require.Equal(t, "9.9.9", res.VLLMRouter)
	require.Equal(t, Percentiles{P50: 1000, P90: 2000, P99: 2000}, res.TTFT)
	// Each replay alone: busy 1 s over 2 engines × 1 s, then 3 s over 2 × 2 s.
	require.Equal(t, []RepeatResult{
		{Goodput: 1, PrefixHitRate: 0.5, TTFT: Percentiles{P50: 1000, P90: 1000, P99: 1000}, BusyShare: 0.5},
		{Goodput: 0, PrefixHitRate: 0.5, TTFT: Percentiles{P50: 2000, P90: 2000, P99: 2000}, BusyShare: 0.75},
	}, res.PerRepeat)
	// 180 uncached tokens in 4 s busy × 2 slots less 2 overheads of 0.1 s.
	require.Equal(t, Service{Slots: 2, TokensPerSec: 100, OverheadMs: 100, Prefills: 2, UncachedTokens: 180, DeliveredTokensPerSec: 180 / 7.8}, res.Service)
}

// TestViolations: 429s are a policy's outcome; broken requests, mix-ups
// and refused KV hand-offs are not.
func TestViolations(t *testing.T) {
	tests := []struct {
		name string
		run  RunResult
		bad  bool
	}{
		{name: "clean", run: RunResult{}},
		{name: "shed", run: RunResult{Errors: 3, Shed: 3}},
		{name: "broken", run: RunResult{Errors: 1, Broken: 1}, bad: true},
		{name: "mixed up", run: RunResult{MixUps: 1}, bad: true},
		{name: "KV refused", run: RunResult{Engines: EngineStats{Rejected: 1}}, bad: true},
	}
	for _, tc := range tests {
		err := (&Report{Runs: []RunResult{tc.run}}).Violations()
		require.Equal(t, tc.bad, err != nil, "%s: %v", tc.name, err)
	}
}
