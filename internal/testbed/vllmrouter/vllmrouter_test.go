package vllmrouter

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

// TestServesThroughSimulatedEngines runs the real vllm-router over pdx's
// NIXL simulators, concurrently, with its two policies the benchmarks
// measure: the engines accept its prefill and decode requests and every
// decode pulls its own prompt's KV from the prefill it was paired with.
func TestServesThroughSimulatedEngines(t *testing.T) {
	dir, err := Dir()
	require.NoError(t, err)
	v, err := InstalledVersion(dir)
	require.NoError(t, err)
	require.Equal(t, Version, v, "the install is not the pinned vllm-router; run `make vllm-router`")

	for _, policy := range []string{"round_robin", "cache_aware"} {
		t.Run(policy, func(t *testing.T) {
			prefill, decode := engines(t, enginesim.RolePrefill, 2), engines(t, enginesim.RoleDecode, 2)
			r, err := Start(t.Context(), Options{Dir: dir, Prefill: EngineURLs(prefill), Decode: EngineURLs(decode), Policy: policy})
			require.NoError(t, err)
			t.Cleanup(func() {
				_ = r.Stop()
				if t.Failed() {
					t.Logf("vllm-router log:\n%s", r.Log())
				}
			})

			const n = 64
			var wg sync.WaitGroup
			errs := make(chan error, n)
			for i := range n {
				wg.Go(func() { errs <- ask(r.URL(), i) })
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				require.NoError(t, err)
			}

			var prefills, decodes []enginesim.Record
			for _, e := range prefill {
				prefills = append(prefills, e.Records()...)
			}
			for _, e := range decode {
				decodes = append(decodes, e.Records()...)
			}
			fromPrefill := map[string]string{} // request id -> prefill engine
			for _, rec := range prefills {
				if rec.Kind == enginesim.KindPrefill {
					fromPrefill[rec.RequestID] = rec.Fingerprint
				}
				require.NotEqual(t, enginesim.KindRejected, rec.Kind, "a prefill engine refused: %s", rec.Error)
			}
			var pulled int
			for _, rec := range decodes {
				require.NotEqual(t, enginesim.KindRejected, rec.Kind, "a decode engine refused: %s", rec.Error)
				require.Equal(t, enginesim.KindDecode, rec.Kind)
				require.Equal(t, enginesim.KVPulled, rec.KV, "decode %s took no KV", rec.RequestID)
				require.Equal(t, fromPrefill[rec.RequestID], rec.Fingerprint, "decode %s pulled another prompt's KV", rec.RequestID)
				pulled++
			}
			require.Equal(t, n, pulled)
		})
	}
}

// ask sends request i (chat or completion, streamed or not) and checks the
// answer is its own prompt's: the simulator's text starts with the
// prompt's fingerprint.
func ask(url string, i int) error {
	prompt := fmt.Sprintf("request %d: %s", i, strings.Repeat("tell me more ", i%7+1))
	stream := i%2 == 1
	body := map[string]any{"model": "m", "max_tokens": 4, "stream": stream}
	path := "/v1/chat/completions"
	want := enginesim.Fingerprint(enginesim.ChatPromptText([]enginesim.Message{{Role: "user", Content: prompt}}))
	if i%4 < 2 {
		body["messages"] = []map[string]string{{"role": "user", "content": prompt}}
	} else {
		path = "/v1/completions"
		body["prompt"] = prompt
		want = enginesim.Fingerprint(prompt)
	}
	b, _ := json.Marshal(body)
	resp, err := http.Post(url+path, "application/json", bytes.NewReader(b))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("request %d: status %d: %s", i, resp.StatusCode, got)
	}
	if !bytes.Contains(got, []byte(want)) {
		return fmt.Errorf("request %d: answer is not its prompt's (%s): %s", i, want, got)
	}
	if stream && !bytes.Contains(got, []byte("data: [DONE]")) {
		return fmt.Errorf("request %d: stream without [DONE]: %s", i, got)
	}
	return nil
}

