// Package stack starts a whole pdx deployment on loopback: simulated prefill
// and decode engines, pdx, and a real Envoy in front. The demo, the
// end-to-end tests and the benchmarks all run on it.
package stack

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/server"
	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/envoyproc"
	"github.com/pdx-router/pdx/internal/testbed/logbuf"
)

// Model is the model name the stack's pool serves.
const Model = "demo-model"

// Options shape a stack. The zero value is two prefill and two decode NIXL
// engines with no simulated latency.
type Options struct {
	// Prefill and Decode are the numbers of simulated engines (default 2).
	Prefill, Decode int
	// Connector is the pool's KV connector (default "nixl"); the engines
	// speak its protocol.
	Connector string
	// MooncakeProtocol is the "mooncake" connector's protocol ("nixl" or
	// "vllm").
	MooncakeProtocol string
	// Engine sets the simulators' latencies; Role and EngineID are ignored.
	Engine enginesim.Config
	// PrefillTimeout is the pool's prefill_timeout (default 30s).
	PrefillTimeout time.Duration
	// ListenPort is Envoy's client port; 0 picks a free one.
	ListenPort int
	// EnvoyBin overrides envoyproc.Binary().
	EnvoyBin string
	// LogLevel is pdx's log level (default Info).
	LogLevel slog.Level
	// MaxBodyBytes is pdx's max_body_bytes (default 16 MiB); Envoy buffers a
	// little more (see envoy.BufferHeadroom), so that pdx, not Envoy,
	// answers bodies just over it.
	MaxBodyBytes int
	// PKI, when set, makes pdx require mutual TLS with its certificates and
	// Envoy present its client certificate. EnvoyWithoutClientCert leaves
	// Envoy's certificate out (a client pdx must refuse).
	PKI                    *PKI
	EnvoyWithoutClientCert bool
	// PoolYAML is added to the pool's config, e.g. "prefill_attempts: 2".
	PoolYAML string
	// NotDefault leaves the stack's pool without default: true, so that it
	// serves only Model.
	NotDefault bool
	// ConfigYAML is added to the top level of pdx's config, e.g.
	// "request_body_timeout: 1s"; PoolsYAML after the stack's pool, as more
	// list items of pools.
	ConfigYAML, PoolsYAML string
	// Envoy, when set, adjusts Envoy's config before it starts.
	Envoy func(*envoy.Config)
	// RequestBodyMode is the ext_proc filter's request body mode
	// (envoy.Config.RequestBodyMode): BUFFERED by default, or
	// FULL_DUPLEX_STREAMED.
	RequestBodyMode string
	// Tune, when set, adjusts engine i of a role before it starts (a sick
	// or slow engine among healthy ones).
	Tune func(role enginesim.Role, i int, c *enginesim.Config)
}

// Stack is a running deployment.
type Stack struct {
	Envoy   *envoyproc.Process
	Pdx     *server.Server
	Prefill []*enginesim.Server
	Decode  []*enginesim.Server
	// Store is the shared KV store of the "http"/"lmcache" connector.
	Store *enginesim.Store

	pdxLog *logbuf.Buffer
}

// Start brings the stack up and returns once Envoy routes to pdx.
func Start(ctx context.Context, opts Options) (_ *Stack, err error) {
	if opts.Prefill == 0 {
		opts.Prefill = 2
	}
	if opts.Decode == 0 {
		opts.Decode = 2
	}
	if opts.Connector == "" {
		opts.Connector = "nixl"
	}
	if opts.PrefillTimeout == 0 {
		opts.PrefillTimeout = 30 * time.Second
	}
	bin := opts.EnvoyBin
	if bin == "" {
		if bin, err = envoyproc.Binary(); err != nil {
			return nil, err
		}
	}
	s := &Stack{pdxLog: &logbuf.Buffer{}}
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	engine := opts.Engine
	engine.Connector = opts.Connector
	engine.MooncakeProtocol = opts.MooncakeProtocol
	if enginesim.UsesStore(opts.Connector) {
		if s.Store, err = enginesim.StartStore(ctx, "127.0.0.1:0"); err != nil {
			return nil, err
		}
		engine.StoreAddr = s.Store.Addr()
	}
	for i := range opts.Prefill {
		sim, err := startSim(ctx, engine, enginesim.RolePrefill, i, opts.Tune)
		if err != nil {
			return nil, err
		}
		s.Prefill = append(s.Prefill, sim)
	}
	for i := range opts.Decode {
		sim, err := startSim(ctx, engine, enginesim.RoleDecode, i, opts.Tune)
		if err != nil {
			return nil, err
		}
		s.Decode = append(s.Decode, sim)
	}

	cfg, err := config.Parse([]byte(s.pdxConfig(opts)))
	if err != nil {
		return nil, fmt.Errorf("stack config: %w", err)
	}
	log := slog.New(slog.NewJSONHandler(s.pdxLog, &slog.HandlerOptions{Level: opts.LogLevel}))
	if s.Pdx, err = server.Start(cfg, log); err != nil {
		return nil, err
	}
	ecfg := envoy.Config{
		ListenPort:       opts.ListenPort,
		PdxAddress:       s.Pdx.GRPCAddr(),
		MessageTimeout:   opts.PrefillTimeout + 5*time.Second,
		BufferLimitBytes: int(cfg.GetMaxBodyBytes()) + envoy.BufferHeadroom/2,
		RequestBodyMode:  opts.RequestBodyMode,
	}
	if opts.Envoy != nil {
		opts.Envoy(&ecfg)
	}
	if p := opts.PKI; p != nil {
		ecfg.PdxTLS = &envoy.TLS{CAFile: p.CAFile, SNI: p.ServerName}
		if !opts.EnvoyWithoutClientCert {
			ecfg.PdxTLS.CertFile, ecfg.PdxTLS.KeyFile = p.ClientCertFile, p.ClientKey
		}
	}
	s.Envoy, err = envoyproc.Start(ctx, bin, ecfg, nil)
	if err != nil {
		return nil, err
	}
	return s, nil
}

