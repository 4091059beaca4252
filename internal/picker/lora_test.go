package picker

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/endpoint"
)

func TestLoRAPreference(t *testing.T) {
	eps := endpoints(3)
	adapters := []string{"sql", "chat", "code"}
	now := time.Now()
	type send struct {
		ep      int
		adapter string
	}
	for _, tc := range []struct {
		name    string
		loads   [3]*Load
		sent    []send // what pdx sent where, in order
		sat     Saturation
		adapter string
		want    []int // the endpoints the pick may return
		outcome LoRAOutcome
	}{
		{name: "no adapter: blind to them", adapter: "", want: []int{0, 1, 2}, outcome: LoRANone},
		{
			name:    "the engine running it wins",
			loads:   [3]*Load{nil, {At: now, Adapters: AdapterLoad{Running: []string{"sql"}, MaxLoRA: 2}}, nil},
			adapter: "sql", want: []int{1}, outcome: LoRALoaded,
		},
		{
			name:    "waiting counts as loaded",
			loads:   [3]*Load{{At: now, Adapters: AdapterLoad{Waiting: []string{"sql"}, MaxLoRA: 2}}, nil, nil},
			adapter: "sql", want: []int{0}, outcome: LoRALoaded,
		},
		{
			name:    "an engine's word on an adapter pdx does not list",
			loads:   [3]*Load{nil, nil, {At: now, Adapters: AdapterLoad{Running: []string{"other"}, MaxLoRA: 1}}},
			adapter: "other", want: []int{2}, outcome: LoRALoaded,
		},
		{
			name:    "what pdx sent last is taken to be loaded",
			sent:    []send{{0, "sql"}, {1, "chat"}, {2, "code"}},
			adapter: "chat", want: []int{1}, outcome: LoRALoaded,
		},
		{
			name: "with max_lora 2 the two latest sent are loaded, an older one evicted",
			loads: [3]*Load{
				{At: now.Add(-time.Hour), Adapters: AdapterLoad{MaxLoRA: 2}}, // stale: its max_lora still counts
				{At: now.Add(-time.Hour), Adapters: AdapterLoad{MaxLoRA: 2}},
				{At: now.Add(-time.Hour), Adapters: AdapterLoad{MaxLoRA: 2}},
			},
			sent:    []send{{0, "sql"}, {0, "chat"}, {0, "code"}, {1, "chat"}, {1, "code"}, {2, "code"}},
			adapter: "sql", want: []int{2}, outcome: LoRAFreeSlot, // 0 evicted sql; 2 has one of two slots free
		},
		{
			name:    "without a signal, endpoints sent no adapter have a free slot",
			sent:    []send{{0, "sql"}, {2, "code"}},
			adapter: "chat", want: []int{1}, outcome: LoRAFreeSlot,
		},
		{
			name: "a full batch has no free slot",
			loads: [3]*Load{
				{At: now, Adapters: AdapterLoad{Running: []string{"a", "b"}, MaxLoRA: 2}},
				{At: now, Adapters: AdapterLoad{Running: []string{"a"}, MaxLoRA: 2}},
				{At: now, Adapters: AdapterLoad{Running: []string{"a", "b"}, MaxLoRA: 2}},
			},
			adapter: "sql", want: []int{1}, outcome: LoRAFreeSlot,
		},
		{
			name: "none loaded nor free: blind",
			loads: [3]*Load{
				{At: now, Adapters: AdapterLoad{Running: []string{"a"}, MaxLoRA: 1}},
				{At: now, Adapters: AdapterLoad{Running: []string{"b"}, MaxLoRA: 1}},
				{At: now, Adapters: AdapterLoad{Running: []string{"c"}, MaxLoRA: 1}},
			},
			adapter: "sql", want: []int{0, 1, 2}, outcome: LoRABlind,
		},
		{
			name: "a saturated engine with the adapter yields to a free slot",
			loads: [3]*Load{
				{At: now, Waiting: 9, Adapters: AdapterLoad{Running: []string{"sql"}, MaxLoRA: 2}},
				{At: now, Adapters: AdapterLoad{Running: []string{"a", "b"}, MaxLoRA: 2}},
				{At: now, Adapters: AdapterLoad{Running: []string{"a"}, MaxLoRA: 2}},
			},
			sat:     Saturation{QueueDepth: 5},
			adapter: "sql", want: []int{2}, outcome: LoRAFreeSlot,
		},
		{
			name: "every engine saturated: panic mode as without adapters",
			loads: [3]*Load{
				{At: now, Waiting: 9, Adapters: AdapterLoad{MaxLoRA: 2}},
				{At: now, Waiting: 9, Adapters: AdapterLoad{Running: []string{"sql"}, MaxLoRA: 2}},
				{At: now, Waiting: 9, Adapters: AdapterLoad{MaxLoRA: 2}},
			},
			sat:     Saturation{QueueDepth: 5},
			adapter: "sql", want: []int{0, 1, 2}, outcome: LoRABlind,
		},
	} {
		for _, policy := range Policies() {
			t.Run(tc.name+"/"+policy, func(t *testing.T) {
				set := NewSet(eps, Options{Adapters: adapters, Saturation: tc.sat, Now: func() time.Time { return now }})
				for _, s := range tc.sent {
					sender := newLeg(set, new(RoundRobin), RoleDecode)
					lease, ok := sender.Pick(Request{Subset: []string{eps[s.ep].Address}, Adapter: s.adapter})
					require.True(t, ok)
					lease.End(Succeeded)
				}
				for i, l := range tc.loads {
					if l != nil {
						set.Observe(eps[i].Address, *l)
					}
				}
				l, err := NewLeg(set, &configv1.Picker{Policy: policy}, RolePrefill)
				require.NoError(t, err)
				for range 6 { // turns and ties go round: every pick keeps to want
					// Peeks lease nothing, so what one sends does not change
					// the next one's tiers.
					req := Request{Adapter: tc.adapter}
					v, i, _, o, ok := l.pick(&req, false)
					require.True(t, ok)
					require.Contains(t, endpointsAt(eps, tc.want), v.endpoints[i])
					require.Equal(t, tc.outcome, o)
				}
				lease, ok := l.Pick(Request{Adapter: tc.adapter})
				require.True(t, ok)
				require.Equal(t, tc.outcome, lease.LoRA())
				lease.End(Released)
			})
		}
	}
}

