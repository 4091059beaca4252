package replay

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

// oracleProfile is the table's oracle of that name.
func oracleProfile(t *testing.T, name string) Profile {
	t.Helper()
	ps, err := SelectProfiles(Profiles(Scale{TokenScale: 16}), []string{name})
	require.NoError(t, err)
	require.True(t, ps[0].Oracle || ps[0].Direct)
	return ps[0]
}

// oracleRig is the rig of the oracle's tests: two engines of each role.
var oracleRig = Rig{Prefill: 2, Decode: 2, Scale: Scale{TokenScale: 16}, TimeScale: 0.0625}

// oracleTest is an oracle in front of oracleRig's engines, with the means
// to send it requests and see where they went.
type oracleTest struct {
	t        *testing.T
	d        *deployment
	client   *http.Client
	question int64 // the last question block's id
}

func startOracleTest(t *testing.T, profile string) *oracleTest {
	t.Helper()
	d, err := oracleRig.start(t.Context(), oracleProfile(t, profile), 1)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, d.Close()) })
	client := newClient()
	t.Cleanup(client.CloseIdleConnections)
	return &oracleTest{t: t, d: d, client: client, question: 1000}
}

// request is a tenant's 8-block context (256 simulated tokens) and a
// block of a question of its own.
func (ot *oracleTest) request(tenant int64) Request {
	ot.t.Helper()
	var ids []int64
	for b := range int64(8) {
		ids = append(ids, 100*tenant+b)
	}
	ot.question++
	reqs, err := oracleRig.Scale.Requests([]TraceRequest{{InputLength: 9 * TraceBlockTokens, OutputLength: 64, HashIDs: append(ids, ot.question)}})
	require.NoError(ot.t, err)
	return reqs[0]
}

// sendTo sends r and names the prefill engine that served it (-1: none,
// decode-alone) and the decode engine.
func (ot *oracleTest) sendTo(r Request) (prefill, decode int) {
	ot.t.Helper()
	before, alone := engineStats(ot.d.st), ot.d.oracle.DecodeAlone()
	o := send(ot.t.Context(), ot.client, ot.d.URL(), r)
	require.True(ot.t, o.OK(), "%+v", o)
	require.Equal(ot.t, r.MaxTokens, o.Tokens)
	after := engineStats(ot.d.st)
	prefill = -1
	if sum(after.PrefillRequests) != sum(before.PrefillRequests) {
		prefill = changed(ot.t, before.PrefillRequests, after.PrefillRequests)
	}
	require.Equal(ot.t, prefill == -1, ot.d.oracle.DecodeAlone() == alone+1, "the oracle counts its decode-alone requests")
	return prefill, changed(ot.t, before.DecodeRequests, after.DecodeRequests)
}

// busy has each engine compute two long prompts (about 1.5 s each) sent
// to it directly, until ctx ends.
func (ot *oracleTest) busy(ctx context.Context, engines ...*enginesim.Server) {
	ot.t.Helper()
	const tokens = 688 * TraceBlockTokens / 16 // simulated, 22,016: under an engine's 27,000 blocks of KV
	for i, e := range engines {
		for k := range 2 {
			long, err := oracleRig.Scale.Requests([]TraceRequest{{InputLength: tokens * 16, OutputLength: 16,
				HashIDs: uniqueIDs(-1000-int64(2*i+k)*1000, tokens*16/TraceBlockTokens)}})
			require.NoError(ot.t, err)
			done := make(chan struct{})
			go func() {
				defer close(done)
				send(ctx, ot.client, "http://"+e.Addr(), long[0])
			}()
			ot.t.Cleanup(func() { <-done })
		}
	}
	for _, e := range engines {
		require.Eventually(ot.t, func() bool {
			return e.ForecastPrefill("x").Wait > 2*time.Second
		}, 10*time.Second, time.Millisecond, "both long prompts are in")
	}
}

func cachedOn(e *enginesim.Server, r Request) int {
	return e.CachedPrefixTokens(enginesim.ChatPromptText([]enginesim.Message{{Role: "user", Content: r.Prompt}}))
}

