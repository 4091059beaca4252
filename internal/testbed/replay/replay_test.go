package replay

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/vllmrouter"
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
	require.Equal(t, []string{"round-robin", "least-request", "llm-d-default", "pdx-default", "pdx-held", "pdx-uncounted", "prefix-affinity", "precise",
		"precise-peers", "pdx-default-peers", "precise-peers-at-once", "pdx-default-peers-at-once", "precise-peers-jitter-16", "precise-reuse", "least-work", "least-work-precise",
		"pdx-decode-load-aware", "pdx-decode-round-robin", "pdx-decode-least-request", "vllm-router-cache-aware", "vllm-router-kv-aware", "vllm-router-round-robin",
		"oracle", "oracle-decode-early", "oracle-decode-room-prefix", "oracle-decode-room-fewest", "oracle-decode-fewest", "oracle-decode-round-robin", "oracle-reuse",
		"direct-round-robin"}, names(all))
	require.Contains(t, all[4].ConfigYAML, "end_streams_at_routing: false")
	require.Contains(t, all[5].ConfigYAML, "end_streams_at_routing: true")
	precise := all[7]
	require.True(t, precise.pdx() && precise.KVEvents, "pdx reading the engines' events")
	require.Contains(t, precise.Config(), "kv_events")
	peers := all[8]
	require.True(t, peers.pdx() && peers.KVEvents && peers.Peers, "precise, the replicas exchanging their prefills")
	require.Contains(t, peers.Config(), "peers:")
	defaultPeers := all[9]
	require.True(t, defaultPeers.pdx() && !defaultPeers.KVEvents && defaultPeers.Peers, "the defaults, the replicas exchanging their prefills")
	require.Contains(t, defaultPeers.Config(), "peers:")
	for k, p := range all[10:12] {
		require.Equal(t, all[8+k].KVEvents, p.KVEvents, p.Name)
		require.Equal(t, all[8+k].PoolYAML, p.PoolYAML, p.Name)
		require.True(t, p.pdx() && p.Peers, p.Name)
		require.Contains(t, p.Config(), "peers: {addresses: [every replica's admin address], pick_jitter: 0s}", p.Name)
	}
	require.Contains(t, all[12].Config(), "pick_jitter: 16ms")
	reuse := all[13]
	require.True(t, reuse.pdx() && reuse.KVEvents)
	require.Contains(t, reuse.Config(), "kv_events")
	require.Contains(t, reuse.PoolYAML, fmt.Sprintf("min_uncached_tokens: %d", Scale{TokenScale: 16}.Tokens(1000)), "Dynamo's 1,000 tokens, scaled")
	for k, policy := range []string{"load_aware", "round_robin", "least_request"} {
		p := all[16+k]
		require.True(t, p.pdx() && !p.KVEvents, p.Name)
		require.Equal(t, "decode_picker: {policy: "+policy+"}\n", p.PoolYAML, "pdx's defaults but the decode leg's")
	}
	for _, p := range all[19:22] {
		require.NotEmpty(t, p.Peer, p.Name)
		require.Empty(t, p.PoolYAML+p.ConfigYAML, "a peer has no pdx config")
		require.Contains(t, p.Config(), "--policy "+p.Peer)
		require.Equal(t, p.Peer == "kv_aware", p.KVEvents, "only kv_aware reads the engines' KV events")
	}
	oracle := all[22]
	require.True(t, oracle.Oracle)
	require.Empty(t, oracle.Peer+oracle.PoolYAML+oracle.ConfigYAML, "the oracle is neither a peer nor pdx")
	require.False(t, oracle.pdx())
	require.Contains(t, oracle.Config(), "true state")
	require.False(t, oracle.DecodeAlone)
	for _, p := range all[23:28] {
		require.True(t, p.Oracle && p.OracleDecode != "" && !p.DecodeAlone, p.Name)
		require.Equal(t, "oracle-decode-"+p.OracleDecode, p.Name)
		require.Contains(t, p.Config(), "but the decode pick: "+oracleDecodePicks[p.OracleDecode], p.Name)
		require.NotEmpty(t, oracleDecodePicks[p.OracleDecode], p.Name)
	}
	oracleReuse := all[28]
	require.True(t, oracleReuse.Oracle && oracleReuse.DecodeAlone)
	require.False(t, oracleReuse.pdx())
	require.Contains(t, oracleReuse.Config(), "plain request to the decode engine")
	direct := all[29]
	require.True(t, direct.Direct && !direct.Oracle, "round robin on the oracle's path, not a yardstick")
	require.False(t, direct.pdx())
	require.Contains(t, direct.Config(), "round robin")
	require.Equal(t, all[2].PoolYAML, all[2].Config(), "a pdx profile's config is its YAML")
	require.Contains(t, all[2].PoolYAML, "disaggregation: {min_uncached_tokens: 1}", "llm-d's 16 tokens at scale 16")
	require.Contains(t, Profiles(Scale{TokenScale: 4})[2].PoolYAML, "min_uncached_tokens: 4")

	got, err := SelectProfiles(all, []string{"pdx-default", "round-robin"})
	require.NoError(t, err)
	require.Equal(t, []string{"pdx-default", "round-robin"}, names(got))
	_, err = SelectProfiles(all, []string{"random"})
	require.ErrorContains(t, err, `unknown policy "random"`)
	require.Equal(t, []string{"round-robin", "pdx-default"}, names(withRoundRobin(got[:1], all)), "round robin runs first, always")
}

