// Package enginesim simulates a vLLM engine behind an OpenAI-compatible HTTP
// API, in the prefill, decode or combined role of prefill/decode (P/D)
// disaggregated serving.
//
// It speaks the request side of vLLM's NixlConnector protocol faithfully and
// stands in for the NIXL KV transfer with an HTTP side channel, so that a
// router which derives a prefill request wrongly, or hands a decode engine the
// KV of another request, is caught by the engine itself rather than producing
// plausible-looking output. Generated text starts with the fingerprint of the
// prompt, so a response can be matched to the prompt it belongs to.
package enginesim

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync"
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
	PrefillPerToken time.Duration // extra per prompt token (tokens ~= len(prompt text)/4, at least 1)
	DecodeLatency   time.Duration // fixed time to first output token
	DecodePerToken  time.Duration // per further output token (SSE chunks are spaced by it)
	KVTTL           time.Duration // prefilled KV kept this long if never pulled; default 2m
	// Client is used for KV pulls. The default has a tuned transport, a 10s
	// timeout and dials loopback addresses only (the simulator is a test
	// fixture, and a tampered remote_host must not send traffic elsewhere).
	Client *http.Client
	Logger *slog.Logger // default: discard
}

const (
	defaultKVTTL = 2 * time.Minute
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
	} {
		if d < 0 {
			return c, fmt.Errorf("enginesim: %s must not be negative, got %v", name, d)
		}
	}
	if c.EngineID == "" {
		c.EngineID = randomHex(8)
	}
	if c.KVTTL == 0 {
		c.KVTTL = defaultKVTTL
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c, nil
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
	srv       *http.Server
	served    chan struct{} // closed when Serve has returned
	cancel    context.CancelFunc

	mu        sync.Mutex
	nextSeq   uint64
	resetSeq  uint64 // requests that arrived before this are not recorded
	records   []sequenced
	closing   bool
	stopWatch func() bool // detaches Close from the Start context
	inflight  sync.WaitGroup

	closeOnce sync.Once
	closeErr  error
}

// sequenced is a Record with its arrival number, so records stay in arrival
// order although they are completed in any order.
type sequenced struct {
	seq uint64
	rec Record
}

// Start listens on addr (e.g. "127.0.0.1:0") and serves until Close is called
// or ctx is done.
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
	tcp := ln.Addr().(*net.TCPAddr)
	host := tcp.IP.String()
	if tcp.IP.IsUnspecified() {
		// A wildcard listener is reachable on loopback; advertise that.
		host = "127.0.0.1"
	}
	baseCtx, cancel := context.WithCancel(context.Background())
	s := &Server{
		cfg:    cfg,
		addr:   net.JoinHostPort(host, strconv.Itoa(tcp.Port)),
		host:   host,
		port:   tcp.Port,
		log:    cfg.Logger.With("engine_id", cfg.EngineID, "role", string(cfg.Role)),
		client: cfg.Client,
		kv:     newKVStore(cfg.KVTTL),
		served: make(chan struct{}),
		cancel: cancel,
	}
	if s.client == nil {
		s.client, s.ownClient = newPullClient(), true
	}
	s.srv = &http.Server{
		Handler:           s.routes(),
		ReadHeaderTimeout: 10 * time.Second,
		// Close cancels this to abort simulated work that outlives the grace period.
		BaseContext: func(net.Listener) context.Context { return baseCtx },
		ErrorLog:    slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
	go func() {
		defer close(s.served)
		if err := s.srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			s.log.Error("serve failed", "err", err)
		}
	}()
	stop := context.AfterFunc(ctx, func() { _ = s.Close() })
	s.mu.Lock()
	s.stopWatch = stop
	s.mu.Unlock()
	s.log.Info("engine simulator listening", "addr", s.addr)
	return s, nil
}

// Addr is the "host:port" the simulator is reachable on, e.g. "127.0.0.1:41234".
func (s *Server) Addr() string { return s.addr }

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
		ctx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
		defer cancel()
		if err := s.srv.Shutdown(ctx); err != nil {
			s.log.Warn("grace period over, aborting in-flight requests", "err", err)
			s.cancel()
			s.closeErr = s.srv.Close()
		}
		s.cancel()
		s.inflight.Wait()
		<-s.served
		if s.ownClient {
			s.client.CloseIdleConnections()
		}
		s.log.Info("engine simulator closed")
	})
	return s.closeErr
}

// Records returns a copy of every recorded request, in arrival order. Only
// inference requests and KV pulls are recorded; a record appears once its
// response is decided, before the response is complete on the wire.
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

func (s *Server) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", s.handleInference(apiChat))
	mux.HandleFunc("POST /v1/completions", s.handleInference(apiCompletions))
	mux.HandleFunc("POST /sim/kv/pull", s.handlePull)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusOK)
	})
	mux.HandleFunc("GET /v1/models", s.handleModels)
	mux.HandleFunc("GET /sim/requests", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, s.Records())
	})
	// Without these the mux would answer in plain text rather than the
	// OpenAI error shape clients expect.
	for _, p := range []string{"/v1/chat/completions", "/v1/completions", "/sim/kv/pull", "/health", "/v1/models", "/sim/requests"} {
		mux.HandleFunc(p, func(w http.ResponseWriter, r *http.Request) {
			writeError(w, &apiError{status: http.StatusMethodNotAllowed, msg: "method " + r.Method + " not allowed on " + p})
		})
	}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, &apiError{status: http.StatusNotFound, msg: "no route for " + r.URL.Path})
	})
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(HeaderEngine, s.addr)
		if !s.enter() {
			writeError(w, &apiError{status: http.StatusServiceUnavailable, msg: "engine is shutting down"})
			return
		}
		defer s.inflight.Done()
		mux.ServeHTTP(w, r)
	})
}

func (s *Server) handleModels(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{
		"object": "list",
		"data": []map[string]any{{
			"id": ModelName, "object": "model", "created": time.Now().Unix(),
			"owned_by": "pdx", "root": ModelName,
		}},
	})
}

// ModelName is the model /v1/models lists. Requests may name any model; the
// simulator echoes it back.
const ModelName = "pdx-sim"

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // crypto/rand.Read never fails
	return hex.EncodeToString(b)
}
