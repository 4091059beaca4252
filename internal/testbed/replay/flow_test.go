package replay

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The tenants' arrivals: Poisson at each rate within each one's span, in
// order of arrival, every request a prompt of its own carrying its
// tenant's headers.
func TestFlowSchedule(t *testing.T) {
	p := FlowPlan{Rig: Rig{Prefill: 1, Decode: 1, Scale: Scale{TokenScale: 16}}}
	tenants := []tenant{
		{name: "chat", objective: "chat", rate: 200, to: 10 * time.Second},
		{name: "batch", objective: "batch", flow: "b", rate: 400, from: 5 * time.Second, to: 10 * time.Second},
	}
	reqs, at := p.schedule(tenants, 0)
	n := map[int]int{}
	prompts := map[string]bool{}
	for i, r := range reqs {
		n[r.Index]++
		prompts[r.Prompt] = true
		if i > 0 {
			require.GreaterOrEqual(t, at[i], at[i-1], "in order of arrival")
		}
		require.Equal(t, tenants[r.Index].objective, r.Objective)
		require.Equal(t, tenants[r.Index].flow, r.Flow)
		require.GreaterOrEqual(t, at[i], tenants[r.Index].from)
		require.Less(t, at[i], tenants[r.Index].to)
	}
	require.InDelta(t, 2000, n[0], 200, "200/s for 10 s")
	require.InDelta(t, 2000, n[1], 200, "400/s for 5 s")
	require.Len(t, prompts, len(reqs), "no prompt repeats")

	burst, at := p.schedule([]tenant{{name: "burst"}}, 7)
	require.Len(t, burst, 7)
	require.Equal(t, make([]time.Duration, 7), at, "all at once")
}

// The summary states each goal from the runs it needs.
func TestFlowSummary(t *testing.T) {
	rep := &FlowReport{Prefill: 1, Decode: 1, Capacity: 100, Runs: []FlowRun{
		{Experiment: "priority", Scenario: "critical alone", Tenants: []FlowTenant{{Name: "chat", TTFT: Percentiles{P90: 40}}}},
		{Experiment: "priority", Scenario: "one band (flow control without objectives)", Tenants: []FlowTenant{
			{Name: "chat", TTFT: Percentiles{P90: 200}}, {Name: "batch"}}},
		{Experiment: "priority", Scenario: scenarioBands, Tenants: []FlowTenant{
			{Name: "chat", TTFT: Percentiles{P90: 48}}, {Name: "batch", Shed: 3, TPOT: Percentiles{P90: 1.5}}}},
		{Experiment: "priority", Scenario: scenarioLocal, Tenants: []FlowTenant{
			{Name: "chat", TTFT: Percentiles{P90: 30}}, {Name: "batch", TPOT: Percentiles{P90: 2.25}}}},
		{Experiment: "fairness", Scenario: "round robin across fairness ids", Tenants: []FlowTenant{
			{Name: "heavy", Share: 0.52}, {Name: "light", Share: 0.48}}},
	}}
	s := rep.Summary()
	require.Contains(t, s, "one band 5.00, bands 1.20, bands with the critical tenant's prompts on its decode engine while the prefill engine is saturated 0.75.")
	require.Contains(t, s, "the batch tenant's TPOT p90 2.25 ms, against 1.50 ms when the critical tenant waits")
	require.Contains(t, s, "(goal 0): 0; the batch tenant's 429s: 3")
	require.Contains(t, s, "round robin across fairness ids: the heavy tenant's share 52.0%, the light one's 48.0%")
	require.NotContains(t, s, "one flow (no fairness ids):", "a run not made is not reported")
	require.Equal(t, 9, strings.Count(s, "| priority |")+strings.Count(s, "| fairness |"), "a row a tenant")
}
