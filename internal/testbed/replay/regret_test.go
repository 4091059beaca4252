package replay

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

// TestRegret: a prefill counts as misplaced when its engine's forecast
// is above the least by more than the tie, and its excess splits into
// waiting and computing more; and the hit it took is set against the
// most any engine held.
func TestRegret(t *testing.T) {
	const ms = time.Millisecond
	f := func(wait, compute time.Duration) enginesim.PrefillForecast {
		return enginesim.PrefillForecast{Wait: wait, Compute: compute}
	}
	held := func(wait, compute time.Duration, cached int) enginesim.PrefillForecast {
		return enginesim.PrefillForecast{Wait: wait, Compute: compute, CachedTokens: cached, PromptTokens: 100}
	}
	tests := []struct {
		name string
		at   []int                         // where each prefill came
		fs   [][]enginesim.PrefillForecast // every engine's forecast at its arrival
		want *Regret                       // nil: none judged
	}{
		{
			name: "none judged",
		},
		{
			name: "the best engine",
			at:   []int{1},
			fs:   [][]enginesim.PrefillForecast{{f(10*ms, 5*ms), f(0, 5*ms)}},
			want: &Regret{Prefills: 1},
		},
		{
			name: "within the tie",
			at:   []int{0},
			fs:   [][]enginesim.PrefillForecast{{f(2*ms, 5*ms), f(0, 5*ms)}},
			want: &Regret{Prefills: 1, MeanExcessMs: 2},
		},
		{
			name: "behind a queue, holding more",
			at:   []int{0, 1},
			fs: [][]enginesim.PrefillForecast{
				{f(40*ms, 5*ms), f(0, 15*ms)},
				{f(0, 5*ms), f(0, 5*ms)},
			},
			want: &Regret{Prefills: 2, Misplaced: 0.5, MeanExcessMs: 15, WaitMs: 40, ComputeMs: -10},
		},
		{
			name: "away from a cache, then to it",
			at:   []int{0, 1},
			fs: [][]enginesim.PrefillForecast{
				{held(0, 10*ms, 0), held(20*ms, 4*ms, 64)},
				{held(0, 10*ms, 0), held(0, 7*ms, 32)},
			},
			want: &Regret{Prefills: 2, HitTaken: 0.16, HitBest: 0.48, LeftCache: 0.5},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := &regretLog{tie: 3 * ms}
			for i, at := range tt.at {
				l.judged.add(tt.fs[i], at, l.tie)
			}
			require.Equal(t, tt.want, l.stop().regret())
		})
	}
}

// TestPooledRegret: replays pool by their prefills, the misplaced ones'
// split by the misplaced.
func TestPooledRegret(t *testing.T) {
	const ms = time.Millisecond
	require.Nil(t, pooledRegret([]sample{{}, {}}))
	got := pooledRegret([]sample{
		// 100 prefills, half misplaced, mean excess 10 ms, the misplaced
		// waiting 20 ms more.
		{judged: judged{prefills: 100, misplaced: 50, excess: 1000 * ms, wait: 1000 * ms}},
		// 300 prefills, a tenth misplaced, mean excess 2 ms, the misplaced
		// waiting 40 ms more and computing 8 ms less.
		{judged: judged{prefills: 300, misplaced: 30, excess: 600 * ms, wait: 1200 * ms, compute: -240 * ms}},
		{},
	})
	require.Equal(t, 400, got.Prefills)
	require.InDelta(t, 0.2, got.Misplaced, 1e-12)  // (50 + 30) / 400
	require.InDelta(t, 4, got.MeanExcessMs, 1e-12) // (1000 + 600) / 400
	require.InDelta(t, 27.5, got.WaitMs, 1e-12)    // (50×20 + 30×40) / 80
	require.InDelta(t, -3, got.ComputeMs, 1e-12)   // (30×−8) / 80
}
