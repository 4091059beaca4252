package routing

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/placement"
)

func TestLookup(t *testing.T) {
	cfg, err := config.Parse([]byte(`
pools:
- name: big
  models: [big-model]
  connector: nixl
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:2}]
- name: rest
  default: true
  connector: nixl
  prefill_timeout: 2s
  prefill: [{address: 127.0.0.1:3}]
  decode: [{address: 127.0.0.1:4}]
`))
	require.NoError(t, err)
	table, err := New(cfg)
	require.NoError(t, err)

	p, ok := table.Lookup("big-model")
	require.True(t, ok)
	require.Equal(t, "big", p.Name)
	prefill, _ := p.Prefill.Pick(picker.Request{})
	decode, _ := p.Decode.Pick(picker.Request{})
	prefill.End(picker.Released)
	decode.End(picker.Released)
	require.Equal(t, "127.0.0.1:1", prefill.Endpoint().Address)
	require.Equal(t, "127.0.0.1:2", decode.Endpoint().Address)
	require.Equal(t, config.DefaultPrefillTimeout, p.PrefillTimeout)
	require.Equal(t, config.DefaultPrefillTimeout, p.AttemptTimeout)
	require.Equal(t, config.DefaultPrefillAttempts, p.Attempts)
	require.False(t, p.Fallback)

	p, ok = table.Lookup("anything-else")
	require.True(t, ok)
	require.Equal(t, "rest", p.Name)
	require.Equal(t, "2s", p.PrefillTimeout.String())

	cfg.Pools = cfg.Pools[:1]
	table, err = New(cfg)
	require.NoError(t, err)
	_, ok = table.Lookup("anything-else")
	require.False(t, ok, "no default pool")
}

func TestTableEndpoints(t *testing.T) {
	cfg, err := config.Parse([]byte(`
pools:
- name: one
  models: [one-model]
  connector: nixl
  prefill: [{address: 127.0.0.1:1}, {address: 127.0.0.1:2}]
  decode: [{address: 127.0.0.1:2}, {address: 127.0.0.1:3}]
- name: two
  default: true
  connector: nixl
  prefill: [{address: 127.0.0.1:3}]
  decode: [{address: 127.0.0.1:4}, {address: 127.0.0.1:1}]
`))
	require.NoError(t, err)
	table, err := New(cfg)
	require.NoError(t, err)

	var got []string
	for _, ep := range table.Endpoints() {
		got = append(got, ep.Address)
	}
	require.Equal(t, []string{"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4"}, got,
		"every pool's prefill and decode endpoints, each address once, where first listed")
	require.Equal(t, got, table.Addresses(), "the engines scraped are those")
}

func TestUnknownNames(t *testing.T) {
	// Configs that config.Parse would refuse, built by hand.
	for _, tc := range []struct {
		name    string
		pool    func(*configv1.Pool)
		wantErr string
	}{
		{name: "connector", pool: func(p *configv1.Pool) { p.Connector = "nixel" },
			wantErr: `pools[0].connector: unknown connector "nixel" (known: ` + knownConnectors + `)`},
		{name: "prefill policy", pool: func(p *configv1.Pool) { p.PrefillPicker = &configv1.Picker{Policy: "random"} },
			wantErr: `pools[0].prefill_picker.policy: unknown picking policy "random" (known: ` + knownPolicies + `)`},
		{name: "decode policy", pool: func(p *configv1.Pool) { p.DecodePicker = &configv1.Picker{Policy: "random"} },
			wantErr: `pools[0].decode_picker.policy: unknown picking policy "random" (known: ` + knownPolicies + `)`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := &configv1.Pool{Name: "p", Default: true, Connector: "nixl",
				Prefill: []*configv1.Endpoint{{Address: "127.0.0.1:1"}}, Decode: []*configv1.Endpoint{{Address: "127.0.0.1:2"}}}
			tc.pool(p)
			_, err := New(&configv1.Config{Pools: []*configv1.Pool{p}})
			require.EqualError(t, err, tc.wantErr)
		})
	}
}

