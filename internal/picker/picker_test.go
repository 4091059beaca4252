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
		{policy: "", want: &LeastWork{}},
		{policy: "round_robin", want: &RoundRobin{}},
		{policy: "least_request", want: &LeastRequest{}},
		{policy: "prefix_affinity", want: &PrefixAffinity{}},
		{policy: "load_aware", want: &LoadAware{}},
		{policy: "least_work", want: &LeastWork{}},
		{policy: "random", wantErr: `unknown picking policy "random" (known: least_request, least_work, load_aware, prefix_affinity, round_robin)`},
	} {
		t.Run(tc.policy, func(t *testing.T) {
			set := NewSet([]endpoint.Endpoint{epA}, Options{})
			p, err := New(tc.policy, set, Params{})
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
	require.Equal(t, []string{"least_request", "least_work", "load_aware", "prefix_affinity", "round_robin"}, Policies())
	p, err := New("", NewSet(nil, Options{}), Params{Role: RoleDecode})
	require.NoError(t, err)
	require.IsType(t, &LoadAware{}, p, "the decode leg's default")
}
