package processor

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestTransitions holds the lifecycle table to its shape: every phase is
// named and reachable from the first, only phases where the client has its
// answer (or Envoy has the decode) end it, and enter refuses what the
// table does not list.
func TestTransitions(t *testing.T) {
	reached := map[state]bool{stateRequestHeaders: true}
	for todo := []state{stateRequestHeaders}; len(todo) > 0; todo = todo[1:] {
		for _, next := range transitions[todo[0]] {
			if !reached[next] {
				reached[next] = true
				todo = append(todo, next)
			}
		}
	}
	for s := range state(len(transitions)) {
		require.NotEqual(t, "", stateNames[s], "phase %d has a name", s)
		require.True(t, reached[s], "%s is reachable", s)
		final := len(transitions[s]) == 0
		require.Equal(t, s.over() || s == stateRouted || s == statePassThrough, final, "%s ends the lifecycle", s)
		if !s.over() && s != stateRouted && s != statePassThrough {
			require.Contains(t, transitions[s], stateFailed, "%s may fail", s)
		}
	}
	require.Len(t, stateNames, len(transitions))

	r := &request{state: stateRouted}
	require.Panics(t, func() { r.enter(stateRequestBody) }, "routed requests take no body")
	r = &request{state: statePrefilling}
	r.enter(stateHoldingResponse)
	require.Equal(t, stateHoldingResponse, r.state)
	require.True(t, r.state.prefilling())
	require.False(t, slices.Contains(transitions[stateHoldingResponse], statePrefilling), "held headers stay held until the prefill's outcome")
}
