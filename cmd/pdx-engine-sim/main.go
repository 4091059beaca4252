// Command pdx-engine-sim runs a simulated vLLM engine (see package enginesim)
// in the prefill, decode or both role, for testing the pdx router end to end
// without GPUs.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/pdx-router/pdx/internal/enginesim"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "pdx-engine-sim:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	fs := flag.NewFlagSet("pdx-engine-sim", flag.ContinueOnError)
	addr := fs.String("addr", "127.0.0.1:8000", "address to listen on")
	role := fs.String("role", string(enginesim.RoleBoth), "engine role: prefill, decode or both")
	var cfg enginesim.Config
	fs.StringVar(&cfg.EngineID, "engine-id", "", "engine id advertised in kv_transfer_params (default random)")
	fs.DurationVar(&cfg.PrefillLatency, "prefill-latency", 0, "fixed latency of a prefill")
	fs.DurationVar(&cfg.PrefillPerToken, "prefill-per-token", 0, "extra prefill latency per prompt token")
	fs.DurationVar(&cfg.DecodeLatency, "decode-latency", 0, "time to first output token")
	fs.DurationVar(&cfg.DecodePerToken, "decode-per-token", 0, "time per further output token")
	fs.DurationVar(&cfg.KVTTL, "kv-ttl", 0, "how long unpulled KV is kept (default 2m)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	cfg.Role = enginesim.Role(*role)
	cfg.Logger = slog.New(slog.NewJSONHandler(os.Stderr, nil))

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	srv, err := enginesim.Start(ctx, *addr, cfg)
	if err != nil {
		return err
	}
	<-ctx.Done()
	return srv.Close()
}
