// Package reload keeps pdx's routing table in step with its config file and
// with the cluster: it builds the table from the file, feeds the pools that
// discover their endpoints from Kubernetes and those that name engines by
// host name (package resolver), and when the file's content changes builds
// a new table and hands it over. A config that does not load
// is logged and changes nothing: the running table stays.
//
// The file is polled, its content hashed: that follows editors that replace
// the file and Kubernetes ConfigMap volumes, which swap a symlink, alike. A
// change is loaded once the content has stayed the same for one poll
// interval, so that a file caught half-written (a truncated YAML may still
// be valid) is not loaded.
package reload

import (
	"context"
	"crypto/sha256"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/proto"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/discovery"
	"github.com/pdx-router/pdx/internal/objectives"
	"github.com/pdx-router/pdx/internal/resolver"
	"github.com/pdx-router/pdx/internal/routing"
)

// Defaults for the zero Options.
const (
	DefaultInterval    = time.Second
	DefaultSyncTimeout = time.Minute
)

// Options configure a Reloader.
type Options struct {
	// Path is the config file.
	Path string
	// Interval is how often Run reads the file; 0 means DefaultInterval.
	Interval time.Duration
	// Log receives reloads and their failures. nil: discarded.
	Log *slog.Logger
	// Kube makes the Kubernetes client of pools with a kubernetes section.
	// It is called once, when the first such pool is loaded; nil rejects
	// such configs.
	Kube func() (kubernetes.Interface, error)
	// SyncTimeout bounds the wait for discovery to list a namespace it
	// starts watching; 0 means DefaultSyncTimeout.
	SyncTimeout time.Duration
	// Discovery configures the discovery; its Log defaults to Log.
	Discovery discovery.Options
	// Dynamic makes the Kubernetes client that watches InferenceObjectives
	// for pools with flow_control.kubernetes_objectives. It is called once,
	// when the first such pool is loaded; nil rejects such configs.
	Dynamic func() (dynamic.Interface, error)
	// Objectives configures the InferenceObjective watcher; its Log
	// defaults to Log.
	Objectives objectives.Options
	// Resolver configures the resolver of endpoints named by host name
	// (its Lookup defaults to the system's); its Log defaults to Log.
	Resolver resolver.Options
}

// Reloader owns the current routing table and the discovery feeding it.
type Reloader struct {
	opts Options
	log  *slog.Logger

	// mu serializes loads, and guards the fields below.
	mu sync.Mutex
	// started is the config pdx started with: its listener settings hold
	// until a restart.
	started *configv1.Config
	// loaded is the hash of the content last loaded or found invalid, so
	// that neither is loaded twice. A load that failed for a passing cause
	// (discovery could not list a namespace) is not recorded: the next
	// check tries again.
	loaded [sha256.Size]byte
	// readErr is the last error reading the file, logged once.
	readErr error
	disc    *discovery.Discovery
	objs    *objectives.Watcher
	names   *resolver.Resolver

	table atomic.Pointer[routing.Table]
}

// New loads the config file, builds its table and, if some pool discovers
// its endpoints, starts the discovery and waits until it has them (bounded
// by SyncTimeout and ctx); if some pool names engines by host name, looks
// the names up (a name that does not resolve leaves its pool without it,
// and is retried). Close stops the discovery and the lookups.
func New(ctx context.Context, opts Options) (*Reloader, error) {
	if opts.Interval <= 0 {
		opts.Interval = DefaultInterval
	}
	if opts.SyncTimeout <= 0 {
		opts.SyncTimeout = DefaultSyncTimeout
	}
	if opts.Log == nil {
		opts.Log = slog.New(slog.DiscardHandler)
	}
	if opts.Discovery.Log == nil {
		opts.Discovery.Log = opts.Log
	}
	if opts.Objectives.Log == nil {
		opts.Objectives.Log = opts.Log
	}
	if opts.Resolver.Log == nil {
		opts.Resolver.Log = opts.Log
	}
	r := &Reloader{opts: opts, log: opts.Log}
	data, err := os.ReadFile(opts.Path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err) // names the file already
	}
	cfg, err := config.ParseFile(data, opts.Path)
	if err != nil {
		return nil, err
	}
	r.started = cfg
	table, _, err := r.build(ctx, cfg)
	if err != nil {
		r.Close()
		return nil, err
	}
	r.loaded = sha256.Sum256(data)
	r.table.Store(table)
	return r, nil
}

// Config is the config pdx started with.
func (r *Reloader) Config() *configv1.Config { return r.started }

// Table is the current routing table.
func (r *Reloader) Table() *routing.Table { return r.table.Load() }

// Run checks the file every Interval until ctx ends, handing each new table
// to apply (processor.Server.SetTable). New content is loaded at the check
// after the one that first saw it, if it has not changed in between.
func (r *Reloader) Run(ctx context.Context, apply func(*routing.Table)) {
	t := time.NewTicker(r.opts.Interval)
	defer t.Stop()
	var seen [sha256.Size]byte // new content seen at the last check
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			r.poll(ctx, apply, &seen)
		}
	}
}

