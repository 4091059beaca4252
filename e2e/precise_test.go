package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// preciseEngines are where TestPrecisePlacement warms each prompt: not
// the order in which ties go round, so that a pdx that does not read the
// engines' events lands most follow-ups elsewhere.
var preciseEngines = []int{2, 0, 2, 1, 1, 0}

// TestPrecisePlacement prefills each prompt first directly on one prefill
// engine, behind pdx's back, so that only that engine's KV events can tell
// pdx where the prefix is; a follow-up through Envoy must then prefill
// there. Both ways to meet the engines' publishers: pdx dials each, and
// the engines dial pdx naming themselves in their topics. Without events
// (control) the same follow-ups land where ties go, most elsewhere.
func TestPrecisePlacement(t *testing.T) {
	for _, mode := range []string{"dial", "bind", ""} {
		name := mode
		if name == "" {
			name = "control"
		}
		t.Run(name, func(t *testing.T) {
			c := enginesim.ReferenceCapacity(1, 1)
			// Without scraped loads: a sample taken while the test warmed
			// an engine behind pdx's back counts that request as another
			// router's for a scrape, and the test is of where the
			// prefixes are.
			opts := stack.Options{Prefill: 3, Decode: 1, KVEvents: mode, Engine: enginesim.Config{Capacity: &c},
				ConfigYAML: "engine_metrics: {disabled: true}"}
			if mode == "" {
				// Engines with a prefix cache and a render API, a pdx
				// that reads neither.
				opts.PoolYAML = "render: {disabled: true}"
			}
			st := startStack(t, opts)
			hc := &http.Client{Timeout: 30 * time.Second}
			t.Cleanup(hc.CloseIdleConnections)
			texts := make([]string, len(preciseEngines))
			for i, e := range preciseEngines {
				texts[i] = fmt.Sprintf("tenant %d's shared document: %s", i, strings.Repeat(fmt.Sprintf("clause %d of tenant %d. ", i, i), 200))
				a := post(t, hc, "http://"+st.Prefill[e].Addr()+"/v1/chat/completions", chatBody(texts[i]))
				require.Equal(t, 200, a.status, a.body)
			}
			if mode != "" {
				blocks := 0 // the prompts share no block: each starts with its tenant
				for _, text := range texts {
					blocks += len(enginesim.ChatPromptText([]enginesim.Message{{Role: "user", Content: text}})) / (4 * c.BlockTokens)
				}
				waitKVBlocks(t, st, blocks)
			}
			right := 0
			for i, e := range preciseEngines {
				a := post(t, hc, st.URL()+"/v1/chat/completions", chatBody(texts[i]+" And a question about it?"))
				require.Equal(t, 200, a.status, a.body)
				if got := prefilledOn(t, st, texts[i]+" And a question about it?"); got == e {
					right++
				} else {
					t.Logf("prompt %d warmed on prefill engine %d, prefilled on %d", i, e, got)
				}
			}
			fams := scrape(t, "http://"+st.Pdx.AdminAddr()+"/metrics")
			if mode == "" {
				require.Less(t, right, len(preciseEngines), "without the engines' events pdx cannot know where the prefixes are")
				require.Zero(t, value(fams, "pdx_prompt_tokens_total", map[string]string{"source": "render"}))
				return
			}
			require.Equal(t, len(preciseEngines), right, "every follow-up prefilled where its prefix is")
			require.Equal(t, float64(len(preciseEngines)), value(fams, "pdx_prompt_tokens_total", map[string]string{"source": "render"}))
			require.Zero(t, value(fams, "pdx_prompt_tokens_total", map[string]string{"source": "estimate"}))
			for _, e := range st.Engines() {
				require.Zero(t, e.Tally().Rejected, e.Addr())
			}
		})
	}
}

