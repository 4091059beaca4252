package connectors

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/jsonedit"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// TestPrepareAllocs bounds the allocations of one request through the NIXL
// and HTTP connectors, client body parse included: the decode body and the
// list of the prefill body's pieces, nothing per member or per edit.
// (BenchmarkPrepare counts two more, its own: the *Request and the engine
// boxed into the Engine interface.)
func TestPrepareAllocs(t *testing.T) {
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", 4096) +
		`"}],"max_tokens":64,"stream":true,"stream_options":{"include_usage":true},"temperature":0.7}`)
	engines := map[string]Engine{
		"nixl": fakeengine.Fixed{PostAnswer: []byte(`{"id":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[[1,2,3]],"remote_host":"10.0.0.1","remote_port":21001}}`)},
		"http": fakeengine.Fixed{PostAnswer: []byte(`{"id":"x"}`)},
	}
	for name, eng := range engines {
		conn, err := newFor(t, name, "")
		require.NoError(t, err)
		req := &Request{ID: "allocs", Path: "/v1/chat/completions", Prefill: testPrefill, Decode: testDecode}
		allocs := testing.AllocsPerRun(100, func() {
			obj, err := jsonedit.Parse(body)
			if err != nil {
				t.Fatal(err)
			}
			req.Body = obj
			d, err := conn.Prepare(t.Context(), Env{Engine: eng}, req)
			if err != nil || d.Prefill != nil {
				t.Fatal(err)
			}
		})
		limit := 2.0
		if raceEnabled {
			limit = 3 // the edits' stack buffer escapes in -race builds
		}
		require.LessOrEqual(t, allocs, limit, name)
	}
}