func TestPick(t *testing.T) {
	ep := func(addr, group string) endpoint.Endpoint { return endpoint.Endpoint{Address: addr, Group: group} }
	tests := []struct {
		name            string
		prefill, decode []endpoint.Endpoint
		exclude         []endpoint.Endpoint
		wantDecode      endpoint.Endpoint
		wantPrefill     []endpoint.Endpoint // in turn
		wantErr         string
	}{
		{
			name:    "unpaired: any prefill",
			prefill: []endpoint.Endpoint{ep("127.0.0.1:1", ""), ep("127.0.0.1:2", "")}, decode: []endpoint.Endpoint{ep("127.0.0.1:9", "")},
			wantDecode: ep("127.0.0.1:9", ""), wantPrefill: []endpoint.Endpoint{ep("127.0.0.1:1", ""), ep("127.0.0.1:2", ""), ep("127.0.0.1:1", "")},
		},
		{
			name:    "paired: the decode's group only",
			prefill: []endpoint.Endpoint{ep("127.0.0.1:1", "a"), ep("127.0.0.1:2", "b"), ep("127.0.0.1:3", "a")}, decode: []endpoint.Endpoint{ep("127.0.0.1:9", "a")},
			wantDecode: ep("127.0.0.1:9", "a"), wantPrefill: []endpoint.Endpoint{ep("127.0.0.1:1", "a"), ep("127.0.0.1:3", "a"), ep("127.0.0.1:1", "a")},
		},
		{
			name:    "no decode",
			prefill: []endpoint.Endpoint{ep("127.0.0.1:1", "")},
			wantErr: "no endpoint available: pool p has no ready decode endpoint",
		},
		{
			name:    "no prefill",
			decode:  []endpoint.Endpoint{ep("127.0.0.1:9", "")},
			wantErr: "no endpoint available: pool p has no ready prefill endpoint",
		},
		{
			name:    "group without prefill",
			prefill: []endpoint.Endpoint{ep("127.0.0.1:1", "b")}, decode: []endpoint.Endpoint{ep("127.0.0.1:9", "a")},
			wantErr: `no endpoint available: pool p has no ready prefill endpoint in group "a" of decode endpoint 127.0.0.1:9`,
		},
		{
			name:    "group tried out",
			prefill: []endpoint.Endpoint{ep("127.0.0.1:1", "a"), ep("127.0.0.1:2", "b")}, decode: []endpoint.Endpoint{ep("127.0.0.1:9", "a")},
			exclude: []endpoint.Endpoint{ep("127.0.0.1:1", "a")},
			wantErr: "no endpoint available: pool p has no prefill endpoint left to try",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := &Pool{Pool: &placement.Pool{Name: "p", Prefill: leg(t, nil, picker.Options{}), Decode: leg(t, nil, picker.Options{})}}
			p.SetEndpoints(tc.prefill, tc.decode)
			lease, err := p.PickDecode(picker.Request{})
			d := lease.Endpoint()
			lease.End(picker.Released)
			if err == nil {
				var got []endpoint.Endpoint
				for range max(1, len(tc.wantPrefill)) {
					var pf picker.Lease
					if pf, err = p.PickPrefill(d, picker.Request{}, tc.exclude...); err != nil {
						break
					}
					pf.End(picker.Released)
					got = append(got, pf.Endpoint())
				}
				if err == nil {
					require.Equal(t, tc.wantDecode, d)
					require.Equal(t, tc.wantPrefill, got)
					return
				}
			}
			require.EqualError(t, err, tc.wantErr)
			require.ErrorIs(t, err, ErrNoEndpoint)
		})
	}
}

func TestSetEndpointsKeepsHealth(t *testing.T) {
	a, b, c := endpoint.Endpoint{Address: "127.0.0.1:1"}, endpoint.Endpoint{Address: "127.0.0.1:2"}, endpoint.Endpoint{Address: "127.0.0.1:3"}
	p := &Pool{Pool: &placement.Pool{Name: "p", Prefill: leg(t, []endpoint.Endpoint{a, b}, picker.Options{FailureThreshold: 1}), Decode: leg(t, []endpoint.Endpoint{c}, picker.Options{})}}
	p.Prefill.Report(a, false)
	p.SetEndpoints([]endpoint.Endpoint{c, a}, []endpoint.Endpoint{b})
	require.Equal(t, []endpoint.Endpoint{c, a}, p.Prefill.Set.Endpoints(), "the new set, not the union used on the way")
	require.Equal(t, []endpoint.Endpoint{b}, p.Decode.Set.Endpoints())
	require.False(t, p.Prefill.Set.Healthy(a), "still ejected")
	require.True(t, p.Prefill.Set.Healthy(c))
}

