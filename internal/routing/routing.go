// Package routing maps a request's model to its pool: the connector and the
// engines that serve it. A Table is immutable once built (only the endpoint
// sets of pools discovered from Kubernetes follow the cluster); a stream
// takes one snapshot when it starts and keeps it to its end.
package routing

import (
	"fmt"
	"slices"
	"sync"
	"time"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/flowcontrol"
	"github.com/pdx-router/pdx/internal/kvcache"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/placement"
)

// ErrNoEndpoint is the error of a pick that finds no endpoint to use.
var ErrNoEndpoint = placement.ErrNoEndpoint

// Pool is a set of prefill and decode engines serving some models with one
// connector: what its requests are placed by (placement.Pool: its name,
// legs, render and decider), and what they are routed and prepared with.
type Pool struct {
	*placement.Pool
	ConnectorName string
	Connector     connectors.Connector
	// Traits are the connector's protocol properties.
	Traits connectors.Traits
	// Models are the models the pool serves; Default makes it serve the
	// models no pool lists.
	Models  []string
	Default bool
	// Adapters are the LoRA adapters the pool lists (lora.adapters): a
	// request for one comes to this pool. LoRA: the pool has a lora
	// config, so a model it does not list among Models is an adapter its
	// engines may report (see Adapter).
	Adapters []string
	LoRA     bool
	// PrefillTimeout bounds all prefill attempts of a request together;
	// AttemptTimeout bounds each.
	PrefillTimeout time.Duration
	AttemptTimeout time.Duration
	// Attempts is how many prefill endpoints a request may try.
	Attempts int
	// Fallback sends a request whose prefill attempts all failed to a decode
	// endpoint with the plain client body, instead of failing it.
	Fallback bool
	// PassThrough are the paths besides the routed generation APIs that the
	// pool's decode endpoints serve as they are: the pool's pass_through
	// and connectors.DefaultPassThrough.
	PassThrough []string
	// KVHosts are the hosts besides a prefill endpoint's own that its
	// answers may name as the KV source.
	KVHosts endpoint.HostSet
	// Saturated is what a request does when every endpoint of a leg is
	// saturated; nil when saturation is off.
	Saturated *Shedding
	// Ranked: the pool's engines may serve several DP ranks (a dp_size of
	// its config), so its requests may carry a rank header.
	Ranked bool
	// SessionHeader, when not empty, is the request header naming a
	// session, which keeps the session on its engines
	// (picker.Request.Session).
	SessionHeader string

	// update serializes SetEndpoints.
	update sync.Mutex
	// changed, when set (NewTable sets it), is told of every SetEndpoints.
	changed func()
}

// Adapter is the LoRA adapter a request for model uses in the pool, ""
// for a base model: a listed adapter, or with a lora config any model
// that is not one of Models (its engines report which they serve).
func (p *Pool) Adapter(model string) string {
	switch {
	case model == "":
		return ""
	case slices.Contains(p.Adapters, model):
		return model
	case p.LoRA && !slices.Contains(p.Models, model):
		return model
	}
	return ""
}

// Shedding is what a request does when every endpoint of a leg is
// saturated: wait up to MaxWait for room (0: not at all), then be refused.
type Shedding struct {
	MaxWait time.Duration
	// Flow orders the requests that wait, by their objectives' bands and
	// flows (MaxWait is its default band's wait).
	Flow *flowcontrol.Controller
}

// flowControl is the flow control of a pool's config fc (nil: one band,
// one flow), whose bands wait maxWait unless fc says otherwise.
func flowControl(fc *configv1.FlowControl, maxWait time.Duration) *flowcontrol.Controller {
	cfg := flowcontrol.Config{
		MaxRequests: int(fc.GetMaxRequests()), MaxBytes: int64(fc.GetMaxBytes()), MaxWaitDefault: maxWait,
	}
	if fc.GetFairness() == "token_usage" {
		cfg.Fairness = flowcontrol.TokenUsage
	}
	if fc.GetOrdering() == "edf" {
		cfg.Ordering = flowcontrol.EDF
	}
	if o := fc.GetObjectives(); len(o) > 0 {
		cfg.Priorities = make(map[string]int, len(o))
		for _, obj := range o {
			cfg.Priorities[obj.GetName()] = int(obj.GetPriority())
		}
	}
	if b := fc.GetBands(); len(b) > 0 {
		cfg.MaxWait = make(map[int]time.Duration, len(b))
		for _, band := range b {
			cfg.MaxWait[int(band.GetPriority())] = band.GetMaxQueueTime().AsDuration()
		}
	}
	return flowcontrol.New(cfg)
}

