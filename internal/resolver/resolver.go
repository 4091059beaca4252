// Package resolver feeds pools the engines their configs name by host name
// ("localhost:8000", "vllm-decode-0.vllm:8000"), as Envoy's STRICT_DNS
// clusters do: every address a name has is an engine, on the port the
// config gives; the names are looked up again every refresh period; a
// lookup that finds no address takes the name's engines out of their
// pools, and one that fails keeps them as last resolved. Each change
// reaches the pools through their SetEndpoints (routing.Pool), as
// Kubernetes discovery's do, so that passive health, in-flight counts,
// metrics scraping and KV event subscriptions follow it; Envoy is only
// ever given the IPs.
//
// A name takes its IPv4 addresses when it has any, else its IPv6 ones
// (Envoy's V4_PREFERRED): a dual-stack engine is one engine, not two, and
// "localhost" is 127.0.0.1, where engines listen, not ::1.
package resolver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/pdx-router/pdx/internal/endpoint"
)

// DefaultRefresh is how often a name is looked up again: Envoy's
// dns_refresh_rate default.
const DefaultRefresh = 5 * time.Second

// Retries after a failed or empty lookup: the first after firstRetry, each
// next after twice as long, up to the refresh period (Envoy's
// dns_failure_refresh_rate with base_interval 1s, max_interval the refresh
// period).
const firstRetry = time.Second

// lookupTimeout bounds one lookup: resolv.conf's default timeout for a
// query.
const lookupTimeout = 5 * time.Second

// ErrNotFound is the error of a lookup that found the name has no address
// (NXDOMAIN, or no A or AAAA record).
var ErrNotFound = errors.New("no address")

// ErrClosed is returned by SetTargets after Close.
var ErrClosed = errors.New("resolver: closed")

// Lookup returns the addresses of host. An error wrapping ErrNotFound says
// the name has none; any other says the lookup failed.
type Lookup func(ctx context.Context, host string) ([]netip.Addr, error)

// LookupWith is the Lookup of r (nil: net.DefaultResolver, which reads
// /etc/hosts and asks the name servers of /etc/resolv.conf, in the order
// nsswitch.conf gives).
func LookupWith(r *net.Resolver) Lookup {
	if r == nil {
		r = net.DefaultResolver
	}
	return func(ctx context.Context, host string) ([]netip.Addr, error) {
		addrs, err := r.LookupNetIP(ctx, "ip", host)
		var dnsErr *net.DNSError
		if errors.As(err, &dnsErr) && dnsErr.IsNotFound {
			return nil, fmt.Errorf("%w: %w", ErrNotFound, err)
		}
		return addrs, err
	}
}

// Target is a pool the resolver feeds.
type Target struct {
	// Pool names the pool in logs.
	Pool string
	// Prefill and Decode are the pool's endpoints as its config lists
	// them (routing.Endpoints). An Address "name:port" stands for an
	// endpoint on each address of the name; a KVAddress on the same name
	// is, for each, that address on its own port.
	Prefill, Decode []endpoint.Endpoint
	// Set receives the pool's endpoints, in the config's order, each
	// name's addresses in order and an address listed twice once
	// (routing.Pool.SetEndpoints). It is called with no two calls at once.
	Set func(prefill, decode []endpoint.Endpoint)
}

// Options configure a Resolver.
type Options struct {
	// Lookup looks names up; nil: LookupWith(nil).
	Lookup Lookup
	// Log receives each change of a name's addresses and each failure
	// (once, not per retry). nil: discarded.
	Log *slog.Logger
	// Resolved, when set, is called after each lookup's outcome is applied
	// (every target using the name has its endpoints). Tests wait on it.
	Resolved func(name string)
}

// Resolver keeps its targets' named endpoints resolved.
type Resolver struct {
	lookup   Lookup
	log      *slog.Logger
	resolved func(string)

	// mu guards the fields below and serializes every push to targets.
	mu      sync.Mutex
	refresh time.Duration
	targets []*target
	names   map[string]*name
	closed  bool
}

// target is a Target with the names it uses.
type target struct {
	Target
	hosts []string
}

// name is one host name's state and lookup loop.
type name struct {
	host string
	// addrs are the addresses last found, sorted; nil when none.
	addrs []netip.Addr
	// err is the last lookup's error, nil after a success; failures
	// counts the lookups in a row that failed or found no address.
	err      error
	failures int
	// rescheduled tells the loop the refresh period changed.
	rescheduled chan struct{}
	stop        context.CancelFunc
	done        chan struct{}
}

// New returns a Resolver. It resolves nothing until SetTargets.
func New(opts Options) *Resolver {
	if opts.Lookup == nil {
		opts.Lookup = LookupWith(nil)
	}
	if opts.Log == nil {
		opts.Log = slog.New(slog.DiscardHandler)
	}
	return &Resolver{lookup: opts.Lookup, log: opts.Log, resolved: opts.Resolved, refresh: DefaultRefresh, names: map[string]*name{}}
}

