// Package stack starts a whole pdx deployment on loopback: simulated prefill
// and decode engines, pdx, and a real Envoy in front. The demo, the
// end-to-end tests and the benchmarks all run on it.
package stack

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/server"
	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/envoyproc"
	"github.com/pdx-router/pdx/internal/testbed/logbuf"
	"github.com/pdx-router/pdx/internal/testbed/loopback"
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
	// Engine sets the simulators' latencies and DP size (DPSize, which
	// pdx's config then gives as each endpoint's dp_size); Role and
	// EngineID are ignored.
	Engine enginesim.Config
	// DecodeCapacity, when set, is the decode engines' capacity instead
	// of Engine.Capacity: a rig whose decode engines differ (less KV).
	DecodeCapacity *enginesim.Capacity
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
	// Profile is Envoy's shape (envoy.Config.Profile). With
	// envoy.ProfileAIGateway pdx serves TLS with a self-signed certificate,
	// as an InferencePool's endpoint picker does.
	Profile string
	// SubsetHintHeader is envoy.Config.SubsetHintHeader: a request header
	// that Envoy turns into the gateway's subset hint.
	SubsetHintHeader string
	// EDS runs the decode-fallback profile: pdx serves the decode
	// endpoints over xDS and Envoy's decode cluster is the EDS cluster
	// with override_host (envoy.DecodeEDS). DecodeFallbacks, when set,
	// is the pool's decode_fallbacks and implies EDS.
	EDS             bool
	DecodeFallbacks int
	// PdxReplicas is how many pdx servers run (default 1), each with the
	// same config and its own state; Envoy's ext_proc cluster lists them
	// all and spreads requests over them round robin.
	PdxReplicas int
	// Peers makes the replicas exchange their prefills (config peers,
	// every replica listing every replica's admin address); PeersYAML
	// are more fields of peers, e.g. "pick_jitter: 0s".
	Peers     bool
	PeersYAML string
	// KVEvents makes every engine publish its KV events (the engines need
	// Engine.Capacity) and pdx subscribe to them: "dial", each engine binds
	// a publisher and a replay socket on free loopback ports (unless
	// Engine.KVEvents says otherwise) and pdx's endpoints name them;
	// "bind", pdx listens on a free port and each engine connects to it,
	// its topic kv@<address>@<model>.
	KVEvents string
	// External, when set, are engines already running (real vLLM:
	// package realvllm) that the stack fronts instead of starting
	// simulators; Prefill, Decode, Engine, Tune and MooncakeProtocol are
	// then not read, and Stack.Prefill and Stack.Decode stay empty.
	External *External
}

// External engines a stack fronts: what pdx's config says of them.
type External struct {
	Prefill, Decode []Endpoint
	// KVBind is where pdx listens for the engines' KV events in mode bind
	// ("tcp://127.0.0.1:port"): the engines were told it before they
	// started.
	KVBind string
	// BlockSize is the engines' KV block size (kv_events.block_size).
	BlockSize int
}

// Endpoint is an external engine: its address, the NIXL side channel its
// prefill answers name (kv_address; optional) and, in mode dial, its KV
// event ports.
type Endpoint struct {
	Addr, KVAddr                     string
	KVEventsPort, KVEventsReplayPort int
}

// Stack is a running deployment.
type Stack struct {
	Envoy *envoyproc.Process
	// Pdx is the first pdx replica; Replicas all of them.
	Pdx      *server.Server
	Replicas []*server.Server
	Prefill  []*enginesim.Server
	Decode   []*enginesim.Server
	// Store is the shared KV store of the "http"/"lmcache" connector.
	Store *enginesim.Store

	pdxLog *logbuf.Buffer
	// kvBind is where pdx listens for the engines' KV events in mode bind.
	kvBind string
	// cfg and log are pdx's, for RestartPdx.
	cfg *configv1.Config
	log *slog.Logger
}

