package e2e

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// Three pdx replicas behind the real Envoy, exchanging their prefills
// (config peers, each listing all three): while a prefill runs, every
// replica counts it on its engine, the one that sent it as its own and
// the two others as a peer's; once it is over, none does.
func TestReplicasExchangePrefills(t *testing.T) {
	st := startStack(t, stack.Options{PdxReplicas: 3, Peers: true, Prefill: 2, Decode: 1,
		Engine: enginesim.Config{PrefillLatency: 500 * time.Millisecond}})
	_, hc := newClient(t, st)
	// counts are each replica's prefills in flight on the engines, and
	// the peers' among them.
	counts := func() (inFlight, peers []int) {
		for _, r := range st.Replicas {
			set := r.Table().Pools()[0].Prefill.Set
			n := 0
			for _, e := range set.Endpoints() {
				n += set.InFlight(e)
			}
			inFlight, peers = append(inFlight, n), append(peers, set.PeerLeases())
		}
		return inFlight, peers
	}
	status := make(chan int, 1)
	go func() {
		resp, err := hc.Post(st.URL()+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"demo-model","prompt":"one prefill, three replicas","max_tokens":2}`))
		if err != nil {
			status <- 0
			return
		}
		resp.Body.Close()
		status <- resp.StatusCode
	}()
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		inFlight, peers := counts()
		assert.Equal(c, []int{1, 1, 1}, inFlight, "every replica counts the prefill")
		assert.ElementsMatch(c, []int{0, 1, 1}, peers, "as its own on one replica, a peer's on the two others")
	}, 10*time.Second, 5*time.Millisecond)
	require.Equal(t, http.StatusOK, <-status)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		inFlight, peers := counts()
		assert.Equal(c, []int{0, 0, 0}, inFlight)
		assert.Equal(c, []int{0, 0, 0}, peers)
	}, 10*time.Second, 5*time.Millisecond)
}
