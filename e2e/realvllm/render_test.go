package realvllm

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// postRaw posts body to url and returns the status and the answer.
func postRaw(t *testing.T, hc *http.Client, url, body string) (int, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	resp, err := hc.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

// TestRenderScaleOut: with --enable-scale-out vLLM renders chat and
// completions requests (an object; an array of one per prompt), with the
// very token count it then computes; pdx places every request of the
// shared stack by its rendered tokens.
func TestRenderScaleOut(t *testing.T) {
	s, st := sharedStack(t)
	hc := httpClient(t)
	p := s.prefill[0]
	for _, c := range []call{chat(prompt("rendered chat"), 1), completion(prompt("rendered completion"), 1)} {
		body, err := json.Marshal(c.body)
		require.NoError(t, err)
		status, answer := postRaw(t, hc, p.URL()+c.path+"/render", string(body))
		require.Equal(t, http.StatusOK, status, answer)
		type rendered struct {
			TokenIDs []uint32 `json:"token_ids"`
		}
		var r rendered
		if c.path == completionsPath {
			var list []rendered
			require.NoError(t, json.Unmarshal([]byte(answer), &list), "completions render: an array, one per prompt: %s", answer)
			require.Len(t, list, 1)
			r = list[0]
		} else {
			require.NoError(t, json.Unmarshal([]byte(answer), &r), "chat render: one object: %s", answer)
		}
		ran := send(t, hc, p.URL(), c)
		require.Equal(t, http.StatusOK, ran.status, ran.raw)
		require.Len(t, r.TokenIDs, ran.promptTokens, "%s: the render's tokens are those the engine computes", c.path)
	}

	fams := pdxMetrics(t, st)
	rendered := value(fams, "pdx_prompt_tokens_total", map[string]string{"source": "render"})
	estimated := value(fams, "pdx_prompt_tokens_total", map[string]string{"source": "estimate"})
	for i := range 4 {
		got := send(t, hc, st.URL(), completion(prompt(fmt.Sprintf("placed by its rendered tokens %d", i)), 2))
		require.Equal(t, http.StatusOK, got.status, got.raw)
	}
	fams = pdxMetrics(t, st)
	require.Equal(t, rendered+4, value(fams, "pdx_prompt_tokens_total", map[string]string{"source": "render"}))
	require.Equal(t, estimated, value(fams, "pdx_prompt_tokens_total", map[string]string{"source": "estimate"}))
	require.Zero(t, value(fams, "pdx_render_failures_total", nil))
}

// TestRenderWithoutScaleOut: `vllm serve` without --enable-scale-out
// refuses the render API with 403. A pool rendering there still serves
// every request, placed by the estimate, and pdx says why once, naming
// the flag, and counts each refusal.
func TestRenderWithoutScaleOut(t *testing.T) {
	s := engines.nixlEngines(t)
	hc := httpClient(t)
	status, answer := postRaw(t, hc, s.decode.URL()+"/v1/completions/render",
		fmt.Sprintf(`{"model":%q,"prompt":"hi"}`, stack.Model))
	require.Equal(t, http.StatusForbidden, status, answer)
	require.Contains(t, answer, "--enable-scale-out", "vLLM's own message names the flag")

	opts := s.options(fmt.Sprintf("render: {address: %s, timeout: 10s}", s.decode.Addr()))
	st := startStack(t, opts, s.all()...)
	const n = 3 // below routing.RenderFailures: no pause
	for i := range n {
		got := send(t, hc, st.URL(), chat(prompt(fmt.Sprintf("not rendered %d", i)), 2))
		require.Equal(t, http.StatusOK, got.status, got.raw)
	}
	fams := pdxMetrics(t, st)
	require.Equal(t, float64(n), value(fams, "pdx_render_failures_total", map[string]string{"reason": "forbidden"}))
	require.Equal(t, float64(n), value(fams, "pdx_prompt_tokens_total", map[string]string{"source": "estimate"}))
	require.Zero(t, value(fams, "pdx_prompt_tokens_total", map[string]string{"source": "render"}))
	log := st.PdxLog()
	require.Equal(t, 1, strings.Count(log, "started with --enable-scale-out"), "one line names the flag:\n%s", log)
	require.Contains(t, log, s.decode.Addr())
}
