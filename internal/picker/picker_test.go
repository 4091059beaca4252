package picker

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/endpoint"
)

func TestNew(t *testing.T) {
	for _, tc := range []struct {
		policy  string
		want    Picker
		wantErr string
	}{
		{policy: "", want: &RoundRobin{}},
		{policy: "round_robin", want: &RoundRobin{}},
		{policy: "random", wantErr: `unknown picking policy "random" (known: round_robin)`},
	} {
		t.Run(tc.policy, func(t *testing.T) {
			set := NewSet([]endpoint.Endpoint{epA}, Options{})
			p, err := New(tc.policy, set)
			if tc.wantErr != "" {
				require.EqualError(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.IsType(t, tc.want, p)
			ep, ok := p.Pick(Request{})
			require.True(t, ok)
			require.Equal(t, epA, ep, "the policy picks over the Set it was given")
		})
	}
	require.Equal(t, []string{"round_robin"}, Policies())
}
