package mainlib

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/pdx-router/pdx/internal/server"
	"github.com/pdx-router/pdx/internal/tracing"
)

// newLogger returns serve's logger. JSON, the default, is what log pipelines
// parse; text (key=value) is for reading in a terminal. Durations read as
// Go writes them ("30s") in both: JSON would have them in nanoseconds.
func newLogger(format string, level slog.Level, w io.Writer) (*slog.Logger, error) {
	opts := &slog.HandlerOptions{Level: level, ReplaceAttr: durationString}
	switch format {
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("%w: --log-format must be json or text, got %q", ErrUsage, format)
}

// durationString is a ReplaceAttr writing a duration as its String.
func durationString(_ []string, a slog.Attr) slog.Attr {
	if a.Value.Kind() == slog.KindDuration {
		return slog.String(a.Key, a.Value.Duration().String())
	}
	return a
}

// startTracing sets up tracing when the OTEL_* environment asks for it (see
// tracing.FromEnv) and returns the server option that turns it on, with the
// function that flushes the last spans; both are no-ops with tracing off.
func startTracing(ctx context.Context, log *slog.Logger) ([]server.Option, func(), error) {
	tp, err := tracing.FromEnv(ctx)
	if err != nil || tp == nil {
		return nil, func() {}, err
	}
	log.Info("tracing on: exporting spans over OTLP/gRPC")
	stop := func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := tp.Shutdown(sctx); err != nil {
			log.Warn("flushing traces failed", slog.String("error", err.Error()))
		}
	}
	return []server.Option{server.WithTracerProvider(tp)}, stop, nil
}
