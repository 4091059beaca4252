package mainlib

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
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
	for format, want := range map[string]struct{ first, drain string }{
		"":     {`{"time":`, `"drain_timeout":"30s"`}, // the default is JSON
		"json": {`{"time":`, `"drain_timeout":"30s"`},
		"text": {`time=`, `drain_timeout=30s`},
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
			require.True(t, strings.HasPrefix(log.String(), want.first), log.String())
			require.Contains(t, log.String(), want.drain, "a duration as Go writes it")
		})
	}
	var out bytes.Buffer
	require.ErrorContains(t, Main(t.Context(), []string{"serve", "--config", cfg, "--log-format", "xml"}, &out, &out), "--log-format must be json or text")
}

// Durations read as Go writes them in both formats, in groups too.
func TestLoggerDurations(t *testing.T) {
	for format, want := range map[string][]string{
		"json": {`"wait":"1.5s"`, `"any":"250ms"`, `"g":{"timeout":"2m0s"}`, `"n":3`},
		"text": {`wait=1.5s`, `any=250ms`, `g.timeout=2m0s`, `n=3`},
	} {
		var out bytes.Buffer
		log, err := newLogger(format, slog.LevelInfo, &out)
		require.NoError(t, err)
		log.Info("x", slog.Duration("wait", 1500*time.Millisecond), slog.Any("any", 250*time.Millisecond),
			slog.Group("g", slog.Duration("timeout", 2*time.Minute)), slog.Int("n", 3))
		for _, w := range want {
			require.Contains(t, out.String(), w, format)
		}
	}
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
