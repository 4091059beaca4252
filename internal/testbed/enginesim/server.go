// Package enginesim simulates a vLLM engine behind an OpenAI-compatible HTTP
// API, in the prefill, decode or combined role of prefill/decode (P/D)
// disaggregated serving.
//
// It speaks the request side of one KV connector protocol faithfully (vLLM's
// NixlConnector by default; see Config.Connector for LMCache, Mooncake,
// SGLang, P2P NCCL and TensorRT-LLM) and stands in for the KV transfer with
// HTTP side channels, so that a router which derives a prefill request
// wrongly, or hands a decode engine the KV of another request, is caught by
// the engine itself rather than producing plausible-looking output. Generated
// text starts with the fingerprint of the prompt, so a response can be matched
// to the prompt it belongs to.
//
// Timing is fixed latencies by default; Config.Capacity makes an engine a
// queueing model of a real one instead (prefill server, decode batch, prefix
// cache, KV pulls), and GET /metrics reports its load under the real
// engines' Prometheus metric names.
package enginesim

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Role is the part an engine plays in P/D disaggregated serving.
type Role string

// The roles mirror vLLM's kv_role: a prefill engine produces KV, a decode
// engine consumes it, and "both" does either (kv_both).
const (
	RolePrefill Role = "prefill"
	RoleDecode  Role = "decode"
	RoleBoth    Role = "both"
)

