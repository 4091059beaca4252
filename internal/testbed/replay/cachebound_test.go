package replay

import (
	"math"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

func TestDistinctBlocksAndUnlimitedHit(t *testing.T) {
	trace := []TraceRequest{
		{InputLength: 1500, HashIDs: []int64{1, 2, 3}},
		{InputLength: 1400, HashIDs: []int64{1, 2, 4}}, // 2 blocks seen
		{InputLength: 1200, HashIDs: []int64{1, 2, 3}}, // all seen: all but its last token
		{InputLength: 600, HashIDs: []int64{5, 1}},     // seen, but not leading
	}
	require.Equal(t, 5, DistinctBlocks(trace))
	require.InDelta(t, float64(2*TraceBlockTokens+1199)/4700, UnlimitedCacheHit(trace), 1e-12)
	require.Zero(t, UnlimitedCacheHit(trace[:1]))
}

// headRig is the cache-bound rig over the testdata's 48 requests of the
// conversation trace.
func headRig() CacheBound {
	c := DefaultCacheBound("../shared/traces")
	c.TracePath = filepath.Join("testdata", "conversation-head.jsonl")
	return c
}

// TestCacheBoundPlan: the rig's engines hold its share of the window's
// distinct blocks, in blocks of one trace block, compute two prompts at
// once without a step budget (a capacity the simulator takes), and its
// plan has fixed speedups, a TTFT-only SLO and its policies; with
// DecodeKVBlocks its decode engines hold that much KV instead.
func TestCacheBoundPlan(t *testing.T) {
	c := headRig()
	raw, err := ReadTrace(c.TracePath, c.Requests)
	require.NoError(t, err)
	distinct := DistinctBlocks(raw)
	p, err := c.Plan()
	require.NoError(t, err)

	capa := p.Rig.Capacity
	require.NotNil(t, capa)
	require.Equal(t, int(math.Round(c.KVShare*float64(distinct))), capa.KVBlocks)
	require.Equal(t, 32, capa.BlockTokens, "a 512-token trace block at token scale 16")
	require.Equal(t, 2, capa.PrefillSlots)
	require.Zero(t, capa.MaxBatchedTokens)
	require.Equal(t, c.PrefillTokensPerSec, capa.PrefillTokensPerSec)
	require.Equal(t, c.PrefillOverhead, capa.PrefillOverhead)
	ref := enginesim.ReferenceCapacity(16, c.DecodeTimeScale)
	require.Equal(t, ref.DecodeStep, capa.DecodeStep)
	require.Equal(t, 32*ref.KVPullPerBlock, capa.KVPullPerBlock, "the reference pull of 32 of its blocks")
	_, engine := p.Rig.engineConfig()
	require.Equal(t, *capa, engine, "every engine has the rig's capacity")
	s, err := enginesim.Start(t.Context(), "127.0.0.1:0", enginesim.Config{Role: enginesim.RolePrefill, Capacity: capa})
	require.NoError(t, err, "the simulator takes the capacity")
	require.NoError(t, s.Close())

	require.Equal(t, CacheBoundRig, p.Rig.Name)
	require.Equal(t, 3, p.Rig.Prefill)
	require.Equal(t, 3, p.Rig.Decode)
	require.Equal(t, []float64{0.55, 0.7, 0.85}, p.Loads)
	require.Len(t, p.Speedups, 3)
	require.Equal(t, &SLO{TTFT: 500 * time.Millisecond}, p.SLO)
	require.Equal(t, 1000, p.Requests)
	require.Equal(t, 2, p.Repeats)
	var names []string
	for _, pr := range p.Profiles {
		names = append(names, pr.Name)
	}
	require.Equal(t, []string{"round-robin", "vllm-router-cache-aware", "least-work", "pdx-default", PreciseProfile, OracleProfile}, names)
	require.Equal(t, []string{"pdx-default", DefaultPeersProfile, PreciseProfile, PrecisePeersProfile, DefaultPeersAtOnceProfile, PrecisePeersAtOnceProfile, PrecisePeersJitter16Profile}, p.ReplicaPolicies)
	require.Equal(t, []int{1, 3}, p.ReplicaCounts)
	require.NoError(t, p.Rig.CheckProfiles(p.Profiles))
	require.Nil(t, p.Rig.DecodeCapacity, "decode engines as the prefill ones")

	c.DecodeKVBlocks = 180
	p, err = c.Plan()
	require.NoError(t, err)
	decode := *capa
	decode.KVBlocks = 180
	require.Equal(t, &decode, p.Rig.DecodeCapacity, "the decode engines' KV alone differs")
	require.Equal(t, capa, p.Rig.Capacity)
	opts, _ := p.Rig.options(p.Profiles[0], 1)
	require.Equal(t, &decode, opts.DecodeCapacity)

	c.Policies = []string{"no-such-policy"}
	_, err = c.Plan()
	require.ErrorContains(t, err, `unknown policy "no-such-policy"`)
	c = headRig()
	c.TracePath = filepath.Join(t.TempDir(), "missing.jsonl")
	_, err = c.Plan()
	require.ErrorContains(t, err, "cache-bound rig")
}

// TestCacheBoundReplay replays the testdata's conversation turns on the
// cache-bound rig at one fixed speedup, pdx's default (at 1 and 2
// replicas) and the oracle, each twice: no round robin runs unless asked,
// every answer whole and its own, the rate the speedup's, each replay's
// own figures and the engines' service in the result, pdx's prediction of
// what the engines found cached against what they reported, the replicas
// measured against the oracle, and the rig's report.
func TestCacheBoundReplay(t *testing.T) {
	c := headRig()
	c.Points = []CacheBoundPoint{{Load: 0.7, Speedup: 4}}
	c.Policies = []string{"pdx-default", OracleProfile}
	c.ReplicaCounts = []int{1, 2}
	c.Requests = 40
	p, err := c.Plan()
	require.NoError(t, err)
	p.Progress = testWriter{t}
	p.Rig.PromptTokensDetails = true
	rep, err := Run(t.Context(), p)
	require.NoError(t, err)
	require.NoError(t, rep.Violations())
	require.Len(t, rep.Runs, 2)
	require.True(t, rep.PromptTokensDetails)
	require.Len(t, rep.ReplicaRuns, 2)
	tr := rep.Traces[0]
	require.Equal(t, []float64{4 * tr.NativeRate}, tr.Rates)
	require.Zero(t, tr.GuessRate, "no calibration")
	require.Positive(t, tr.DistinctBlocks)
	require.Equal(t, &SLO{TTFT: 500 * time.Millisecond}, p.SLO)
	require.Equal(t, *p.SLO, tr.SLO)
	for _, r := range append(rep.Runs, rep.ReplicaRuns...) {
		require.Equal(t, 80, r.Requests, "two replays of 40")
		require.Zero(t, r.Errors, "%s: %v", r.Policy, r.ErrorSamples)
		require.Zero(t, r.RRBusyShare, "round robin did not run")
		require.Equal(t, 0.7, r.TargetLoad)
		require.Positive(t, r.BusyShare)
		require.Len(t, r.PerRepeat, 2)
		require.Equal(t, 2, r.Service.Slots)
		require.Equal(t, c.PrefillTokensPerSec, r.Service.TokensPerSec)
		require.Positive(t, r.Service.Prefills)
		require.Positive(t, r.Service.DeliveredTokensPerSec)
		require.LessOrEqual(t, r.Service.DeliveredTokensPerSec, 1.01*r.Service.TokensPerSec, "timers wake late, never early")
		// The harness's split of the hit is of what the engines found: the
		// prompt tokens cached where each prefill came, as forecast at its
		// arrival, are the run's prefix hit but for evictions before the
		// engine took it, and the engine holding the most held no less.
		pr := r.Placement
		require.NotNil(t, pr, "%s x%d", r.Policy, r.Replicas)
		require.InDelta(t, r.PrefixHitRate, pr.HitTaken, 0.02, "%s x%d", r.Policy, r.Replicas)
		require.GreaterOrEqual(t, pr.HitBest, pr.HitTaken, "%s x%d", r.Policy, r.Replicas)
		if r.Oracle {
			require.Nil(t, r.SelfCheck, "the oracle is not pdx")
			continue
		}
		// pdx hashes prompts in the engines' blocks: what it predicts
		// cached is what they report, within a block of a few prefills.
		c := r.SelfCheck
		require.NotNil(t, c, "%s x%d", r.Policy, r.Replicas)
		require.Positive(t, c.ReportedCachedTokens, "the trace's turns share prefixes")
		t.Logf("%s x%d: predicted %d, reported %d cached", r.Policy, r.Replicas, c.PredictedCachedTokens, c.ReportedCachedTokens)
		require.InDelta(t, 1, c.Ratio, 0.2, "%s x%d", r.Policy, r.Replicas)
	}
	require.Equal(t, 2, rep.ReplicaRuns[1].Replicas)
	require.NotNil(t, rep.ReplicaRuns[1].VsOracle, "the replicas' distance from the oracle")

	out := t.TempDir()
	require.NoError(t, rep.Write(out))
	summary, err := os.ReadFile(filepath.Join(out, "summary.md"))
	require.NoError(t, err)
	for _, want := range []string{"# Trace replay: the cache-bound rig", "**Goodput: TTFT ≤ 500 ms**", "2 prompts at once",
		"| 70% → – | pdx-default | 1 |", "| 70% → – | pdx-default | 2 |", "| 70% → – | oracle | 1 |", "TTFT p90 × oracle",
		"2500 + 5 ms →", "Placement's self-check", "held, ", "pdx-default x2 at 70% → –: "} {
		require.Contains(t, string(summary), want)
	}
}
