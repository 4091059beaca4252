package loadtest

import (
	"slices"
	"time"
)

// latencies summarises request durations.
type latencies struct {
	P50, P90, P99, Mean, Max time.Duration
}

// summarize sorts d in place and returns its percentiles (nearest rank).
func summarize(d []time.Duration) latencies {
	if len(d) == 0 {
		return latencies{}
	}
	slices.Sort(d)
	var sum time.Duration
	for _, x := range d {
		sum += x
	}
	return latencies{
		P50:  percentile(d, 50),
		P90:  percentile(d, 90),
		P99:  percentile(d, 99),
		Mean: sum / time.Duration(len(d)),
		Max:  d[len(d)-1],
	}
}

// percentile of sorted d by the nearest-rank method.
func percentile(sorted []time.Duration, p int) time.Duration {
	rank := (p*len(sorted) + 99) / 100 // ceil(p/100 * n)
	return sorted[max(rank, 1)-1]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