// Config configures a simulator. The zero value is a usable engine in role
// "both" with no latency.
type Config struct {
	Role            Role          // default RoleBoth
	EngineID        string        // default: random hex string
	PrefillLatency  time.Duration // fixed latency of a prefill (also of the prompt phase of a plain request)
	PrefillPerToken time.Duration // extra per prompt token (tokens = the simulator tokenizer's, 4 bytes a token, at least 1)
	DecodeLatency   time.Duration // fixed time to first output token
	DecodePerToken  time.Duration // per further output token (SSE chunks are spaced by it)
	// KVTTL is how long a prefill keeps KV that no decode takes before it
	// frees it; default 2m. For NIXL it stands for vLLM's
	// VLLM_NIXL_ABORT_REQUEST_TIMEOUT (480 s upstream, 120 s in older
	// releases), for SGLang's prefill for SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.
	KVTTL time.Duration
	// Connector is the KV connector protocol the engine speaks; like vLLM's
	// --kv-transfer-config, one engine speaks one: "nixl" (default), "http"
	// (alias "lmcache"), "mooncake", "sglang", "p2p-nccl" or "trtllm".
	Connector string
	// MooncakeProtocol is the flavour of Connector "mooncake": "nixl"
	// (default; Kthena, vllm-ascend) or "vllm" (upstream vLLM's
	// MooncakeConnector, with a bootstrap server and transfer ids).
	MooncakeProtocol string
	// BootstrapAddr is the listen address of the bootstrap server that a
	// prefill-capable engine of Connector "sglang", or "mooncake" with
	// MooncakeProtocol "vllm", runs; default "127.0.0.1:0".
	BootstrapAddr string
	// KVAddr is the listen address of the KV listener of Connector
	// "p2p-nccl" (the stand-in for its ZMQ socket); default "127.0.0.1:0".
	KVAddr string
	// StoreAddr is the address of the shared KV store (see StartStore) that
	// engines of Connector "http" use; required for it.
	StoreAddr string
	// KVWaitTimeout bounds how long a decode waits for the KV of a prefill
	// that runs concurrently with it or has not arrived yet; default 30s.
	// For SGLang it stands for SGLANG_DISAGGREGATION_WAITING_TIMEOUT (300 s
	// upstream), during which the decode holds its pre-allocated KV.
	KVWaitTimeout time.Duration
	// DecodeQueueLatency is how long a NIXL decode request waits in vLLM's
	// waiting queue before the scheduler takes it and it pulls its KV. A
	// client that goes away meanwhile aborts it unscheduled, and the decode
	// notifies the prefill to free the KV (vLLM PR #19223).
	DecodeQueueLatency time.Duration
	// DisconnectCheckInterval is how often SGLang's tokenizer manager looks
	// at the client of a request that waits for output
	// (SGLANG_REQUEST_STATE_WAIT_TIMEOUT, 4 s): a client that went away is
	// noticed, and its request aborted, only at the next check. Default 4s
	// for Connector "sglang"; the other engines notice at once.
	DisconnectCheckInterval time.Duration
	// KeepAlive is how long the API server keeps an idle connection open
	// for the client's next request before it closes it: uvicorn's
	// timeout_keep_alive, which vLLM (VLLM_HTTP_TIMEOUT_KEEP_ALIVE) and
	// SGLang leave at 5 s. Default 5s.
	KeepAlive time.Duration
	// TamperKVParams is a JSON object whose members override those of the
	// kv_transfer_params a NIXL prefill returns (e.g. a foreign remote_host):
	// a misbehaving prefill engine, for testing a router's check of the KV
	// source. Decodes still pull from loopback addresses only.
	TamperKVParams json.RawMessage
	// TRTLLMLegacy makes a Connector "trtllm" engine an older TensorRT-LLM
	// server, whose DisaggregatedParams declares only request_type,
	// first_gen_tokens, ctx_request_id, encoded_opaque_state and
	// draft_tokens (so it refuses disagg_request_id, ctx_usage, ...), and
	// whose context answers carry no prompt_token_ids or disagg_request_id.
	TRTLLMLegacy bool
	// PromptTokensDetails is vLLM's --enable-prompt-tokens-details: usage
	// reports prompt_tokens_details.cached_tokens, the prompt tokens the
	// engine did not compute (for a decode, the KV it pulled), when not 0.
	PromptTokensDetails bool
	// ChatTemplate is text the engine's chat template puts before a chat
	// request's messages (none by default): engines of one model share
	// it, and a render server with another counts other tokens, as a
	// vLLM render server of another model's template would.
	ChatTemplate string
	// Client is used for KV pulls. The default has a tuned transport, a 10s
	// timeout and dials loopback addresses only (the simulator is a test
	// fixture, and a tampered remote_host must not send traffic elsewhere).
	Client *http.Client
	Logger *slog.Logger // default: discard
	// FailStatus, when set, answers every inference request with this
	// status and an OpenAI-style error: a sick engine, for failure tests.
	FailStatus int
	// TallyOnly keeps counts (see Tally) instead of records and logs
	// nothing per request: a load run's millions of records, bodies
	// included, would cost more than the engine being measured.
	TallyOnly bool
	// DPSize is how many data-parallel ranks the engine serves behind its
	// one address (vLLM --data-parallel-size, SGLang --dp-size); 0 or 1:
	// one. A request names its rank as the engine family does (vLLM's
	// X-data-parallel-rank header, SGLang's routed_dp_rank), or the engine
	// picks one; each rank keeps its own KV: a NIXL prefill on rank r names
	// engine "<EngineID>_dp<r>", an SGLang room is registered on the rank
	// its prefill ran on.
	DPSize int
	// Capacity, when set, replaces the fixed latencies above (but
	// DecodeQueueLatency) with a queueing model of a real engine: a prefill
	// server, a decode batch, a prefix cache and KV pull times (see
	// Capacity). GET /metrics reports its queues and cache either way.
	Capacity *Capacity
	// LoRAModules are the LoRA adapters the engine serves (vLLM's
	// --lora-modules names, with --enable-lora): a request whose model is
	// one of them uses it, and under Capacity.MaxLoRA competes for the
	// engine's adapter slots (lora.go). GET /v1/models lists them.
	LoRAModules []string
	// NoScaleOut plays `vllm serve` without --enable-scale-out (vLLM's
	// default): the render routes answer 403, as vLLM 0.32's do
	// (vllm/entrypoints/scale_out/factories.py). The simulator serves them
	// by default, as an engine started with the flag.
	NoScaleOut bool
	// ServedModelName is the model GET /v1/models lists (vLLM's
	// --served-model-name); default ModelName. Requests may name any.
	ServedModelName string
	// KVEvents, when set, publishes the prefix cache's changes (Capacity's)
	// as vLLM's KV events over ZeroMQ (see KVEvents).
	KVEvents *KVEvents
}

