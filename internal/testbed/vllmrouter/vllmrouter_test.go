package vllmrouter

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"

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
			r, err := Start(t.Context(), Options{Dir: dir, Prefill: urls(prefill), Decode: urls(decode), Policy: policy})
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

func urls(ss []*enginesim.Server) []string {
	var out []string
	for _, s := range ss {
		out = append(out, "http://"+s.Addr())
	}
	return out
}
