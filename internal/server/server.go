// Package server runs pdx: the ext_proc gRPC service with its health
// services, and the HTTP admin endpoint.
package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/enginemetrics"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/kvevents"
	"github.com/pdx-router/pdx/internal/metrics"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/xds"
	"github.com/pdx-router/pdx/processor"
)

// healthServices are the gRPC health service names pdx answers for: the
// endpoint-picker convention plus the empty name for plain checkers.
var healthServices = []string{"", "liveness", "readiness", extprocv3.ExternalProcessor_ServiceDesc.ServiceName}

// grpcOverhead is room for the ext_proc message around a body of
// max_body_bytes: headers, metadata and framing.
const grpcOverhead = 1 << 20

// Server is a running pdx.
type Server struct {
	log     *slog.Logger
	grpc    *grpc.Server
	health  *health.Server
	admin   *http.Server
	engine  *engines.HTTP
	grpcLn  net.Listener
	adminLn net.Listener
	ready   atomic.Bool
	served  chan error
	metrics *metrics.Metrics
	proc    *processor.Server
	// stopScraping ends the engine metrics scraper; scraped is closed once
	// it has. nil when scraping is off.
	stopScraping context.CancelFunc
	scraped      chan struct{}
	// kvEvents reads the engines' KV events (nil: off); stopEvents ends
	// its engine updates, eventsDone is closed once they have.
	kvEvents   *kvevents.Subscriber
	stopEvents context.CancelFunc
	eventsDone chan struct{}
	// xds serves Envoy the decode endpoints (nil: off); stopXDS ends its
	// streams and its updates, xdsDone is closed once the updates have.
	xds     *xds.Server
	stopXDS context.CancelFunc
	xdsDone chan struct{}
	// instance is the replica's name among its peers (peers.go);
	// peersStop, closed at shutdown, ends the peers' streams of its
	// journal; stopPeers ends its reading of theirs, peersDone is closed
	// once it has (nil: no peers).
	instance  string
	peersStop chan struct{}
	stopPeers context.CancelFunc
	peersDone chan struct{}

	shutdownOnce sync.Once
	shutdownErr  error
}

// Option configures a Server.
type Option func(*options)

type options struct {
	tracerProvider trace.TracerProvider
	table          *routing.Table
}

// WithTable serves table instead of one built from the config's pools: a
// table whose discovered pools are already fed (see package reload).
func WithTable(t *routing.Table) Option {
	return func(o *options) { o.table = t }
}

// WithTracerProvider traces requests with tp (see processor.WithTracerProvider).
// The caller shuts tp down, after the server.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return func(o *options) { o.tracerProvider = tp }
}

