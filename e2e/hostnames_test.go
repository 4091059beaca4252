package e2e

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/cmd/pdx/mainlib"
	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/internal/reload"
	"github.com/pdx-router/pdx/internal/resolver"
	"github.com/pdx-router/pdx/internal/server"
	"github.com/pdx-router/pdx/internal/testbed/dnsserver"
	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/envoyproc"
	"github.com/pdx-router/pdx/internal/testbed/logbuf"
	"github.com/pdx-router/pdx/internal/testbed/loopback"
)

// startSim starts a simulated engine of role on addr, closed when the test
// ends.
func startSim(t *testing.T, addr string, role enginesim.Role) *enginesim.Server {
	t.Helper()
	s, err := enginesim.Start(t.Context(), addr, enginesim.Config{Role: role})
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s
}

func port(t *testing.T, addr string) string {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	require.NoError(t, err)
	return p
}

// startEnvoy runs the pinned Envoy in front of the pdx at grpcAddr.
func startEnvoy(t *testing.T, grpcAddr string) *envoyproc.Process {
	t.Helper()
	bin, err := envoyproc.Binary()
	require.NoError(t, err)
	proxy, err := envoyproc.Start(t.Context(), bin, envoy.Config{PdxAddress: grpcAddr, MessageTimeout: 10 * time.Second}, nil)
	require.NoError(t, err)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("envoy log:\n%s", proxy.Log())
		}
		proxy.Stop()
	})
	return proxy
}

func getText(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(b)
}

// TestEnginesByHostName runs `pdx serve` on a config that names its engines
// as a new user would, "localhost:PORT" and "http://localhost:PORT": pdx
// resolves them, and Envoy, which connects to the decode engine pdx names,
// is given its IP. The render server named by URL is reached by name.
func TestEnginesByHostName(t *testing.T) {
	prefill := startSim(t, "127.0.0.1:0", enginesim.RolePrefill)
	decode := startSim(t, "127.0.0.1:0", enginesim.RoleDecode)
	grpcAddr, adminAddr := loopback.FreeAddr(t), loopback.FreeAddr(t)
	path := filepath.Join(t.TempDir(), "pdx.yaml")
	require.NoError(t, os.WriteFile(path, fmt.Appendf(nil, `
grpc_address: %s
admin_address: %s
pools:
- name: named
  models: [served-model]
  connector: nixl
  prefill_timeout: 5s
  render: {address: "http://localhost:%[3]s", timeout: 5s}
  prefill: [{address: "localhost:%[3]s"}]
  decode: [{address: "http://localhost:%[4]s"}]
`, grpcAddr, adminAddr, port(t, prefill.Addr()), port(t, decode.Addr())), 0o600))

	var pdxLog logbuf.Buffer
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- mainlib.Main(ctx, []string{"serve", "--config", path}, &pdxLog, &pdxLog) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
		if t.Failed() {
			t.Logf("pdx log:\n%s", pdxLog.String())
		}
	})
	waitPdxReady(t, adminAddr)
	require.Contains(t, pdxLog.String(), `"msg":"endpoint host name resolved","name":"localhost","addresses":["127.0.0.1"],"pools":["named"]`)

	proxy := startEnvoy(t, grpcAddr)
	hc := &http.Client{Timeout: 30 * time.Second}
	t.Cleanup(hc.CloseIdleConnections)
	a := post(t, hc, proxy.URL()+"/v1/completions", `{"model":"served-model","prompt":"engines by name"}`)
	require.Equal(t, 200, a.status, a.body)
	require.Equal(t, decode.Addr(), a.header.Get(enginesim.HeaderEngine), "Envoy connected to the decode engine's IP")
	require.Equal(t, enginesim.KVPulled, a.header.Get(enginesim.HeaderKV))
	require.Equal(t, prefill.Addr(), a.header.Get(enginesim.HeaderKVSource))

	metrics := getText(t, "http://"+adminAddr+"/metrics")
	require.Contains(t, metrics, fmt.Sprintf(`pdx_endpoint_healthy{endpoint=%q,pool="named",role="decode"} 1`, decode.Addr()))
	require.Contains(t, metrics, fmt.Sprintf(`pdx_endpoint_healthy{endpoint=%q,pool="named",role="prefill"} 1`, prefill.Addr()))
	require.Contains(t, metrics, `pdx_prompt_tokens_total{pool="named",source="render"} 1`)
}