// SetEndpoints replaces the pool's endpoints (Kubernetes discovery and the
// resolver of engines named by host name call it on every change).
// Endpoints that remain keep their passive health.
//
// A request picks its decode endpoint, then a prefill endpoint of the
// decode's group. So that a decode picked from the old set or from the new
// one finds its group's prefill endpoints, the prefill set grows to both
// sets' endpoints before the decode set changes, and shrinks after.
func (p *Pool) SetEndpoints(prefill, decode []endpoint.Endpoint) {
	p.update.Lock()
	defer p.update.Unlock()
	both := p.Prefill.Set.Endpoints()
	for _, ep := range prefill {
		if !slices.Contains(both, ep) {
			both = append(both, ep)
		}
	}
	p.Prefill.Set.SetEndpoints(both)
	p.Decode.Set.SetEndpoints(decode)
	p.Prefill.Set.SetEndpoints(prefill)
	if p.changed != nil {
		p.changed()
	}
}

// Table finds the pool of a model.
type Table struct {
	pools      []*Pool // in config order
	byModel    map[string]*Pool
	fallback   *Pool
	concurrent bool
	limits     Limits
	models     []string // every pool's models, in config order
	created    time.Time
	// fallbacks is the most decode fallbacks of a pool; ranked: some
	// pool's requests may carry a DP rank header.
	fallbacks int
	ranked    bool
	// changes hears of every change of a pool's endpoints (see Changes).
	changes chan struct{}
	cache   *kvcache.Index
	journal *picker.Journal
	// pickJitter is peers.pick_jitter, read at start like journal.
	pickJitter time.Duration
}

// Limits are the bounds pdx holds a request to.
type Limits struct {
	// MaxBodyBytes is the largest request body pdx routes.
	MaxBodyBytes int
	// MaxHeaders and MaxHeaderBytes are Envoy's limits on a request's
	// headers, which pdx's header mutations must stay within.
	MaxHeaders, MaxHeaderBytes int
	// BodyTimeout bounds the time a request's body takes to arrive.
	BodyTimeout time.Duration
	// StreamEnd is when pdx ends a routed request's stream.
	StreamEnd StreamEnd
}

// StreamEnd is when pdx ends a routed request's ext_proc stream (the
// config's end_streams_at_routing): a stream pdx holds is one whose
// generation dies with pdx.
type StreamEnd int

const (
	// EndWhenDetached ends it once pdx needs nothing more of it and the
	// decode's count is detached (picker.Lease.Detach), else with the
	// response. The default.
	EndWhenDetached StreamEnd = iota
	// EndAtRouting ends it once routed, the decode uncounted.
	EndAtRouting
	// EndWithResponse holds it until Envoy ends it with the response, the
	// decode counted until then.
	EndWithResponse
)

// MaxBodyBytes is the largest request body pdx routes.
func (t *Table) MaxBodyBytes() int { return t.limits.MaxBodyBytes }

// Limits returns the bounds pdx holds a request to.
func (t *Table) Limits() Limits { return t.limits }

// Models lists the models the table's pools name, in config order (the
// default pool's unnamed models are not among them), and when the table
// was built.
func (t *Table) Models() ([]string, time.Time) { return t.models, t.created }

// PassThrough returns the pool that serves path as it is for a request
// naming model ("" when it names none): the model's pool if it lists path;
// without a model, the default pool if it lists path, else the first pool
// that does. It reports false when no such pool exists.
func (t *Table) PassThrough(path, model string) (*Pool, bool) {
	if model != "" {
		p, ok := t.Lookup(model)
		return p, ok && slices.Contains(p.PassThrough, path)
	}
	if t.fallback != nil && slices.Contains(t.fallback.PassThrough, path) {
		return t.fallback, true
	}
	for _, p := range t.pools {
		if slices.Contains(p.PassThrough, path) {
			return p, true
		}
	}
	return nil, false
}

// passThrough is a pool's pass_through and the paths every pool passes
// through, each once.
func passThrough(own []string) []string {
	paths := slices.Clone(own)
	for _, p := range connectors.DefaultPassThrough() {
		if !slices.Contains(paths, p) {
			paths = append(paths, p)
		}
	}
	return paths
}