// Tally counts what an engine served, by outcome.
type Tally struct {
	Prefill, Decode, Plain, KVPull, KVPush int
	// Pulled counts decodes that took their KV from a prefill engine.
	Pulled int
	// Rejected counts requests and transfers answered with an error status.
	Rejected int
	// KVRelease counts KV release notifications a prefill engine received
	// (vLLM NIXL, a decode aborted before it pulled); Abort counts SGLang
	// /abort_request calls.
	KVRelease, Abort int
	// LongPrefill counts vLLM prefill legs that generated more than one
	// token, StreamedPrefill those answered as a stream (a NIXL one then
	// gives the router no kv_transfer_params): what a router that derives
	// prefills wrongly leaves behind, since vLLM serves both. They are
	// counted with or without TallyOnly (see State too).
	LongPrefill, StreamedPrefill int
	// LoRALoads counts adapters loaded onto the GPU (Capacity.MaxLoRA),
	// with or without TallyOnly.
	LoRALoads int
}

const (
	defaultKVTTL         = 2 * time.Minute
	defaultKVWaitTimeout = 30 * time.Second
	defaultKeepAlive     = 5 * time.Second
	// defaultSGLangDisconnectCheck is SGLang's
	// SGLANG_REQUEST_STATE_WAIT_TIMEOUT (environ.py; the literal timeout=4
	// of tokenizer_manager.py's _wait_one_response in older releases).
	defaultSGLangDisconnectCheck = 4 * time.Second
	defaultSideAddr              = "127.0.0.1:0"
	// shutdownGrace bounds how long Close lets in-flight requests finish
	// before their contexts are cancelled.
	shutdownGrace = 5 * time.Second
	// statusClientGone is recorded (never sent) when the client went away
	// before the response was complete; it is nginx's convention.
	statusClientGone = 499
)

// Response headers that let tests see which engine answered and how.
const (
	HeaderEngine   = "X-Pdx-Sim-Engine"
	HeaderKV       = "X-Pdx-Sim-Kv"
	HeaderKVSource = "X-Pdx-Sim-Kv-Source"
	headerReqID    = "X-Request-Id"
)