// TestCheckProfiles fails a bad policy config, or a peer profile without
// vllm-router installed, before anything starts, naming the policy; a
// peer's empty pdx config is not parsed.
func TestCheckProfiles(t *testing.T) {
	rig := Rig{Prefill: 2, Decode: 2, Scale: Scale{TokenScale: 16}, TimeScale: 0.1}
	all := Profiles(rig.Scale)
	installed := os.Getenv(vllmrouter.DirEnv)
	require.NoError(t, rig.CheckProfiles(all), "every profile, the peers with vllm-router installed")
	err := rig.CheckProfiles([]Profile{{Name: "broken", PoolYAML: "prefill_picker: {policy: no_such_policy}\n"}})
	require.ErrorContains(t, err, "policy broken")

	var own, peers []Profile
	for _, p := range all {
		if p.Peer == "" {
			own = append(own, p)
		} else {
			peers = append(peers, p)
		}
	}
	t.Setenv(vllmrouter.DirEnv, t.TempDir())
	require.NoError(t, rig.CheckProfiles(own), "pdx's profiles and the oracles need no vllm-router")
	err = rig.CheckProfiles(peers[:1])
	require.ErrorIs(t, err, vllmrouter.ErrNotInstalled)
	require.ErrorContains(t, err, "policy vllm-router-cache-aware")
	t.Setenv(vllmrouter.DirEnv, installed)

	// kv_aware reads events in 16-token blocks: a token scale whose
	// engines' blocks are not that is refused.
	kv, err := SelectProfiles(all, []string{"vllm-router-kv-aware"})
	require.NoError(t, err)
	for _, tt := range []struct {
		scale int
		ok    bool
	}{{1, true}, {4, true}, {16, true}, {32, false}} {
		err := Rig{Prefill: 2, Decode: 2, Scale: Scale{TokenScale: tt.scale}, TimeScale: 0.1}.CheckProfiles(kv)
		if tt.ok {
			require.NoError(t, err, "token scale %d", tt.scale)
		} else {
			require.ErrorContains(t, err, "blocks of 16 tokens", "token scale %d", tt.scale)
		}
	}
}

// TestSendMixUp: the client takes an answer as its own only when it
// starts with its prompt's fingerprint, whatever the stream's id (a
// router may rewrite it, as vllm-router does).
func TestSendMixUp(t *testing.T) {
	mine, other := Request{Index: 1, Prompt: "block one", MaxTokens: 2}, Request{Prompt: "block two"}
	for _, tc := range []struct {
		name   string
		answer Request
		mixed  bool
	}{
		{name: "own answer", answer: mine},
		{name: "another prompt's answer", answer: other, mixed: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				w.Header().Set("Content-Type", "text/event-stream")
				for _, c := range []string{wantPrefix(tc.answer), " t1"} {
					fmt.Fprintf(w, "data: {\"id\":\"chatcmpl-rewritten\",\"choices\":[{\"delta\":{\"content\":%q}}]}\n\n", c)
				}
				fmt.Fprint(w, "data: [DONE]\n\n")
			}))
			defer srv.Close()
			o := send(t.Context(), srv.Client(), srv.URL, mine)
			require.Empty(t, o.Err)
			require.Equal(t, 2, o.Tokens)
			require.Equal(t, tc.mixed, o.MixedUp)
			require.Equal(t, !tc.mixed, o.OK())
		})
	}
}

