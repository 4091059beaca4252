// Package mainlib is the pdx command, kept out of package main so that tests
// and benchmarks run the real thing in-process.
package mainlib

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/reload"
	"github.com/pdx-router/pdx/internal/server"
	"github.com/pdx-router/pdx/internal/version"
)

const usage = `usage: pdx <command> [flags]

commands:
  serve --config FILE      run the ext_proc service
  validate --config FILE   check a config file as serve loads it, without serving
  envoy-config             print the Envoy bootstrap for a pdx at --pdx-address
  version                  print pdx's version, commit, Go, and the Envoy it is tested with

pdx <command> --help lists a command's flags.
`

// ErrUsage is returned for a command line pdx does not understand.
var ErrUsage = errors.New("bad usage")

// Main runs the pdx command with args (without the program name) until ctx
// ends or the command finishes.
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	err := run(ctx, args, stdout, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return nil // the flag package printed the help asked for
	}
	return err
}

// ExitStatus reports err, Main's, on stderr, one problem a line (a
// config's problems are joined so), and returns the process's exit status:
// 0 without an error, else 1.
func ExitStatus(err error, stderr io.Writer) int {
	if err == nil {
		return 0
	}
	for line := range strings.Lines(err.Error()) {
		fmt.Fprintln(stderr, "pdx:", strings.TrimSuffix(line, "\n"))
	}
	return 1
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return ErrUsage
	}
	switch args[0] {
	case "serve":
		return serve(ctx, args[1:], stderr)
	case "validate":
		return validate(args[1:], stdout, stderr)
	case "envoy-config":
		return envoyConfig(args[1:], stdout, stderr)
	case "version", "--version", "-version":
		return printVersion(args[1:], stdout, stderr)
	case "help", "-h", "--help", "-help":
		fmt.Fprint(stdout, usage)
		return nil
	}
	fmt.Fprint(stderr, usage)
	return fmt.Errorf("%w: unknown command %q", ErrUsage, args[0])
}

// parseFlags parses a command's flags; a command takes no arguments
// besides them.
func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		return fmt.Errorf("%w: %w", ErrUsage, err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%w: unexpected argument %q: %s takes only flags (pdx %s --help lists them)", ErrUsage, fs.Arg(0), fs.Name(), fs.Name())
	}
	return nil
}

// printVersion prints what version.Get says.
func printVersion(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("version", flag.ContinueOnError)
	fs.SetOutput(stderr)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	fmt.Fprint(stdout, version.Get())
	return nil
}

func serve(ctx context.Context, args []string, stderr io.Writer) error {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	path := fs.String("config", "", "config file (YAML)")
	level := fs.String("log-level", "info", "log level: debug, info, warn, error")
	logFormat := fs.String("log-format", "json", "log format: json (for log pipelines) or text (key=value)")
	drain := fs.Duration("drain-timeout", 30*time.Second, "how long in-flight requests may finish on shutdown")
	pprofAddr := fs.String("pprof-address", "", "serve Go's /debug/pprof/ on this host:port (off when empty; keep it on loopback)")
	kubeconfig := fs.String("kubeconfig", "", "kubeconfig file for pools that discover their engines in Kubernetes (default: the in-cluster service account)")
	pollEvery := fs.Duration("config-poll-interval", reload.DefaultInterval, "how often to check --config for changes and reload it")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *path == "" {
		return fmt.Errorf("%w: serve needs --config", ErrUsage)
	}
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(*level)); err != nil {
		return fmt.Errorf("%w: --log-level: %w", ErrUsage, err)
	}
	log, err := newLogger(*logFormat, lvl, stderr)
	if err != nil {
		return err
	}
	v := version.Get()
	log.Info("pdx starting", slog.String("version", v.Release), slog.String("commit", v.Commit), slog.String("go", v.Go))
	// The table follows the file's changes, and discovered pools the cluster.
	rl, err := reload.New(ctx, reload.Options{Path: *path, Interval: *pollEvery, Log: log, Kube: kubeClient(*kubeconfig, log),
		Dynamic: dynamicClient(*kubeconfig, log)})
	if err != nil {
		return err
	}
	defer rl.Close() // after the drain below: draining requests keep their pools fed
	cfg := rl.Config()
	tracingOpts, stopTracing, err := startTracing(ctx, log)
	if err != nil {
		return err
	}
	defer stopTracing() // after the drain below: it flushes the drained requests' spans
	srv, err := server.Start(cfg, log, append(tracingOpts, server.WithTable(rl.Table()))...)
	if err != nil {
		return err
	}
	rctx, stopReloading := context.WithCancel(ctx)
	reloading := make(chan struct{})
	go func() {
		defer close(reloading)
		rl.Run(rctx, srv.SetTable)
	}()
	defer func() { stopReloading(); <-reloading }() // before rl.Close
	if *pprofAddr != "" {
		stop, err := servePprof(*pprofAddr, log)
		if err != nil {
			_ = srv.Shutdown(context.Background())
			return err
		}
		defer stop()
	}
	<-ctx.Done()
	log.Info("shutting down", slog.Duration("drain_timeout", *drain))
	sctx, cancel := context.WithTimeout(context.Background(), *drain)
	defer cancel()
	return srv.Shutdown(sctx)
}

