package processor

import (
	"fmt"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/kvcache"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// instantEngine answers every prefill at once, so the benchmarks measure
// pdx's own work on a request.
var instantEngine = fakeengine.Fixed{PostAnswer: []byte(kvAnswer)}

// BenchmarkProcess is one whole ext_proc stream, headers to decode mutation,
// on a fake stream with the NIXL connector, on a new goroutine.
func BenchmarkProcess(b *testing.B) {
	for _, size := range []int{1 << 10, 32 << 10, 512 << 10} {
		b.Run(fmt.Sprintf("%dKiB", size>>10), func(b *testing.B) {
			table := testTable(b, true, time.Minute)
			srv := New(table, instantEngine, slog.New(slog.DiscardHandler))
			hdr := headers("POST", "/v1/chat/completions", false, "x-request-id", "bench")
			bd := body(fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"%s"}],"max_tokens":16}`, strings.Repeat("x", size)), true)
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				stream := newFakeStream(b.Context())
				stream.in <- hdr
				stream.in <- bd
				close(stream.in)
				// On a goroutine of its own, as gRPC serves each stream:
				// its stack's growth is part of the cost.
				done := make(chan error)
				go func() { done <- srv.Process(stream) }()
				if err := <-done; err != nil {
					b.Fatal(err)
				}
				if r := <-stream.out; r.GetRequestHeaders() == nil {
					b.Fatal("no headers answer")
				}
				if r := <-stream.out; r.GetRequestBody().GetResponse().GetBodyMutation() == nil {
					b.Fatal("no decode mutation")
				}
			}
		})
	}
}

var _ extprocv3.ExternalProcessor_ProcessServer = (*fakeStream)(nil)

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
			answer, err := http.Post(b.Context(), ep, renderChatPath, "bench", endpoint.Rank{}, net.Buffers{[]byte(client)})
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
