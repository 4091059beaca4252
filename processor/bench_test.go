package processor

import (
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

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
