package replay

import (
	"fmt"
	"math"
	"slices"
	"time"
)

// Percentiles are a latency distribution's p50, p90 and p99 in
// milliseconds.
type Percentiles struct {
	P50 float64 `json:"p50_ms"`
	P90 float64 `json:"p90_ms"`
	P99 float64 `json:"p99_ms"`
}

// percentiles of d by the nearest-rank method (the smallest value with at
// least p% of the values at or below it); d is sorted in place.
func percentiles(d []time.Duration) Percentiles {
	if len(d) == 0 {
		return Percentiles{}
	}
	slices.Sort(d)
	return Percentiles{P50: ms(nearestRank(d, 50)), P90: ms(nearestRank(d, 90)), P99: ms(nearestRank(d, 99))}
}

// nearestRank is the p-th percentile of sorted d.
func nearestRank(sorted []time.Duration, p int) time.Duration {
	rank := (p*len(sorted) + 99) / 100 // ceil(p/100 × n)
	return sorted[max(rank, 1)-1]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// SLO is the service level a request must meet to count as goodput.
type SLO struct {
	TTFT time.Duration `json:"ttft_ns"`
	// TPOT 0 bounds nothing.
	TPOT time.Duration `json:"tpot_ns"`
}

func (s SLO) String() string {
	if s.TPOT == 0 {
		return fmt.Sprintf("TTFT ≤ %.0f ms", ms(s.TTFT))
	}
	return fmt.Sprintf("TTFT ≤ %.0f ms, TPOT ≤ %.1f ms", ms(s.TTFT), ms(s.TPOT))
}

// Meets reports whether o succeeded within both bounds. A one-token answer
// has no TPOT and meets that bound.
func (s SLO) Meets(o Outcome) bool {
	return o.OK() && o.TTFT <= s.TTFT && (s.TPOT == 0 || o.TPOT() <= s.TPOT)
}

// goodput is the share of all requests (failures included) meeting slo.
func goodput(outs []Outcome, slo SLO) float64 {
	if len(outs) == 0 {
		return 0
	}
	n := 0
	for _, o := range outs {
		if slo.Meets(o) {
			n++
		}
	}
	return float64(n) / float64(len(outs))
}

// cv is the coefficient of variation (population standard deviation over
// the mean) of counts: 0 for an even spread.
func cv(counts []int) float64 {
	if len(counts) == 0 {
		return 0
	}
	var sum float64
	for _, c := range counts {
		sum += float64(c)
	}
	mean := sum / float64(len(counts))
	if mean == 0 {
		return 0
	}
	var sq float64
	for _, c := range counts {
		sq += (float64(c) - mean) * (float64(c) - mean)
	}
	return math.Sqrt(sq/float64(len(counts))) / mean
}

// ratio is a/b, 0 when b is 0.
func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}
