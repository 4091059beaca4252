package replay

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestProfiles(t *testing.T) {
	names := func(ps []Profile) []string {
		var out []string
		for _, p := range ps {
			out = append(out, p.Name)
		}
		return out
	}
	all := Profiles(Scale{TokenScale: 16})
	require.Equal(t, []string{"round-robin", "least-request", "llm-d-default", "pdx-default", "prefix-affinity"}, names(all))
	require.Contains(t, all[2].PoolYAML, "disaggregation: {min_uncached_tokens: 1}", "llm-d's 16 tokens at scale 16")
	require.Contains(t, Profiles(Scale{TokenScale: 4})[2].PoolYAML, "min_uncached_tokens: 4")

	got, err := SelectProfiles(all, []string{"pdx-default", "round-robin"})
	require.NoError(t, err)
	require.Equal(t, []string{"pdx-default", "round-robin"}, names(got))
	_, err = SelectProfiles(all, []string{"random"})
	require.ErrorContains(t, err, `unknown policy "random"`)
	require.Equal(t, []string{"round-robin", "pdx-default"}, names(withRoundRobin(got[:1], all)), "round robin runs first, always")
}

// TestCheckProfiles fails a bad policy config before anything starts,
// naming the policy.
func TestCheckProfiles(t *testing.T) {
	rig := Rig{Prefill: 2, Decode: 2, Scale: Scale{TokenScale: 16}, TimeScale: 0.1}
	require.NoError(t, rig.CheckProfiles(Profiles(rig.Scale)[:1]))
	err := rig.CheckProfiles([]Profile{{Name: "broken", PoolYAML: "prefill_picker: {policy: no_such_policy}\n"}})
	require.ErrorContains(t, err, "policy broken")
}

// TestReplay replays a few dozen requests of the conversation trace through
// the real Envoy, pdx (two replicas in the affinity run) and simulated
// engines with round robin at one load point: every answer whole and its
// own, no KV hand-off refused, the engines' prefix caches counting, the
// report written.
func TestReplay(t *testing.T) {
	out := t.TempDir()
	plan := Plan{
		Rig:           Rig{Prefill: 2, Decode: 2, Scale: Scale{TokenScale: 16}, TimeScale: 0.0625},
		Traces:        []TraceFile{{Name: "conversation", Path: filepath.Join("testdata", "conversation-head.jsonl")}},
		Profiles:      Profiles(Scale{TokenScale: 16})[:1],
		Loads:         []float64{0.5},
		Requests:      40,
		ReplicaCounts: []int{1, 2},
		TTFTFactor:    5, TPOTFactor: 2,
		// Shedding (429) is a policy's outcome; this test checks the
		// harness, whose every request must come back whole.
		ExtraPoolYAML: "saturation: {disabled: true}",
	}
	rep, err := Run(t.Context(), plan)
	require.NoError(t, err)
	require.Len(t, rep.Runs, 1)
	require.Len(t, rep.ReplicaRuns, 2)
	require.Equal(t, 2, rep.ReplicaRuns[1].Replicas)
	for _, r := range append(rep.Runs, rep.ReplicaRuns...) {
		require.Equal(t, 40, r.Requests)
		require.Zero(t, r.Errors, "%v", r.ErrorSamples)
		require.Zero(t, r.Shed+r.Broken)
		require.Zero(t, r.MixUps)
		require.Zero(t, r.Engines.Rejected, "KV hand-offs refused")
		require.Positive(t, r.Engines.PrefillQueryTokens)
		require.Positive(t, r.Engines.PrefillHitTokens, "the trace's shared first block is a hit")
		require.Positive(t, r.BusyShare)
		require.Positive(t, r.TTFT.P50)
		require.Equal(t, 40, sum(r.Engines.PrefillRequests), "every request prefilled once under round robin")
		require.Equal(t, 40, sum(r.Engines.DecodeRequests))
	}
	require.NoError(t, rep.Violations())
	require.Equal(t, "saturation: {disabled: true}", rep.ExtraPoolYAML)
	require.Positive(t, rep.Runs[0].RRBusyShare)
	require.Positive(t, rep.Traces[0].SLO.TTFT)

	require.NoError(t, rep.Write(out))
	for _, f := range []string{"results.json", "summary.md", "ttft-p90-vs-load-conversation.png", "goodput-vs-load-conversation.png"} {
		info, err := os.Stat(filepath.Join(out, f))
		require.NoError(t, err)
		require.Positive(t, info.Size(), f)
	}
	summary, err := os.ReadFile(filepath.Join(out, "summary.md"))
	require.NoError(t, err)
	require.Contains(t, string(summary), "| round-robin |")
}

func sum(xs []int) int {
	n := 0
	for _, x := range xs {
		n += x
	}
	return n
}