// TestOraclePicks drives the P/D oracle through constructed cases on the
// replay's engines: a new context goes to an idle engine, not one holding
// another's; a known one to the prefill engine that holds it, and its
// decode to the decode engine that holds it; unless that prefill engine is
// so busy that computing the context elsewhere is sooner. Every answer is
// its own, whole, and no engine refuses a hand-off.
func TestOraclePicks(t *testing.T) {
	ot := startOracleTest(t, OracleProfile)
	a1 := ot.request(1)
	pa, da := ot.sendTo(a1)
	require.NotEqual(t, -1, pa, "P/D")
	require.Positive(t, cachedOn(ot.d.st.Prefill[pa], a1))
	pb, db := ot.sendTo(ot.request(2))
	require.NotEqual(t, pa, pb, "a new context goes to the idle engine that holds none")
	require.NotEqual(t, da, db)
	for range 3 {
		p, dec := ot.sendTo(ot.request(1))
		require.Equal(t, pa, p, "tenant 1's context is cached on prefill engine %d", pa)
		require.Equal(t, da, dec, "and on decode engine %d, which pulls the least", da)
		p, dec = ot.sendTo(ot.request(2))
		require.Equal(t, pb, p)
		require.Equal(t, db, dec)
	}
	// Prefill engine pa computes long prompts: tenant 1's next request
	// waits less on the other engine, which computes the context anew.
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	ot.busy(ctx, ot.d.st.Prefill[pa])
	p, _ := ot.sendTo(ot.request(1))
	require.Equal(t, pb, p, "the cached engine is busy: the other computes sooner")
	// Read before the long prompts are cancelled: the engines count their
	// clients going away (499) among their refusals.
	es := engineStats(ot.d.st)
	cancel()
	require.Zero(t, es.Rejected, "no KV hand-off refused")
	require.Positive(t, es.PrefillHitTokens)
	require.Zero(t, ot.d.oracle.DecodeAlone())
}

// TestDirectRoundRobin: on the oracle's path round robin places as pdx's
// round robin does, whatever the engines hold.
func TestDirectRoundRobin(t *testing.T) {
	ot := startOracleTest(t, DirectRoundRobinProfile)
	var prefills, decodes []int
	for range 4 {
		p, d := ot.sendTo(ot.request(1))
		prefills, decodes = append(prefills, p), append(decodes, d)
	}
	require.Equal(t, []int{0, 1, 0, 1}, prefills, "round robin, not to the engine holding the context")
	require.Equal(t, []int{0, 1, 0, 1}, decodes)
	require.Zero(t, engineStats(ot.d.st).Rejected, "no KV hand-off refused")
}

// TestOracleReusePicks drives oracle-reuse through constructed cases on
// idle engines, where a decode engine computing a prompt gives its first
// token a KV pull and a decode step sooner than P/D: a new context goes
// decode-alone to an idle decode engine, not one holding another's; a
// known one to the decode engine that holds it. Every answer is its own,
// whole, and no engine refuses a request.
func TestOracleReusePicks(t *testing.T) {
	ot := startOracleTest(t, OracleReuseProfile)
	a1 := ot.request(1)
	pa, da := ot.sendTo(a1)
	require.Equal(t, -1, pa, "decode-alone")
	require.Positive(t, cachedOn(ot.d.st.Decode[da], a1))
	pb, db := ot.sendTo(ot.request(2))
	require.Equal(t, -1, pb)
	require.NotEqual(t, da, db, "a new context goes to the idle engine that holds none")
	for range 3 {
		p, dec := ot.sendTo(ot.request(1))
		require.Equal(t, -1, p)
		require.Equal(t, da, dec, "tenant 1's context is cached on decode engine %d", da)
		p, dec = ot.sendTo(ot.request(2))
		require.Equal(t, -1, p)
		require.Equal(t, db, dec)
	}
	require.EqualValues(t, 8, ot.d.oracle.DecodeAlone())
	es := engineStats(ot.d.st)
	require.Zero(t, es.Rejected)
	require.Positive(t, es.AllHitTokens)
}

// TestOracleDecodeAlone: once a decode engine holds a request's whole
// prompt, the request goes there alone unless that engine's prefill
// server is busy, when it goes P/D: back to the prefill engine that
// computed it, and around a busy one.
func TestOracleDecodeAlone(t *testing.T) {
	tests := []struct {
		name                    string
		busyPrefill, busyDecode []int // engines computing long prompts
		sends                   int   // of the request, after the engines are busy
		wantAlone               bool
		wantPrefill             int // of a P/D request; -1: any, the same for every send
	}{
		{name: "idle: its last token on the decode engine is sooner than a pull and a step", sends: 1, wantAlone: true},
		{name: "prefill engines busy", busyPrefill: []int{0, 1}, sends: 1, wantAlone: true},
		{name: "decode engines busy: P/D, to the prefill engine that holds it", busyDecode: []int{0, 1}, sends: 2, wantPrefill: -1},
		{name: "decode engines and a prefill engine busy: P/D through the other", busyPrefill: []int{0}, busyDecode: []int{0, 1}, sends: 1, wantPrefill: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ot := startOracleTest(t, OracleReuseProfile)
			r := ot.request(1)
			p, holder := ot.sendTo(r)
			require.Equal(t, -1, p, "idle engines: decode-alone")
			require.Equal(t, simTokens(r)-1, cachedOn(ot.d.st.Decode[holder], r), "decode engine %d holds the whole prompt", holder)

			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			var busy []*enginesim.Server
			for _, i := range tt.busyPrefill {
				busy = append(busy, ot.d.st.Prefill[i])
			}
			for _, i := range tt.busyDecode {
				busy = append(busy, ot.d.st.Decode[i])
			}
			ot.busy(ctx, busy...)
			first := -1
			for k := range tt.sends {
				p, dec := ot.sendTo(r)
				if tt.wantAlone {
					require.Equal(t, -1, p, "decode-alone")
					require.Equal(t, holder, dec, "on the decode engine that holds it")
					continue
				}
				require.NotEqual(t, -1, p, "P/D")
				if tt.wantPrefill >= 0 {
					require.Equal(t, tt.wantPrefill, p)
				}
				if k == 0 {
					first = p
				}
				require.Equal(t, first, p, "the prefill engine that computed it holds it")
			}
			// Read before the long prompts are cancelled: the engines count
			// their clients going away (499) among their refusals.
			require.Zero(t, engineStats(ot.d.st).Rejected, "no KV hand-off refused")
			cancel()
		})
	}
}