func (c Config) withDefaults() (Config, error) {
	switch c.Role {
	case "":
		c.Role = RoleBoth
	case RolePrefill, RoleDecode, RoleBoth:
	default:
		return c, fmt.Errorf("enginesim: unknown role %q (want prefill, decode or both)", c.Role)
	}
	for name, d := range map[string]time.Duration{
		"PrefillLatency": c.PrefillLatency, "PrefillPerToken": c.PrefillPerToken,
		"DecodeLatency": c.DecodeLatency, "DecodePerToken": c.DecodePerToken, "KVTTL": c.KVTTL,
		"KVWaitTimeout": c.KVWaitTimeout, "DecodeQueueLatency": c.DecodeQueueLatency,
		"DisconnectCheckInterval": c.DisconnectCheckInterval, "KeepAlive": c.KeepAlive,
	} {
		if d < 0 {
			return c, fmt.Errorf("enginesim: %s must not be negative, got %v", name, d)
		}
	}
	if c.DPSize < 0 {
		return c, fmt.Errorf("enginesim: DPSize must not be negative, got %d", c.DPSize)
	}
	if c.Capacity != nil {
		if err := c.Capacity.validate(); err != nil {
			return c, err
		}
	}
	if c.KVEvents != nil {
		k := *c.KVEvents // the caller's may change; the engine's must not
		if err := k.withDefaults(&c); err != nil {
			return c, err
		}
		c.KVEvents = &k
	}
	if c.EngineID == "" {
		c.EngineID = randomHex(8)
	}
	if c.KVTTL == 0 {
		c.KVTTL = defaultKVTTL
	}
	if c.KVWaitTimeout == 0 {
		c.KVWaitTimeout = defaultKVWaitTimeout
	}
	if c.KeepAlive == 0 {
		c.KeepAlive = defaultKeepAlive
	}
	if c.BootstrapAddr == "" {
		c.BootstrapAddr = defaultSideAddr
	}
	if c.KVAddr == "" {
		c.KVAddr = defaultSideAddr
	}
	if c.Connector == "" {
		c.Connector = ConnectorNIXL
	}
	if !slices.Contains(Connectors(), c.Connector) {
		return c, fmt.Errorf("enginesim: unknown connector %q (want %s)", c.Connector, strings.Join(Connectors(), ", "))
	}
	switch c.MooncakeProtocol {
	case "":
		c.MooncakeProtocol = MooncakeNIXL
	case MooncakeNIXL, MooncakeVLLM:
	default:
		return c, fmt.Errorf("enginesim: unknown Mooncake protocol %q (want %s or %s)", c.MooncakeProtocol, MooncakeNIXL, MooncakeVLLM)
	}
	if UsesStore(c.Connector) && c.StoreAddr == "" {
		return c, fmt.Errorf("enginesim: connector %q needs StoreAddr, the address of a KV store (see StartStore)", c.Connector)
	}
	if c.DisconnectCheckInterval == 0 && c.Connector == ConnectorSGLang {
		c.DisconnectCheckInterval = defaultSGLangDisconnectCheck
	}
	if _, err := parseTamper(c.TamperKVParams); err != nil {
		return c, err
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c, nil
}

// parseTamper reads Config.TamperKVParams: nothing, or a JSON object.
func parseTamper(raw json.RawMessage) (map[string]json.RawMessage, error) {
	if len(bytes.TrimSpace(raw)) == 0 {
		return nil, nil
	}
	var m map[string]json.RawMessage
	if err := decodeJSON(raw, &m); err != nil || m == nil {
		return nil, fmt.Errorf("enginesim: TamperKVParams must be a JSON object, got %s", bytes.TrimSpace(raw))
	}
	return m, nil
}

// Server is a running simulator.
type Server struct {
	cfg       Config
	addr      string // host:port others reach us on
	host      string // advertised as remote_host
	port      int    // advertised as remote_port
	log       *slog.Logger
	client    *http.Client
	ownClient bool // whether Close should drop the client's idle connections
	kv        *kvStore
	tamper    map[string]json.RawMessage // Config.TamperKVParams
	srv       *http.Server
	served    chan struct{}   // closed when Serve has returned
	base      context.Context // the requests' base context: cancelled once Close gives up on them
	cancel    context.CancelFunc
	proto     protocol
	sides     []*sideServer // bootstrap servers and KV listeners of the protocol
	load      *engineLoad   // queues and prefix cache (Config.Capacity), or in-flight counts
	kvpub     *kvPublisher  // Config.KVEvents, or nil
	metrics   http.Handler  // GET /metrics
	// waitsDone is cancelled when Close starts, so that requests waiting for
	// KV give up at once rather than holding Close for its grace period.
	waitsDone   context.Context
	stopWaiting context.CancelFunc

	mu        sync.Mutex
	nextSeq   uint64
	resetSeq  uint64 // requests that arrived before this are not recorded
	records   []sequenced
	tally     Tally
	waiting   int // NIXL decodes in the waiting queue (Config.DecodeQueueLatency)
	slots     int // decodes holding pre-allocated KV while they wait for a prefill's
	nextRank  int // the DP rank the engine last picked itself (servingRank)
	closing   bool
	stopWatch func() bool // detaches Close from the Start context
	inflight  sync.WaitGroup

	// longPrefills and streamedPrefills count vLLM prefill legs
	// (countPrefill), under mu.
	longPrefills, streamedPrefills int

	closeOnce sync.Once
	closeErr  error

	// prefillObserver is ObservePrefills' function, nil without one.
	prefillObserver atomic.Pointer[func(prompt string)]
}

// sequenced is a Record with its arrival number, so records stay in arrival
// order although they are completed in any order.
type sequenced struct {
	seq uint64
	rec Record
}

// Start listens on addr (e.g. "127.0.0.1:0") and serves until Close is called
// or ctx is done. A protocol that needs a bootstrap server or a KV listener
// (see Config) gets it started too; it stops with the engine.
func Start(ctx context.Context, addr string, cfg Config) (*Server, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("enginesim: listen: %w", err)
	}
	host, port := advertised(ln)
	var kvpub *kvPublisher
	if cfg.KVEvents != nil {
		if kvpub, err = startKVPublisher(*cfg.KVEvents); err != nil {
			_ = ln.Close()
			return nil, err
		}
	}
	baseCtx, cancel := context.WithCancel(context.Background())
	waitsDone, stopWaiting := context.WithCancel(context.Background())
	s := &Server{
		cfg:         cfg,
		addr:        net.JoinHostPort(host, strconv.Itoa(port)),
		host:        host,
		port:        port,
		log:         cfg.Logger.With("engine_id", cfg.EngineID, "role", string(cfg.Role), "connector", cfg.Connector),
		client:      cfg.Client,
		kv:          newKVStore(cfg.KVTTL),
		load:        newEngineLoad(cfg.Capacity, kvpub),
		kvpub:       kvpub,
		served:      make(chan struct{}),
		base:        baseCtx,
		cancel:      cancel,
		waitsDone:   waitsDone,
		stopWaiting: stopWaiting,
	}
	if s.client == nil {
		s.client, s.ownClient = newPullClient(), true
	}
	s.tamper, _ = parseTamper(cfg.TamperKVParams) // withDefaults checked it
	s.metrics = s.metricsHandler()
	errorLog := slog.NewLogLogger(s.log.Handler(), slog.LevelWarn)
	s.proto, err = newProtocol(ctx, s)
	if err != nil {
		_ = ln.Close()
		for _, side := range s.sides {
			_ = side.ln.Close()
		}
		cancel()
		stopWaiting()
		if kvpub != nil {
			kvpub.close()
		}
		return nil, err
	}
	mux := http.NewServeMux()
	s.routes(mux)
	s.srv = &http.Server{
		Handler:           s.guard(mux),
		ReadHeaderTimeout: headerTimeout,
		IdleTimeout:       s.cfg.KeepAlive,
		// Close cancels this to abort simulated work that outlives the grace period.
		BaseContext: func(net.Listener) context.Context { return baseCtx },
		ErrorLog:    errorLog,
	}
	go func() {
		defer close(s.served)
		if err := s.srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			s.log.Error("serve failed", "err", err)
		}
	}()
	for _, side := range s.sides {
		side.srv = &http.Server{
			Handler:           s.guard(side.handler),
			ReadHeaderTimeout: headerTimeout,
			BaseContext:       func(net.Listener) context.Context { return baseCtx },
			ErrorLog:          errorLog,
		}
		go func() {
			defer close(side.served)
			if err := side.srv.Serve(side.ln); !errors.Is(err, http.ErrServerClosed) {
				s.log.Error("serve failed", "listener", side.name, "err", err)
			}
		}()
		s.log.Info("side channel listening", "listener", side.name, "addr", side.addr)
	}
	stop := context.AfterFunc(ctx, func() { _ = s.Close() })
	s.mu.Lock()
	s.stopWatch = stop
	s.mu.Unlock()
	s.log.Info("engine simulator listening", "addr", s.addr)
	return s, nil
}