// TestEngineNameFollowsDNS: a decode engine named by a host name whose
// addresses change, grow, vanish and fail to resolve, through the real
// Envoy. The name is served by a DNS server on loopback that the test
// changes, and pdx looks it up with Go's own DNS client (the system
// resolver's code, pointed at that server: the machine's /etc/hosts and
// name servers are not the test's to change). The two engines behind the
// name listen on 127.0.0.1 and 127.0.0.2, on one port.
func TestEngineNameFollowsDNS(t *testing.T) {
	dns, err := dnsserver.Start()
	require.NoError(t, err)
	t.Cleanup(func() { dns.Close() })
	prefill := startSim(t, "127.0.0.1:0", enginesim.RolePrefill)
	engineA := startSim(t, "127.0.0.1:0", enginesim.RoleDecode)
	decodePort := port(t, engineA.Addr())
	engineB := startSim(t, "127.0.0.2:"+decodePort, enginesim.RoleDecode)
	ip := netip.MustParseAddr
	dns.Set("prefill.pdx.test", ip("127.0.0.1"))
	dns.Set("decode.pdx.test", ip("127.0.0.1"))

	path := filepath.Join(t.TempDir(), "pdx.yaml")
	require.NoError(t, os.WriteFile(path, fmt.Appendf(nil, `
grpc_address: 127.0.0.1:0
admin_address: 127.0.0.1:0
dns_refresh_rate: 50ms
pools:
- name: named
  models: [served-model]
  connector: nixl
  prefill_timeout: 5s
  decode_picker: {policy: round_robin}
  prefill: [{address: "prefill.pdx.test:%s"}]
  decode: [{address: "http://decode.pdx.test:%s"}]
`, port(t, prefill.Addr()), decodePort), 0o600))

	// pdx as `pdx serve` runs it, its resolver asking the test's server.
	var pdxLog logbuf.Buffer
	log := slog.New(slog.NewJSONHandler(&pdxLog, nil))
	ctx, cancel := context.WithCancel(context.Background())
	rl, err := reload.New(ctx, reload.Options{Path: path, Log: log, Resolver: resolver.Options{Lookup: resolver.LookupWith(dns.Resolver())}})
	require.NoError(t, err)
	srv, err := server.Start(rl.Config(), log, server.WithTable(rl.Table()))
	require.NoError(t, err)
	reloading := make(chan struct{})
	go func() {
		defer close(reloading)
		rl.Run(ctx, srv.SetTable)
	}()
	t.Cleanup(func() {
		cancel()
		<-reloading
		rl.Close()
		require.NoError(t, srv.Shutdown(context.Background()))
		if t.Failed() {
			t.Logf("pdx log:\n%s", pdxLog.String())
		}
	})
	proxy := startEnvoy(t, srv.GRPCAddr())
	hc := &http.Client{Timeout: 30 * time.Second}
	t.Cleanup(hc.CloseIdleConnections)

	// served sends a request and returns the decode engine that served it,
	// "" if it failed. It does not fail the test: Eventually runs it on
	// another goroutine.
	n := 0
	served := func() string {
		n++
		resp, err := hc.Post(proxy.URL()+"/v1/completions", "application/json",
			strings.NewReader(fmt.Sprintf(`{"model":"served-model","prompt":"request %d"}`, n)))
		if err != nil {
			return ""
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		if resp.StatusCode != 200 || resp.Header.Get(enginesim.HeaderKV) != enginesim.KVPulled {
			return ""
		}
		return resp.Header.Get(enginesim.HeaderEngine)
	}
	// servedBy reports whether a few requests in a row were all served,
	// by engines and each of them.
	servedBy := func(engines ...*enginesim.Server) func() bool {
		return func() bool {
			seen := map[string]bool{}
			for range 4 * len(engines) {
				seen[served()] = true
			}
			for _, e := range engines {
				if !seen[e.Addr()] {
					return false
				}
			}
			return len(seen) == len(engines)
		}
	}
	healthy := func(e *enginesim.Server) string {
		return fmt.Sprintf(`pdx_endpoint_healthy{endpoint=%q,pool="named",role="decode"} 1`, e.Addr())
	}
	metrics := func() string { return getText(t, "http://"+srv.AdminAddr()+"/metrics") }

	require.True(t, servedBy(engineA)(), "the name's first address")

	dns.Set("decode.pdx.test", ip("127.0.0.2"))
	require.Eventually(t, servedBy(engineB), 10*time.Second, 10*time.Millisecond, "the name moved to 127.0.0.2")
	require.Contains(t, metrics(), healthy(engineB))
	require.NotContains(t, metrics(), engineA.Addr(), "the address the name left is no longer an endpoint")
	require.Contains(t, pdxLog.String(), `"msg":"endpoint host name resolved","name":"decode.pdx.test","addresses":["127.0.0.2"],"pools":["named"],"before":["127.0.0.1"]`)

	dns.Set("decode.pdx.test", ip("127.0.0.2"), ip("127.0.0.1"))
	require.Eventually(t, servedBy(engineA, engineB), 10*time.Second, 10*time.Millisecond, "two addresses, two engines")
	require.Contains(t, metrics(), healthy(engineA))
	require.Contains(t, metrics(), healthy(engineB))

	dns.Set("decode.pdx.test") // NXDOMAIN
	require.Eventually(t, func() bool { return served() == "" }, 10*time.Second, 10*time.Millisecond,
		"a name without addresses leaves the pool without its engines")
	requireAPIError(t, post(t, hc, proxy.URL()+"/v1/completions", `{"model":"served-model","prompt":"no decode"}`),
		503, "no_endpoint", "pool named has no ready decode endpoint")
	require.Contains(t, pdxLog.String(), `"msg":"endpoint host name does not resolve: its pools serve without it, pdx keeps trying","name":"decode.pdx.test","addresses":[],"pools":["named"]`)

	dns.Set("decode.pdx.test", ip("127.0.0.1"))
	require.Eventually(t, servedBy(engineA), 10*time.Second, 10*time.Millisecond, "the name is back")

	// A server that fails (SERVFAIL) keeps the engines last resolved.
	dns.Fail("decode.pdx.test")
	queries := dns.Queries()
	require.Eventually(t, func() bool { return strings.Contains(pdxLog.String(), "endpoint host name lookup failed") }, 10*time.Second, 10*time.Millisecond)
	require.Eventually(t, func() bool { return dns.Queries() > queries+4 }, 10*time.Second, 10*time.Millisecond)
	require.True(t, servedBy(engineA)(), "the engines stay as last resolved")
}
