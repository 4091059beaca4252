package picker

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/endpoint"
)

// startPrefill leases ep on a prefill leg of set for a prompt of tokens
// uncached tokens, as a prefill sent there and still running.
func startPrefill(t testing.TB, set *Set, ep endpoint.Endpoint, tokens int) *Lease {
	t.Helper()
	l := newLeg(set, new(RoundRobin), RolePrefill) // leaves the Set's turn alone
	lease, ok := l.Pick(Request{Subset: []string{ep.Address}, Tokens: tokens})
	require.True(t, ok)
	require.Equal(t, ep, lease.Endpoint())
	return &lease
}

// inFlightSet is a prefill Set of 64 endpoints with the fluid model at
// work: each has a learned rate and 1–4 of pdx's prefills in flight, and
// fresh engine metrics; learn, when set, teaches each endpoint's service
// model first; sent, when set, sends each endpoint a prompt of
// benchPrompts (all share the first block, so that every pick matches
// every endpoint), and kv has every engine say it holds 1,000 blocks
// first (so that every pick reads every endpoint's LRU).
func inFlightSet(b *testing.B, learn, sent, kv bool) *Set {
	eps := endpoints(64)
	clk := newFakeClock()
	set := NewSet(eps, Options{Now: clk.Now, Saturation: Saturation{QueueDepth: 5, KVUsage: 0.8}, BlockTokens: 64})
	if learn {
		for i := range eps {
			m := set.view.Load().states[i].service
			for k := range 32 {
				m.learn(0.01+float64(k*100+i)/15000, queue{ahead: k * 50, waiting: k * 25}, k*100+i)
			}
		}
	}
	var taught []*Lease
	for _, ep := range eps {
		taught = append(taught, startPrefill(b, set, ep, 15_000))
	}
	clk.Advance(time.Second)
	for _, l := range taught {
		l.End(Succeeded)
	}
	for i, ep := range eps {
		for k := range 1 + i%4 {
			startPrefill(b, set, ep, 1000+100*((i+k)%13))
		}
		ld := Load{Waiting: i % 3, Running: i % 7, KVUsage: 0.5, At: clk.Now()}
		if kv {
			ld.KVTokens = 1000 * 64
		}
		set.Observe(ep.Address, ld)
	}
	if sent {
		prompts := benchPrompts()
		for i, ep := range eps {
			hold(b, set, ep, prompts[i], 0).End(Released)
		}
	}
	clk.Advance(300 * time.Millisecond)
	return set
}

// benchInFlight is a pick of p on set, prompts going round.
func benchInFlight(b *testing.B, set *Set, p Policy) {
	prompts := benchPrompts()
	l := newLeg(set, p, RolePrefill)
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		l.peek(Request{Blocks: prompts[i%len(prompts)], BlockTokens: 64, Tokens: 2048})
		i++
	}
}

// BenchmarkLeastWorkInFlight is BenchmarkPolicies' least_work pick with
// the fluid model at work (inFlightSet).
func BenchmarkLeastWorkInFlight(b *testing.B) {
	benchInFlight(b, inFlightSet(b, false, false, false), LeastWork{})
}

// BenchmarkForecastInFlight is the same pick with the forecast policy,
// each endpoint's service model learned.
func BenchmarkForecastInFlight(b *testing.B) {
	benchInFlight(b, inFlightSet(b, true, false, false), Forecast{})
}

// BenchmarkForecastInFlightSent is the same pick where every endpoint was
// sent a prompt sharing the picked one's first block, with the engines'
// KV unknown and known (the prefix match reads all 64 endpoints' LRUs).
func BenchmarkForecastInFlightSent(b *testing.B) {
	for _, kv := range []bool{false, true} {
		b.Run(map[bool]string{false: "KV unknown", true: "KV known"}[kv], func(b *testing.B) {
			benchInFlight(b, inFlightSet(b, true, true, kv), Forecast{})
		})
	}
}
