package processor

import (
	"log/slog"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// dpTable is a NIXL pool whose engines serve prefillDP and decodeDP ranks.
func dpTable(t *testing.T, prefillDP, decodeDP uint32) *routing.Table {
	t.Helper()
	table, err := routing.New(&configv1.Config{Pools: []*configv1.Pool{{
		OnPrefillFailure: configv1.PrefillFailure_PREFILL_FAILURE_FALLBACK,
		Name:             "p",
		Models:           []string{"m"},
		Connector:        "nixl",
		Prefill:          []*configv1.Endpoint{{Address: "127.0.0.1:8100", DpSize: prefillDP}},
		Decode:           []*configv1.Endpoint{{Address: "127.0.0.1:8200", DpSize: decodeDP}},
		PrefillTimeout:   durationpb.New(time.Second),
	}}})
	require.NoError(t, err)
	return table
}

// TestDPRanksRouted runs requests one after another through a pool of DP
// engines: each leg gets a rank, the prefill in its X-data-parallel-rank
// and the decode in Envoy's header mutation, ranks take turns as requests
// end (each ended request released its ranks), and a client's own
// x-data-parallel-rank is removed. Engines without ranks get none.
func TestDPRanksRouted(t *testing.T) {
	const client = `{"model":"m","prompt":"hi"}`
	for _, tc := range []struct {
		name                string
		prefillDP, decodeDP uint32
		wantPrefill         []int // per request; -1: no rank
		wantDecode          []int
	}{
		{"both legs ranked", 2, 4, []int{1, 0, 1, 0}, []int{1, 2, 3, 0}},
		{"decode only", 0, 2, []int{-1, -1, -1, -1}, []int{1, 0, 1, 0}},
		{"no dp", 1, 0, []int{-1, -1, -1, -1}, []int{-1, -1, -1, -1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			table := dpTable(t, tc.prefillDP, tc.decodeDP)
			eng := fakeengine.New().On(http.MethodPost, "", "", fakeengine.Reply{Body: kvAnswer})
			var gotPrefill, gotDecode []int
			for range len(tc.wantPrefill) {
				out := run(t, table, eng,
					headers("POST", "/v1/completions", false, RankHeader, "3"),
					body(client, true))
				require.Len(t, out, 2)
				require.Contains(t, out[0].GetRequestHeaders().GetResponse().GetHeaderMutation().GetRemoveHeaders(), RankHeader,
					"the client's rank is removed")
				rank := -1
				if v, ok := setHeaders(out[1].GetRequestBody().GetResponse().GetHeaderMutation())[RankHeader]; ok {
					var err error
					rank, err = strconv.Atoi(v)
					require.NoError(t, err)
				}
				gotDecode = append(gotDecode, rank)
			}
			for _, c := range eng.Calls() {
				r, ok := c.Rank.Get()
				if !ok {
					r = -1
				}
				gotPrefill = append(gotPrefill, r)
			}
			require.Equal(t, tc.wantPrefill, gotPrefill, "prefill ranks")
			require.Equal(t, tc.wantDecode, gotDecode, "decode ranks")
			requireLegsEnded(t, table)
		})
	}
}

// TestDPRankNotNamedWithoutPrefill: a decode that computes the prompt
// itself (the prefill failed, the pool falls back) names no rank, and is
// counted on its endpoint but on none of its ranks while it runs.
func TestDPRankNotNamedWithoutPrefill(t *testing.T) {
	table := dpTable(t, 2, 2)
	eng := fakeengine.New().On(http.MethodPost, "", "", fakeengine.Reply{Err: &engines.Error{Status: 503, Message: "sick"}})
	stream := newFakeStream(t.Context())
	stream.in <- headers("POST", "/v1/completions", false)
	stream.in <- body(`{"model":"m","prompt":"hi"}`, true)
	done := make(chan error, 1)
	go func() { done <- New(table, eng, slog.New(slog.DiscardHandler)).Process(stream) }()
	<-stream.out
	routed := <-stream.out
	require.NotContains(t, setHeaders(routed.GetRequestBody().GetResponse().GetHeaderMutation()), RankHeader)
	require.NotEmpty(t, eng.Calls(), "the prefill was tried")

	pool, _ := table.Lookup("m")
	ep := pool.Decode.Set.Endpoints()[0]
	require.Equal(t, 1, pool.Decode.Set.InFlight(ep), "the decode runs until Envoy ends the stream")
	require.Zero(t, pool.Decode.Set.RankInFlight(ep, 0)+pool.Decode.Set.RankInFlight(ep, 1), "on no rank")
	close(stream.in)
	require.NoError(t, <-done)
	requireLegsEnded(t, table)
}