// PassesThrough reports whether some pool serves path as it is.
func (t *Table) PassesThrough(path string) bool {
	_, ok := t.PassThrough(path, "")
	return ok
}

// HasConcurrent reports whether some pool's connector prefills concurrently
// with the decode. Such requests need Envoy to send the response headers to
// pdx, which is decided before the body says which pool a request is for.
func (t *Table) HasConcurrent() bool { return t.concurrent }

// Pools returns the table's pools in config order. The slice is the
// table's: callers must not change it.
func (t *Table) Pools() []*Pool { return t.pools }

// New builds a table from a config that config.Parse accepted. It fails on
// connector names that are not registered. Pools that discover their
// endpoints (kubernetes) start empty: the discovery fills them; endpoints
// named by host name are left out until package resolver gives the pool
// their addresses.
func New(cfg *configv1.Config) (*Table, error) {
	return Rebuild(cfg, nil)
}

// Rebuild is New for a config reload: a pool named as one of prev's (which
// may be nil) shares its passive health, so that an endpoint in both keeps
// its failures and ejection. A discovered pool, or one that names hosts,
// starts with its predecessor's endpoints, for the discovery or the
// resolver to replace.
func Rebuild(cfg *configv1.Config, prev *Table) (*Table, error) {
	limits := Limits{
		MaxBodyBytes:   int(cfg.GetMaxBodyBytes()),
		MaxHeaders:     int(cfg.GetMaxRequestHeaders()),
		MaxHeaderBytes: int(cfg.GetMaxRequestHeadersKb()) << 10,
		BodyTimeout:    cfg.GetRequestBodyTimeout().AsDuration(),

		StreamEnd: streamEnd(cfg),
	}
	cache := prev.PrefixCache()
	if k := cfg.GetKvEvents(); k != nil && cache == nil {
		cache = kvcache.New(kvcache.Config{BlockSize: int(k.GetBlockSize()), MaxEntries: int(k.GetMaxBlocksPerEngine())})
	}
	opts := placement.Options{
		StaleAfter: cfg.GetEngineMetrics().GetStaleAfter().AsDuration(), Cache: cache, KVBlockSize: int(cfg.GetKvEvents().GetBlockSize()),
	}
	// Peers are read at start: a reload keeps the first table's journal,
	// which the peers' readers and the server's followers hold, and its
	// pick jitter.
	if prev == nil {
		if p := cfg.GetPeers(); p != nil {
			opts.Journal, opts.PickJitter = picker.NewJournal(), p.GetPickJitter().AsDuration()
		}
	} else {
		opts.Journal, opts.PickJitter = prev.journal, prev.pickJitter
	}
	pools := make([]*Pool, len(cfg.GetPools()))
	for i, pc := range cfg.GetPools() {
		p, err := newPool(pc, prev.pool(pc.GetName()), opts)
		if err != nil {
			return nil, fmt.Errorf("pools[%d].%w", i, err)
		}
		pools[i] = p
	}
	t := NewTable(limits, pools...)
	t.cache, t.journal, t.pickJitter = cache, opts.Journal, opts.PickJitter
	return t, nil
}

// Journal is what this replica tells its peers of its prefills: nil
// without peers. A rebuilt table keeps its predecessor's, which the peers
// go on reading, peers or not in the new config (they are read at start).
func (t *Table) Journal() *picker.Journal {
	if t == nil {
		return nil
	}
	return t.journal
}

// PrefixCache is what the engines of every pool report holding, learned
// from their KV events: nil without kv_events. A rebuilt table keeps its
// predecessor's, which the subscriptions go on feeding.
func (t *Table) PrefixCache() *kvcache.Index {
	if t == nil {
		return nil
	}
	return t.cache
}

