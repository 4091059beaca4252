package replay

import (
	"context"
	"fmt"
	"slices"
	"time"
)

// Probe is what an idle rig answers for a trace's reference requests,
// prompts never seen before (uncached): the yardstick of the SLOs and of
// the first rate guess.
type Probe struct {
	// TTFT and TPOT are those of the median prompt with the median output
	// (at least probeMinTokens); MeanTTFT that of the mean prompt.
	TTFT     time.Duration `json:"ttft_ns"`
	TPOT     time.Duration `json:"tpot_ns"`
	MeanTTFT time.Duration `json:"mean_ttft_ns"`
}

const (
	// probeRepeats is how many requests each probe sends, one at a time;
	// the median counts.
	probeRepeats = 3
	// probeMinTokens gives a TPOT a few gaps to average.
	probeMinTokens = 8
)

// probe measures Probe on a fresh round-robin rig.
func (rig Rig) probe(ctx context.Context, tr TraceReport) (Probe, error) {
	st, err := rig.start(ctx, Profiles(rig.Scale)[0], 1)
	if err != nil {
		return Probe{}, err
	}
	defer st.Close()
	client := newClient()
	defer client.CloseIdleConnections()
	next := int64(-1) // trace ids are >= 0: negative ids are never cached
	measure := func(inputTokens, outputTokens int) ([]Outcome, error) {
		var outs []Outcome
		for range probeRepeats {
			r := rig.uniqueRequest(inputTokens, outputTokens, &next)
			o := send(ctx, client, st.URL(), r)
			if !o.OK() {
				return nil, fmt.Errorf("probe request: %s (mixed up: %v)", o.Err, o.MixedUp)
			}
			outs = append(outs, o)
		}
		return outs, nil
	}
	med, err := measure(tr.MedianInput, max(tr.MedianOutput, probeMinTokens))
	if err != nil {
		return Probe{}, err
	}
	mean, err := measure(tr.MeanInput, 1)
	if err != nil {
		return Probe{}, err
	}
	return Probe{
		TTFT:     median(med, func(o Outcome) time.Duration { return o.TTFT }),
		TPOT:     median(med, Outcome.TPOT),
		MeanTTFT: median(mean, func(o Outcome) time.Duration { return o.TTFT }),
	}, nil
}

// uniqueRequest is a request of the given simulated lengths whose blocks
// no other request has, taking ids downward from *next.
func (rig Rig) uniqueRequest(inputTokens, outputTokens int, next *int64) Request {
	real := inputTokens * rig.Scale.TokenScale
	tr := TraceRequest{InputLength: real, OutputLength: outputTokens * rig.Scale.TokenScale}
	for range (real + TraceBlockTokens - 1) / TraceBlockTokens {
		tr.HashIDs = append(tr.HashIDs, *next)
		*next--
	}
	return Request{Index: -1, Prompt: rig.Scale.Prompt(tr), MaxTokens: outputTokens}
}

// median of f over outs.
func median(outs []Outcome, f func(Outcome) time.Duration) time.Duration {
	d := make([]time.Duration, len(outs))
	for i, o := range outs {
		d[i] = f(o)
	}
	slices.Sort(d)
	return d[len(d)/2]
}