// advertised is the host and port others reach a listener on. A wildcard
// listener is reachable on loopback; that is advertised.
func advertised(ln net.Listener) (string, int) {
	tcp := ln.Addr().(*net.TCPAddr)
	host := tcp.IP.String()
	if tcp.IP.IsUnspecified() {
		host = "127.0.0.1"
	}
	return host, tcp.Port
}

// sideServer is an extra listener of the engine: a bootstrap server or a KV
// listener, served like the engine itself and closed with it.
type sideServer struct {
	name    string
	ln      net.Listener
	addr    string // advertised host:port
	port    int
	handler http.Handler
	srv     *http.Server
	served  chan struct{}
}

// listenSide opens a side channel listener; Start serves it once the engine
// is complete.
func (s *Server) listenSide(ctx context.Context, name, addr string, h http.Handler) (*sideServer, error) {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("enginesim: listen for %s: %w", name, err)
	}
	host, port := advertised(ln)
	side := &sideServer{name: name, ln: ln, addr: net.JoinHostPort(host, strconv.Itoa(port)), port: port,
		handler: h, served: make(chan struct{})}
	s.sides = append(s.sides, side)
	return side, nil
}

// Addr is the "host:port" the simulator is reachable on, e.g. "127.0.0.1:41234".
func (s *Server) Addr() string { return s.addr }

// BootstrapPort is the port of the engine's bootstrap server (Connector
// "sglang", or "mooncake" with MooncakeProtocol "vllm", in role prefill or
// both), or 0 when it runs none.
func (s *Server) BootstrapPort() int {
	for _, side := range s.sides {
		if side.name == sideBootstrap {
			return side.port
		}
	}
	return 0
}

// DPSize is the engine's Config.DPSize: how many data-parallel ranks serve
// behind its address.
func (s *Server) DPSize() int { return s.cfg.DPSize }

