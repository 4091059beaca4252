package e2e

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/envoyproc"
	"github.com/pdx-router/pdx/internal/testbed/logbuf"
	"github.com/pdx-router/pdx/internal/testbed/loopback"
)

// TestServeBinary runs pdx as users do: the built binary, a YAML config
// file, a separate Envoy process; then SIGTERM ends it cleanly.
func TestServeBinary(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "pdx")
	out, err := exec.Command("go", "build", "-o", bin, "../cmd/pdx").CombinedOutput()
	require.NoError(t, err, "%s", out)

	prefill, err := enginesim.Start(t.Context(), "127.0.0.1:0", enginesim.Config{Role: enginesim.RolePrefill})
	require.NoError(t, err)
	t.Cleanup(func() { prefill.Close() })
	decode, err := enginesim.Start(t.Context(), "127.0.0.1:0", enginesim.Config{Role: enginesim.RoleDecode})
	require.NoError(t, err)
	t.Cleanup(func() { decode.Close() })

	grpcAddr, adminAddr := loopback.FreeAddr(t), loopback.FreeAddr(t)
	cfg := filepath.Join(dir, "pdx.yaml")
	require.NoError(t, os.WriteFile(cfg, fmt.Appendf(nil, `
grpc_address: %s
admin_address: %s
pools:
- name: binary
  models: [served-model]
  connector: nixl
  prefill_timeout: 5s
  prefill: [{address: %s}]
  decode: [{address: %s}]
`, grpcAddr, adminAddr, prefill.Addr(), decode.Addr()), 0o600))

	var pdxLog logbuf.Buffer
	cmd := exec.Command(bin, "serve", "--config", cfg)
	cmd.Stdout, cmd.Stderr = &pdxLog, &pdxLog
	require.NoError(t, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		if t.Failed() {
			t.Logf("pdx log:\n%s", pdxLog.String())
		}
	})
	waitPdxReady(t, adminAddr)

	envoyBin, err := envoyproc.Binary()
	require.NoError(t, err)
	proxy, err := envoyproc.Start(t.Context(), envoyBin, envoy.Config{PdxAddress: grpcAddr, MessageTimeout: 10 * time.Second}, nil)
	require.NoError(t, err)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("envoy log:\n%s", proxy.Log())
		}
		proxy.Stop()
	})

	hc := &http.Client{Timeout: 30 * time.Second}
	t.Cleanup(hc.CloseIdleConnections)
	a := post(t, hc, proxy.URL()+"/v1/completions", `{"model":"served-model","prompt":"from the binary"}`, "X-Request-Id", "binary-1")
	require.Equal(t, 200, a.status, a.body)
	require.Equal(t, enginesim.KVPulled, a.header.Get(enginesim.HeaderKV))

	a = post(t, hc, proxy.URL()+"/v1/completions", `{"model":"other-model","prompt":"x"}`)
	requireAPIError(t, a, 404, "model_not_found", `"other-model"`)

	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	select {
	case err := <-exited:
		require.NoError(t, err, "pdx exits 0 on SIGTERM")
	case <-time.After(15 * time.Second):
		t.Fatal("pdx did not exit after SIGTERM")
	}
}

// waitPdxReady waits until the pdx whose admin server is at adminAddr
// answers /readyz with 200.
func waitPdxReady(t *testing.T, adminAddr string) {
	t.Helper()
	require.Eventually(t, func() bool {
		resp, err := http.Get("http://" + adminAddr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	}, 10*time.Second, 20*time.Millisecond)
}
