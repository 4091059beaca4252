package placement

import (
	"fmt"
	"net"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/kvcache"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

func TestRenderedTokens(t *testing.T) {
	for _, tc := range []struct {
		answer string
		want   []uint32
		err    string
	}{
		{answer: `{"request_id":"chatcmpl-1","token_ids":[1,2,3],"sampling_params":{"n":1}}`, want: []uint32{1, 2, 3}},
		{answer: ` [{"token_ids":[4]},{"token_ids":[5,6]}] `, want: []uint32{4}},
		{answer: `[]`, err: "an empty list"},
		{answer: `{"token_ids":[]}`, err: "no token_ids"},
		{answer: `{"token_ids":[-1]}`, err: "render answer"},
		{answer: `<html>`, err: "render answer"},
		{answer: `{"token_ids": [ 0 ,4294967295 ]}`, want: []uint32{0, 4294967295}},
		{answer: `{"token_ids":[4294967296]}`, err: "not an array of token ids"},
		{answer: `{"token_ids":[1.5]}`, err: "not an array of token ids"},
		{answer: `{"token_ids":[1e3]}`, err: "not an array of token ids"},
		{answer: `{"token_ids":["1"]}`, err: "not an array of token ids"},
		{answer: `{"token_ids":{"0":1}}`, err: "not an array of token ids"},
		{answer: `{"token_ids":[1,2]`, err: "render answer"},
	} {
		got, err := renderedTokens([]byte(tc.answer))
		if tc.err != "" {
			require.ErrorContains(t, err, tc.err, tc.answer)
			continue
		}
		require.NoError(t, err)
		require.Equal(t, tc.want, got)
	}
}

// BenchmarkPromptTokens is what placement spends on a 32 KiB chat prompt's
// tokens: the byte estimate (hashing the raw JSON), against a render on a
// simulated vLLM over loopback HTTP (the call, its answer's parse and the
// tokens' hashing; the simulator's own JSON work on 32 KiB in and 8,192 ids
// out is most of it), side by side, and pdx's own part of a render alone.
func BenchmarkPromptTokens(b *testing.B) {
	content := strings.Repeat("a few words of a long document, ", 1024) // 32 KiB
	client := fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":%q}],"max_tokens":16}`, content)
	b.Run("estimate", func(b *testing.B) {
		raw := []byte(client)
		var dst []uint64
		for b.Loop() {
			dst = picker.Blocks(dst[:0], raw, 64)
		}
	})
	// pdx's own part of a render: reading the answer's ids and hashing
	// them (the engine's 8,192 ids of the prompt).
	b.Run("render-answer", func(b *testing.B) {
		ids := make([]string, 8192)
		for i := range ids {
			ids[i] = fmt.Sprint(100_000 + i*37)
		}
		answer := []byte(`{"request_id":"chatcmpl-1","token_ids":[` + strings.Join(ids, ",") + `],"sampling_params":{"n":1}}`)
		var dst []uint64
		for b.Loop() {
			got, err := renderedTokens(answer)
			if err != nil {
				b.Fatal(err)
			}
			dst = kvcache.HashTokens(dst[:0], 0, got, 16, maxTokenBlocks)
		}
	})
	b.Run("render", func(b *testing.B) {
		sim, err := enginesim.Start(b.Context(), "127.0.0.1:0", enginesim.Config{Role: enginesim.RolePrefill, Connector: "nixl"})
		require.NoError(b, err)
		b.Cleanup(func() { _ = sim.Close() })
		http := engines.NewHTTP()
		b.Cleanup(http.CloseIdleConnections)
		ep := endpoint.Endpoint{Address: sim.Addr()}
		var dst []uint64
		for b.Loop() {
			answer, err := http.Post(b.Context(), ep, RenderChatPath, "bench", endpoint.Rank{}, net.Buffers{[]byte(client)})
			if err != nil {
				b.Fatal(err)
			}
			ids, err := renderedTokens(answer)
			if err != nil {
				b.Fatal(err)
			}
			dst = kvcache.HashTokens(dst[:0], 0, ids, 16, maxTokenBlocks)
		}
	})
}