func envoyConfig(args []string, stdout, stderr io.Writer) error {
	fs, c := envoyConfigFlags(stderr)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	return envoy.Render(stdout, c())
}

// envoyConfigFlags are envoy-config's flags, and the envoy.Config they set
// once parsed. A flag left unset leaves its field zero, which Render fills
// in as the profile needs; a flag set that the profile would not honour,
// Render refuses.
func envoyConfigFlags(stderr io.Writer) (*flag.FlagSet, func() envoy.Config) {
	fs := flag.NewFlagSet("envoy-config", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var c envoy.Config
	fs.StringVar(&c.PdxAddress, "pdx-address", config.DefaultGRPCAddress, "pdx's gRPC address (host:port; a DNS name works)")
	fs.StringVar(&c.ListenAddress, "listen-address", "127.0.0.1", "address Envoy listens on for clients")
	fs.IntVar(&c.ListenPort, "listen-port", 10000, "port Envoy listens on for clients")
	fs.IntVar(&c.AdminPort, "admin-port", 9901, "Envoy admin port (on 127.0.0.1)")
	fs.DurationVar(&c.MessageTimeout, "message-timeout", 0, fmt.Sprintf("ext_proc message timeout (default %v); keep it above every pool's prefill_timeout. "+
		"Not with --profile %s, whose is AI Gateway's 5s, which Envoy does not apply to its streamed bodies", envoy.DefaultMessageTimeout, envoy.ProfileAIGateway))
	fs.IntVar(&c.BufferLimitBytes, "buffer-limit", envoy.DefaultBufferLimitBytes, "largest request body Envoy buffers; match pdx's max_body_bytes")
	fs.StringVar(&c.RequestBodyMode, "request-body-mode", "", "how Envoy sends request bodies to pdx: "+envoy.BodyBuffered+" (the default) or "+envoy.BodyFullDuplexStreamed+
		" (the InferencePool integrations' mode, and --profile "+envoy.ProfileAIGateway+"'s only one)")
	fs.IntVar(&c.MaxRequestHeaders, "max-request-headers", envoy.DefaultMaxRequestHeaders, "largest number of request headers; match pdx's max_request_headers")
	fs.IntVar(&c.MaxRequestHeadersKB, "max-request-headers-kb", envoy.DefaultMaxRequestHeadersKB, "largest size of request headers, in KiB; match pdx's max_request_headers_kb")
	fs.StringVar(&c.Profile, "profile", envoy.ProfilePdx, "the Envoy around pdx: "+envoy.ProfilePdx+" (pdx's own) or "+envoy.ProfileAIGateway+
		" (as Envoy AI Gateway's InferencePool translation configures its endpoint picker, to test pdx with; pdx must serve tls.self_signed; "+
		"--pdx-ca and the other TLS flags, --decode-cluster "+envoy.DecodeEDS+", --observer, --message-timeout and --request-body-mode "+envoy.BodyBuffered+" are refused)")
	fs.StringVar(&c.DecodeCluster, "decode-cluster", envoy.DecodeOriginalDst, "the decode cluster: "+envoy.DecodeOriginalDst+" (the one host pdx names) or "+envoy.DecodeEDS+" (decode fallback: the decode engines pdx serves over EDS, its xds config, retried in pdx's order)")
	fs.IntVar(&c.DecodeFallbacks, "decode-fallbacks", 0, "with --decode-cluster "+envoy.DecodeEDS+": how often Envoy retries a decode (default 1); the most decode_fallbacks of pdx's pools")
	fs.StringVar(&c.XDSCluster, "xds-cluster", "", "with --decode-cluster "+envoy.DecodeEDS+": pdx's xds.cluster_name (default "+config.DefaultXDSCluster+")")
	fs.BoolVar(&c.Observer, "observer", false, "add the observability pass: a second ext_proc filter that shows pdx the decode's response (TTFT split, token usage); costs CPU per request")
	fs.StringVar(&c.ObserverAddress, "observer-address", "", "with --observer: send the observability pass to this ext_proc server (host:port) instead of pdx")
	var t envoy.TLS
	fs.StringVar(&t.CAFile, "pdx-ca", "", "reach pdx over TLS: CA file that verifies pdx's certificate")
	fs.StringVar(&t.SNI, "pdx-sni", "", "with --pdx-ca: the DNS name pdx's certificate is valid for")
	fs.StringVar(&t.CertFile, "pdx-client-cert", "", "with --pdx-ca: Envoy's client certificate, for pdx's mutual TLS")
	fs.StringVar(&t.KeyFile, "pdx-client-key", "", "with --pdx-client-cert: its private key")
	return fs, func() envoy.Config {
		if t != (envoy.TLS{}) {
			c.PdxTLS = &t
		}
		return c
	}
}
