package replay

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// cachedTokensMetric is the self-check's counter, by pool, endpoint and
// source (predicted, reported).
const cachedTokensMetric = "pdx_placement_cached_tokens_total"

// selfCheck sums what st's pdx replicas counted in cachedTokensMetric,
// read from their admin endpoints as a user's Prometheus would.
func selfCheck(ctx context.Context, st *stack.Stack) (*SelfCheck, error) {
	bodies, err := st.ReplicaMetrics(ctx)
	if err != nil {
		return nil, err
	}
	var c SelfCheck
	for _, body := range bodies {
		predicted, reported, err := cachedTokens(body)
		if err != nil {
			return nil, err
		}
		c.PredictedCachedTokens += predicted
		c.ReportedCachedTokens += reported
	}
	return &c, nil
}

// cachedTokens sums cachedTokensMetric's predicted and reported series
// over pools and endpoints in a text exposition.
func cachedTokens(exposition string) (predicted, reported int64, err error) {
	for line := range strings.Lines(exposition) {
		if !strings.HasPrefix(line, cachedTokensMetric+"{") {
			continue
		}
		fields := strings.Fields(line)
		v, err := strconv.ParseFloat(fields[len(fields)-1], 64)
		if err != nil {
			return 0, 0, fmt.Errorf("%s: %w", cachedTokensMetric, err)
		}
		switch {
		case strings.Contains(line, `source="predicted"`):
			predicted += int64(v)
		case strings.Contains(line, `source="reported"`):
			reported += int64(v)
		}
	}
	return predicted, reported, nil
}

// pooledSelfCheck is the samples' self-checks summed; nil when none has
// one.
func pooledSelfCheck(samples []sample) *SelfCheck {
	var all *SelfCheck
	for _, s := range samples {
		if s.check == nil {
			continue
		}
		if all == nil {
			all = &SelfCheck{}
		}
		all.PredictedCachedTokens += s.check.PredictedCachedTokens
		all.ReportedCachedTokens += s.check.ReportedCachedTokens
	}
	if all != nil {
		all.Ratio = ratio(float64(all.PredictedCachedTokens), float64(all.ReportedCachedTokens))
	}
	return all
}
