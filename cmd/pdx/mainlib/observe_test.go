package mainlib

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/logbuf"
)

// TestServeLogFormat runs serve with each --log-format and checks its first
// line's shape.
func TestServeLogFormat(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "pdx.yaml")
	require.NoError(t, os.WriteFile(cfg, []byte(`
grpc_address: 127.0.0.1:0
admin_address: 127.0.0.1:0
pools:
- name: p
  default: true
  connector: nixl
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:2}]
`), 0o600))
	for format, want := range map[string]string{
		"":     `{"time":`, // the default is JSON
		"json": `{"time":`,
		"text": `time=`,
	} {
		t.Run(fmt.Sprintf("%q", format), func(t *testing.T) {
			args := []string{"serve", "--config", cfg}
			if format != "" {
				args = append(args, "--log-format", format)
			}
			ctx, cancel := context.WithCancel(t.Context())
			var log logbuf.Buffer
			done := make(chan error, 1)
			go func() { done <- Main(ctx, args, &log, &log) }()
			require.Eventually(t, func() bool { return strings.Contains(log.String(), "pdx serving") }, 10*time.Second, 10*time.Millisecond)
			cancel()
			require.NoError(t, <-done)
			require.True(t, strings.HasPrefix(log.String(), want), log.String())
		})
	}
	var out bytes.Buffer
	require.ErrorContains(t, Main(t.Context(), []string{"serve", "--config", cfg, "--log-format", "xml"}, &out, &out), "--log-format must be json or text")
}

// TestServeTracingFromEnv: an OTLP endpoint in the environment turns
// tracing on; shutting down flushes and closes the exporter (goleak checks
// that nothing of it is left).
func TestServeTracingFromEnv(t *testing.T) {
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1") // nothing listens: no span is sent
	cfg := filepath.Join(t.TempDir(), "pdx.yaml")
	require.NoError(t, os.WriteFile(cfg, []byte("grpc_address: 127.0.0.1:0\nadmin_address: 127.0.0.1:0\npools:\n- name: p\n  default: true\n  connector: nixl\n  prefill: [{address: 127.0.0.1:1}]\n  decode: [{address: 127.0.0.1:2}]\n"), 0o600))
	ctx, cancel := context.WithCancel(t.Context())
	var log logbuf.Buffer
	done := make(chan error, 1)
	go func() { done <- Main(ctx, []string{"serve", "--config", cfg}, &log, &log) }()
	require.Eventually(t, func() bool { return strings.Contains(log.String(), "pdx serving") }, 10*time.Second, 10*time.Millisecond)
	cancel()
	require.NoError(t, <-done)
	require.Contains(t, log.String(), "tracing on")
}
