package replay

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

// oracleProfile is the table's oracle.
func oracleProfile(t *testing.T) Profile {
	t.Helper()
	ps, err := SelectProfiles(Profiles(Scale{TokenScale: 16}), []string{OracleProfile})
	require.NoError(t, err)
	require.True(t, ps[0].Oracle)
	return ps[0]
}

// TestOraclePicks drives the oracle through constructed cases on the
// replay's engines: a new context goes to an idle engine, not one holding
// another's; a known one to the prefill engine that holds it, and its
// decode to the decode engine that holds it; unless that prefill engine is
// so busy that computing the context elsewhere is sooner. Every answer is
// its own, whole, and no engine refuses a hand-off.
func TestOraclePicks(t *testing.T) {
	rig := Rig{Prefill: 2, Decode: 2, Scale: Scale{TokenScale: 16}, TimeScale: 0.0625}
	d, err := rig.start(t.Context(), oracleProfile(t), 1)
	require.NoError(t, err)
	defer func() { require.NoError(t, d.Close()) }()
	client := newClient()
	defer client.CloseIdleConnections()

	// Two tenants' 8-block contexts (256 simulated tokens each), then a
	// block of a request's own.
	question := int64(1000)
	request := func(tenant int64) Request {
		ids := []int64{}
		for b := range int64(8) {
			ids = append(ids, 100*tenant+b)
		}
		question++
		reqs, err := rig.Scale.Requests([]TraceRequest{{InputLength: 9 * TraceBlockTokens, OutputLength: 64, HashIDs: append(ids, question)}})
		require.NoError(t, err)
		return reqs[0]
	}
	// sendTo sends r and names the prefill and decode engines that served
	// it.
	sendTo := func(r Request) (prefill, decode int) {
		t.Helper()
		before := engineStats(d.st)
		o := send(t.Context(), client, d.URL(), r)
		require.True(t, o.OK(), "%+v", o)
		require.Equal(t, r.MaxTokens, o.Tokens)
		after := engineStats(d.st)
		return changed(t, before.PrefillRequests, after.PrefillRequests), changed(t, before.DecodeRequests, after.DecodeRequests)
	}
	cached := func(e *enginesim.Server, r Request) int {
		return e.CachedPrefixTokens(enginesim.ChatPromptText([]enginesim.Message{{Role: "user", Content: r.Prompt}}))
	}

	a1 := request(1)
	pa, da := sendTo(a1)
	require.Positive(t, cached(d.st.Prefill[pa], a1))
	pb, db := sendTo(request(2))
	require.NotEqual(t, pa, pb, "a new context goes to the idle engine that holds none")
	require.NotEqual(t, da, db)

	for range 3 {
		p, dec := sendTo(request(1))
		require.Equal(t, pa, p, "tenant 1's context is cached on prefill engine %d", pa)
		require.Equal(t, da, dec, "and on decode engine %d, which pulls the least", da)
		p, dec = sendTo(request(2))
		require.Equal(t, pb, p)
		require.Equal(t, db, dec)
	}

	// Prefill engine pa computes a long prompt (about 1.3 s) sent to it
	// directly: tenant 1's next request waits less on the other engine,
	// which computes the context anew (about 20 ms).
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	busy := make(chan struct{})
	go func() {
		defer close(busy)
		long, err := rig.Scale.Requests([]TraceRequest{{InputLength: 20000 * 16, OutputLength: 1, HashIDs: uniqueIDs(-1000, 20000*16/TraceBlockTokens)}})
		if err == nil {
			send(ctx, client, "http://"+d.st.Prefill[pa].Addr(), long[0])
		}
	}()
	require.Eventually(t, func() bool {
		return d.st.Prefill[pa].ForecastPrefill("x").Wait > time.Second
	}, 10*time.Second, time.Millisecond, "the long prompt is computing")
	p, _ := sendTo(request(1))
	require.Equal(t, pb, p, "the cached engine is busy for a second: the other computes sooner")
	// Read before the long prompt is cancelled: the engine counts its
	// client going away (499) among its refusals, sooner or later.
	es := engineStats(d.st)
	cancel()
	<-busy

	require.Zero(t, es.Rejected, "no KV hand-off refused")
	require.Positive(t, es.PrefillHitTokens)
}