func endpointsAt(eps []endpoint.Endpoint, is []int) []endpoint.Endpoint {
	var out []endpoint.Endpoint
	for _, i := range is {
		out = append(out, eps[i])
	}
	return out
}

func TestLoRAKeepsSubsetAndGroup(t *testing.T) {
	eps := []endpoint.Endpoint{
		{Address: "10.0.0.1:8000", Group: "g1"}, {Address: "10.0.0.2:8000", Group: "g2"}, {Address: "10.0.0.3:8000", Group: "g2"},
	}
	now := time.Now()
	set := NewSet(eps, Options{Adapters: []string{"sql"}, Now: func() time.Time { return now }})
	set.Observe(eps[0].Address, Load{At: now, Adapters: AdapterLoad{Running: []string{"sql"}, MaxLoRA: 1}})
	set.Observe(eps[1].Address, Load{At: now, Adapters: AdapterLoad{Running: []string{"x"}, MaxLoRA: 1}})
	l := newLeg(set, new(RoundRobin), RoleDecode)
	// The adapter is loaded only outside the group: the group wins.
	lease, ok := l.Pick(Request{Group: "g2", Adapter: "sql"})
	require.True(t, ok)
	require.Equal(t, eps[2], lease.Endpoint(), "the one of g2 with a free slot")
	require.Equal(t, LoRAFreeSlot, lease.LoRA())
	lease.End(Released)
	// Outside the subset hint: never.
	lease, ok = l.Pick(Request{Subset: []string{eps[1].Address}, Adapter: "sql"})
	require.True(t, ok)
	require.Equal(t, eps[1], lease.Endpoint())
	require.Equal(t, LoRABlind, lease.LoRA())
	lease.End(Released)
}

func TestLoRAMemorySurvivesInherit(t *testing.T) {
	eps := endpoints(2)
	set := NewSet(eps, Options{Adapters: []string{"sql", "chat"}})
	l := newLeg(set, new(RoundRobin), RoleDecode)
	lease, _ := l.Pick(Request{Subset: []string{eps[1].Address}, Adapter: "chat"})
	lease.End(Succeeded)
	next := NewSet(eps, Options{Adapters: []string{"sql", "chat"}, Inherit: set})
	nl := newLeg(next, new(RoundRobin), RoleDecode)
	lease, _ = nl.Pick(Request{Adapter: "chat"})
	require.Equal(t, eps[1], lease.Endpoint())
	require.Equal(t, LoRALoaded, lease.LoRA())
	lease.End(Released)
	// Other adapters: what was sent under the old numbering is forgotten.
	other := NewSet(eps, Options{Adapters: []string{"chat"}, Inherit: next})
	ol := newLeg(other, new(RoundRobin), RoleDecode)
	lease, _ = ol.Pick(Request{Adapter: "chat"})
	require.Equal(t, LoRAFreeSlot, lease.LoRA())
	lease.End(Released)
}

func TestLoRAPickDoesNotAllocate(t *testing.T) {
	eps := endpoints(64)
	adapters := []string{"a0", "a1", "a2", "a3", "a4", "a5", "a6", "a7"}
	for _, policy := range Policies() {
		t.Run(policy, func(t *testing.T) {
			set := NewSet(eps, Options{Adapters: adapters, Saturation: Saturation{QueueDepth: 5}})
			for i, ep := range eps {
				set.Observe(ep.Address, Load{Running: i % 4, At: time.Now(), Adapters: AdapterLoad{Running: adapters[i%8 : i%8+1], MaxLoRA: 2}})
			}
			l, err := NewLeg(set, &configv1.Picker{Policy: policy}, RoleDecode)
			require.NoError(t, err)
			i := 0
			require.Zero(t, testing.AllocsPerRun(200, func() {
				lease, _ := l.Pick(Request{Adapter: adapters[i%8]})
				lease.End(Succeeded)
				i++
			}))
		})
	}
}

func BenchmarkLoRA(b *testing.B) {
	eps := endpoints(64)
	adapters := []string{"a0", "a1", "a2", "a3", "a4", "a5", "a6", "a7"}
	for _, policy := range Policies() {
		b.Run(policy, func(b *testing.B) {
			set := NewSet(eps, Options{Adapters: adapters, Saturation: Saturation{QueueDepth: 5, KVUsage: 0.8}})
			for i, ep := range eps {
				set.Observe(ep.Address, Load{Waiting: i % 3, Running: i % 7, KVUsage: 0.5, At: time.Now(),
					Adapters: AdapterLoad{Running: adapters[i%8 : i%8+1], MaxLoRA: 2}})
			}
			l, err := NewLeg(set, &configv1.Picker{Policy: policy}, RolePrefill)
			require.NoError(b, err)
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				lease, _ := l.Pick(Request{Adapter: adapters[i%8]})
				lease.End(Succeeded)
				i++
			}
		})
	}
}
