package loadtest

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/pdx-router/pdx/internal/testbed/envoyproc"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestRunSmall runs the harness end to end on a small plan: every scenario
// answers without errors, the pdx scenario really hands KV from prefill to
// decode engines, the others call no prefill, and the report is written.
func TestRunSmall(t *testing.T) {
	envoyBin, err := envoyproc.Binary()
	require.NoError(t, err, "run `make envoy` or set ENVOY_BIN")
	pdxBin := filepath.Join(t.TempDir(), "pdx")
	out, err := exec.Command("go", "build", "-o", pdxBin, "github.com/pdx-router/pdx/cmd/pdx").CombinedOutput()
	require.NoError(t, err, "%s", out)

	plan := Plan{
		PdxBin: pdxBin, EnvoyBin: envoyBin,
		Profiles:    []Profile{ZeroLatency},
		Concurrency: []int{1, 4}, SweepBody: 2048,
		Bodies: []int{512}, SizeConcurrency: 4,
		Streams: []bool{true},
		Warmup:  100 * time.Millisecond, Window: 600 * time.Millisecond,
		MemoryConcurrency: 8, MemoryBodies: []int{64 << 10},
		ParkedPrefill: time.Second,
		OpenStreams:   300,
	}
	rep, err := Run(t.Context(), plan)
	require.NoError(t, err)

	require.Len(t, rep.Points, 3*len(Scenarios)) // (1, 2K), (4, 2K), (4, 512)
	for _, p := range rep.Points {
		require.Zero(t, p.Errors, "%+v", p)
		require.Positive(t, p.Requests, "%+v", p)
		require.Zero(t, p.EngineRejected, "%+v", p)
		require.Positive(t, p.EnvoyCPUPer1k, "%+v", p)
		if p.Scenario == PD {
			// Warm-up requests count at the engines, not in the window.
			require.GreaterOrEqual(t, p.KVPulled, p.Requests, "every pdx request's decode pulled its KV: %+v", p)
		} else {
			require.Zero(t, p.KVPulled, "%+v", p)
		}
		if p.Scenario == Floor {
			require.Zero(t, p.AddedP50Ms)
		} else {
			require.Positive(t, p.PdxCPUPer1k, "%+v", p)
		}
	}
	require.Len(t, rep.Memory, 1)
	require.Greater(t, rep.Memory[0].HeapMiB, rep.Memory[0].IdleHeapMiB, "parked requests hold memory")
	require.Equal(t, &Streams{Streams: 300, Connections: streamConns, MaxOpen: rep.Streams.MaxOpen, Routed: 300,
		Seconds: rep.Streams.Seconds, HeapMiB: rep.Streams.HeapMiB, RSSMiB: rep.Streams.RSSMiB}, rep.Streams)
	require.Equal(t, int64(300), rep.Streams.MaxOpen, "all streams were open at once")

	dir := t.TempDir()
	require.NoError(t, rep.Write(dir))
	var back Report
	b, err := os.ReadFile(filepath.Join(dir, "results.json"))
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &back))
	require.Len(t, back.Points, len(rep.Points))
	for _, f := range []string{"summary.md", "latency-vs-concurrency.png", "overhead-vs-size.png"} {
		st, err := os.Stat(filepath.Join(dir, f))
		require.NoError(t, err)
		require.Positive(t, st.Size(), f)
	}
}