// KVAddr is the "host:port" of the engine's KV listener (Connector
// "p2p-nccl"), or "" when it runs none.
func (s *Server) KVAddr() string {
	for _, side := range s.sides {
		if side.name == sideKV {
			return side.addr
		}
	}
	return ""
}

// Close stops serving and waits for in-flight handlers. They get a grace
// period to finish; after it their contexts are cancelled. Close is safe to
// call more than once.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		s.closing = true
		stop := s.stopWatch
		s.mu.Unlock()
		if stop != nil {
			stop()
		}
		s.stopWaiting()
		ctx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
		defer cancel()
		servers := []*http.Server{s.srv}
		for _, side := range s.sides {
			servers = append(servers, side.srv)
		}
		for _, srv := range servers {
			if err := srv.Shutdown(ctx); err != nil {
				s.log.Warn("grace period over, aborting in-flight requests", "err", err)
				s.cancel()
				if err := srv.Close(); s.closeErr == nil {
					s.closeErr = err
				}
			}
		}
		s.cancel()
		s.inflight.Wait()
		<-s.served
		for _, side := range s.sides {
			<-side.served
		}
		if s.ownClient {
			s.client.CloseIdleConnections()
		}
		if p := s.kvPublisher(); p != nil {
			p.close()
		}
		s.log.Info("engine simulator closed")
	})
	return s.closeErr
}

// Records returns a copy of every recorded request, in arrival order. Only
// inference requests, KV transfers (pulls, and P2P NCCL pushes), KV release
// notifications and SGLang /abort_request calls are recorded; a record
// appears once its response is decided, before the response is complete on
// the wire.
func (s *Server) Records() []Record {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Record, len(s.records))
	for i, sr := range s.records {
		out[i] = sr.rec
		out[i].Body = slices.Clone(sr.rec.Body)
	}
	return out
}

// Reset clears the records, including those of requests still in flight.
func (s *Server) Reset() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.records = nil
	s.resetSeq = s.nextSeq
}

// arrive numbers a request on arrival.
func (s *Server) arrive() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.nextSeq++
	return s.nextSeq - 1
}

// commit stores a finished record at its arrival position.
func (s *Server) commit(seq uint64, rec Record) {
	if s.cfg.TallyOnly {
		s.count(rec)
		return
	}
	s.log.Info("request", "kind", rec.Kind, "path", rec.Path, "request_id", rec.RequestID,
		"status", rec.Status, "kv", rec.KV, "kv_source", rec.KVSource, "error", rec.Error)
	s.mu.Lock()
	defer s.mu.Unlock()
	if seq < s.resetSeq {
		return
	}
	i, _ := slices.BinarySearchFunc(s.records, seq, func(sr sequenced, seq uint64) int {
		return compareUint(sr.seq, seq)
	})
	s.records = slices.Insert(s.records, i, sequenced{seq: seq, rec: rec})
}

func (s *Server) count(rec Record) {
	s.mu.Lock()
	defer s.mu.Unlock()
	t := &s.tally
	switch rec.Kind {
	case KindPrefill:
		t.Prefill++
	case KindDecode:
		t.Decode++
	case KindPlain:
		t.Plain++
	case KindKVPull:
		t.KVPull++
	case KindKVPush:
		t.KVPush++
	case KindKVRelease:
		t.KVRelease++
	case KindAbort:
		t.Abort++
	}
	if rec.KV == KVPulled {
		t.Pulled++
	}
	if rec.Kind == KindRejected || rec.Status >= 400 {
		t.Rejected++
	}
}

// Tally returns the counts of an engine started with TallyOnly (and, in
// any mode, LongPrefill and StreamedPrefill).
func (s *Server) Tally() Tally {
	m := s.load
	m.mu.Lock()
	loads := int(m.lora.loads)
	m.mu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	t := s.tally
	t.LongPrefill, t.StreamedPrefill = s.longPrefills, s.streamedPrefills
	t.LoRALoads = loads
	return t
}

func compareUint(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// enter registers an in-flight handler unless the server is closing, so that
// Close's Wait never races with a late Add.
func (s *Server) enter() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closing {
		return false
	}
	s.inflight.Add(1)
	return true
}

