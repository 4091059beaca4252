package e2e

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// TestPlacementSelfCheck renders the prompts on a render server whose
// chat template is not the engines' (another model's, say): the rendered
// token counts then disagree with what the prefill engines count in their
// answers, pdx's self-check says so once in its log and in its metrics,
// and places by what it sent instead of rendering. With the engines' own
// template (control) every check matches and nothing is said.
func TestPlacementSelfCheck(t *testing.T) {
	for _, tc := range []struct {
		name     string
		template string
	}{
		{name: "wrong chat template", template: "<|system|>You are a helpful assistant of another model.\n"},
		{name: "control"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			render, err := enginesim.Start(context.Background(), "127.0.0.1:0", enginesim.Config{Role: enginesim.RolePrefill, ChatTemplate: tc.template})
			require.NoError(t, err)
			t.Cleanup(func() { _ = render.Close() })
			c := enginesim.ReferenceCapacity(1, 1)
			st := startStack(t, stack.Options{Prefill: 2, Decode: 1,
				Engine:   enginesim.Config{Capacity: &c, PromptTokensDetails: true},
				PoolYAML: fmt.Sprintf("render: {address: %q, timeout: 2s}", render.Addr())})
			hc := &http.Client{Timeout: 30 * time.Second}
			t.Cleanup(hc.CloseIdleConnections)
			const requests = 24
			for i := range requests {
				a := post(t, hc, st.URL()+"/v1/chat/completions", chatBody(fmt.Sprintf("question %d: %s", i, strings.Repeat("why? ", 40))))
				require.Equal(t, 200, a.status, a.body)
			}
			fams := scrape(t, "http://"+st.Pdx.AdminAddr()+"/metrics")
			checks := func(result string) float64 {
				return value(fams, "pdx_placement_checks_total", map[string]string{"result": result})
			}
			renders := value(fams, "pdx_prompt_tokens_total", map[string]string{"source": "render"})
			if tc.template == "" {
				require.Equal(t, float64(requests), checks("match"))
				require.Equal(t, float64(requests), renders)
				require.NotContains(t, st.PdxLog(), "placement self-check")
				return
			}
			// The self-check turns once half of at least 16 judged
			// prefills mismatched: all 16 here.
			require.Equal(t, 16.0, checks("tokens_mismatch"))
			require.Equal(t, 16.0, renders, "no render while the engines' word is untrusted")
			require.Equal(t, float64(requests-16), checks("untrusted"))
			require.Zero(t, checks("match"))
			require.Equal(t, 1, strings.Count(st.PdxLog(), "placement self-check"), st.PdxLog())
			require.Contains(t, st.PdxLog(), "chat template or tokenizer")
		})
	}
}
