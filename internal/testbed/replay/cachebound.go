package replay

import (
	"fmt"
	"math"
	"path/filepath"
	"time"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

// CacheBoundRig names the cache-bound rig (pdx-replay --rig cachebound).
const CacheBoundRig = "cachebound"

// CacheBound is the cache-bound rig: a deployment and workload where what
// each prefill engine has cached decides a request's TTFT, modelled on the
// third-party rig of issue 34 (llm-d-inference-sim engines, on which
// vLLM's own router out-placed pdx). Every parameter is here, so that a
// policy's change is measured on a rig that stays put.
//
//   - The conversation trace (Mooncake FAST'25): heavy prefix reuse, a
//     conversation's next turn sharing its earlier turns' blocks. Its
//     first 1,000 requests touch 21,514 distinct 512-token blocks; a
//     router with one unlimited cache would find 21.6% of their prompt
//     tokens cached (the summary states the window's figure).
//   - Engines whose KV holds a fifth of what the window touches: each
//     engine's prefix cache is KVShare of the window's distinct trace
//     blocks, in blocks of one trace block (512 real tokens, 32 simulated
//     ones at token scale 16), evicted least recently used among the
//     blocks no request holds (the simulator's cache, vLLM's policy). At
//     1,000 requests that is 4,088 blocks, the 4,096. A prompt's
//     earlier turns are cached only where it, or a turn before it, was
//     prefilled lately: placement decides the hit.
//   - Prefill engines that compute PrefillSlots prompts at once, each at
//     a fixed cost per uncached token plus a fixed overhead, as if alone,
//     the rest waiting FIFO (the simulator's max-num-seqs 2). So a
//     prompt's TTFT is the uncached work queued ahead of it on its engine
//     plus its own: what a forecast placement weighs. The cost, 5 ms plus
//     2,500 simulated tokens a second, makes the median prompt (527
//     simulated tokens) take 216 ms uncached, its idle TTFT 265 ms with
//     the hand-off and first decode step, about half the SLO: whether a
//     request makes it is decided by the uncached work queued ahead of it.
//     The cost was chosen, before any pdx change, so that round robin and
//     pdx's default at the middle point land where the issue measured them
//     on its rig (goodput about 53% and 58%, TTFT p50 0.47 s and 0.41 s,
//     prefix hit 9% and 15%); at 4,000 a second and 20 ms the cache
//     decided less (pdx's default ahead of cache_aware on goodput but for
//     the highest load).
//   - Bursty open-loop arrivals: the trace's own timestamps (whole
//     seconds: most requests arrive in bursts sharing one), compressed by
//     each point's Speedup; every policy at a point gets the same
//     schedule, and no calibration runs, so that a policy can run alone.
//     A point's load is round robin's prefill busy share there (its
//     slots' busy time over the slots), measured whenever round robin
//     runs; the speedups were chosen for about 55%, 70% and 85%.
//   - Goodput is the share of requests whose TTFT is at most TTFTSLO
//     (streamed; no TPOT bound), as in the issue.
//
// Decode engines are the same engines (decode legs pull the KV blocks
// their own cache lacks); their decode steps and KV pulls are the
// reference engine's at DecodeTimeScale, so that decoding and the
// hand-off cost some tens of milliseconds of each TTFT, not hundreds.
type CacheBound struct {
	Prefill, Decode int
	// TokenScale is real tokens per simulated one (the issue's ÷ 16).
	TokenScale int
	// TracePath and Requests are the trace and its window.
	TracePath string
	Requests  int
	// KVShare is each engine's KV over the distinct trace blocks the window
	// touches.
	KVShare float64
	// DecodeKVBlocks, when positive, is each decode engine's KV in blocks
	// instead of KVShare's: a rig where decodes wait for KV, to measure
	// the decode leg's placement (by default the cache-bound rig's decode
	// engines have room for every decode, and no decode policy shows).
	DecodeKVBlocks int
	// PrefillSlots, PrefillTokensPerSec (simulated tokens a second, each
	// slot) and PrefillOverhead are a prefill's cost: overhead + uncached
	// tokens / rate.
	PrefillSlots        int
	PrefillTokensPerSec float64
	PrefillOverhead     time.Duration
	// DecodeTimeScale scales the reference engine's decode step, its
	// per-sequence growth and its KV pull (enginesim.ReferenceCapacity).
	DecodeTimeScale float64
	// TTFTSLO is goodput's bound.
	TTFTSLO time.Duration
	// Points are the load points: each a speedup of the trace's own
	// arrivals and the round-robin busy share it was chosen for.
	Points []CacheBoundPoint
	// Policies run at every point; ReplicaPolicies at ReplicaCounts pdx
	// replicas at the middle point as well.
	Policies        []string
	ReplicaPolicies []string
	ReplicaCounts   []int
	// Repeats is how many fresh replays each row pools (the summary gives
	// each one's figures too).
	Repeats int
}

// CacheBoundPoint is a load point of the rig: arrivals Speedup times the
// trace's own rate, chosen for round robin to keep the prefill slots
// about Load busy.
type CacheBoundPoint struct {
	Load    float64 `json:"load"`
	Speedup float64 `json:"speedup"`
}

// DefaultCacheBound is the rig as `make replay` runs it.
func DefaultCacheBound(traceDir string) CacheBound {
	return CacheBound{
		Prefill: 3, Decode: 3,
		TokenScale: 16,
		TracePath:  filepath.Join(traceDir, "mooncake-conversation.jsonl"),
		Requests:   1000,
		// 4,096 of the 21,514 distinct blocks of the first 1,000 requests
		// (the KV).
		KVShare:             0.19,
		PrefillSlots:        2,
		PrefillTokensPerSec: 2500,
		PrefillOverhead:     5 * time.Millisecond,
		DecodeTimeScale:     0.25,
		TTFTSLO:             500 * time.Millisecond,
		Points:              []CacheBoundPoint{{0.55, 3.5}, {0.7, 4.5}, {0.85, 5.5}},
		Policies:            []string{"round-robin", "vllm-router-cache-aware", "least-work", "pdx-default", PreciseProfile, OracleProfile},
		ReplicaPolicies:     []string{"pdx-default", DefaultPeersProfile, PreciseProfile, PrecisePeersProfile, DefaultPeersAtOnceProfile, PrecisePeersAtOnceProfile, PrecisePeersJitter16Profile},
		ReplicaCounts:       []int{1, 3},
		Repeats:             2,
	}
}

// Scale is the rig's token scale.
func (c CacheBound) Scale() Scale { return Scale{TokenScale: c.TokenScale} }

// BlockTokens is the engines' KV block: one trace block, in simulated
// tokens.
func (c CacheBound) BlockTokens() int { return TraceBlockTokens / c.TokenScale }

// Capacity is every engine's capacity when the window touches
// distinctBlocks trace blocks.
func (c CacheBound) Capacity(distinctBlocks int) enginesim.Capacity {
	ref := enginesim.ReferenceCapacity(float64(c.TokenScale), c.DecodeTimeScale)
	return enginesim.Capacity{
		MaxRunning:          ref.MaxRunning,
		BlockTokens:         c.BlockTokens(),
		KVBlocks:            max(1, int(math.Round(c.KVShare*float64(distinctBlocks)))),
		PrefillSlots:        c.PrefillSlots,
		PrefillTokensPerSec: c.PrefillTokensPerSec,
		PrefillOverhead:     c.PrefillOverhead,
		DecodeStep:          ref.DecodeStep,
		DecodeStepPerSeq:    ref.DecodeStepPerSeq,
		// The reference pull is per block of its own size.
		KVPullPerBlock: ref.KVPullPerBlock * time.Duration(c.BlockTokens()/ref.BlockTokens),
		// Prompts computed side by side, not chunked beside the decode
		// batch (PrefillSlots needs it).
		MaxBatchedTokens: 0,
	}
}

// Plan is the rig's replay plan over its trace window: engines sized to
// the window, fixed arrival speedups, the TTFT bound. The plan's Rig lacks
// only the Envoy binary.
func (c CacheBound) Plan() (Plan, error) {
	if len(c.Points) == 0 {
		return Plan{}, fmt.Errorf("cache-bound rig: no load point")
	}
	raw, err := ReadTrace(c.TracePath, c.Requests)
	if err != nil {
		return Plan{}, fmt.Errorf("cache-bound rig: %w", err)
	}
	capacity := c.Capacity(DistinctBlocks(raw))
	var decode *enginesim.Capacity
	if c.DecodeKVBlocks > 0 {
		d := capacity
		d.KVBlocks = c.DecodeKVBlocks
		decode = &d
	}
	loads := make([]float64, len(c.Points))
	speedups := make([]float64, len(c.Points))
	for i, pt := range c.Points {
		loads[i], speedups[i] = pt.Load, pt.Speedup
	}
	all := Profiles(c.Scale())
	profiles, err := SelectProfiles(all, c.Policies)
	if err != nil {
		return Plan{}, fmt.Errorf("cache-bound rig: %w", err)
	}
	return Plan{
		Rig: Rig{
			Prefill: c.Prefill, Decode: c.Decode, Scale: c.Scale(), TimeScale: c.DecodeTimeScale,
			Capacity: &capacity, DecodeCapacity: decode, Name: CacheBoundRig,
		},
		Traces:          []TraceFile{{Name: "conversation", Path: c.TracePath}},
		Profiles:        profiles,
		Loads:           loads,
		Speedups:        speedups,
		Requests:        c.Requests,
		ReplicaCounts:   c.ReplicaCounts,
		ReplicaPolicies: c.ReplicaPolicies,
		SLO:             &SLO{TTFT: c.TTFTSLO},
		Repeats:         c.Repeats,
	}, nil
}

// DistinctBlocks is the number of distinct trace blocks (hash ids) a
// window touches.
func DistinctBlocks(trace []TraceRequest) int {
	seen := make(map[int64]struct{})
	for _, r := range trace {
		for _, id := range r.HashIDs {
			seen[id] = struct{}{}
		}
	}
	return len(seen)
}

// UnlimitedCacheHit is the share of a window's prompt tokens that one
// unlimited prefix cache in front of every request would hold: each
// prompt's leading blocks seen in an earlier prompt, all but its last
// token at most (an engine computes that one), in trace blocks. No
// placement over engines of any size does better.
func UnlimitedCacheHit(trace []TraceRequest) float64 {
	seen := make(map[int64]struct{})
	var hit, total int
	for _, r := range trace {
		n := 0
		for n < len(r.HashIDs) {
			if _, ok := seen[r.HashIDs[n]]; !ok {
				break
			}
			n++
		}
		hit += min(n*TraceBlockTokens, r.InputLength-1)
		total += r.InputLength
		for _, id := range r.HashIDs {
			seen[id] = struct{}{}
		}
	}
	return ratio(float64(hit), float64(total))
}
