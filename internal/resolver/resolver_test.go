package resolver

import (
	"context"
	"errors"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/testbed/dnsserver"
	"github.com/pdx-router/pdx/internal/testbed/logbuf"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// names is a lookup a test controls: the addresses of each name, or its
// error.
type names struct {
	mu      sync.Mutex
	addrs   map[string][]netip.Addr
	errs    map[string]error
	lookups map[string]int
}

func newNames() *names {
	return &names{addrs: map[string][]netip.Addr{}, errs: map[string]error{}, lookups: map[string]int{}}
}

func (n *names) set(host string, addrs ...string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	delete(n.errs, host)
	n.addrs[host] = nil
	for _, a := range addrs {
		n.addrs[host] = append(n.addrs[host], netip.MustParseAddr(a))
	}
}

func (n *names) fail(host string, err error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.errs[host] = err
}

func (n *names) count(host string) int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.lookups[host]
}

func (n *names) lookup(_ context.Context, host string) ([]netip.Addr, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.lookups[host]++
	if err := n.errs[host]; err != nil {
		return nil, err
	}
	addrs, ok := n.addrs[host]
	if !ok {
		return nil, ErrNotFound
	}
	return slices.Clone(addrs), nil
}

// pool records what a target is given.
type pool struct {
	mu              sync.Mutex
	prefill, decode []endpoint.Endpoint
	sets            int
}

func (p *pool) Set(prefill, decode []endpoint.Endpoint) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.prefill, p.decode = prefill, decode
	p.sets++
}

func (p *pool) addresses() (prefill, decode []string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return addrs(p.prefill), addrs(p.decode)
}

func addrs(eps []endpoint.Endpoint) []string {
	out := []string{}
	for _, ep := range eps {
		out = append(out, ep.Address)
	}
	return out
}

func eps(addresses ...string) []endpoint.Endpoint {
	out := make([]endpoint.Endpoint, len(addresses))
	for i, a := range addresses {
		out[i] = endpoint.Endpoint{Address: a}
	}
	return out
}

// start runs a resolver over lookup with a short refresh; the returned
// channel hears of each lookup after the first ones.
func start(t *testing.T, lookup Lookup, log *logbuf.Buffer) (*Resolver, <-chan string) {
	t.Helper()
	resolved := make(chan string, 100)
	opts := Options{Lookup: lookup, Resolved: func(n string) {
		select {
		case resolved <- n:
		default:
		}
	}}
	if log != nil {
		opts.Log = slog.New(slog.NewTextHandler(log, nil))
	}
	r := New(opts)
	t.Cleanup(r.Close)
	return r, resolved
}

// await waits until host has been looked up again by its loop.
func await(t *testing.T, resolved <-chan string, host string) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		select {
		case n := <-resolved:
			if n == host {
				return
			}
		case <-deadline:
			t.Fatalf("%s was not looked up again", host)
		}
	}
}

const refresh = 10 * time.Millisecond

// TestExpand: each address of a name is an endpoint, in the config's
// order, IPv4 preferred; literal IPs pass as they are; a kv_address on
// the endpoint's own name follows each address; an address met twice is
// kept once.
func TestExpand(t *testing.T) {
	n := newNames()
	n.set("engines", "10.0.0.2", "10.0.0.1", "fd00::1", "::ffff:10.0.0.3")
	n.set("v6only", "fd00::2", "fd00::1")
	n.set("localhost", "127.0.0.1")
	r, _ := start(t, n.lookup, nil)
	var p pool
	prefill := []endpoint.Endpoint{
		{Address: "10.9.9.9:8000", KVAddress: "10.9.9.9:5600"},
		{Address: "engines:8000", KVAddress: "engines:5600", BootstrapPort: 9000, DPSize: 2},
	}
	decode := eps("localhost:9000", "127.0.0.1:9000", "v6only:9000", "10.0.0.1:9000", "engines:9000")
	require.NoError(t, r.SetTargets(t.Context(), time.Hour, []Target{{Pool: "p", Prefill: prefill, Decode: decode, Set: p.Set}}))

	require.Equal(t, []endpoint.Endpoint{
		{Address: "10.9.9.9:8000", KVAddress: "10.9.9.9:5600"},
		{Address: "10.0.0.1:8000", KVAddress: "10.0.0.1:5600", BootstrapPort: 9000, DPSize: 2},
		{Address: "10.0.0.2:8000", KVAddress: "10.0.0.2:5600", BootstrapPort: 9000, DPSize: 2},
		{Address: "10.0.0.3:8000", KVAddress: "10.0.0.3:5600", BootstrapPort: 9000, DPSize: 2},
	}, p.prefill)
	require.Equal(t, []string{"127.0.0.1:9000", "[fd00::1]:9000", "[fd00::2]:9000", "10.0.0.1:9000", "10.0.0.2:9000", "10.0.0.3:9000"}, addrs(p.decode))
	require.Equal(t, 1, p.sets)
	require.True(t, Named(decode))
	require.False(t, Named(eps("10.0.0.1:1"), eps("[fd00::1]:2")))
}