// changed is the index of the one count that grew.
func changed(t *testing.T, before, after []int) int {
	t.Helper()
	idx := -1
	for i := range after {
		if after[i] != before[i] {
			require.Equal(t, -1, idx, "more than one engine served: %v → %v", before, after)
			require.Equal(t, before[i]+1, after[i])
			idx = i
		}
	}
	require.NotEqual(t, -1, idx, "no engine served: %v", after)
	return idx
}

func uniqueIDs(from int64, n int) []int64 {
	ids := make([]int64, n)
	for i := range ids {
		ids[i] = from - int64(i)
	}
	return ids
}

// TestOracleReplay replays a small tenants workload under round robin and
// the oracle: every answer whole and its own, no KV hand-off refused, the
// oracle's rows in the report with every other policy's distance from it.
func TestOracleReplay(t *testing.T) {
	out := t.TempDir()
	rr, err := SelectProfiles(Profiles(Scale{TokenScale: 16}), []string{"round-robin"})
	require.NoError(t, err)
	w := Tenants{Tenants: 6, ContextBlocks: 8, QuestionTokens: 300, OutputTokens: 64, Rate: 1, Seed: 7}
	plan := Plan{
		Rig:        Rig{Prefill: 2, Decode: 2, Scale: Scale{TokenScale: 16}, TimeScale: 0.0625},
		Traces:     []TraceFile{{Name: TenantsTrace, Tenants: &w, Loads: []float64{0.6}}},
		Profiles:   append(rr, oracleProfile(t)),
		Loads:      []float64{0.5, 0.9}, // the trace's own win
		Requests:   40,
		TTFTFactor: 5, TPOTFactor: 2,
		ExtraPoolYAML: "saturation: {disabled: true}",
		Progress:      testWriter{t},
	}
	rep, err := Run(t.Context(), plan)
	require.NoError(t, err)
	require.Len(t, rep.Runs, 2)
	require.Equal(t, []float64{0.6}, rep.Traces[0].Loads)
	require.Equal(t, &w, rep.Traces[0].Workload)
	o := rep.Runs[1]
	require.Equal(t, OracleProfile, o.Policy)
	require.True(t, o.Oracle)
	require.Nil(t, o.VsOracle)
	for _, r := range rep.Runs {
		require.Equal(t, 40, r.Requests)
		require.Zero(t, r.Errors, "%s: %v", r.Policy, r.ErrorSamples)
		require.Zero(t, r.MixUps)
		require.Zero(t, r.Engines.Rejected, "KV hand-offs refused")
		require.Equal(t, 40, sum(r.Engines.PrefillRequests), "every request prefilled once")
		require.Equal(t, 40, sum(r.Engines.DecodeRequests))
		require.Positive(t, r.PrefixHitRate, "%s: tenants share their contexts", r.Policy)
	}
	require.Zero(t, o.CPU.Router, "the oracle's CPU is the harness's")
	g := rep.Runs[0].VsOracle
	require.NotNil(t, g, "round robin's distance from the oracle")
	require.InDelta(t, rep.Runs[0].TTFT.P90/o.TTFT.P90, g.TTFTP90, 1e-9)
	require.InDelta(t, 100*(rep.Runs[0].Goodput-o.Goodput), g.GoodputPoints, 1e-9)
	require.NoError(t, rep.Violations())

	require.NoError(t, rep.Write(out))
	summary, err := os.ReadFile(filepath.Join(out, "summary.md"))
	require.NoError(t, err)
	for _, want := range []string{"| oracle |", "**Oracle.**", "Distance from the oracle", "6 tenants chosen uniformly", "× oracle"} {
		require.Contains(t, string(summary), want)
	}
	require.True(t, strings.Count(string(summary), "| round-robin |") >= 2, "round robin in both tables")
	info, err := os.Stat(filepath.Join(out, "ttft-p90-vs-load-tenants.png"))
	require.NoError(t, err)
	require.Positive(t, info.Size())
}

// testWriter logs the replay's progress lines.
type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