// Start brings the stack up and returns once Envoy routes to pdx.
func Start(ctx context.Context, opts Options) (_ *Stack, err error) {
	opts = opts.withDefaults()
	bin := opts.EnvoyBin
	if bin == "" {
		if bin, err = envoyproc.Binary(); err != nil {
			return nil, err
		}
	}
	var s *Stack
	var prefill, decode []endpoint
	if ext := opts.External; ext != nil {
		s = &Stack{pdxLog: &logbuf.Buffer{}, kvBind: ext.KVBind}
		prefill, decode = externalEndpoints(ext.Prefill), externalEndpoints(ext.Decode)
	} else {
		if s, err = StartEngines(ctx, opts); err != nil {
			return nil, err
		}
		prefill, decode = endpointsOf(s.Prefill), endpointsOf(s.Decode)
	}
	defer func() {
		if err != nil {
			s.Close()
		}
	}()

	if opts.Profile == envoy.ProfileAIGateway {
		opts.ConfigYAML = "tls: {self_signed: true}\n" + opts.ConfigYAML
	}
	var addrs, admins []string
	if opts.Peers {
		if admins, err = loopback.FreeAddrs(opts.PdxReplicas); err != nil {
			return nil, err
		}
	}
	cfg, err := config.Parse([]byte(pdxConfig(opts, s.kvBind, withKVEvents(opts, prefill), withKVEvents(opts, decode), admins)))
	if err != nil {
		return nil, fmt.Errorf("stack config: %w", err)
	}
	s.cfg = cfg
	s.log = slog.New(slog.NewJSONHandler(s.pdxLog, &slog.HandlerOptions{Level: opts.LogLevel}))
	for i := range opts.PdxReplicas {
		l := s.log
		if opts.PdxReplicas > 1 {
			l = s.log.With("replica", i)
		}
		rcfg := cfg
		if opts.Peers {
			rcfg = proto.CloneOf(cfg)
			rcfg.AdminAddress = admins[i]
		}
		p, err := server.Start(rcfg, l)
		if err != nil {
			return nil, err
		}
		s.Replicas = append(s.Replicas, p)
		addrs = append(addrs, p.GRPCAddr())
	}
	s.Pdx = s.Replicas[0]
	ecfg := envoy.Config{
		ListenPort:       opts.ListenPort,
		PdxAddresses:     addrs,
		BufferLimitBytes: int(cfg.GetMaxBodyBytes()) + envoy.BufferHeadroom/2,
		RequestBodyMode:  opts.RequestBodyMode,
		Profile:          opts.Profile,
		SubsetHintHeader: opts.SubsetHintHeader,
	}
	if opts.Profile != envoy.ProfileAIGateway {
		// The profile's is AI Gateway's, which Envoy does not apply (both
		// bodies streamed): envoy.Render refuses another.
		ecfg.MessageTimeout = opts.PrefillTimeout + 5*time.Second
	}
	if opts.EDS || opts.DecodeFallbacks > 0 {
		ecfg.DecodeCluster, ecfg.DecodeFallbacks = envoy.DecodeEDS, opts.DecodeFallbacks
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
	if len(s.Replicas) > 1 {
		if err := s.waitReplicasReached(ctx); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// withDefaults fills in the zero fields Options documents.
func (opts Options) withDefaults() Options {
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
	if opts.PdxReplicas == 0 {
		opts.PdxReplicas = 1
	}
	if opts.KVEvents == "dial" && opts.Engine.KVEvents == nil {
		opts.Engine.KVEvents = &enginesim.KVEvents{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0"}
	}
	return opts
}

// StartEngines starts only the simulated engines of a stack of opts (and
// the KV store of a store connector), exactly as Start would, for another
// router to front: a peer measured on the same engines as pdx. Envoy and
// Pdx stay nil, so URL must not be called; Close stops the engines.
func StartEngines(ctx context.Context, opts Options) (_ *Stack, err error) {
	opts = opts.withDefaults()
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
	// In mode bind every engine's address is in its topic, so it is chosen
	// before the engine starts, as is where pdx listens.
	addrs := make([]string, opts.Prefill+opts.Decode+1)
	for i := range addrs {
		addrs[i] = "127.0.0.1:0"
	}
	if opts.KVEvents == "bind" {
		if addrs, err = loopback.ListenLaterAddrs(len(addrs)); err != nil {
			return nil, err
		}
		s.kvBind = "tcp://" + addrs[len(addrs)-1]
	}
	for i := range opts.Prefill {
		sim, err := startSim(ctx, s.publishing(engine, addrs[i]), addrs[i], enginesim.RolePrefill, i, opts.Tune)
		if err != nil {
			return nil, err
		}
		s.Prefill = append(s.Prefill, sim)
	}
	decode := engine
	if opts.DecodeCapacity != nil {
		decode.Capacity = opts.DecodeCapacity
	}
	for i := range opts.Decode {
		addr := addrs[opts.Prefill+i]
		sim, err := startSim(ctx, s.publishing(decode, addr), addr, enginesim.RoleDecode, i, opts.Tune)
		if err != nil {
			return nil, err
		}
		s.Decode = append(s.Decode, sim)
	}
	return s, nil
}

// waitReplicasReached sends GET /v1/models (which pdx answers itself)
// through Envoy until every pdx replica has served one. Envoy is ready once
// it reaches one replica, but for its first second or so it may send the
// others nothing, which would skew the first requests of a replay.
func (s *Stack) waitReplicasReached(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	client := &http.Client{Timeout: 2 * time.Second}
	defer client.CloseIdleConnections()
	for {
		if err := get(ctx, client, s.URL()+"/v1/models", nil); err != nil && ctx.Err() == nil {
			return fmt.Errorf("waiting for the pdx replicas: %w", err)
		}
		var missing []string
		for _, p := range s.Replicas {
			var n float64
			if err := get(ctx, client, "http://"+p.AdminAddr()+"/metrics", func(body string) { n = requestsTotalOf(body) }); err != nil || n == 0 {
				missing = append(missing, p.GRPCAddr())
			}
		}
		switch {
		case len(missing) == 0:
			return nil
		case ctx.Err() != nil:
			return fmt.Errorf("envoy sent pdx replicas %s nothing: %w", strings.Join(missing, ", "), ctx.Err())
		}
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// ReplicaMetrics is every pdx replica's metrics, in the text exposition
// its admin endpoint serves, in the order of Replicas.
func (s *Stack) ReplicaMetrics(ctx context.Context) ([]string, error) {
	client := &http.Client{Timeout: 5 * time.Second}
	defer client.CloseIdleConnections()
	out := make([]string, 0, len(s.Replicas))
	for _, p := range s.Replicas {
		if err := get(ctx, client, "http://"+p.AdminAddr()+"/metrics", func(body string) { out = append(out, body) }); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// get fetches url and hands its body to read, when set.
func get(ctx context.Context, client *http.Client, url string, read func(string)) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: status %d", url, resp.StatusCode)
	}
	if read != nil {
		read(string(b))
	}
	return nil
}

// requestsTotalOf sums pdx_requests_total over its labels in a Prometheus
// text exposition.
func requestsTotalOf(metrics string) float64 {
	var sum float64
	for line := range strings.Lines(metrics) {
		if !strings.HasPrefix(line, "pdx_requests_total{") {
			continue
		}
		fields := strings.Fields(line)
		if v, err := strconv.ParseFloat(fields[len(fields)-1], 64); err == nil {
			sum += v
		}
	}
	return sum
}

// publishing is base with the engine at addr connecting its KV events to
// pdx's socket, in mode bind.
func (s *Stack) publishing(base enginesim.Config, addr string) enginesim.Config {
	if s.kvBind == "" {
		return base
	}
	k := enginesim.KVEvents{}
	if base.KVEvents != nil {
		k = *base.KVEvents
	}
	k.Endpoint, k.Connect, k.ReplayEndpoint = s.kvBind, true, ""
	k.Topic = "kv@" + addr + "@" + Model
	base.KVEvents = &k
	return base
}

func startSim(ctx context.Context, base enginesim.Config, addr string, role enginesim.Role, i int, tune func(enginesim.Role, int, *enginesim.Config)) (*enginesim.Server, error) {
	cfg := base
	cfg.Role = role
	cfg.EngineID = ""
	if tune != nil {
		tune(role, i, &cfg)
	}
	return enginesim.Start(ctx, addr, cfg)
}

// endpoint is what pdx's config says of an engine.
type endpoint struct {
	addr, kvAddr          string
	bootstrapPort, dpSize int
	// kvEventsPort and kvEventsReplayPort are the engine's KV event
	// sockets when it publishes (Config.KVEvents): engines on one host
	// each name their own.
	kvEventsPort, kvEventsReplayPort int
}

func externalEndpoints(eps []Endpoint) []endpoint {
	out := make([]endpoint, len(eps))
	for i, e := range eps {
		out[i] = endpoint{addr: e.Addr, kvAddr: e.KVAddr, kvEventsPort: e.KVEventsPort, kvEventsReplayPort: e.KVEventsReplayPort}
	}
	return out
}

func endpointsOf(sims []*enginesim.Server) []endpoint {
	out := make([]endpoint, len(sims))
	for i, sim := range sims {
		out[i] = endpoint{addr: sim.Addr(), kvAddr: sim.KVAddr(), bootstrapPort: sim.BootstrapPort(), dpSize: sim.DPSize(),
			kvEventsPort: zmqPort(sim.KVEventsEndpoint()), kvEventsReplayPort: zmqPort(sim.KVEventsReplayEndpoint())}
	}
	return out
}

// withKVEvents keeps the endpoints' KV event ports only when pdx
// subscribes: engines that publish for another router (a replay's peer)
// are ordinary endpoints to pdx.
func withKVEvents(opts Options, eps []endpoint) []endpoint {
	if opts.KVEvents != "dial" {
		for i := range eps {
			eps[i].kvEventsPort, eps[i].kvEventsReplayPort = 0, 0
		}
	}
	return eps
}

// zmqPort is the port of a tcp:// ZMQ endpoint, 0 for none.
func zmqPort(ep string) int {
	_, port, err := net.SplitHostPort(strings.TrimPrefix(ep, "tcp://"))
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(port)
	return n
}

// CheckConfig parses the pdx config a stack of opts would run, with
// placeholder engine addresses, so that a bad PoolYAML or ConfigYAML fails
// before any engine or Envoy starts.
func CheckConfig(opts Options) error {
	if opts.Connector == "" {
		opts.Connector = "nixl"
	}
	if opts.PrefillTimeout == 0 {
		opts.PrefillTimeout = 30 * time.Second
	}
	placeholders := func(n, port int) []endpoint {
		out := make([]endpoint, max(n, 1))
		for i := range out {
			out[i] = endpoint{addr: fmt.Sprintf("127.0.0.1:%d", port+i)}
			if opts.KVEvents == "dial" {
				out[i].kvEventsPort = port + 5000 + i
			}
		}
		return out
	}
	admins := make([]string, opts.PdxReplicas)
	for i := range admins {
		admins[i] = fmt.Sprintf("127.0.0.1:%d", 40000+i)
	}
	if _, err := config.Parse([]byte(pdxConfig(opts, "", placeholders(opts.Prefill, 20000), placeholders(opts.Decode, 30000), admins))); err != nil {
		return fmt.Errorf("stack config: %w", err)
	}
	return nil
}

// pdxConfig is the YAML a user would write for this stack; admins are the
// replicas' admin addresses, which peers lists.
func pdxConfig(opts Options, kvBind string, prefill, decode []endpoint, admins []string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "grpc_address: 127.0.0.1:0\nadmin_address: 127.0.0.1:0\n")
	if opts.MaxBodyBytes > 0 {
		fmt.Fprintf(&b, "max_body_bytes: %d\n", opts.MaxBodyBytes)
	}
	if p := opts.PKI; p != nil {
		fmt.Fprintf(&b, "tls: {cert_file: %q, key_file: %q, client_ca_file: %q}\n", p.ServerCertFile, p.ServerKey, p.CAFile)
	}
	if opts.EDS || opts.DecodeFallbacks > 0 {
		fmt.Fprintf(&b, "xds: {enabled: true}\n")
	}
	// The engines' published block size is what pdx hashes prompts in.
	block := 16
	if ext := opts.External; ext != nil && ext.BlockSize > 0 {
		block = ext.BlockSize
	} else if c := opts.Engine.Capacity; c != nil {
		block = c.BlockTokens
		if k := opts.Engine.KVEvents; k != nil && k.TokenScale > 1 {
			block *= k.TokenScale
		}
	}
	switch opts.KVEvents {
	case "dial":
		fmt.Fprintf(&b, "kv_events: {mode: dial, block_size: %d}\n", block)
	case "bind":
		fmt.Fprintf(&b, "kv_events: {mode: bind, bind_address: %q, block_size: %d}\n", cmp.Or(kvBind, "tcp://127.0.0.1:0"), block)
	}
	for line := range strings.Lines(opts.ConfigYAML) {
		fmt.Fprintf(&b, "%s\n", strings.TrimSpace(line))
	}
	if opts.Peers {
		more := ""
		if opts.PeersYAML != "" {
			more = ", " + opts.PeersYAML
		}
		fmt.Fprintf(&b, "peers: {addresses: [%s]%s}\n", strings.Join(admins, ", "), more)
	}
	fmt.Fprintf(&b, "pools:\n")
	fmt.Fprintf(&b, "- name: demo\n  models: [%s]\n  default: %v\n  connector: %s\n  prefill_timeout: %s\n",
		Model, !opts.NotDefault, opts.Connector, opts.PrefillTimeout)
	if opts.MooncakeProtocol != "" {
		fmt.Fprintf(&b, "  mooncake_protocol: %s\n", opts.MooncakeProtocol)
	}
	if opts.DecodeFallbacks > 0 {
		fmt.Fprintf(&b, "  decode_fallbacks: %d\n", opts.DecodeFallbacks)
	}
	for line := range strings.Lines(opts.PoolYAML) {
		fmt.Fprintf(&b, "  %s\n", strings.TrimSpace(line))
	}
	fmt.Fprintf(&b, "  prefill:\n")
	for _, p := range prefill {
		fmt.Fprintf(&b, "  - address: %s\n", p.addr)
		if p.bootstrapPort != 0 {
			fmt.Fprintf(&b, "    bootstrap_port: %d\n", p.bootstrapPort)
		}
		if p.kvAddr != "" {
			fmt.Fprintf(&b, "    kv_address: %s\n", p.kvAddr)
		}
		if p.dpSize != 0 {
			fmt.Fprintf(&b, "    dp_size: %d\n", p.dpSize)
		}
		p.kvEvents(&b)
	}
	fmt.Fprintf(&b, "  decode:\n")
	for _, d := range decode {
		fmt.Fprintf(&b, "  - address: %s\n", d.addr)
		if d.kvAddr != "" {
			fmt.Fprintf(&b, "    kv_address: %s\n", d.kvAddr)
		}
		if d.dpSize != 0 {
			fmt.Fprintf(&b, "    dp_size: %d\n", d.dpSize)
		}
		d.kvEvents(&b)
	}
	b.WriteString(opts.PoolsYAML)
	return b.String()
}

// kvEvents writes the endpoint's KV event ports, for a config with
// kv_events in mode dial.
func (e endpoint) kvEvents(b *strings.Builder) {
	if e.kvEventsPort == 0 {
		return // the engine publishes nothing, or kv_events is not on
	}
	fmt.Fprintf(b, "    kv_events_port: %d\n", e.kvEventsPort)
	if e.kvEventsReplayPort != 0 {
		fmt.Fprintf(b, "    kv_events_replay_port: %d\n", e.kvEventsReplayPort)
	}
}

// URL is the base URL clients use, e.g. "http://127.0.0.1:10000".
func (s *Stack) URL() string { return s.Envoy.URL() }

// RestartPdx stops the first pdx replica and starts a new one with the same
// config on the same addresses, as a restarted pdx process: everything it
// had learnt is gone, and Envoy reconnects to it.
func (s *Stack) RestartPdx(ctx context.Context) error {
	old := s.Replicas[0]
	grpcAddr, adminAddr := old.GRPCAddr(), old.AdminAddr()
	sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	err := old.Shutdown(sctx)
	cancel()
	if err != nil {
		return fmt.Errorf("stopping pdx: %w", err)
	}
	cfg := proto.CloneOf(s.cfg)
	cfg.GrpcAddress, cfg.AdminAddress = grpcAddr, adminAddr
	// The old listeners may take a moment to be free again.
	var p *server.Server
	for {
		if p, err = server.Start(cfg, s.log); err == nil {
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("starting pdx again: %w", err)
		case <-time.After(100 * time.Millisecond):
		}
	}
	s.Replicas[0], s.Pdx = p, p
	return nil
}

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
	for _, p := range s.Replicas {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		errs = append(errs, p.Shutdown(ctx))
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
