package processor

import (
	"bytes"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/kvevents"
	"github.com/pdx-router/pdx/internal/metrics"
	"github.com/pdx-router/pdx/internal/placement"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// preciseTable is a NIXL pool of three prefill engines whose placement
// reads the engines' KV events (kv_events) and renders prompts on the
// engines.
func preciseTable(t *testing.T, render *configv1.Render) *routing.Table {
	t.Helper()
	table, err := routing.New(&configv1.Config{
		KvEvents: &configv1.KVEvents{Mode: "dial", Port: 5557, BlockSize: 4},
		Pools: []*configv1.Pool{{
			Name: "p", Models: []string{"m"}, Connector: "nixl",
			Prefill:        []*configv1.Endpoint{{Address: "127.0.0.1:8100"}, {Address: "127.0.0.1:8101"}, {Address: "127.0.0.1:8102"}},
			Decode:         []*configv1.Endpoint{{Address: "127.0.0.1:8200"}},
			PrefillTimeout: durationpb.New(5 * time.Second),
			Render:         render,
		}},
	})
	require.NoError(t, err)
	return table
}

// holds tells the table's index that the engine at address holds tokens,
// as its KV events would.
func holds(t *testing.T, table *routing.Table, address string, tokens []uint32) {
	t.Helper()
	hashes := make([]kvevents.Hash, len(tokens)/4)
	for i := range hashes {
		hashes[i] = kvevents.Hash{Lo: uint64(i) + 1}
	}
	table.PrefixCache().Apply(address, &kvevents.Batch{Events: []kvevents.Event{{
		Kind: kvevents.BlockStored, Hashes: hashes, TokenIDs: tokens[:len(hashes)*4], BlockSize: 4,
	}}})
	require.NotZero(t, table.PrefixCache().Stats().Blocks)
}

const preciseClient = `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":9,"kv_transfer_params":{"remote_host":"10.6.6.6"}}`

// The prefill goes where the engines report holding the prompt's tokens,
// as the render API tokenized them; the render gets the client's body
// without protocol fields.
func TestRenderedPlacement(t *testing.T) {
	table := preciseTable(t, &configv1.Render{Timeout: durationpb.New(time.Second)})
	tokens := []uint32{10, 11, 12, 13, 14, 15, 16, 17, 18}
	holds(t, table, "127.0.0.1:8102", tokens)
	eng := fakeengine.New().
		On(http.MethodPost, "", placement.RenderChatPath, fakeengine.Reply{Body: `{"request_id":"chatcmpl-1","token_ids":[10,11,12,13,14,15,16,17,18,19]}`}).
		On(http.MethodPost, "", "", fakeengine.Reply{Body: kvAnswer})
	out := run(t, table, eng, headers("POST", "/v1/chat/completions", false), body(preciseClient, true))
	require.Len(t, out, 2)
	calls := eng.Calls()
	require.Len(t, calls, 2)
	require.Equal(t, placement.RenderChatPath, calls[0].Path)
	require.Equal(t, "127.0.0.1:8100", calls[0].Endpoint.Address, "renders go to the pool's prefill engines in turn")
	require.JSONEq(t, `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":9}`, calls[0].Body)
	require.Equal(t, "127.0.0.1:8102", calls[1].Endpoint.Address, "the engine that holds the prompt's first two blocks")
	require.Equal(t, calls[0].RequestID, calls[1].RequestID)
}

// A render that fails, answers nonsense or is late costs the request
// nothing but precision: it is placed by the estimate and served.
func TestRenderFallsBackToTheEstimate(t *testing.T) {
	for _, tc := range []struct {
		name  string
		reply fakeengine.Reply
	}{
		{"engine error", fakeengine.Reply{Err: errors.New("connection refused")}},
		{"not a render answer", fakeengine.Reply{Body: `{"token_ids":"x"}`}},
		{"no tokens", fakeengine.Reply{Body: `[]`}},
		{"late", fakeengine.Reply{Block: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			table := preciseTable(t, &configv1.Render{Timeout: durationpb.New(50 * time.Millisecond)})
			holds(t, table, "127.0.0.1:8102", []uint32{10, 11, 12, 13})
			eng := fakeengine.New().
				On(http.MethodPost, "", placement.RenderCompletionsPath, tc.reply).
				On(http.MethodPost, "", "", fakeengine.Reply{Body: kvAnswer})
			start := time.Now()
			out := run(t, table, eng, headers("POST", "/v1/completions", false), body(`{"model":"m","prompt":"hi"}`, true))
			require.Len(t, out, 2)
			require.NotNil(t, out[1].GetRequestBody().GetResponse().GetBodyMutation(), "routed to decode")
			require.Less(t, time.Since(start), 2*time.Second)
			var prefills int
			for _, c := range eng.Calls() {
				if c.Path != placement.RenderCompletionsPath {
					prefills++
					require.Equal(t, "127.0.0.1:8100", c.Endpoint.Address, "placed as without the engines' word")
				}
			}
			require.Equal(t, 1, prefills)
		})
	}
}

// Engines without a render API (SGLang's) cost a failed call for the first
// requests only: renders pause after placement.RenderFailures in a row.
func TestRenderPausesAfterFailures(t *testing.T) {
	table := preciseTable(t, &configv1.Render{Timeout: durationpb.New(time.Second)})
	eng := fakeengine.New().
		On(http.MethodPost, "", placement.RenderCompletionsPath, fakeengine.Reply{Err: errors.New("404 Not Found")}).
		On(http.MethodPost, "", "", fakeengine.Reply{Body: kvAnswer})
	for range placement.RenderFailures + 3 {
		out := run(t, table, eng, headers("POST", "/v1/completions", false), body(`{"model":"m","prompt":"hi"}`, true))
		require.Len(t, out, 2)
	}
	renders := 0
	for _, c := range eng.Calls() {
		if c.Path == placement.RenderCompletionsPath {
			renders++
		}
	}
	require.Equal(t, placement.RenderFailures, renders)
}

// vLLM serves its render API only with --enable-scale-out, and refuses it
// with 403 otherwise: pdx says so once, naming the flag, and counts every
// refusal; the requests are placed by the estimate and served.
func TestRenderForbiddenNamesTheFlag(t *testing.T) {
	table := preciseTable(t, &configv1.Render{Timeout: durationpb.New(time.Second)})
	forbidden := &engines.Error{Endpoint: endpoint.Endpoint{Address: "127.0.0.1:8100"}, Status: http.StatusForbidden,
		Message: "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."}
	eng := fakeengine.New().
		On(http.MethodPost, "", placement.RenderCompletionsPath, fakeengine.Reply{Err: forbidden}).
		On(http.MethodPost, "", placement.RenderChatPath, fakeengine.Reply{Err: errors.New("connection refused")}).
		On(http.MethodPost, "", "", fakeengine.Reply{Body: kvAnswer})
	var logs bytes.Buffer
	m := metrics.New()
	srv := New(table, eng, slog.New(slog.NewJSONHandler(&logs, nil)), WithMetrics(m))
	for range 3 {
		out := runOn(t, srv, headers("POST", "/v1/completions", false), body(`{"model":"m","prompt":"hi"}`, true))
		require.NotNil(t, out[1].GetRequestBody().GetResponse().GetBodyMutation(), "routed to decode")
	}
	runOn(t, srv, headers("POST", "/v1/chat/completions", false), body(chatHi, true))
	require.Equal(t, 1, strings.Count(logs.String(), "--enable-scale-out;"), "one line names the flag:\n%s", logs.String())
	require.Contains(t, logs.String(), `"render_server":"127.0.0.1:8100"`)
	require.Equal(t, 3.0, counterValue(t, m, "pdx_render_failures_total", map[string]string{"pool": "p", "reason": "forbidden"}))
	require.Equal(t, 1.0, counterValue(t, m, "pdx_render_failures_total", map[string]string{"pool": "p", "reason": "error"}))
	require.Equal(t, 4.0, counterValue(t, m, "pdx_prompt_tokens_total", map[string]string{"pool": "p", "source": "estimate"}))
}
