// Command pdx-demo runs pdx the way the Quick start shows it: simulated
// prefill and decode engines, pdx and a real Envoy on loopback, a batch of
// real requests through them, and a table of what each engine saw; with
// --engines=vllm, real vLLM engines on CPU instead (`make vllm`). It is the
// test wing's command (it links the engine simulator); `make demo` runs
// it, and `pdx` itself links none of it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := demo(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "pdx-demo:", err)
		os.Exit(1)
	}
}