func TestRebuild(t *testing.T) {
	parse := func(yaml string) *configv1.Config {
		cfg, err := config.Parse([]byte(yaml))
		require.NoError(t, err)
		return cfg
	}
	old, err := New(parse(`
pools:
- name: static
  models: [a]
  connector: nixl
  eject_after_failures: 1
  prefill: [{address: 127.0.0.1:1}, {address: 127.0.0.1:2}]
  decode: [{address: 127.0.0.1:9}]
- name: found
  models: [b]
  connector: nixl
  kubernetes: {namespace: llm, service: engines, port: 8000}
`))
	require.NoError(t, err)
	ep := func(addr string) endpoint.Endpoint { return endpoint.Endpoint{Address: addr} }
	static, _ := old.Pool("static")
	static.Prefill.Report(ep("127.0.0.1:1"), false)
	found, _ := old.Pool("found")
	found.SetEndpoints([]endpoint.Endpoint{ep("10.0.0.1:8000")}, []endpoint.Endpoint{ep("10.0.0.9:8000")})
	found.Prefill.Report(ep("10.0.0.1:8000"), false)
	found.Prefill.Report(ep("10.0.0.1:8000"), false)
	found.Prefill.Report(ep("10.0.0.1:8000"), false)

	table, err := Rebuild(parse(`
pools:
- name: static
  models: [a]
  connector: nixl
  eject_after_failures: 1
  prefill: [{address: 127.0.0.1:1}, {address: 127.0.0.1:3}]
  decode: [{address: 127.0.0.1:9}]
- name: found
  models: [b]
  connector: nixl
  kubernetes: {namespace: llm, service: engines, port: 8000}
- name: renamed
  models: [c]
  connector: nixl
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:9}]
`), old)
	require.NoError(t, err)
	static, _ = table.Pool("static")
	require.False(t, static.Prefill.Set.Healthy(ep("127.0.0.1:1")), "an ejected endpoint stays ejected across the reload")
	require.True(t, static.Prefill.Set.Healthy(ep("127.0.0.1:3")))
	found, _ = table.Pool("found")
	require.Equal(t, []endpoint.Endpoint{ep("10.0.0.1:8000")}, found.Prefill.Set.Endpoints(), "a discovered pool starts from its predecessor's endpoints")
	require.Equal(t, []endpoint.Endpoint{ep("10.0.0.9:8000")}, found.Decode.Set.Endpoints())
	require.False(t, found.Prefill.Set.Healthy(ep("10.0.0.1:8000")))
	renamed, _ := table.Pool("renamed")
	require.True(t, renamed.Prefill.Set.Healthy(ep("127.0.0.1:1")), "health is carried by pool name")
	_, ok := table.Pool("nope")
	require.False(t, ok)
}

// Peers are read at start: their journal and pick jitter reach every
// pool, and a rebuilt table keeps them whatever its config says.
func TestRebuildKeepsPeers(t *testing.T) {
	const pools = `
pools:
- name: p
  models: [a]
  connector: nixl
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:9}]
`
	parse := func(yaml string) *configv1.Config {
		cfg, err := config.Parse([]byte(yaml))
		require.NoError(t, err)
		return cfg
	}
	none, err := New(parse(pools))
	require.NoError(t, err)
	require.Nil(t, none.Journal())
	p, _ := none.Pool("p")
	require.Zero(t, p.PickJitter, "no peers, no wait")

	first, err := New(parse(pools + "peers: {addresses: [127.0.0.1:9003], pick_jitter: 7ms}\n"))
	require.NoError(t, err)
	require.NotNil(t, first.Journal())
	p, _ = first.Pool("p")
	require.Equal(t, 7*time.Millisecond, p.PickJitter)

	table, err := Rebuild(parse(pools), first)
	require.NoError(t, err)
	require.Same(t, first.Journal(), table.Journal())
	p, _ = table.Pool("p")
	require.Equal(t, 7*time.Millisecond, p.PickJitter)
}

// leg is a round-robin leg over eps.
func leg(t *testing.T, eps []endpoint.Endpoint, opts picker.Options) picker.Leg {
	t.Helper()
	l, err := picker.NewLeg(picker.NewSet(eps, opts), &configv1.Picker{Policy: picker.RoundRobinPolicy}, picker.RoleDecode)
	require.NoError(t, err)
	return l
}

