// Command pdx is the prefill/decode disaggregation router for Envoy.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/pdx-router/pdx/cmd/pdx/mainlib"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := mainlib.Main(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(mainlib.ExitStatus(err, os.Stderr))
}