// simTokens is r's prompt in the simulator's tokens (4 bytes each, the
// last one partly), as the engines see it.
func simTokens(r Request) int {
	return (len(enginesim.ChatPromptText([]enginesim.Message{{Role: "user", Content: r.Prompt}})) + 3) / 4
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
// both oracles: every answer whole and its own, no KV hand-off refused,
// the oracles' rows in the report with every other policy's distance from
// the P/D one.
func TestOracleReplay(t *testing.T) {
	out := t.TempDir()
	rr, err := SelectProfiles(Profiles(Scale{TokenScale: 16}), []string{"round-robin"})
	require.NoError(t, err)
	w := Tenants{Tenants: 6, ContextBlocks: 8, QuestionTokens: 300, OutputTokens: 64, Rate: 1, Seed: 7}
	plan := Plan{
		Rig:        Rig{Prefill: 2, Decode: 2, Scale: Scale{TokenScale: 16}, TimeScale: 0.0625},
		Traces:     []TraceFile{{Name: TenantsTrace, Tenants: &w, Loads: []float64{0.6}}},
		Profiles:   append(rr, oracleProfile(t, OracleProfile), oracleProfile(t, OracleReuseProfile)),
		Loads:      []float64{0.5, 0.9}, // the trace's own win
		Requests:   40,
		TTFTFactor: 5, TPOTFactor: 2,
		ExtraPoolYAML: "saturation: {disabled: true}",
		Progress:      testWriter{t},
	}
	rep, err := Run(t.Context(), plan)
	require.NoError(t, err)
	require.Len(t, rep.Runs, 3)
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
		require.Equal(t, 40, sum(r.Engines.DecodeRequests), "every request decoded once")
		require.Positive(t, r.PrefixHitRateAll, "%s: tenants share their contexts", r.Policy)
		judged := 0 // oracle-reuse may serve every request decode-alone: none to judge
		if r.Placement != nil {
			judged = r.Placement.Prefills
		}
		require.Equal(t, sum(r.Engines.PrefillRequests), judged, "%s: every prefill leg judged", r.Policy)
	}
	reuse := rep.Runs[2]
	require.Equal(t, OracleReuseProfile, reuse.Policy)
	require.NotNil(t, reuse.VsOracle, "measured against the P/D oracle")
	require.Equal(t, 40, sum(rep.Runs[0].Engines.PrefillRequests), "round robin prefills every request once")
	require.Equal(t, 40, sum(o.Engines.PrefillRequests), "the P/D oracle too")
	require.Less(t, sum(reuse.Engines.PrefillRequests), 40, "oracle-reuse serves some decode-alone")
	require.Zero(t, o.CPU.Router, "the oracle's CPU is the harness's")
	g := rep.Runs[0].VsOracle
	require.NotNil(t, g, "round robin's distance from the oracle")
	require.InDelta(t, rep.Runs[0].TTFT.P90/o.TTFT.P90, g.TTFTP90, 1e-9)
	require.InDelta(t, 100*(rep.Runs[0].Goodput-o.Goodput), g.GoodputPoints, 1e-9)
	require.NoError(t, rep.Violations())

	require.NoError(t, rep.Write(out))
	summary, err := os.ReadFile(filepath.Join(out, "summary.md"))
	require.NoError(t, err)
	for _, want := range []string{"| oracle |", "**Oracle.**", "Distance from the oracle", "6 tenants chosen uniformly", "× oracle",
		"Prefills misplaced", "The oracle's own prefills, judged alike: oracle at 60%",
		fmt.Sprintf("- oracle-reuse at 60%%: %d of 40 requests decode-alone", 40-sum(reuse.Engines.PrefillRequests))} {
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
