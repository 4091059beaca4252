package replay

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestCachedTokens(t *testing.T) {
	for _, tc := range []struct {
		name                string
		exposition          string
		predicted, reported int64
		err                 string
	}{
		{name: "none counted", exposition: "# HELP pdx_requests_total x\npdx_requests_total{pool=\"p\"} 3\n"},
		{
			name: "summed over pools and endpoints",
			exposition: `# TYPE pdx_placement_cached_tokens_total counter
pdx_placement_cached_tokens_total{endpoint="a:1",pool="p",source="predicted"} 640
pdx_placement_cached_tokens_total{endpoint="a:1",pool="p",source="reported"} 600
pdx_placement_cached_tokens_total{endpoint="b:1",pool="p",source="predicted"} 32
pdx_placement_cached_tokens_total{endpoint="b:1",pool="q",source="reported"} 64
pdx_placement_checks_total{pool="p",result="match"} 9
`,
			predicted: 672, reported: 664,
		},
		{name: "not a number", exposition: `pdx_placement_cached_tokens_total{source="predicted"} many` + "\n", err: "invalid syntax"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			predicted, reported, err := cachedTokens(tc.exposition)
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.predicted, predicted)
			require.Equal(t, tc.reported, reported)
		})
	}
}

func TestPooledSelfCheck(t *testing.T) {
	require.Nil(t, pooledSelfCheck([]sample{{}, {}}), "no replay recorded one")
	got := pooledSelfCheck([]sample{
		{check: &SelfCheck{PredictedCachedTokens: 300, ReportedCachedTokens: 200}},
		{},
		{check: &SelfCheck{PredictedCachedTokens: 100, ReportedCachedTokens: 300}},
	})
	require.Equal(t, &SelfCheck{PredictedCachedTokens: 400, ReportedCachedTokens: 500, Ratio: 0.8}, got)
}