func startSim(ctx context.Context, base enginesim.Config, role enginesim.Role, i int, tune func(enginesim.Role, int, *enginesim.Config)) (*enginesim.Server, error) {
	cfg := base
	cfg.Role = role
	cfg.EngineID = ""
	if tune != nil {
		tune(role, i, &cfg)
	}
	return enginesim.Start(ctx, "127.0.0.1:0", cfg)
}

// pdxConfig is the YAML a user would write for this stack.
func (s *Stack) pdxConfig(opts Options) string {
	var b strings.Builder
	fmt.Fprintf(&b, "grpc_address: 127.0.0.1:0\nadmin_address: 127.0.0.1:0\n")
	if opts.MaxBodyBytes > 0 {
		fmt.Fprintf(&b, "max_body_bytes: %d\n", opts.MaxBodyBytes)
	}
	if p := opts.PKI; p != nil {
		fmt.Fprintf(&b, "tls: {cert_file: %q, key_file: %q, client_ca_file: %q}\n", p.ServerCertFile, p.ServerKey, p.CAFile)
	}
	for line := range strings.Lines(opts.ConfigYAML) {
		fmt.Fprintf(&b, "%s\n", strings.TrimSpace(line))
	}
	fmt.Fprintf(&b, "pools:\n")
	fmt.Fprintf(&b, "- name: demo\n  models: [%s]\n  default: %v\n  connector: %s\n  prefill_timeout: %s\n",
		Model, !opts.NotDefault, opts.Connector, opts.PrefillTimeout)
	if opts.MooncakeProtocol != "" {
		fmt.Fprintf(&b, "  mooncake_protocol: %s\n", opts.MooncakeProtocol)
	}
	for line := range strings.Lines(opts.PoolYAML) {
		fmt.Fprintf(&b, "  %s\n", strings.TrimSpace(line))
	}
	fmt.Fprintf(&b, "  prefill:\n")
	for _, p := range s.Prefill {
		fmt.Fprintf(&b, "  - address: %s\n", p.Addr())
		if port := p.BootstrapPort(); port != 0 {
			fmt.Fprintf(&b, "    bootstrap_port: %d\n", port)
		}
		if kv := p.KVAddr(); kv != "" {
			fmt.Fprintf(&b, "    kv_address: %s\n", kv)
		}
	}
	fmt.Fprintf(&b, "  decode:\n")
	for _, d := range s.Decode {
		fmt.Fprintf(&b, "  - address: %s\n", d.Addr())
		if kv := d.KVAddr(); kv != "" {
			fmt.Fprintf(&b, "    kv_address: %s\n", kv)
		}
	}
	b.WriteString(opts.PoolsYAML)
	return b.String()
}

// URL is the base URL clients use, e.g. "http://127.0.0.1:10000".
func (s *Stack) URL() string { return s.Envoy.URL() }

// Engines returns every simulator, prefill first.
func (s *Stack) Engines() []*enginesim.Server {
	return append(append([]*enginesim.Server(nil), s.Prefill...), s.Decode...)
}

// PdxLog returns what pdx has logged so far.
func (s *Stack) PdxLog() string { return s.pdxLog.String() }

// Logs returns Envoy's and pdx's logs, for a failing test.
func (s *Stack) Logs() string {
	var b strings.Builder
	if s.Envoy != nil {
		fmt.Fprintf(&b, "----- envoy log -----\n%s\n", s.Envoy.Log())
	}
	fmt.Fprintf(&b, "----- pdx log -----\n%s\n", s.pdxLog.String())
	return b.String()
}

// Close stops everything, Envoy first so no request is cut mid-way by pdx.
func (s *Stack) Close() error {
	var errs []error
	if s.Envoy != nil {
		errs = append(errs, s.Envoy.Stop())
	}
	if s.Pdx != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		errs = append(errs, s.Pdx.Shutdown(ctx))
		cancel()
	}
	for _, e := range s.Engines() {
		errs = append(errs, e.Close())
	}
	if s.Store != nil {
		errs = append(errs, s.Store.Close())
	}
	return errors.Join(errs...)
}
