package e2e

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3/option"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// dpRequests is how many requests are in flight at once on the DP engines.
const dpRequests = 64

// TestDPRanks runs many concurrent requests through Envoy and pdx to
// engines that each serve two data-parallel ranks. pdx names a rank per leg
// (vLLM: X-data-parallel-rank on its prefill call and in Envoy's decode
// request; SGLang: routed_dp_rank and disagg_prefill_dp_rank in the bodies)
// and the engines check the hand-off per rank: a NIXL or Mooncake decode
// pulls from the engine id of the prefill's rank, an SGLang decode waits on
// the bootstrap registration of the rank it was told. Every request must answer its own
// prompt, both ranks of every engine must serve, and each decode must have
// taken the KV of the rank its prefill ran on. Clients name ranks of their
// own (the header, SGLang's fields) that pdx must drop: rank 7 is out of
// range, and an engine that got it would refuse the request.
func TestDPRanks(t *testing.T) {
	for _, tc := range []struct{ name, connector, mooncake string }{
		{"nixl", "nixl", ""},
		{"sglang", "sglang", ""},
		{"mooncake-vllm", "mooncake", "vllm"},
	} {
		connector := tc.name
		t.Run(tc.name, func(t *testing.T) {
			st := startStack(t, stack.Options{Connector: tc.connector, MooncakeProtocol: tc.mooncake, Prefill: 2, Decode: 2,
				Engine: enginesim.Config{DPSize: 2, PrefillLatency: 100 * time.Millisecond, DecodeLatency: 20 * time.Millisecond, DecodePerToken: time.Millisecond}})
			client, _ := newClient(t, st)
			clientRanks := []option.RequestOption{
				option.WithHeader("X-Data-Parallel-Rank", "7"),
				option.WithJSONSet("routed_dp_rank", 7),
				option.WithJSONSet("disagg_prefill_dp_rank", 7),
				option.WithJSONSet("data_parallel_rank", 7),
			}
			type outcome struct {
				id, prompt, got string
				err             error
			}
			outcomes := make([]outcome, dpRequests)
			var wg sync.WaitGroup
			start := make(chan struct{})
			for i := range outcomes {
				wg.Go(func() {
					<-start
					o := &outcomes[i]
					o.id = fmt.Sprintf("dp-%s-%d", connector, i)
					text := fmt.Sprintf("%s dp prompt %d: %s", connector, i, strings.Repeat("r", i%17))
					o.got, o.err = isolationRequest(t, client, i, o.id, text, clientRanks...)
					o.prompt = text
					if i%2 == 0 {
						o.prompt = chatPrompt(text)
					}
				})
			}
			close(start)
			wg.Wait()
			for _, o := range outcomes {
				require.NoError(t, o.err, o.id)
				require.True(t, strings.HasPrefix(o.got, wantPrefix(o.prompt)), "%s: got %q", o.id, o.got)
			}

			// The engines' side.
			for _, e := range st.Engines() {
				served := map[int]int{}
				for _, r := range e.Records() {
					require.NotEqual(t, enginesim.KindRejected, r.Kind, "engine %s refused %s: %s", e.Addr(), r.RequestID, r.Error)
					require.Less(t, r.Status, 400, "engine %s: %+v", e.Addr(), r)
					if r.Kind == enginesim.KindPrefill || r.Kind == enginesim.KindDecode {
						require.True(t, r.DPRankNamed, "pdx named the rank of %s %s on %s", r.Kind, r.RequestID, e.Addr())
						served[r.DPRank]++
					}
				}
				require.Len(t, served, 2, "both ranks of engine %s served: %v", e.Addr(), served)
				require.Positive(t, served[0], "rank 0 of %s", e.Addr())
				require.Positive(t, served[1], "rank 1 of %s", e.Addr())
			}
			for _, o := range outcomes {
				fp := enginesim.Fingerprint(o.prompt)
				recs := recordsWhere(st, func(r enginesim.Record) bool { return r.Fingerprint == fp })
				requireOneHandoff(t, st, fp, recs)
				p, d := recs["prefill"][0], recs["decode"][0]
				require.Equal(t, p.DPRank, d.KVSourceRank, "%s: the decode took the KV of the rank its prefill ran on", o.id)
			}
		})
	}
}

// TestClientRankIgnored: a client's X-data-parallel-rank never reaches an
// engine. Here the engines have no DP ranks, so pdx names none, and a vLLM
// engine that got rank 1 would refuse it (out of range [0, 1)).
func TestClientRankIgnored(t *testing.T) {
	st := startStack(t, stack.Options{Connector: "nixl", Prefill: 1, Decode: 1})
	_, hc := newClient(t, st)
	for _, path := range []string{"/v1/completions", "/v1/chat/completions"} {
		text := "client rank " + path
		body, prompt := fmt.Sprintf(`{"model":"demo-model","prompt":%q,"max_tokens":3}`, text), text
		if path == "/v1/chat/completions" {
			body, prompt = fmt.Sprintf(`{"model":"demo-model","messages":[{"role":"user","content":%q}],"max_tokens":3}`, text), chatPrompt(text)
		}
		a := post(t, hc, st.URL()+path, body, "X-Data-Parallel-Rank", "1")
		require.Equal(t, 200, a.status, a.body)
		require.Contains(t, a.body, wantPrefix(prompt))
		requireHandoff(t, st, prompt)
	}
}