// chatBody is a one-message chat request of the stack's model.
func chatBody(text string) string {
	b, _ := json.Marshal(map[string]any{
		"model": stack.Model, "max_tokens": 1,
		"messages": []map[string]string{{"role": "user", "content": text}},
	})
	return string(b)
}

// prefilledOn is the prefill engine that ran the prefill leg of the chat
// request with text, -1 if none did.
func prefilledOn(t *testing.T, st *stack.Stack, text string) int {
	t.Helper()
	return recordedOn(st.Prefill, enginesim.KindPrefill, text)
}

// recordedOn is the engine of engines that recorded a request of kind for
// the chat request with text, -1 if none did.
func recordedOn(engines []*enginesim.Server, kind, text string) int {
	want := enginesim.Fingerprint(enginesim.ChatPromptText([]enginesim.Message{{Role: "user", Content: text}}))
	for i, e := range engines {
		for _, r := range e.Records() {
			if r.Kind == kind && r.Fingerprint == want {
				return i
			}
		}
	}
	return -1
}

// waitKVBlocks waits until pdx's index holds n blocks on the GPU tiers
// of the engines, as pdx_kv_cache_blocks tells: the events travel on their
// own.
func waitKVBlocks(t *testing.T, st *stack.Stack, n int) {
	t.Helper()
	held := 0.0
	require.Eventually(t, func() bool {
		fams := scrape(t, "http://"+st.Pdx.AdminAddr()+"/metrics")
		held = 0
		for _, m := range matching(fams, "pdx_kv_cache_blocks", map[string]string{"tier": "gpu"}) {
			held += m.GetGauge().GetValue()
		}
		return held >= float64(n)
	}, 20*time.Second, 50*time.Millisecond, "pdx heard of %v of the engines' %d blocks", held, n)
}

// TestDecodeSideReuse computes each prompt first directly on one decode
// engine, behind pdx's back, as a conversation's earlier turn leaves its KV
// where it decoded. With the engines' events pdx sees that the follow-up's
// decode engine holds all but a few of its tokens, and the pool's decider
// (min_uncached_tokens) sends it there alone: the decode engine prefills
// the rest itself and no prefill engine runs. Without events (control) pdx
// cannot know, and every follow-up takes the prefill leg.
func TestDecodeSideReuse(t *testing.T) {
	for _, mode := range []string{"dial", ""} {
		name := mode
		if name == "" {
			name = "control"
		}
		t.Run(name, func(t *testing.T) {
			c := enginesim.ReferenceCapacity(1, 1)
			opts := stack.Options{Prefill: 1, Decode: 3, KVEvents: mode, Engine: enginesim.Config{Capacity: &c},
				ConfigYAML: "engine_metrics: {disabled: true}",
				// A follow-up's question and its prompt's last, partial
				// block are well under 64 tokens; the prompts are ~1,500.
				PoolYAML: "disaggregation: {min_uncached_tokens: 64}\n"}
			if mode == "" {
				opts.PoolYAML += "render: {disabled: true}\n"
			}
			st := startStack(t, opts)
			hc := &http.Client{Timeout: 30 * time.Second}
			t.Cleanup(hc.CloseIdleConnections)
			texts := make([]string, len(preciseEngines))
			for i, e := range preciseEngines {
				texts[i] = fmt.Sprintf("conversation %d so far: %s", i, strings.Repeat(fmt.Sprintf("turn of conversation %d. ", i), 200))
				a := post(t, hc, "http://"+st.Decode[e].Addr()+"/v1/chat/completions", chatBody(texts[i]))
				require.Equal(t, 200, a.status, a.body)
			}
			if mode != "" {
				blocks := 0
				for _, text := range texts {
					blocks += len(enginesim.ChatPromptText([]enginesim.Message{{Role: "user", Content: text}})) / (4 * c.BlockTokens)
				}
				waitKVBlocks(t, st, blocks)
			}
			alone := 0
			for i, e := range preciseEngines {
				text := texts[i] + " And the next question?"
				a := post(t, hc, st.URL()+"/v1/chat/completions", chatBody(text))
				require.Equal(t, 200, a.status, a.body)
				if p, on := prefilledOn(t, st, text), servedAlone(st, text); p < 0 && on == e {
					alone++
				} else {
					t.Logf("prompt %d held by decode engine %d: prefilled on %d, served alone by %d", i, e, p, on)
				}
			}
			fams := scrape(t, "http://"+st.Pdx.AdminAddr()+"/metrics")
			short := value(fams, "pdx_disaggregation_decisions_total", map[string]string{"decision": "short_uncached"})
			if mode == "" {
				require.Zero(t, alone, "without the engines' events no decode engine is known to hold a prompt")
				require.Zero(t, short)
				return
			}
			require.Equal(t, len(preciseEngines), alone, "every follow-up served alone by the decode engine that holds it")
			require.Equal(t, float64(len(preciseEngines)), short)
			for _, e := range st.Engines() {
				require.Zero(t, e.Tally().Rejected, e.Addr())
			}
		})
	}
}