// TestNameChanges: a name whose addresses change, appear, vanish or fail
// to resolve, as the pool sees it.
func TestNameChanges(t *testing.T) {
	n := newNames()
	n.set("decode", "127.0.0.1")
	var log logbuf.Buffer
	r, resolved := start(t, n.lookup, &log)
	var p pool
	require.NoError(t, r.SetTargets(t.Context(), refresh, []Target{{Pool: "p", Prefill: eps("127.0.0.9:1", "prefill:8000"), Decode: eps("decode:8000"), Set: p.Set}}))

	prefill, decode := p.addresses()
	require.Equal(t, []string{"127.0.0.9:1"}, prefill, "a name that does not resolve at start leaves the pool without it")
	require.Equal(t, []string{"127.0.0.1:8000"}, decode)
	require.Contains(t, log.String(), `msg="endpoint host name does not resolve: its pools serve without it, pdx keeps trying" name=prefill addresses=[] pools=[p] error="no address" retry_in=10ms`)

	steps := []struct {
		name         string
		change       func()
		host         string
		prefill, dec []string
		logged       string
	}{
		{"the address changes", func() { n.set("decode", "127.0.0.2") }, "decode",
			[]string{"127.0.0.9:1"}, []string{"127.0.0.2:8000"},
			`msg="endpoint host name resolved" name=decode addresses=[127.0.0.2] pools=[p] before=[127.0.0.1]`},
		{"a second address", func() { n.set("decode", "127.0.0.2", "127.0.0.1") }, "decode",
			[]string{"127.0.0.9:1"}, []string{"127.0.0.1:8000", "127.0.0.2:8000"},
			`addresses="[127.0.0.1 127.0.0.2]"`},
		{"a name appears", func() { n.set("prefill", "127.0.0.3") }, "prefill",
			[]string{"127.0.0.9:1", "127.0.0.3:8000"}, []string{"127.0.0.1:8000", "127.0.0.2:8000"},
			`msg="endpoint host name resolved" name=prefill addresses=[127.0.0.3] pools=[p] before=[]`},
		{"a failed lookup keeps the addresses", func() { n.fail("decode", errors.New("server misbehaving")) }, "decode",
			[]string{"127.0.0.9:1", "127.0.0.3:8000"}, []string{"127.0.0.1:8000", "127.0.0.2:8000"},
			`msg="endpoint host name lookup failed: its engines stay as last resolved, pdx keeps trying" name=decode addresses="[127.0.0.1 127.0.0.2]" pools=[p] error="server misbehaving" retry_in=10ms`},
		{"it resolves again", func() { n.set("decode", "127.0.0.1", "127.0.0.2") }, "decode",
			[]string{"127.0.0.9:1", "127.0.0.3:8000"}, []string{"127.0.0.1:8000", "127.0.0.2:8000"},
			`msg="endpoint host name resolves again" name=decode`},
		{"a name vanishes", func() { n.mu.Lock(); delete(n.addrs, "decode"); n.mu.Unlock() }, "decode",
			[]string{"127.0.0.9:1", "127.0.0.3:8000"}, []string{},
			`msg="endpoint host name does not resolve: its pools serve without it, pdx keeps trying" name=decode addresses=[] pools=[p] error="no address"`},
		{"an answer without an address", func() { n.set("decode") }, "decode",
			[]string{"127.0.0.9:1", "127.0.0.3:8000"}, []string{},
			`error="no address: lookup decode: the answer has no address"`},
		{"and back", func() { n.set("decode", "127.0.0.4") }, "decode",
			[]string{"127.0.0.9:1", "127.0.0.3:8000"}, []string{"127.0.0.4:8000"},
			`msg="endpoint host name resolved" name=decode addresses=[127.0.0.4] pools=[p] before=[]`},
	}
	for _, s := range steps {
		s.change()
		// The lookup after the change may have started before it: wait
		// for two.
		await(t, resolved, s.host)
		await(t, resolved, s.host)
		prefill, decode := p.addresses()
		require.Equal(t, s.prefill, prefill, s.name)
		require.Equal(t, s.dec, decode, s.name)
		require.Contains(t, log.String(), s.logged, s.name)
	}
}