// Start listens on the config's addresses and serves until Shutdown.
func Start(cfg *configv1.Config, log *slog.Logger, with ...Option) (*Server, error) {
	var o options
	for _, opt := range with {
		opt(&o)
	}
	table := o.table
	if table == nil {
		var err error
		if table, err = routing.New(cfg); err != nil {
			return nil, err
		}
	}
	grpcLn, err := net.Listen("tcp", cfg.GetGrpcAddress())
	if err != nil {
		return nil, fmt.Errorf("grpc_address: %w", err)
	}
	tlsCfg, err := tlsConfig(cfg.GetTls(), grpcLn.Addr())
	if err != nil {
		grpcLn.Close()
		return nil, err
	}
	adminLn, err := net.Listen("tcp", cfg.GetAdminAddress())
	if err != nil {
		grpcLn.Close()
		return nil, fmt.Errorf("admin_address: %w", err)
	}
	maxMsg := int(cfg.GetMaxBodyBytes()) + grpcOverhead
	opts := []grpc.ServerOption{
		grpc.MaxRecvMsgSize(maxMsg),
		grpc.MaxSendMsgSize(maxMsg),
		// Large windows let a multi-megabyte body arrive in one go.
		grpc.InitialWindowSize(16 << 20),
		grpc.InitialConnWindowSize(64 << 20),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 5 * time.Second, PermitWithoutStream: true}),
		grpc.ForceServerCodecV2(codec{}),
	}
	if tlsCfg != nil {
		opts = append(opts, grpc.Creds(credentials.NewTLS(tlsCfg)))
	}
	s := &Server{
		log:     log,
		engine:  engines.NewHTTP(),
		grpc:    grpc.NewServer(opts...),
		health:  health.NewServer(),
		grpcLn:  grpcLn,
		adminLn: adminLn,
		served:  make(chan error, 2),
		metrics: metrics.New(),

		instance:  newInstance(),
		peersStop: make(chan struct{}),
	}
	proc := processor.New(table, s.engine, log, processor.WithMetrics(s.metrics), processor.WithTracerProvider(o.tracerProvider))
	s.proc = proc
	if err := s.subscribe(cfg.GetKvEvents()); err != nil {
		grpcLn.Close()
		adminLn.Close()
		return nil, fmt.Errorf("kv_events: %w", err)
	}
	s.metrics.CollectEndpoints(proc.Table)
	extprocv3.RegisterExternalProcessorServer(s.grpc, proc)
	healthpb.RegisterHealthServer(s.grpc, s.health)
	if x := cfg.GetXds(); x.GetEnabled() {
		s.serveXDS(x.GetClusterName(), table)
	}
	for _, name := range healthServices {
		s.health.SetServingStatus(name, healthpb.HealthCheckResponse_SERVING)
	}
	s.scrape(cfg.GetEngineMetrics())
	s.admin = &http.Server{Handler: s.adminHandler(), ReadHeaderTimeout: 5 * time.Second}
	s.ready.Store(true)
	go func() { s.served <- s.grpc.Serve(grpcLn) }()
	go func() { s.served <- s.admin.Serve(adminLn) }()
	var peers context.Context
	peers, s.stopPeers = context.WithCancel(context.Background())
	s.followPeers(peers, cfg.GetPeers(), cfg.GetDnsRefreshRate().AsDuration())
	log.Info("pdx serving", slog.String("grpc", s.GRPCAddr()), slog.String("admin", s.AdminAddr()),
		slog.Int("pools", len(cfg.GetPools())), slog.Bool("tls", tlsCfg != nil), slog.Bool("self_signed", cfg.GetTls().GetSelfSigned()),
		slog.Bool("mtls", tlsCfg != nil && tlsCfg.ClientCAs != nil))
	return s, nil
}

