package main

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/replay"
)

// TestRigOf: --rig cachebound is the rig as defined, changed by the flags
// that apply to it (--decode-kv-blocks its decode engines' KV); --quick
// is its middle point alone on a shorter window; a flag the rig sets
// itself, an unknown rig, a load it has no point at, replicas of no
// policy --policies runs or decode engines without KV fails, naming what
// to do.
func TestRigOf(t *testing.T) {
	def := replay.DefaultCacheBound(traceDir)
	base := replay.Plan{Requests: 300, Repeats: 3}
	tests := []struct {
		name     string
		rig      string
		set      []string
		policies string
		loads    string
		replicas string
		quick    bool
		decodeKV int
		want     func(*replay.CacheBound)
		err      string
	}{
		{name: "as defined", rig: replay.CacheBoundRig, want: func(*replay.CacheBound) {}},
		{name: "one policy, quick", rig: replay.CacheBoundRig, set: []string{"policies"}, policies: "pdx-default", quick: true,
			want: func(c *replay.CacheBound) {
				c.Policies = []string{"pdx-default"}
				c.Points = def.Points[1:2]
				c.Requests, c.ReplicaCounts, c.Repeats = rigQuickRequests, nil, 1
			}},
		{name: "its points by load, window, repeats and replicas", rig: replay.CacheBoundRig,
			set: []string{"loads", "requests", "repeats", "replicas"}, loads: "0.85,0.55", replicas: "1,2",
			want: func(c *replay.CacheBound) {
				c.Points = []replay.CacheBoundPoint{def.Points[2], def.Points[0]}
				c.Requests, c.Repeats, c.ReplicaCounts = 300, 3, []int{1, 2}
			}},
		{name: "replicas of a policy it runs", rig: replay.CacheBoundRig, set: []string{"policies", "replicas"}, policies: "precise,oracle",
			replicas: "1,3", want: func(c *replay.CacheBound) { c.Policies = []string{"precise", "oracle"} }},
		{name: "replicas of none of its policies", rig: replay.CacheBoundRig, set: []string{"policies", "replicas"}, policies: "round-robin,oracle",
			replicas: "3", err: "--replicas: the cachebound rig runs replicas of pdx-default, pdx-default-peers, precise, precise-peers, pdx-default-peers-at-once, precise-peers-at-once, precise-peers-jitter-16, and --policies has none of them"},
		{name: "decode engines with less KV", rig: replay.CacheBoundRig, set: []string{"decode-kv-blocks"}, decodeKV: 180,
			want: func(c *replay.CacheBound) { c.DecodeKVBlocks = 180 }},
		{name: "decode engines without KV", rig: replay.CacheBoundRig, set: []string{"decode-kv-blocks"}, err: "--decode-kv-blocks: 0 is not a number of blocks"},
		{name: "a load it has no point at", rig: replay.CacheBoundRig, set: []string{"loads"}, loads: "0.6", err: "no point at 0.6 (its points: 0.55, 0.7, 0.85)"},
		{name: "a flag the rig sets", rig: replay.CacheBoundRig, set: []string{"token-scale"}, err: "--token-scale: the cachebound rig sets it itself"},
		{name: "the traces", rig: replay.CacheBoundRig, set: []string{"traces"}, err: "--traces"},
		{name: "unknown rig", rig: "tiny", err: `unknown rig "tiny" (known: cachebound)`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			set := map[string]bool{}
			for _, f := range tt.set {
				set[f] = true
			}
			got, err := rigOf(tt.rig, set, tt.policies, tt.loads, tt.replicas, tt.quick, tt.decodeKV, base)
			if tt.err != "" {
				require.ErrorContains(t, err, tt.err)
				return
			}
			require.NoError(t, err)
			want := replay.DefaultCacheBound(traceDir)
			tt.want(&want)
			require.Equal(t, want, got)
		})
	}
}