// TestReplay replays a few dozen requests of the conversation trace through
// the real Envoy, pdx (two replicas in the affinity run) and simulated
// engines with round robin and precise placement (the engines publishing
// their KV events to every replica) at one load point, and through
// vllm-router (cache_aware, kv_aware) over the same engines: every answer whole and its own, no
// KV hand-off refused, the engines' prefix caches counting (every request
// of the trace starts with the same block), the router's CPU measured,
// the peer kept out of the replica runs, the report written.
func TestReplay(t *testing.T) {
	out := t.TempDir()
	profiles, err := SelectProfiles(Profiles(Scale{TokenScale: 16}), []string{"round-robin", PreciseProfile, "vllm-router-cache-aware", "vllm-router-kv-aware"})
	require.NoError(t, err)
	plan := Plan{
		Rig:           Rig{Prefill: 2, Decode: 2, Scale: Scale{TokenScale: 16}, TimeScale: 0.0625},
		Traces:        []TraceFile{{Name: "conversation", Path: filepath.Join("testdata", "conversation-head.jsonl")}},
		Profiles:      profiles,
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
	require.Len(t, rep.Runs, 4)
	require.Equal(t, []string{"round-robin", PreciseProfile, "vllm-router-cache-aware", "vllm-router-kv-aware"},
		[]string{rep.Runs[0].Policy, rep.Runs[1].Policy, rep.Runs[2].Policy, rep.Runs[3].Policy})
	require.Empty(t, rep.Runs[0].VLLMRouter+rep.Runs[1].VLLMRouter)
	cacheAware, kvAware := rep.Runs[2], rep.Runs[3]
	require.Equal(t, vllmrouter.Version, cacheAware.VLLMRouter)
	require.Equal(t, vllmrouter.Version, kvAware.VLLMRouter)
	// kv_aware placed by the engines' KV events: it looked up every
	// prefill and found the trace's shared first block in some engine's.
	require.Zero(t, cacheAware.PeerKVLookups, "cache_aware reads no events")
	require.GreaterOrEqual(t, kvAware.PeerKVLookups, 40)
	require.Positive(t, kvAware.PeerKVHits)
	t.Logf("kv_aware: %d of %d placement lookups hit", kvAware.PeerKVHits, kvAware.PeerKVLookups)
	require.Equal(t, vllmrouter.Version, rep.VLLMRouter)
	require.Len(t, rep.ReplicaRuns, 4, "round robin and precise at 1 and 2 replicas; no peer")
	require.Equal(t, []int{1, 2, 1, 2}, []int{rep.ReplicaRuns[0].Replicas, rep.ReplicaRuns[1].Replicas, rep.ReplicaRuns[2].Replicas, rep.ReplicaRuns[3].Replicas})
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
		require.Equal(t, 40, sum(r.Engines.PrefillRequests), "every request prefilled once")
		require.Equal(t, 40, r.Placement.Prefills, "%s: every prefill leg judged", r.Policy)
		require.Equal(t, 40, sum(r.Engines.DecodeRequests))
		require.Positive(t, r.CPU.Router, "%s: the router's cores", r.Policy)
		require.Positive(t, r.CPU.RouterMsPerRequest)
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
	require.Contains(t, string(summary), "| vllm-router-cache-aware |")
	require.Contains(t, string(summary), "| vllm-router-kv-aware |")
	require.Contains(t, string(summary), "vllm-router "+vllmrouter.Version)
}

func sum(xs []int) int {
	n := 0
	for _, x := range xs {
		n += x
	}
	return n
}