// newPool builds the pool of pc; old, when not nil, is its predecessor in
// the table being replaced; opts are the table's, for every pool (Prefills
// is set here). Errors name the field at fault.
func newPool(pc *configv1.Pool, old *Pool, opts placement.Options) (*Pool, error) {
	conn, traits, err := connectors.New(pc)
	if err != nil {
		return nil, fmt.Errorf("connector: %w", err)
	}
	kvHosts, err := endpoint.ParseHostSet(pc.GetAllowedKvHosts())
	if err != nil {
		return nil, fmt.Errorf("allowed_kv_hosts: %w", err)
	}
	var shedding *Shedding
	if s := pc.GetSaturation(); s != nil && !s.GetDisabled() {
		shedding = &Shedding{}
		if s.GetAction() != configv1.SaturationAction_SATURATION_ACTION_REJECT {
			shedding.MaxWait = s.GetMaxQueueTime().AsDuration()
		}
		shedding.Flow = flowControl(pc.GetFlowControl(), shedding.MaxWait)
	}
	// Endpoints named by host name wait for package resolver, which
	// gives the pool one per address.
	prefill, decode := onIPs(Endpoints(pc.GetPrefill())), onIPs(Endpoints(pc.GetDecode()))
	named := len(prefill) < len(pc.GetPrefill()) || len(decode) < len(pc.GetDecode())
	var prev *placement.Pool
	if old != nil {
		prev = old.Pool
		if pc.GetKubernetes() != nil || named {
			prefill, decode = old.Prefill.Set.Endpoints(), old.Decode.Set.Endpoints()
		}
	}
	opts.Prefills = traits.Prefills
	// The decode body of such a connector names no decode engine, so the
	// decode can be picked again, by what the engines say once the
	// prefill has answered; a concurrent one's decode starts with it.
	opts.LateDecode = traits.DecodeFallback && !traits.Concurrent
	placed, err := placement.New(pc, prefill, decode, prev, opts)
	if err != nil {
		return nil, err
	}
	p := &Pool{
		Pool:           placed,
		Models:         pc.GetModels(),
		Default:        pc.GetDefault(),
		Adapters:       pc.GetLora().GetAdapters(),
		LoRA:           pc.GetLora() != nil,
		ConnectorName:  pc.GetConnector(),
		Connector:      conn,
		Traits:         traits,
		PrefillTimeout: pc.GetPrefillTimeout().AsDuration(),
		AttemptTimeout: pc.GetPrefillAttemptTimeout().AsDuration(),
		Attempts:       max(1, int(pc.GetPrefillAttempts())),
		Fallback:       pc.GetOnPrefillFailure() == configv1.PrefillFailure_PREFILL_FAILURE_FALLBACK,
		PassThrough:    passThrough(pc.GetPassThrough()),
		KVHosts:        kvHosts,
		Saturated:      shedding,
		Ranked:         ranked(pc),
		SessionHeader:  pc.GetSessionAffinity().GetHeader(),
	}
	if p.AttemptTimeout <= 0 { // a config not through config.Parse
		p.AttemptTimeout = p.PrefillTimeout
	}
	return p, nil
}

// NewTable returns a table of pools, in config order, holding requests to
// limits (zero fields: Envoy's defaults).
func NewTable(limits Limits, pools ...*Pool) *Table {
	t := &Table{pools: pools, byModel: map[string]*Pool{}, limits: defaultLimits(limits), created: time.Now(),
		changes: make(chan struct{}, 1)}
	for _, p := range pools {
		p.changed = t.changed
		t.fallbacks = max(t.fallbacks, p.DecodeFallbacks)
		t.ranked = t.ranked || p.Ranked
		t.concurrent = t.concurrent || p.Traits.Concurrent
		for _, m := range p.Models {
			t.byModel[m] = p
			t.models = append(t.models, m)
		}
		// GET /v1/models lists adapters as vLLM does, after the models.
		for _, a := range p.Adapters {
			t.byModel[a] = p
			t.models = append(t.models, a)
		}
		if p.Default {
			t.fallback = p
		}
	}
	return t
}

// Ranked reports whether some pool's requests may carry a DP rank header.
func (t *Table) Ranked() bool { return t.ranked }

// ranked reports whether a pool's config gives its engines DP ranks.
func ranked(pc *configv1.Pool) bool {
	k := pc.GetKubernetes()
	if k.GetDpSize() > 1 || k.GetDecodeDpSize() > 1 {
		return true
	}
	for _, ep := range append(slices.Clip(pc.GetPrefill()), pc.GetDecode()...) {
		if ep.GetDpSize() > 1 {
			return true
		}
	}
	return false
}

// MaxDecodeFallbacks is the most decode fallbacks a request of the table
// may name (the pools' DecodeFallbacks).
func (t *Table) MaxDecodeFallbacks() int { return t.fallbacks }

// Changes receives a value after the endpoints of some pool changed
// (Pool.SetEndpoints, as discovery calls it), changes coming faster than
// they are received being told once. It has one receiver: the xDS server,
// which then reads the table's endpoints anew.
func (t *Table) Changes() <-chan struct{} { return t.changes }

