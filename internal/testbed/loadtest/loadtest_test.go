package loadtest

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/pdx-router/pdx/internal/testbed/envoyproc"
	"github.com/pdx-router/pdx/internal/testbed/vllmrouter"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestRunSmall runs the harness end to end on a small plan: every scenario,
// the vllm-router peers too, answers without errors, pdx's P/D scenario and
// the peers really hand every request's KV from prefill to decode engines,
// the others call no prefill, and the report is written.
func TestRunSmall(t *testing.T) {
	envoyBin, err := envoyproc.Binary()
	require.NoError(t, err, "run `make envoy` or set ENVOY_BIN")
	_, err = vllmrouter.Dir()
	require.NoError(t, err)
	pdxBin := filepath.Join(t.TempDir(), "pdx")
	out, err := exec.Command("go", "build", "-o", pdxBin, "github.com/pdx-router/pdx/cmd/pdx").CombinedOutput()
	require.NoError(t, err, "%s", out)

	plan := Plan{
		PdxBin: pdxBin, EnvoyBin: envoyBin, VLLMRouter: true,
		Profiles:    []Profile{ZeroLatency},
		Concurrency: []int{1, 4}, SweepBody: 2048,
		Bodies: []int{512}, SizeConcurrency: 4,
		Streams: []bool{true},
		Warmup:  100 * time.Millisecond, Window: 600 * time.Millisecond,
		MemoryConcurrency: 8, MemoryBodies: []int{64 << 10},
		// Long enough that the 300 streams are all open before the first
		// prefill answers, on two loaded cores under -race (at 1 s, one
		// had already finished: 299 open at once).
		ParkedPrefill: 3 * time.Second,
		OpenStreams:   300,
		GoalRounds:    1,
		// At 512 clients and 32 KiB under -race a request took 4–6 s,
		// and a window of 0.6 s once closed with none complete.
		GoalWindow: 3 * time.Second,
		Progress:   t.Output(), // in the log of a failure
	}
	rep, err := Run(t.Context(), plan)
	require.NoError(t, err)

	require.Equal(t, vllmrouter.Version, rep.VLLMRouter)
	require.Len(t, rep.Points, 3*(len(Scenarios)+1)) // (1, 2K), (4, 2K), (4, 512), each with FloorAtPdxRate
	for _, p := range rep.Points {
		require.Zero(t, p.Errors, "%+v", p)
		require.Positive(t, p.Requests, "%+v", p)
		// Warm-up requests count at the engines, not in the window.
		require.GreaterOrEqual(t, p.Answered, p.Requests, "%+v", p)
		require.Zero(t, p.EngineRejected, "%+v", p)
		require.Positive(t, p.RouterCPUPer1k, "%+v", p)
		require.Positive(t, p.RouterPeakRSSMiB, "%+v", p)
		if p.Scenario.Disaggregated() {
			require.Equal(t, p.Answered, p.KVPulled, "every answer's decode pulled its KV: %+v", p)
		} else {
			require.Zero(t, p.KVPulled, "%+v", p)
		}
		if p.Scenario == FloorAtPdxRate {
			// Paced to pdx's throughput at the same point: no more than
			// its rate, but for the clients' last requests of the window.
			i := slices.IndexFunc(rep.Points, func(q Point) bool {
				return q.Scenario == PD && q.Concurrency == p.Concurrency && q.BodyBytes == p.BodyBytes
			})
			require.GreaterOrEqual(t, i, 0)
			pd := rep.Points[i]
			require.LessOrEqual(t, p.Throughput, 1.1*pd.Throughput+float64(p.Concurrency)/p.Seconds+2, "paced to %v: %+v", pd.Throughput, p)
		}
		switch {
		case p.Scenario.Floor():
			require.Zero(t, p.AddedP50Ms)
			require.Zero(t, p.PdxCPUPer1k, "%+v", p)
			require.Equal(t, p.EnvoyCPUPer1k, p.RouterCPUPer1k, "%+v", p)
		case p.Scenario.Peer():
			require.Zero(t, p.PdxCPUPer1k+p.EnvoyCPUPer1k, "%+v", p)
			require.Zero(t, p.PdxPeakRSSMiB, "%+v", p)
		default:
			require.Positive(t, p.PdxCPUPer1k, "%+v", p)
			require.Positive(t, p.EnvoyCPUPer1k, "%+v", p)
			require.InDelta(t, p.PdxCPUPer1k+p.EnvoyCPUPer1k, p.RouterCPUPer1k, 1e-9, "%+v", p)
			require.Greater(t, p.RouterPeakRSSMiB, p.PdxPeakRSSMiB, "pdx and its Envoy: %+v", p)
		}
	}
	require.Len(t, rep.Goals, 2*len(GoalShapes), "the floor and pdx at each goal point")
	for i, p := range rep.Goals {
		g := GoalShapes[i/2]
		require.Equal(t, []any{1, []Scenario{Floor, PD}[i%2], g.Concurrency, g.BodyBytes, false},
			[]any{p.Round, p.Scenario, p.Concurrency, p.BodyBytes, p.Stream}, "%+v", p)
		require.Zero(t, p.Errors, "%+v", p)
		require.Positive(t, p.Requests, "%+v", p)
		require.Positive(t, p.EnvoyCPUPer1k, "%+v", p)
		require.Equal(t, map[Scenario]int{PD: p.Answered}[p.Scenario], p.KVPulled, "%+v", p)
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
	require.Len(t, back.Goals, len(rep.Goals))
	for _, f := range []string{"summary.md", "latency-vs-concurrency.png", "overhead-vs-size.png"} {
		st, err := os.Stat(filepath.Join(dir, f))
		require.NoError(t, err)
		require.Positive(t, st.Size(), f)
	}
}