// servedAlone is the decode engine that served the chat request with text
// without a KV transfer (it computed the prompt itself), -1 if none did.
func servedAlone(st *stack.Stack, text string) int {
	return recordedOn(st.Decode, enginesim.KindPlain, text)
}

// TestDecodeSideReuseCountsNewTokens: a turn that adds more than
// min_uncached_tokens to a conversation its decode engine holds takes the
// prefill leg, also when pdx sent that engine the conversation itself and
// the conversation's JSON runs long (each "<" and ">" is 6 bytes). The
// decider reads the engine's events, not what pdx sent: a byte estimate
// of what was sent, at 4 bytes of JSON a token or as its share of the
// prompt's bytes, makes the new turn look held when the history's bytes a
// token exceed the new turn's.
func TestDecodeSideReuseCountsNewTokens(t *testing.T) {
	for _, tt := range []struct {
		name, history, turn string
	}{
		{"written alike", "<turn> of the conversation. ", "<turn> tell me more. "},
		{"dense history, plain turn", "<<<<>>>> ", "tell me more about it. "},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := enginesim.ReferenceCapacity(1, 1)
			st := startStack(t, stack.Options{Prefill: 1, Decode: 1, KVEvents: "dial", Engine: enginesim.Config{Capacity: &c},
				ConfigYAML: "engine_metrics: {disabled: true}",
				PoolYAML:   "disaggregation: {min_uncached_tokens: 64}\n"})
			hc := &http.Client{Timeout: 30 * time.Second}
			t.Cleanup(hc.CloseIdleConnections)
			first := "a conversation so far: " + strings.Repeat(tt.history, 200)
			a := post(t, hc, "http://"+st.Decode[0].Addr()+"/v1/chat/completions", chatBody(first))
			require.Equal(t, 200, a.status, a.body)
			waitKVBlocks(t, st, len(enginesim.ChatPromptText([]enginesim.Message{{Role: "user", Content: first}}))/(4*c.BlockTokens))

			// A short turn: served alone, and now sent there by pdx.
			second := first + " And the next question?"
			a = post(t, hc, st.URL()+"/v1/chat/completions", chatBody(second))
			require.Equal(t, 200, a.status, a.body)
			require.Equal(t, 0, servedAlone(st, second), "a short turn is served by the decode engine alone")

			// A turn of ~120 new tokens: the prefill leg.
			third := second + " " + strings.Repeat(tt.turn, 24)
			a = post(t, hc, st.URL()+"/v1/chat/completions", chatBody(third))
			require.Equal(t, 200, a.status, a.body)
			require.Equal(t, 0, prefilledOn(t, st, third), "a long new turn takes the prefill leg")
			require.Equal(t, -1, servedAlone(st, third))
			for _, e := range st.Engines() {
				require.Zero(t, e.Tally().Rejected, e.Addr())
			}
		})
	}
}