// poll is one check of Run: it loads the file's content if it is new and
// the same as at the last check, whose content *seen holds.
func (r *Reloader) poll(ctx context.Context, apply func(*routing.Table), seen *[sha256.Size]byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	data, sum, ok := r.read()
	if !ok || sum == r.loaded {
		return
	}
	if sum == *seen {
		_, _ = r.load(ctx, apply, data, sum) // failures are logged
	}
	*seen = sum
}

// Reload reads the file and, if its content changed since it was last
// loaded, builds a new table and hands it to apply. It reports whether it
// did; a config that fails to load is logged, returned, and leaves the
// current table in place.
func (r *Reloader) Reload(ctx context.Context, apply func(*routing.Table)) (bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	data, sum, ok := r.read()
	if !ok {
		return false, fmt.Errorf("config: %w", r.readErr)
	}
	if sum == r.loaded {
		return false, nil
	}
	return r.load(ctx, apply, data, sum)
}

// read reads the file. A failure is logged once: a file being replaced may
// be missing for a moment. r.mu is held.
func (r *Reloader) read() ([]byte, [sha256.Size]byte, bool) {
	data, err := os.ReadFile(r.opts.Path)
	if err != nil {
		if r.readErr == nil || err.Error() != r.readErr.Error() {
			r.readErr = err
			r.log.Warn("config reload: cannot read the file, keeping the running config", slog.String("error", err.Error()))
		}
		return nil, [sha256.Size]byte{}, false
	}
	r.readErr = nil
	return data, sha256.Sum256(data), true
}

// load builds and applies the table of data, whose hash is sum. r.mu is
// held.
func (r *Reloader) load(ctx context.Context, apply func(*routing.Table), data []byte, sum [sha256.Size]byte) (bool, error) {
	cfg, err := config.ParseFile(data, r.opts.Path)
	var table *routing.Table
	passing := false
	if err == nil {
		r.keepStartSettings(cfg)
		table, passing, err = r.build(ctx, cfg)
	}
	if err != nil {
		if !passing {
			r.loaded = sum // the same content would fail the same way
		}
		r.log.Error("config reload failed, keeping the running config", slog.String("error", err.Error()))
		return false, err
	}
	r.loaded = sum
	r.table.Store(table)
	apply(table)
	r.log.Info("config reloaded", slog.Int("pools", len(cfg.GetPools())))
	return true, nil
}

// keepStartSettings keeps in cfg the settings that take a restart to
// change, warning about those it changed: the listeners, the body limit
// that sizes gRPC messages, and what the server starts with it (the KV
// event subscriptions, the xDS service, the engine metrics scraper's
// round, the peers' streams). A reload that took them would build a table
// that disagrees with what runs: a prefix cache no subscription feeds.
func (r *Reloader) keepStartSettings(cfg *configv1.Config) {
	s := r.started
	var kept []string
	if cfg.GetGrpcAddress() != s.GetGrpcAddress() {
		cfg.GrpcAddress, kept = s.GetGrpcAddress(), append(kept, "grpc_address")
	}
	if cfg.GetAdminAddress() != s.GetAdminAddress() {
		cfg.AdminAddress, kept = s.GetAdminAddress(), append(kept, "admin_address")
	}
	if cfg.GetMaxBodyBytes() != s.GetMaxBodyBytes() {
		cfg.MaxBodyBytes, kept = s.GetMaxBodyBytes(), append(kept, "max_body_bytes")
	}
	if !proto.Equal(cfg.GetTls(), s.GetTls()) {
		cfg.Tls, kept = s.GetTls(), append(kept, "tls")
	}
	if !proto.Equal(cfg.GetKvEvents(), s.GetKvEvents()) {
		cfg.KvEvents, kept = s.GetKvEvents(), append(kept, "kv_events")
	}
	if !proto.Equal(cfg.GetXds(), s.GetXds()) {
		cfg.Xds, kept = s.GetXds(), append(kept, "xds")
	}
	// stale_after is read by the table: it reloads. (config.Parse sets
	// engine_metrics.)
	if m, sm := cfg.GetEngineMetrics(), s.GetEngineMetrics(); m.GetDisabled() != sm.GetDisabled() || m.GetPath() != sm.GetPath() ||
		!proto.Equal(m.GetInterval(), sm.GetInterval()) {
		m.Disabled, m.Path, m.Interval = sm.GetDisabled(), sm.GetPath(), sm.GetInterval()
		kept = append(kept, "engine_metrics")
	}
	if !proto.Equal(cfg.GetPeers(), s.GetPeers()) {
		cfg.Peers, kept = s.GetPeers(), append(kept, "peers")
	}
	if len(kept) > 0 {
		r.log.Warn("config reload: these settings take effect on restart only", slog.Any("kept", kept))
	}
}