// scrape starts reading the engines' metrics into the routing table's legs,
// off every request's path. The engines are those of the table current when
// each scrape round starts, so reloads and discovery are followed; the
// interval and path are the config's at start.
func (s *Server) scrape(m *configv1.EngineMetrics) {
	if m == nil || m.GetDisabled() {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	s.stopScraping, s.scraped = cancel, make(chan struct{})
	first := newFirstRound(s.proc.Table().Addresses())
	go func() {
		defer close(s.scraped)
		enginemetrics.Run(ctx, enginemetrics.Options{
			Interval: m.GetInterval().AsDuration(),
			Path:     m.GetPath(),
			Targets:  func() []string { return s.proc.Table().Addresses() },
			Store: func(address string, smp enginemetrics.Sample, at time.Time) {
				s.proc.Table().Observe(address, picker.Load{Waiting: smp.Waiting, Running: smp.Running, KVUsage: smp.KVUsage, KVTokens: smp.KVTokens, KVBlockTokens: smp.KVBlockSize, At: at,
					Adapters: picker.AdapterLoad{Running: smp.LoRA.Running, Waiting: smp.LoRA.Waiting, MaxLoRA: smp.LoRA.MaxLoRA}})
				first.heard(address)
			},
			Failed: func(address string, _ error) {
				s.metrics.ScrapeFailed(address)
				first.heard(address)
			},
			Log: s.log.With(slog.String("component", "engine_metrics")),
		})
	}()
	// Until the engines' metrics are in, pdx holds every decode's stream
	// to count it (request.letGo), and those generations would die with
	// pdx: readiness waits for one answer or failure from every engine,
	// which takes a scrape, or up to firstRoundWait.
	select {
	case <-first.done:
	case <-time.After(firstRoundWait):
		s.log.Warn("serving before every engine's metrics were read", slog.Duration("waited", firstRoundWait))
	}
}

// firstRoundWait bounds how long pdx's start waits for the engines' first
// metrics: a scrape's timeout, at the default interval, with room.
const firstRoundWait = time.Second

// firstRound tells when every engine of a set has been scraped once.
type firstRound struct {
	mu   sync.Mutex
	left map[string]bool
	done chan struct{}
}

func newFirstRound(addresses []string) *firstRound {
	f := &firstRound{left: map[string]bool{}, done: make(chan struct{})}
	for _, a := range addresses {
		f.left[a] = true
	}
	if len(f.left) == 0 {
		close(f.done)
	}
	return f
}

// heard notes a scrape of address, successful or not.
func (f *firstRound) heard(address string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.left[address] {
		delete(f.left, address)
		if len(f.left) == 0 {
			close(f.done)
		}
	}
}

// stopScrape ends the engine metrics scraper, if it runs.
func (s *Server) stopScrape() {
	if s.stopScraping != nil {
		s.stopScraping()
		<-s.scraped
	}
}

// serveXDS registers the endpoint discovery service on the gRPC server and
// keeps it up to date with the table proc routes by.
func (s *Server) serveXDS(cluster string, table *routing.Table) {
	ctx, cancel := context.WithCancel(context.Background())
	s.xds = xds.New(cluster, table, s.log.With(slog.String("component", "xds")))
	s.xds.Register(ctx, s.grpc)
	s.stopXDS, s.xdsDone = cancel, make(chan struct{})
	go func() {
		defer close(s.xdsDone)
		s.xds.Run(ctx)
	}()
}

// GRPCAddr is the ext_proc listener's address.
func (s *Server) GRPCAddr() string { return s.grpcLn.Addr().String() }

// SetTable routes the streams that start from now on by t (a reloaded
// config); streams already open keep the table they started with.
func (s *Server) SetTable(t *routing.Table) {
	s.proc.SetTable(t)
	if s.xds != nil {
		s.xds.SetTable(t)
	}
}

// Table is the routing table new streams are routed by.
func (s *Server) Table() *routing.Table { return s.proc.Table() }

// AdminAddr is the HTTP admin listener's address.
func (s *Server) AdminAddr() string { return s.adminLn.Addr().String() }

// Shutdown stops taking streams, lets in-flight ones finish until ctx ends,
// then cuts the rest. Later calls return the first call's result.
func (s *Server) Shutdown(ctx context.Context) error {
	s.shutdownOnce.Do(func() { s.shutdownErr = s.shutdown(ctx) })
	return s.shutdownErr
}

func (s *Server) shutdown(ctx context.Context) error {
	s.ready.Store(false)
	s.health.Shutdown() // NOT_SERVING everywhere: Envoy stops sending new streams
	stopped := make(chan struct{})
	s.proc.Drain() // streams held only to count decodes end now
	if s.stopXDS != nil {
		// Envoy's EDS streams never end by themselves; Envoy keeps the
		// endpoints it has.
		s.stopXDS()
		<-s.xdsDone
	}
	go func() {
		s.grpc.GracefulStop()
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-ctx.Done():
		s.grpc.Stop()
		<-stopped
	}
	close(s.peersStop) // the peers' streams would hold the admin listener's shutdown
	err := s.admin.Shutdown(ctx)
	if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
		// Admin connections still open when ctx ends are cut like the streams.
		err = s.admin.Close()
	}
	// Releases of engines' work that requests left behind are short (each
	// bounded by seconds); a forced drain does not wait for them.
	if s.proc.Wait(ctx) != nil {
		s.log.Warn("stopped before the engines were told to release every request's work")
	}
	s.stopScrape()
	s.stopSubscribing()
	s.stopPeers()
	if s.peersDone != nil {
		<-s.peersDone
	}
	s.engine.CloseIdleConnections()
	for range 2 {
		if e := <-s.served; e != nil && !errors.Is(e, http.ErrServerClosed) && !errors.Is(e, grpc.ErrServerStopped) {
			err = errors.Join(err, e)
		}
	}
	return err
}

func (s *Server) adminHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Write([]byte("ok\n"))
	})
	mux.Handle("GET /metrics", s.metrics.Handler())
	mux.HandleFunc("GET "+peersPath, s.servePeers)
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !s.ready.Load() {
			http.Error(w, "draining", http.StatusServiceUnavailable)
			return
		}
		w.Write([]byte("ok\n"))
	})
	return mux
}
