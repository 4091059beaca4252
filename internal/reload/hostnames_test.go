package reload

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/resolver"
)

const named = `
dns_refresh_rate: %s
pools:
- name: p
  models: [m]
  connector: nixl
  eject_after_failures: 1
  prefill: [{address: "http://prefill.test:8000"}, {address: 127.0.0.1:1}]
  decode: [{address: "decode.test:9000"}]
`

// TestReloadNamed: pools whose engines are named by host name are fed
// before the table is handed over, at start and at each reload, and follow
// the names' addresses from then on; a name that does not resolve at
// start leaves its pool without it and does not stop pdx.
func TestReloadNamed(t *testing.T) {
	var mu sync.Mutex
	hosts := map[string][]netip.Addr{"prefill.test": {netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2")}}
	set := func(host string, addrs ...string) {
		mu.Lock()
		defer mu.Unlock()
		hosts[host] = nil
		for _, a := range addrs {
			hosts[host] = append(hosts[host], netip.MustParseAddr(a))
		}
	}
	resolve := func(_ context.Context, host string) ([]netip.Addr, error) {
		mu.Lock()
		defer mu.Unlock()
		if len(hosts[host]) == 0 {
			return nil, fmt.Errorf("%w: lookup %s: no such host", resolver.ErrNotFound, host)
		}
		return hosts[host], nil
	}
	resolved := make(chan string, 100)
	path := filepath.Join(t.TempDir(), "pdx.yaml")
	write(t, path, fmt.Sprintf(named, "1h"))
	var logs syncBuffer
	r, err := New(t.Context(), Options{Path: path, Log: slog.New(slog.NewTextHandler(&logs, nil)), Resolver: resolver.Options{Lookup: resolve, Resolved: func(n string) {
		select {
		case resolved <- n:
		default:
		}
	}}})
	require.NoError(t, err, "a name that does not resolve does not stop pdx")
	defer r.Close()
	first := lookup(t, r.Table(), "m")
	require.Equal(t, []string{"10.0.0.1:8000", "10.0.0.2:8000", "127.0.0.1:1"}, addresses(first.Prefill.Set.Endpoints()))
	require.Empty(t, first.Decode.Set.Endpoints())
	require.Contains(t, logs.String(), `msg="endpoint host name does not resolve: its pools serve without it, pdx keeps trying" name=decode.test addresses=[] pools=[p]`)
	first.Prefill.Report(endpoint.Endpoint{Address: "10.0.0.2:8000"}, false) // ejected

	// A reload with a short refresh: the known names keep their addresses
	// (and health), and follow DNS from then on.
	write(t, path, fmt.Sprintf(named, "10ms"))
	var a applied
	changed, err := r.Reload(t.Context(), a.apply)
	require.NoError(t, err)
	require.True(t, changed)
	second := lookup(t, r.Table(), "m")
	require.NotSame(t, first, second)
	require.Equal(t, []string{"10.0.0.1:8000", "10.0.0.2:8000", "127.0.0.1:1"}, addresses(second.Prefill.Set.Endpoints()), "fed before it is handed over")
	require.False(t, second.Prefill.Set.Healthy(endpoint.Endpoint{Address: "10.0.0.2:8000"}), "passive health kept")

	set("decode.test", "10.0.0.9")
	require.Eventually(t, func() bool {
		select {
		case <-resolved:
		case <-time.After(10 * time.Millisecond):
		}
		return len(second.Decode.Set.Endpoints()) == 1
	}, 10*time.Second, time.Millisecond)
	require.Equal(t, []string{"10.0.0.9:9000"}, addresses(second.Decode.Set.Endpoints()))
	require.Empty(t, first.Decode.Set.Endpoints(), "the old table's pool is left alone")
	require.Contains(t, logs.String(), `msg="endpoint host name resolved" name=decode.test addresses=[10.0.0.9] pools=[p] before=[]`)

	// Back to IPs only: no name is looked up any more (goleak checks at
	// the end that no lookup loop is left running either way).
	write(t, path, static)
	changed, err = r.Reload(t.Context(), a.apply)
	require.NoError(t, err)
	require.True(t, changed)
	require.Equal(t, []string{"127.0.0.1:1"}, addresses(lookup(t, r.Table(), "m").Prefill.Set.Endpoints()))
}