// SetTargets makes targets the pools r feeds, in place of the previous
// ones, looking names up again every refresh (0: DefaultRefresh). It looks
// up the names that are new to it (bounded by ctx and a lookup's timeout)
// and gives every target its endpoints before it returns; names it knows
// keep their addresses and their schedule. A name that does not resolve
// leaves its targets without its engines, is logged, and is retried.
func (r *Resolver) SetTargets(ctx context.Context, refresh time.Duration, targets []Target) error {
	if refresh <= 0 {
		refresh = DefaultRefresh
	}
	ts := make([]*target, len(targets))
	var used []string
	for i, t := range targets {
		ts[i] = &target{Target: t, hosts: hosts(t.Prefill, t.Decode)}
		for _, h := range ts[i].hosts {
			if !slices.Contains(used, h) {
				used = append(used, h)
			}
		}
	}
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return ErrClosed
	}
	fresh := slices.DeleteFunc(slices.Clone(used), func(h string) bool { return r.names[h] != nil })
	r.mu.Unlock()

	// Lookups hold no lock: running loops go on meanwhile.
	found := make([]*name, len(fresh))
	var wg sync.WaitGroup
	for i, host := range fresh {
		wg.Go(func() {
			n := &name{host: host}
			n.record(r.resolve(ctx, host))
			found[i] = n
		})
	}
	wg.Wait()

	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return ErrClosed
	}
	if refresh != r.refresh {
		for _, n := range r.names {
			select {
			case n.rescheduled <- struct{}{}:
			default:
			}
		}
	}
	r.refresh, r.targets = refresh, ts
	for _, n := range found {
		if r.names[n.host] != nil {
			continue // looked up by a SetTargets meanwhile
		}
		r.names[n.host] = n
		r.start(n)
		r.logFirst(n)
	}
	for _, t := range r.targets {
		r.push(t)
	}
	var unused []*name
	for host, n := range r.names {
		if !slices.Contains(used, host) {
			unused = append(unused, n)
			delete(r.names, host)
		}
	}
	r.mu.Unlock()
	stopAll(unused)
	return nil
}

// Close stops every lookup loop and waits for them. Targets keep their
// endpoints and get no more updates.
func (r *Resolver) Close() {
	r.mu.Lock()
	r.closed = true
	r.targets = nil
	names := slices.Collect(maps.Values(r.names))
	r.names = map[string]*name{}
	r.mu.Unlock()
	stopAll(names)
}

func stopAll(names []*name) {
	for _, n := range names {
		n.stop()
	}
	for _, n := range names {
		<-n.done
	}
}

// start runs n's lookup loop. r.mu is held.
func (r *Resolver) start(n *name) {
	ctx, cancel := context.WithCancel(context.Background())
	n.stop, n.done, n.rescheduled = cancel, make(chan struct{}), make(chan struct{}, 1)
	go r.run(ctx, n, delay(n.failures, r.refresh))
}

// run looks n up again and again until ctx ends, the first time after
// wait: every refresh period, or sooner after a failure.
func (r *Resolver) run(ctx context.Context, n *name, wait time.Duration) {
	defer close(n.done)
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-n.rescheduled:
			// A new period counts from now, as after a lookup.
			r.mu.Lock()
			timer.Reset(delay(n.failures, r.refresh))
			r.mu.Unlock()
			continue
		case <-timer.C:
		}
		addrs, err := r.resolve(ctx, n.host)
		if ctx.Err() != nil {
			return
		}
		timer.Reset(r.apply(n, addrs, err))
		if r.resolved != nil {
			r.resolved(n.host)
		}
	}
}

// delay is how long a name waits for its next lookup after failures
// failed or empty lookups in a row.
func delay(failures int, refresh time.Duration) time.Duration {
	if failures == 0 {
		return refresh
	}
	return min(refresh, firstRetry<<min(failures-1, 16))
}

// resolve looks host up: its addresses of one family, sorted.
func (r *Resolver) resolve(ctx context.Context, host string) ([]netip.Addr, error) {
	ctx, cancel := context.WithTimeout(ctx, lookupTimeout)
	defer cancel()
	addrs, err := r.lookup(ctx, host)
	if err != nil {
		return nil, err
	}
	if addrs = Preferred(addrs); len(addrs) == 0 {
		return nil, fmt.Errorf("%w: lookup %s: the answer has no address", ErrNotFound, host)
	}
	return addrs, nil
}