// build makes the table of cfg, carrying the current table's passive health
// over, and points the discovery at its discovered pools. passing reports a
// failure that may not recur (the cluster could not be listed). r.mu is
// held, or r is not shared yet.
func (r *Reloader) build(ctx context.Context, cfg *configv1.Config) (table *routing.Table, passing bool, err error) {
	table, err = routing.Rebuild(cfg, r.table.Load())
	if err != nil {
		return nil, false, err
	}
	// Objectives first: should discovery then fail, the running table's
	// pools keep their endpoints' updates, and lose only objectives'.
	if passing, err := r.watchObjectives(ctx, cfg, table); err != nil {
		return nil, passing, err
	}
	var targets []discovery.Target
	for _, pc := range cfg.GetPools() {
		if pc.GetKubernetes() == nil {
			continue
		}
		pool, _ := table.Pool(pc.GetName())
		targets = append(targets, discovery.Target{
			Pool: pc.GetName(), Prefills: pool.Traits.Prefills, Spec: pc.GetKubernetes(), Set: pool.SetEndpoints,
		})
	}
	if len(targets) > 0 && r.disc == nil {
		if r.opts.Kube == nil {
			return nil, false, fmt.Errorf("config: pools discover their endpoints from Kubernetes, but pdx has no Kubernetes client")
		}
		client, err := r.opts.Kube()
		if err != nil {
			return nil, false, fmt.Errorf("kubernetes client: %w", err)
		}
		r.disc = discovery.New(client, r.opts.Discovery)
	}
	if r.disc != nil {
		// Also with no target: namespaces no longer used stop being watched.
		sctx, cancel := context.WithTimeout(ctx, r.opts.SyncTimeout)
		defer cancel()
		if err := r.disc.SetTargets(sctx, targets); err != nil {
			return nil, true, err
		}
	}
	// Last, as it cannot fail: the running table's pools stay fed until
	// the new table is sure to replace it.
	if err := r.resolve(ctx, cfg, table); err != nil {
		return nil, false, err
	}
	return table, false, nil
}

// resolve points the resolver at the pools of table that name engines by
// host name. r.mu is held, or r is not shared yet.
func (r *Reloader) resolve(ctx context.Context, cfg *configv1.Config, table *routing.Table) error {
	var targets []resolver.Target
	for _, pc := range cfg.GetPools() {
		prefill, decode := routing.Endpoints(pc.GetPrefill()), routing.Endpoints(pc.GetDecode())
		if !resolver.Named(prefill, decode) {
			continue
		}
		pool, _ := table.Pool(pc.GetName())
		targets = append(targets, resolver.Target{Pool: pc.GetName(), Prefill: prefill, Decode: decode, Set: pool.SetEndpoints})
	}
	if len(targets) > 0 && r.names == nil {
		r.names = resolver.New(r.opts.Resolver)
	}
	if r.names == nil {
		return nil
	}
	// Also with no target: names no longer used stop being looked up.
	return r.names.SetTargets(ctx, cfg.GetDnsRefreshRate().AsDuration(), targets)
}

// watchObjectives points the InferenceObjective watcher at the flow
// control of table's pools that learn objectives from the cluster. r.mu is
// held, or r is not shared yet.
func (r *Reloader) watchObjectives(ctx context.Context, cfg *configv1.Config, table *routing.Table) (passing bool, err error) {
	var targets []objectives.Target
	for _, pc := range cfg.GetPools() {
		k := pc.GetFlowControl().GetKubernetesObjectives()
		if k == nil {
			continue
		}
		pool, _ := table.Pool(pc.GetName())
		if pool.Saturated == nil || pool.Saturated.Flow == nil {
			continue // config.Parse refuses flow control without saturation
		}
		targets = append(targets, objectives.Target{Pool: pc.GetName(), Spec: k, Set: pool.Saturated.Flow.SetObjectives})
	}
	if len(targets) > 0 && r.objs == nil {
		if r.opts.Dynamic == nil {
			return false, fmt.Errorf("config: pools learn objectives from Kubernetes, but pdx has no Kubernetes client")
		}
		client, err := r.opts.Dynamic()
		if err != nil {
			return false, fmt.Errorf("kubernetes client: %w", err)
		}
		r.objs = objectives.New(client, r.opts.Objectives)
	}
	if r.objs != nil {
		// Also with no target: namespaces no longer used stop being watched.
		sctx, cancel := context.WithTimeout(ctx, r.opts.SyncTimeout)
		defer cancel()
		if err := r.objs.SetTargets(sctx, targets); err != nil {
			return true, err
		}
	}
	return false, nil
}

// Close stops the discovery, the objectives' watcher and the lookups of
// host names: the table's pools keep the endpoints and objectives they
// have.
func (r *Reloader) Close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.disc != nil {
		r.disc.Close()
	}
	if r.names != nil {
		r.names.Close()
	}
	if r.objs != nil {
		r.objs.Close()
	}
}
