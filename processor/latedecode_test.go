package processor

import (
	"context"
	"log/slog"
	"net/http"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// A NIXL decode is picked again once its prefill has answered: when two
// requests reached the first pick's engine meanwhile, Envoy is sent to
// the other, which the fallbacks follow, and the first pick's count ends.
func TestDecodePickedAfterPrefill(t *testing.T) {
	cfg, err := config.Parse([]byte(`
pools:
- name: p
  default: true
  connector: nixl
  decode_fallbacks: 1
  prefill: [{address: 127.0.0.1:8100}]
  decode: [{address: 127.0.0.1:8200}, {address: 127.0.0.1:8201}]
`))
	require.NoError(t, err)
	table, err := routing.New(cfg)
	require.NoError(t, err)
	decode := &table.Pools()[0].Decode
	var others []picker.Lease
	eng := fakeengine.New().On(http.MethodPost, "", "", fakeengine.Reply{Fn: func(context.Context, fakeengine.Call) ([]byte, error) {
		require.Equal(t, 1, decode.InFlight(decode.Endpoints()[0]), "the first pick, a fresh table's first endpoint")
		for range 2 {
			l, ok := decode.Pick(picker.Request{Subset: []string{"127.0.0.1:8200"}})
			require.True(t, ok)
			others = append(others, l)
		}
		return []byte(kvAnswer), nil
	}})
	stream := newFakeStream(t.Context())
	stream.in <- headers("POST", "/v1/completions", false)
	stream.in <- body(`{"model":"m","prompt":"hi"}`, true)
	close(stream.in)
	require.NoError(t, New(table, eng, slog.New(slog.DiscardHandler)).Process(stream))
	close(stream.out)
	var out []*extprocv3.ProcessingResponse
	for r := range stream.out {
		out = append(out, r)
	}
	require.Len(t, out, 2)
	require.Equal(t, "127.0.0.1:8201,127.0.0.1:8200", setHeaders(out[1].GetRequestBody().GetResponse().GetHeaderMutation())[DestinationHeader])
	require.Equal(t, 2, decode.InFlight(decode.Endpoints()[0]), "the first pick no longer counts there")
	for _, l := range others {
		l.End(picker.Released)
	}
	requireLegsEnded(t, table)
}