// Preferred are the IPv4 addresses of addrs if it has any, else its IPv6
// ones, sorted, each once: a dual-stack host is one host.
func Preferred(addrs []netip.Addr) []netip.Addr {
	out := make([]netip.Addr, 0, len(addrs))
	v4 := false
	for _, a := range addrs {
		if a = a.Unmap(); a.IsValid() && !a.IsUnspecified() {
			out = append(out, a)
			v4 = v4 || a.Is4()
		}
	}
	if v4 {
		out = slices.DeleteFunc(out, func(a netip.Addr) bool { return !a.Is4() })
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return slices.Compact(out)
}

// record stores a lookup's outcome in n and reports whether n's addresses
// changed: a failed lookup keeps them, one that found none clears them.
func (n *name) record(addrs []netip.Addr, err error) bool {
	before := n.addrs
	switch {
	case err == nil:
		n.addrs, n.err, n.failures = addrs, nil, 0
	case errors.Is(err, ErrNotFound):
		n.addrs, n.err, n.failures = nil, err, n.failures+1
	default:
		n.err, n.failures = err, n.failures+1
	}
	return !slices.Equal(before, n.addrs)
}

// apply records a lookup of n, logs what changed, gives the targets that
// use n their new endpoints, and returns the wait for n's next lookup.
func (r *Resolver) apply(n *name, addrs []netip.Addr, err error) time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.names[n.host] != n {
		return r.refresh // no longer used: its loop is being stopped
	}
	before, failed := n.addrs, n.err
	changed := n.record(addrs, err)
	r.logChange(n, before, failed, changed)
	if changed {
		for _, t := range r.targets {
			if slices.Contains(t.hosts, n.host) {
				r.push(t)
			}
		}
	}
	return delay(n.failures, r.refresh)
}

// logFirst logs a name's first lookup. r.mu is held.
func (r *Resolver) logFirst(n *name) {
	if n.err != nil {
		r.log.Warn("endpoint host name does not resolve: its pools serve without it, pdx keeps trying", r.attrs(n)...)
		return
	}
	r.log.Info("endpoint host name resolved", r.attrs(n)...)
}

// logChange logs a lookup of n whose outcome differs from the one before
// (its addresses, or its error): once per change, not per retry. r.mu is
// held.
func (r *Resolver) logChange(n *name, before []netip.Addr, failed error, changed bool) {
	newErr := n.err != nil && (failed == nil || failed.Error() != n.err.Error())
	switch {
	case n.err != nil && len(n.addrs) == 0 && (changed || newErr):
		r.log.Warn("endpoint host name does not resolve: its pools serve without it, pdx keeps trying", r.attrs(n)...)
	case newErr:
		r.log.Warn("endpoint host name lookup failed: its engines stay as last resolved, pdx keeps trying", r.attrs(n)...)
	case changed:
		r.log.Info("endpoint host name resolved", append(r.attrs(n), slog.Any("before", texts(before)))...)
	case failed != nil && n.err == nil:
		r.log.Info("endpoint host name resolves again", r.attrs(n)...)
	}
}

// attrs describe n in a log line: the name, its addresses, the pools that
// list it, and the last error with the wait for the next try. r.mu is
// held.
func (r *Resolver) attrs(n *name) []any {
	var pools []string
	for _, t := range r.targets {
		if slices.Contains(t.hosts, n.host) && !slices.Contains(pools, t.Pool) {
			pools = append(pools, t.Pool)
		}
	}
	out := []any{slog.String("name", n.host), slog.Any("addresses", texts(n.addrs)), slog.Any("pools", pools)}
	if n.err != nil {
		out = append(out, slog.String("error", n.err.Error()), slog.String("retry_in", delay(n.failures, r.refresh).String()))
	}
	return out
}

func texts(addrs []netip.Addr) []string {
	out := make([]string, len(addrs))
	for i, a := range addrs {
		out[i] = a.String()
	}
	return out
}

// push gives t its endpoints from the names' current addresses. r.mu is
// held.
func (r *Resolver) push(t *target) {
	t.Set(r.expand(t.Prefill), r.expand(t.Decode))
}

// expand turns a leg's endpoints as listed into endpoints on IPs: a named
// one into one per address of its name (none while it has none). An
// address met twice is kept once, where first met.
func (r *Resolver) expand(listed []endpoint.Endpoint) []endpoint.Endpoint {
	out := make([]endpoint.Endpoint, 0, len(listed))
	add := func(ep endpoint.Endpoint) {
		if !slices.ContainsFunc(out, func(e endpoint.Endpoint) bool { return e.Address == ep.Address }) {
			out = append(out, ep)
		}
	}
	for _, ep := range listed {
		a, err := endpoint.ParseHostPort(ep.Address)
		if err != nil || !a.IsName() {
			add(ep)
			continue
		}
		n := r.names[a.Name]
		if n == nil {
			continue
		}
		kv, kvErr := endpoint.ParseHostPort(ep.KVAddress)
		kvOnName := kvErr == nil && kv.Name == a.Name
		for _, ip := range n.addrs {
			e := ep
			e.Address = a.At(ip)
			if kvOnName {
				e.KVAddress = kv.At(ip)
			}
			add(e)
		}
	}
	return out
}

// hosts are the names legs' endpoints use, in order, each once.
func hosts(legs ...[]endpoint.Endpoint) []string {
	var out []string
	for _, leg := range legs {
		for _, ep := range leg {
			if a, err := endpoint.ParseHostPort(ep.Address); err == nil && a.IsName() && !slices.Contains(out, a.Name) {
				out = append(out, a.Name)
			}
		}
	}
	return out
}

// Named reports whether some endpoint of legs names a host: a pool the
// resolver must feed.
func Named(legs ...[]endpoint.Endpoint) bool {
	return len(hosts(legs...)) > 0
}