func engines(t *testing.T, role enginesim.Role, n int) []*enginesim.Server {
	var out []*enginesim.Server
	for range n {
		s, err := enginesim.Start(t.Context(), "127.0.0.1:0", enginesim.Config{Role: role, Connector: enginesim.ConnectorNIXL})
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		out = append(out, s)
	}
	return out
}

// TestKVAwareConsumesEvents runs vllm-router's kv_aware policy over
// simulated prefill engines that publish vLLM's KV events. Each prompt is
// first prefilled on one engine directly, behind the router's back, so the
// router can know that engine holds it only from that engine's events
// (neither from its own routing history nor its speculative entries). Then
// a request extending the prompt, through the router, must go to that
// engine, the router counting the cached prefix; the hand-offs are checked
// by the engines as in TestServesThroughSimulatedEngines.
func TestKVAwareConsumesEvents(t *testing.T) {
	dir, err := Dir()
	require.NoError(t, err)
	// vllm-router reads --pd-kv-events with block size 16: real token
	// counts, or a replay's scaled engines publishing each token as
	// tokenScale (block 16/tokenScale tokens, published as 16). Times are
	// scaled down so the test is quick. kv_aware uses an engine's events
	// only for requests naming its served model.
	for _, tt := range []struct {
		name       string
		tokenScale int
		model      string
	}{
		{"real tokens", 1, ""},
		{"replay scale", 16, "demo-model"},
	} {
		t.Run(tt.name, func(t *testing.T) { kvAwareRun(t, dir, tt.tokenScale, tt.model) })
	}
}

func kvAwareRun(t *testing.T, dir string, tokenScale int, model string) {
	capa := enginesim.ReferenceCapacity(float64(tokenScale), 0.01)
	if model == "" {
		model = enginesim.ModelName
	}
	start := func(role enginesim.Role, events bool) *enginesim.Server {
		cfg := enginesim.Config{Role: role, Connector: enginesim.ConnectorNIXL, Capacity: &capa, ServedModelName: model}
		if events {
			cfg.KVEvents = &enginesim.KVEvents{Endpoint: "tcp://127.0.0.1:0", TokenScale: tokenScale}
		}
		s, err := enginesim.Start(t.Context(), "127.0.0.1:0", cfg)
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		return s
	}
	prefill := []*enginesim.Server{start(enginesim.RolePrefill, true), start(enginesim.RolePrefill, true)}
	decode := []*enginesim.Server{start(enginesim.RoleDecode, false), start(enginesim.RoleDecode, false)}
	sources := map[string]string{}
	for _, s := range prefill {
		sources["http://"+s.Addr()] = s.KVEventsEndpoint()
	}
	r, err := Start(t.Context(), Options{Dir: dir, Prefill: EngineURLs(prefill), Decode: EngineURLs(decode), Policy: "kv_aware", KVEvents: sources})
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = r.Stop()
		if t.Failed() {
			t.Logf("vllm-router log:\n%s", r.Log())
		}
	})

	// Prompts of 10 blocks or so; seeded alternately on either engine, so
	// a router that ignores the events cannot get them all right.
	const n = 6
	type seeded struct {
		chat         bool
		seed, follow string
		engine       int
	}
	var cases []seeded
	for i := range n {
		prefix := fmt.Sprintf("document %d: %s", i, strings.Repeat(fmt.Sprintf("paragraph %d of a long shared context. ", i), 16))
		cases = append(cases, seeded{chat: i%2 == 1, seed: prefix + "first question?", follow: prefix + "second question?", engine: i % 2})
	}
	send := func(base string, c seeded, prompt string) {
		body := map[string]any{"model": model, "max_tokens": 2}
		path := "/v1/completions"
		if c.chat {
			path = "/v1/chat/completions"
			body["messages"] = []map[string]string{{"role": "user", "content": prompt}}
		} else {
			body["prompt"] = prompt
		}
		b, _ := json.Marshal(body)
		resp, err := http.Post(base+path, "application/json", bytes.NewReader(b))
		require.NoError(t, err)
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, "%s", got)
	}
	for _, c := range cases {
		send("http://"+prefill[c.engine].Addr(), c, c.seed)
	}
	// The events go out as the seeds finish; give the router's
	// subscribers a moment to apply them.
	time.Sleep(2 * time.Second)
	for _, c := range cases {
		send(r.URL(), c, c.follow)
	}

	promptOf := func(c seeded, text string) string {
		if c.chat {
			return enginesim.ChatPromptText([]enginesim.Message{{Role: "user", Content: text}})
		}
		return text
	}
	prefillOf := map[string]int{} // fingerprint of a routed prompt -> prefill engine
	for i, s := range prefill {
		for _, rec := range s.Records() {
			require.NotEqual(t, enginesim.KindRejected, rec.Kind, "a prefill engine refused: %s", rec.Error)
			if rec.Kind == enginesim.KindPrefill {
				prefillOf[rec.Fingerprint] = i
			}
		}
	}
	for _, c := range cases {
		fp := enginesim.Fingerprint(promptOf(c, c.follow))
		engine, ok := prefillOf[fp]
		require.True(t, ok, "no prefill leg for %q", c.follow[:20])
		require.Equal(t, c.engine, engine, "%q went to the engine without its prefix", c.follow[:20])
	}
	var pulled int
	for _, s := range decode {
		for _, rec := range s.Records() {
			require.Equal(t, enginesim.KindDecode, rec.Kind, "a decode engine refused: %s", rec.Error)
			require.Equal(t, enginesim.KVPulled, rec.KV)
			pulled++
		}
	}
	require.Equal(t, n, pulled)

	// The router's own account: every prefill choice looked up the blocks
	// and found some (vllm_router_kv_placement_lookups_total{result="hit"}),
	// and none fell back to load (vllm_router_pd_prefill_decisions_total).
	m, err := r.Metrics()
	require.NoError(t, err)
	require.GreaterOrEqual(t, m[`vllm_router_kv_placement_lookups_total{result="hit"}`], float64(n), "metrics:\n%v", m)
	require.Equal(t, float64(n), m[`vllm_router_pd_prefill_decisions_total{fallback="none"}`], "metrics:\n%v", m)
	require.Equal(t, float64(n), m[`vllm_router_prefix_routing_decisions_total{policy="kv_aware",stage="prefill",outcome="prefix_cost"}`], "metrics:\n%v", m)
}

