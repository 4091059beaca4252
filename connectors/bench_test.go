package connectors

import (
	"fmt"
	"strings"
	"testing"

	"github.com/pdx-router/pdx/internal/jsonedit"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// BenchmarkPrepare is one request through each connector, client body
// parsed once as the processor does, for prompts of 1 KiB to 2 MiB.
func BenchmarkPrepare(b *testing.B) {
	engines := map[string]fakeengine.Fixed{
		"nixl":     {PostAnswer: []byte(`{"id":"x","choices":[{"text":"a"}],"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[[1,2,3]],"remote_request_id":"r","remote_host":"10.0.0.1","remote_port":21001}}`)},
		"http":     {PostAnswer: []byte(`{"id":"x"}`)},
		"sglang":   {PostAnswer: []byte(`{"id":"x"}`)},
		"p2p-nccl": {PostAnswer: []byte(`{"id":"x"}`)},
		"trtllm":   {PostAnswer: []byte(`{"id":"x","choices":[{"index":0,"text":"a","finish_reason":"length","disaggregated_params":{"request_type":"context_only","ctx_request_id":9007199254740993,"first_gen_tokens":[42],"encoded_opaque_state":"b3BhcXVl"}}]}`)},
		"mooncake": {PostAnswer: []byte(`{"id":"x"}`), GetAnswer: []byte(`{"0":{"engine_id":"e","worker_addr":{}}}`)},
	}
	connectors := []struct {
		name string
		opts string // the mooncake protocol
	}{{"nixl", ""}, {"http", ""}, {"mooncake", "vllm"}, {"sglang", ""}, {"p2p-nccl", ""}, {"trtllm", ""}}
	for _, c := range connectors {
		conn, err := newFor(b, c.name, c.opts)
		if err != nil {
			b.Fatal(err)
		}
		for _, size := range []int{1 << 10, 32 << 10, 512 << 10, 2 << 20} {
			body := []byte(fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"%s"}],"max_tokens":64,"stream":true,"stream_options":{"include_usage":true},"temperature":0.7}`,
				strings.Repeat("x", size)))
			b.Run(fmt.Sprintf("%s/%dKiB", c.name, size>>10), func(b *testing.B) {
				var eng Engine = engines[c.name] // converted once, not per call
				b.SetBytes(int64(len(body)))
				b.ReportAllocs()
				for b.Loop() {
					obj, err := jsonedit.Parse(body)
					if err != nil {
						b.Fatal(err)
					}
					req := &Request{ID: "bench", Path: "/v1/chat/completions", Body: obj, Prefill: testPrefill, Decode: testDecode}
					d, err := conn.Prepare(b.Context(), Env{Engine: eng}, req)
					if err != nil {
						b.Fatal(err)
					}
					if d.Prefill != nil {
						if err := <-d.Prefill.Done(); err != nil {
							b.Fatal(err)
						}
					}
				}
			})
		}
	}
}
