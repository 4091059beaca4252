package picker

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/reflect/protoreflect"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/endpoint"
)

func TestNewLeg(t *testing.T) {
	for _, tc := range []struct {
		policy  string
		want    Policy
		wantErr string
	}{
		{policy: "", want: Forecast{}},
		{policy: "round_robin", want: &RoundRobin{}},
		{policy: "least_request", want: LeastRequest{}},
		{policy: "prefix_affinity", want: &PrefixAffinity{}},
		{policy: "load_aware", want: &LoadAware{}},
		{policy: "least_work", want: LeastWork{}},
		{policy: "random", wantErr: `unknown picking policy "random" (known: forecast, least_request, least_work, load_aware, prefix_affinity, round_robin)`},
	} {
		t.Run(tc.policy, func(t *testing.T) {
			set := NewSet([]endpoint.Endpoint{epA}, Options{})
			l, err := NewLeg(set, &configv1.Picker{Policy: tc.policy}, RolePrefill)
			if tc.wantErr != "" {
				require.EqualError(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.IsType(t, tc.want, l.policy)
			lease, ok := l.Pick(Request{})
			require.True(t, ok)
			require.Equal(t, epA, lease.Endpoint(), "the policy picks over the Set it was given")
		})
	}
	require.Equal(t, []string{"forecast", "least_request", "least_work", "load_aware", "prefix_affinity", "round_robin"}, Policies())
	l, err := NewLeg(NewSet(nil, Options{}), nil, RoleDecode)
	require.NoError(t, err)
	require.IsType(t, Forecast{}, l.policy, "the decode leg's default")
}

// NewLeg applies the policy's defaults to what the config leaves unset,
// and leaves the config as it is.
func TestNewLegDefaults(t *testing.T) {
	set := NewSet([]endpoint.Endpoint{epA}, Options{})
	for _, tc := range []struct {
		name   string
		picker *configv1.Picker
		role   Role
		want   Policy
	}{
		{name: "load_aware, prefill", picker: &configv1.Picker{Policy: LoadAwarePolicy}, role: RolePrefill,
			want: &LoadAware{w: DefaultWeights(RolePrefill)}},
		{name: "load_aware, decode", picker: &configv1.Picker{Policy: LoadAwarePolicy}, role: RoleDecode,
			want: &LoadAware{w: DefaultWeights(RoleDecode)}},
		{name: "load_aware, weights given", picker: &configv1.Picker{Policy: LoadAwarePolicy, Weights: &configv1.Weights{Queue: 1}},
			role: RoleDecode, want: &LoadAware{w: Weights{Queue: 1}}},
		{name: "prefix_affinity", picker: &configv1.Picker{Policy: PrefixAffinityPolicy}, want: newPrefixAffinity(DefaultLoadFactor)},
		{name: "prefix_affinity, load factor given", picker: &configv1.Picker{Policy: PrefixAffinityPolicy, LoadFactor: 2},
			want: newPrefixAffinity(2)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			given := tc.picker.String()
			l, err := NewLeg(set, tc.picker, tc.role)
			require.NoError(t, err)
			require.Equal(t, tc.want, l.policy)
			require.Equal(t, given, tc.picker.String(), "the config is not changed")
		})
	}
}

// Every spec has a distinct name and claims fields the config's Picker
// has, so that config can refuse them on other policies.
func TestSpecs(t *testing.T) {
	fields := (&configv1.Picker{}).ProtoReflect().Descriptor().Fields()
	seen := map[string]bool{}
	for _, s := range specs() {
		require.NotEmpty(t, s.Name)
		require.False(t, seen[s.Name], "%s registered twice", s.Name)
		seen[s.Name] = true
		require.NotNil(t, s.New, s.Name)
		for _, f := range s.Fields {
			require.NotNil(t, fields.ByName(protoreflect.Name(f)), "%s claims %q, which Picker does not have", s.Name, f)
			require.NotEqual(t, "policy", f, "%s claims the policy field, which every policy reads", s.Name)
		}
		spec, err := Lookup(s.Name)
		require.NoError(t, err)
		require.Equal(t, s.Name, spec.Name)
	}
	require.Equal(t, []string{LoadAwarePolicy}, Claimants("weights"))
	require.Equal(t, []string{PrefixAffinityPolicy}, Claimants("load_factor"))
}

// TestSetAddresses: a set's distinct addresses in the order first listed
// (an endpoint listed twice, or one address under two bootstrap ports, is
// one engine to scrape), and the new ones once its endpoints change.
func TestSetAddresses(t *testing.T) {
	a, b, c := "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"
	s := NewSet([]endpoint.Endpoint{{Address: b}, {Address: a}, {Address: b}, {Address: a, BootstrapPort: 9000}}, Options{})
	require.Equal(t, []string{b, a}, s.Addresses())
	s.SetEndpoints([]endpoint.Endpoint{{Address: c}, {Address: b}})
	require.Equal(t, []string{c, b}, s.Addresses())
	require.Empty(t, NewSet(nil, Options{}).Addresses())
}