func (t *Table) changed() {
	select {
	case t.changes <- struct{}{}:
	default:
	}
}

// Addresses returns the distinct addresses of every endpoint of the table's
// pools: the engines whose metrics pdx scrapes.
func (t *Table) Addresses() []string {
	n := 0
	for _, p := range t.pools {
		n += len(p.Prefill.Set.Addresses()) + len(p.Decode.Set.Addresses())
	}
	out, seen := make([]string, 0, n), make(map[string]bool, n)
	for _, p := range t.pools {
		for _, set := range []*picker.Set{p.Prefill.Set, p.Decode.Set} {
			for _, a := range set.Addresses() {
				if !seen[a] {
					seen[a] = true
					out = append(out, a)
				}
			}
		}
	}
	return out
}

// Endpoints returns every pool's endpoints, prefill and decode, each
// address once (its first listing).
func (t *Table) Endpoints() []endpoint.Endpoint {
	var out []endpoint.Endpoint
	seen := make(map[string]bool)
	for _, p := range t.pools {
		for _, set := range []*picker.Set{p.Prefill.Set, p.Decode.Set} {
			for _, ep := range set.Endpoints() {
				if !seen[ep.Address] {
					seen[ep.Address] = true
					out = append(out, ep)
				}
			}
		}
	}
	return out
}

// Observe stores what the engine at address said of its load in every leg
// that has it.
func (t *Table) Observe(address string, l picker.Load) {
	for _, p := range t.pools {
		p.Prefill.Set.Observe(address, l)
		p.Decode.Set.Observe(address, l)
	}
}

// pool returns the pool named name, or nil (also when t is nil).
func (t *Table) pool(name string) *Pool {
	if t == nil {
		return nil
	}
	for _, p := range t.pools {
		if p.Name == name {
			return p
		}
	}
	return nil
}

// Pool returns the pool named name.
func (t *Table) Pool(name string) (*Pool, bool) {
	p := t.pool(name)
	return p, p != nil
}

// Lookup returns the pool serving model: the pool that lists it, else the
// default pool.
func (t *Table) Lookup(model string) (*Pool, bool) {
	if p, ok := t.byModel[model]; ok {
		return p, true
	}
	return t.fallback, t.fallback != nil
}

// Endpoints are the endpoints a config lists, in order, each Address
// "host:port" (a URL written "http://host:port" loses its scheme): a host
// name stays a name, which package resolver turns into an endpoint per
// address.
func Endpoints(eps []*configv1.Endpoint) []endpoint.Endpoint {
	out := make([]endpoint.Endpoint, len(eps))
	for i, e := range eps {
		out[i] = endpoint.Endpoint{Address: hostPort(e.GetAddress()), BootstrapPort: int(e.GetBootstrapPort()), KVAddress: e.GetKvAddress(), DPSize: int(e.GetDpSize()),
			KVEventsPort: int(e.GetKvEventsPort()), KVEventsReplayPort: int(e.GetKvEventsReplayPort())}
	}
	return out
}

// hostPort is address, an engine's as config.Parse accepts it, as
// "host:port".
func hostPort(address string) string {
	if a, err := endpoint.ParseAddress(address); err == nil {
		return a.String()
	}
	return address // not through config.Parse
}

// onIPs are the endpoints of eps whose address is an IP.
func onIPs(eps []endpoint.Endpoint) []endpoint.Endpoint {
	return slices.DeleteFunc(eps, func(ep endpoint.Endpoint) bool {
		a, err := endpoint.ParseHostPort(ep.Address)
		return err == nil && a.IsName()
	})
}

// defaultLimits fills in Envoy's defaults for limits a config through
// config.Parse always sets.
func defaultLimits(l Limits) Limits {
	if l.MaxHeaders == 0 {
		l.MaxHeaders = config.DefaultMaxRequestHeaders
	}
	if l.MaxHeaderBytes == 0 {
		l.MaxHeaderBytes = config.DefaultMaxRequestHeadersKB << 10
	}
	if l.BodyTimeout <= 0 {
		l.BodyTimeout = config.DefaultRequestBodyTimeout
	}
	return l
}

func streamEnd(cfg *configv1.Config) StreamEnd {
	switch {
	case cfg.EndStreamsAtRouting == nil:
		return EndWhenDetached
	case cfg.GetEndStreamsAtRouting():
		return EndAtRouting
	}
	return EndWithResponse
}
