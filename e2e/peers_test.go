package e2e

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/placement"
	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// Three pdx replicas behind the real Envoy, exchanging their prefills
// (config peers, each listing all three): while a prefill runs, every
// replica counts it on its engine, the one that sent it as its own and
// the two others as a peer's; once it is over, none does, and every
// replica counts its prompt as sent to that engine (its cache).
func TestReplicasExchangePrefills(t *testing.T) {
	st := startStack(t, stack.Options{PdxReplicas: 3, Peers: true, Prefill: 2, Decode: 1,
		Engine: enginesim.Config{PrefillLatency: 500 * time.Millisecond}})
	_, hc := newClient(t, st)
	for _, r := range st.Replicas {
		require.Equal(t, placement.DefaultPickJitter, r.Table().Pools()[0].PickJitter, "peers' default wait before a prefill pick")
	}
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
	// A prompt of several prefix blocks (placement's 64 tokens of 4 bytes).
	prompt := strings.Repeat("one prefill, three replicas. ", 40)
	status := make(chan int, 1)
	go func() {
		resp, err := hc.Post(st.URL()+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"demo-model","prompt":"`+prompt+`","max_tokens":2}`))
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

	// Placement hashes a completion's prompt as its JSON string.
	blocks := picker.Blocks(nil, []byte(`"`+prompt+`"`), placement.DefaultPrefixBlockTokens)
	require.Greater(t, len(blocks), 2)
	var holders []endpoint.Endpoint
	for _, r := range st.Replicas {
		set := r.Table().Pools()[0].Prefill.Set
		for _, e := range set.Endpoints() {
			if n := set.Sent(e, blocks); n > 0 {
				require.Equal(t, len(blocks), n, "the whole prompt")
				holders = append(holders, e)
			}
		}
	}
	require.Len(t, holders, 3, "every replica counts the prompt as sent, to one engine")
	require.Equal(t, holders[0], holders[1])
	require.Equal(t, holders[0], holders[2])
}