// TestLogsOncePerChange: a name that keeps failing is logged once, not at
// every retry.
func TestLogsOncePerChange(t *testing.T) {
	n := newNames()
	var log logbuf.Buffer
	r, resolved := start(t, n.lookup, &log)
	var p pool
	require.NoError(t, r.SetTargets(t.Context(), refresh, []Target{{Pool: "p", Decode: eps("missing:8000"), Set: p.Set}}))
	for range 5 {
		await(t, resolved, "missing")
	}
	require.GreaterOrEqual(t, n.count("missing"), 6)
	require.Equal(t, 1, strings.Count(log.String(), "missing"), log.String())
	require.Equal(t, 1, p.sets, "nothing changed after the first")
}

// TestDelay: a name that fails is retried sooner, backing off up to the
// refresh period.
func TestDelay(t *testing.T) {
	for _, tc := range []struct {
		failures int
		refresh  time.Duration
		want     time.Duration
	}{
		{0, 5 * time.Second, 5 * time.Second},
		{1, 5 * time.Second, time.Second},
		{2, 5 * time.Second, 2 * time.Second},
		{3, 5 * time.Second, 4 * time.Second},
		{4, 5 * time.Second, 5 * time.Second},
		{1000, 5 * time.Second, 5 * time.Second},
		{1, 100 * time.Millisecond, 100 * time.Millisecond},
		{0, time.Minute, time.Minute},
		{6, time.Minute, 32 * time.Second},
	} {
		require.Equal(t, tc.want, delay(tc.failures, tc.refresh), "%d failures, refresh %v", tc.failures, tc.refresh)
	}
}

// TestSetTargetsAgain: a reload's targets reuse the names known, whose
// addresses they get without a lookup, and the names no target uses any
// more are no longer looked up.
func TestSetTargetsAgain(t *testing.T) {
	n := newNames()
	n.set("a", "127.0.0.1")
	n.set("b", "127.0.0.2")
	r, resolved := start(t, n.lookup, nil)
	var p1 pool
	require.NoError(t, r.SetTargets(t.Context(), time.Hour, []Target{{Pool: "p", Decode: eps("a:1", "b:1"), Set: p1.Set}}))
	require.Equal(t, 1, n.count("a"))

	var p2 pool
	require.NoError(t, r.SetTargets(t.Context(), refresh, []Target{{Pool: "p", Decode: eps("b:2"), Prefill: eps("c:3"), Set: p2.Set}}))
	_, decode := p2.addresses()
	require.Equal(t, []string{"127.0.0.2:2"}, decode)
	require.Equal(t, 1, n.count("b"), "b's address is known")
	require.Equal(t, 1, n.count("c"))

	// Every loop runs at the new period, b's too, which waited an hour;
	// a's has stopped.
	await(t, resolved, "b")
	before := n.count("a")
	n.set("c", "127.0.0.3")
	await(t, resolved, "c")
	await(t, resolved, "c")
	prefill, _ := p2.addresses()
	require.Equal(t, []string{"127.0.0.3:3"}, prefill)
	require.Equal(t, before, n.count("a"))
	_, decode1 := p1.addresses()
	require.Equal(t, []string{"127.0.0.1:1", "127.0.0.2:1"}, decode1, "the former target is not fed any more")

	r.Close()
	require.ErrorIs(t, r.SetTargets(t.Context(), refresh, nil), ErrClosed)
}

// TestLookupWith: the system lookup over a real DNS exchange (Go's client
// against a DNS server on loopback) tells a name that does not exist from
// a server that fails.
func TestLookupWith(t *testing.T) {
	dns, err := dnsserver.Start()
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, dns.Close()) })
	lookup := LookupWith(dns.Resolver())
	dns.Set("decode.pdx.test", netip.MustParseAddr("127.0.0.2"))

	addrs, err := lookup(t.Context(), "decode.pdx.test")
	require.NoError(t, err)
	require.Equal(t, []netip.Addr{netip.MustParseAddr("127.0.0.2")}, addrs)
	_, err = lookup(t.Context(), "gone.pdx.test")
	require.ErrorIs(t, err, ErrNotFound)
	dns.Fail("decode.pdx.test")
	_, err = lookup(t.Context(), "decode.pdx.test")
	require.Error(t, err)
	require.NotErrorIs(t, err, ErrNotFound)

	addrs, err = LookupWith(nil)(t.Context(), "localhost")
	require.NoError(t, err, "localhost is in /etc/hosts")
	require.Contains(t, Preferred(addrs), netip.MustParseAddr("127.0.0.1"))
}
