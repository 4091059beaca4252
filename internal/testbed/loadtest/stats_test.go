package loadtest

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestSummarize(t *testing.T) {
	tests := []struct {
		name string
		in   []time.Duration
		want latencies
	}{
		{name: "empty", want: latencies{}},
		{name: "one", in: []time.Duration{5}, want: latencies{P50: 5, P90: 5, P99: 5, Mean: 5, Max: 5}},
		{name: "1..100 shuffled", in: func() []time.Duration {
			var d []time.Duration
			for i := 100; i >= 1; i-- {
				d = append(d, time.Duration(i))
			}
			return d
		}(), want: latencies{P50: 50, P90: 90, P99: 99, Mean: 50, Max: 100}},
		{name: "tail dominates p99 of ten", in: []time.Duration{1, 1, 1, 1, 1, 1, 1, 1, 1, 1000}, want: latencies{P50: 1, P90: 1, P99: 1000, Mean: 100, Max: 1000}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, summarize(tc.in))
		})
	}
}