// A request's decode fallbacks are the pool's other decode endpoints in the
// picker's order, the first pick excluded, healthy ones first; round
// robin's turns are not used up by them.
func TestPickFallbacks(t *testing.T) {
	const pool = `
pools:
- name: p
  default: true
  connector: nixl
  decode_fallbacks: %d
  decode_picker: {policy: %s}
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:11}, {address: 127.0.0.1:12}, {address: 127.0.0.1:13}]
`
	addrs := func(eps []endpoint.Endpoint) []string {
		out := []string{}
		for _, ep := range eps {
			out = append(out, ep.Address)
		}
		return out
	}
	for _, tc := range []struct {
		name      string
		fallbacks int
		policy    string
		eject     string         // a decode endpoint made unhealthy first
		busy      map[string]int // requests in flight on decode endpoints
		want      [][]string
	}{
		{name: "none", fallbacks: 0, policy: "round_robin", want: [][]string{{"127.0.0.1:11"}, {"127.0.0.1:12"}}},
		{name: "round robin, one", fallbacks: 1, policy: "round_robin",
			want: [][]string{{"127.0.0.1:11", "127.0.0.1:12"}, {"127.0.0.1:12", "127.0.0.1:13"}, {"127.0.0.1:13", "127.0.0.1:11"}}},
		{name: "round robin, more than there are", fallbacks: 5, policy: "round_robin",
			want: [][]string{{"127.0.0.1:11", "127.0.0.1:12", "127.0.0.1:13"}, {"127.0.0.1:12", "127.0.0.1:13", "127.0.0.1:11"}}},
		{name: "round robin, an ejected endpoint last", fallbacks: 2, policy: "round_robin", eject: "127.0.0.1:12",
			want: [][]string{{"127.0.0.1:11", "127.0.0.1:13", "127.0.0.1:12"}}},
		{name: "least request", fallbacks: 2, policy: "least_request", busy: map[string]int{"127.0.0.1:11": 2, "127.0.0.1:12": 1},
			want: [][]string{{"127.0.0.1:13", "127.0.0.1:12", "127.0.0.1:11"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := config.Parse(fmt.Appendf(nil, pool, tc.fallbacks, tc.policy))
			require.NoError(t, err)
			table, err := New(cfg)
			require.NoError(t, err)
			require.Equal(t, tc.fallbacks, table.MaxDecodeFallbacks())
			p, _ := table.Lookup("m")
			if tc.eject != "" {
				for range config.DefaultEjectAfterFailures {
					p.Decode.Report(endpoint.Endpoint{Address: tc.eject}, false)
				}
			}
			for addr, n := range tc.busy {
				for range n {
					_, err := p.PickDecode(picker.Request{Subset: []string{addr}}) // still running
					require.NoError(t, err)
				}
			}
			for i, want := range tc.want {
				lease, err := p.PickDecode(picker.Request{})
				require.NoError(t, err)
				lease.End(picker.Released)
				first := lease.Endpoint()
				got := p.PickFallbacks([]endpoint.Endpoint{first}, picker.Request{}, first)
				require.Equal(t, want, addrs(got), "request %d", i)
			}
		})
	}
}

// Fallbacks stay in the first pick's group: its prefill hands the KV over
// within it.
func TestPickFallbacksInGroup(t *testing.T) {
	cfg, err := config.Parse([]byte("pools:\n- name: p\n  default: true\n  connector: nixl\n  decode_fallbacks: 3\n  decode_picker: {policy: round_robin}\n  prefill: [{address: 127.0.0.1:1}]\n  decode: [{address: 127.0.0.1:2}]\n"))
	require.NoError(t, err)
	table, err := New(cfg)
	require.NoError(t, err)
	p := table.Pools()[0]
	a1, a2 := endpoint.Endpoint{Address: "127.0.0.1:11", Group: "a"}, endpoint.Endpoint{Address: "127.0.0.1:12", Group: "a"}
	b1 := endpoint.Endpoint{Address: "127.0.0.1:21", Group: "b"}
	p.SetEndpoints([]endpoint.Endpoint{{Address: "127.0.0.1:1", Group: "a"}, {Address: "127.0.0.1:2", Group: "b"}}, []endpoint.Endpoint{a1, b1, a2})
	require.Equal(t, []endpoint.Endpoint{a2}, p.PickFallbacks(nil, picker.Request{}, a1))
	require.Empty(t, p.PickFallbacks(nil, picker.Request{}, b1), "group b has no other decode endpoint")
}

// Changing a pool's endpoints tells the table's Changes, once for changes
// not yet received.
func TestChanges(t *testing.T) {
	cfg, err := config.Parse([]byte("pools:\n- name: p\n  default: true\n  connector: nixl\n  prefill: [{address: 127.0.0.1:1}]\n  decode: [{address: 127.0.0.1:2}]\n"))
	require.NoError(t, err)
	table, err := New(cfg)
	require.NoError(t, err)
	select {
	case <-table.Changes():
		t.Fatal("no change yet")
	default:
	}
	p := table.Pools()[0]
	p.SetEndpoints([]endpoint.Endpoint{{Address: "127.0.0.1:1"}}, []endpoint.Endpoint{{Address: "127.0.0.1:3"}})
	p.SetEndpoints([]endpoint.Endpoint{{Address: "127.0.0.1:1"}}, []endpoint.Endpoint{{Address: "127.0.0.1:4"}})
	<-table.Changes()
	select {
	case <-table.Changes():
		t.Fatal("two changes told once")
	default:
	}
}

// The registries' names, as the unknown-name messages list them: the
// registries' own tests hold the lists themselves.
var (
	knownConnectors = strings.Join(connectors.Names(), ", ")
	knownPolicies   = strings.Join(picker.Policies(), ", ")
)

// Two tables of one config (two pdx replicas) send a session to the same
// decode engine and the same prefill engine of its group, request after
// request; each session's prefill is in its decode's group.
func TestSessionPicks(t *testing.T) {
	cfg, err := config.Parse([]byte(`
pools:
- name: p
  default: true
  connector: nixl
  session_affinity: {header: x-session-id}
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:5}]
`))
	require.NoError(t, err)
	// Groups come from discovery, in an order of each replica's own.
	prefill := []endpoint.Endpoint{{Address: "127.0.0.1:1", Group: "a"}, {Address: "127.0.0.1:2", Group: "a"}, {Address: "127.0.0.1:3", Group: "b"}, {Address: "127.0.0.1:4", Group: "b"}}
	decode := []endpoint.Endpoint{{Address: "127.0.0.1:5", Group: "a"}, {Address: "127.0.0.1:6", Group: "a"}, {Address: "127.0.0.1:7", Group: "b"}}
	var replicas [2]*Pool
	for i := range replicas {
		table, err := New(cfg)
		require.NoError(t, err)
		replicas[i] = table.Pools()[0]
		require.Equal(t, "x-session-id", replicas[i].SessionHeader)
		replicas[i].SetEndpoints(prefill, decode)
		slices.Reverse(prefill)
		slices.Reverse(decode)
	}
	decodes, prefills := map[endpoint.Endpoint]bool{}, map[endpoint.Endpoint]bool{}
	for n := range 60 {
		req := picker.Request{Session: picker.SessionKey(fmt.Appendf(nil, "s%d", n))}
		var decode, prefill endpoint.Endpoint
		for i, p := range append(replicas[:], replicas[:]...) {
			d, err := p.PickDecode(req)
			require.NoError(t, err)
			pf, err := p.PickPrefill(d.Endpoint(), req)
			require.NoError(t, err)
			require.Equal(t, d.Endpoint().Group, pf.Endpoint().Group, "session %d: the prefill is in its decode's group", n)
			require.Equal(t, picker.SessionKept, d.Session())
			require.Equal(t, picker.SessionKept, pf.Session())
			if i == 0 {
				decode, prefill = d.Endpoint(), pf.Endpoint()
			}
			require.Equal(t, decode, d.Endpoint(), "session %d, pick %d", n, i)
			require.Equal(t, prefill, pf.Endpoint(), "session %d, pick %d", n, i)
			d.End(picker.Released)
			pf.End(picker.Released)
		}
		decodes[decode], prefills[prefill] = true, true
	}
	require.Len(t, decodes, 3, "the sessions spread over the decode engines")
	require.Len(t, prefills, 4, "and over the prefill engines")
}

func TestLoRAAdapters(t *testing.T) {
	cfg, err := config.Parse([]byte(`
pools:
- name: tuned
  models: [base]
  lora: {adapters: [sql, chat]}
  connector: nixl
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:2}]
- name: any
  models: [other-base]
  lora: {}
  connector: nixl
  prefill: [{address: 127.0.0.1:5}]
  decode: [{address: 127.0.0.1:6}]
- name: rest
  default: true
  connector: nixl
  prefill: [{address: 127.0.0.1:3}]
  decode: [{address: 127.0.0.1:4}]
`))
	require.NoError(t, err)
	table, err := New(cfg)
	require.NoError(t, err)

	for _, tc := range []struct {
		model, pool, adapter string
	}{
		{model: "sql", pool: "tuned", adapter: "sql"},
		{model: "chat", pool: "tuned", adapter: "chat"},
		{model: "base", pool: "tuned", adapter: ""},
		{model: "other-base", pool: "any", adapter: ""},
		{model: "unlisted", pool: "rest", adapter: ""}, // the default pool has no lora config
	} {
		p, ok := table.Lookup(tc.model)
		require.True(t, ok, tc.model)
		require.Equal(t, tc.pool, p.Name, tc.model)
		require.Equal(t, tc.adapter, p.Adapter(tc.model), tc.model)
	}
	anyPool, _ := table.Pool("any")
	require.Equal(t, "reported", anyPool.Adapter("reported"), "with a lora config, a model it does not list is an adapter its engines may report")
	models, _ := table.Models()
	require.Equal(t, []string{"base", "sql", "chat", "other-base"}, models, "adapters listed after their pool's models")

	// Both legs remember the pool's adapters.
	tuned, _ := table.Pool("tuned")
	lease, err := tuned.PickDecode(picker.Request{Adapter: "sql"})
	require.NoError(t, err)
	require.Equal(t, picker.LoRAFreeSlot, lease.LoRA())
	lease.End(picker.Released)
	lease, err = tuned.PickDecode(picker.Request{Adapter: "sql"})
	require.NoError(t, err)
	require.Equal(t, picker.LoRALoaded, lease.LoRA(), "sent there last")
	lease.End(picker.Released)
}

func TestPrefillMaxInFlight(t *testing.T) {
	tests := []struct {
		name                              string
		saturation                        string
		prefillSaturated, decodeSaturated bool
	}{
		{"one bound for both legs", "{max_in_flight: 1}", true, true},
		{"prefill's own bound", "{prefill_max_in_flight: 1}", true, false},
		{"prefill's bound replaces the pool's", "{max_in_flight: 1, prefill_max_in_flight: 2}", false, true},
		{"saturation disabled", "{disabled: true, prefill_max_in_flight: 1}", false, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := config.Parse([]byte("pools:\n- name: p\n  default: true\n  connector: nixl\n  saturation: " + tc.saturation +
				"\n  prefill: [{address: 127.0.0.1:1}]\n  decode: [{address: 127.0.0.1:2}]\n"))
			require.NoError(t, err)
			table, err := New(cfg)
			require.NoError(t, err)
			p, ok := table.Pool("p")
			require.True(t, ok)
			decode, err := p.PickDecode(picker.Request{})
			require.NoError(t, err)
			prefill, err := p.PickPrefill(decode.Endpoint(), picker.Request{})
			require.NoError(t, err)
			require.Equal(t, tc.prefillSaturated, p.Prefill.Set.Saturated(""), "prefill leg saturated with one request on it")
			require.Equal(t, tc.decodeSaturated, p.Decode.Set.Saturated(""), "decode leg saturated with one request on it")
			prefill.End(picker.Succeeded)
			decode.End(picker.Succeeded)
		})
	}
}

// BenchmarkTableAddresses: the metrics scraper asks for the engines at
// every tick (every 50 ms by default); one pool of n engines, half
// prefill, half decode.
func BenchmarkTableAddresses(b *testing.B) {
	for _, n := range []int{8, 64, 512} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			var prefill, decode strings.Builder
			for i := range n / 2 {
				fmt.Fprintf(&prefill, "{address: 10.0.%d.%d:8000},", i/256, i%256)
				fmt.Fprintf(&decode, "{address: 10.1.%d.%d:8000},", i/256, i%256)
			}
			cfg, err := config.Parse(fmt.Appendf(nil, "pools:\n- name: p\n  default: true\n  connector: nixl\n  prefill: [%s]\n  decode: [%s]\n",
				strings.TrimSuffix(prefill.String(), ","), strings.TrimSuffix(decode.String(), ",")))
			require.NoError(b, err)
			table, err := New(cfg)
			require.NoError(b, err)
			require.Len(b, table.Addresses(), n)
			b.ReportAllocs()
			for b.Loop() {
				table.Addresses()
			}
		})
	}
}