func (s *Server) routes(mux *http.ServeMux) {
	mux.HandleFunc("POST /v1/chat/completions", s.handleInference(apiChat))
	mux.HandleFunc("POST /v1/completions", s.handleInference(apiCompletions))
	mux.HandleFunc("POST /v1/responses", s.handleInference(apiResponses))
	mux.HandleFunc("POST /v1/messages", s.handleInference(apiMessages))
	mux.HandleFunc("POST /sim/kv/pull", s.handlePull)
	mux.HandleFunc("POST /sim/kv/release", s.handleRelease)
	mux.HandleFunc("GET /sim/state", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, s.State())
	})
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusOK)
	})
	mux.HandleFunc("GET /v1/models", s.handleModels)
	mux.HandleFunc("GET /sim/requests", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, s.Records())
	})
	mux.HandleFunc("POST /reset_prefix_cache", s.handleResetPrefixCache)
	mux.HandleFunc("POST /v1/chat/completions/render", s.handleRender(apiChat))
	mux.HandleFunc("POST /v1/completions/render", s.handleRender(apiCompletions))
	mux.HandleFunc("POST /v1/responses/render", s.handleRender(apiResponses))
	mux.HandleFunc("POST /v1/messages/render", s.handleRender(apiMessages))
	paths := []string{"/v1/chat/completions", "/v1/completions", "/sim/kv/pull", "/sim/kv/release", "/sim/state",
		"/health", "/v1/models", "/sim/requests", "/reset_prefix_cache",
		"/v1/chat/completions/render", "/v1/completions/render", "/v1/responses", "/v1/messages",
		"/v1/responses/render", "/v1/messages/render"}
	paths = append(paths, s.metricsRoutes(mux)...)
	if r, ok := s.proto.(routeAdder); ok {
		paths = append(paths, r.addRoutes(mux)...)
	}
	fallbackRoutes(mux, paths...)
}

// routeAdder is a protocol that serves side channel routes on the engine's
// own HTTP server. addRoutes returns their paths.
type routeAdder interface {
	addRoutes(mux *http.ServeMux) []string
}

// fallbackRoutes answers wrong methods on paths, and unknown paths, in the
// OpenAI error shape; without them the mux would answer in plain text.
func fallbackRoutes(mux *http.ServeMux, paths ...string) {
	for _, p := range paths {
		mux.HandleFunc(p, func(w http.ResponseWriter, r *http.Request) {
			writeError(w, &apiError{status: http.StatusMethodNotAllowed, msg: "method " + r.Method + " not allowed on " + p})
		})
	}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, &apiError{status: http.StatusNotFound, msg: "no route for " + r.URL.Path})
	})
}

// guard names the engine on every response and tracks in-flight handlers.
func (s *Server) guard(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(HeaderEngine, s.addr)
		if !s.enter() {
			writeError(w, &apiError{status: http.StatusServiceUnavailable, msg: "engine is shutting down"})
			return
		}
		defer s.inflight.Done()
		h.ServeHTTP(w, r)
	})
}

func (s *Server) handleModels(w http.ResponseWriter, _ *http.Request) {
	name := s.cfg.ServedModelName
	if name == "" {
		name = ModelName
	}
	data := []map[string]any{{
		"id": name, "object": "model", "created": time.Now().Unix(),
		"owned_by": "pdx", "root": name,
	}}
	// vLLM lists its LoRA modules after the base model, their parent.
	for _, a := range s.cfg.LoRAModules {
		data = append(data, map[string]any{
			"id": a, "object": "model", "created": time.Now().Unix(),
			"owned_by": "pdx", "root": a, "parent": name,
		})
	}
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": data})
}

// ModelName is the model /v1/models lists by default
// (Config.ServedModelName). Requests may name any model; the simulator
// echoes it back.
const ModelName = "pdx-sim"

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // crypto/rand.Read never fails
	return hex.EncodeToString(b)
}

// handleResetPrefixCache is vLLM's POST /reset_prefix_cache (a dev-mode
// route of its API server). A reset declined because requests hold blocks
// gets 409 here.
func (s *Server) handleResetPrefixCache(w http.ResponseWriter, _ *http.Request) {
	if !s.ResetPrefixCache() {
		writeError(w, &apiError{status: http.StatusConflict, msg: "prefix cache is in use by running requests; not reset"})
		return
	}
	w.WriteHeader(http.StatusOK)
}