// TestStartRetriesATakenPort runs Start over a stand-in launcher that
// fails its first run as vllm-router does when its port was taken between
// pdx finding it free and the router binding it: Start tries other ports
// then, and only then.
func TestStartRetriesATakenPort(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "vllm_router"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "vllm_router", "version.py"), []byte(`__version__ = "`+Version+`"`), 0o644))
	// The stand-in serves /readiness on --port on its second run; on its
	// first it exits with the given message.
	launcher := filepath.Join(dir, "python")
	require.NoError(t, os.WriteFile(launcher, []byte(`#!/bin/sh
echo run >> "$0.runs"
if [ "$(wc -l < "$0.runs")" -eq 1 ]; then echo "$FIRST_RUN_SAYS"; exit 1; fi
while [ "$1" != "--port" ]; do shift; done
exec python3 -c '
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
' "$2"
`), 0o755))

	for _, tc := range []struct {
		name    string
		says    string
		started bool
		runs    int
	}{
		{"port taken", `PanicException: failed to install Prometheus metrics exporter: FailedToCreateHTTPListener("Address already in use (os error 98)")`, true, 2},
		{"other failure", `error: unexpected argument '--policy'`, false, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.NoError(t, os.RemoveAll(launcher+".runs"))
			t.Setenv("FIRST_RUN_SAYS", tc.says)
			r, err := Start(t.Context(), Options{Dir: dir, Python: launcher, Prefill: []string{"http://127.0.0.1:1"}, Decode: []string{"http://127.0.0.1:2"}})
			if tc.started {
				require.NoError(t, err)
				require.NoError(t, r.Stop())
			} else {
				require.ErrorContains(t, err, "exited before it was ready")
				require.ErrorContains(t, err, tc.says)
			}
			runs, err := os.ReadFile(launcher + ".runs")
			require.NoError(t, err)
			require.Equal(t, tc.runs, strings.Count(string(runs), "run"))
		})
	}
}
