package endpoint

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestEndpoint(t *testing.T) {
	tests := []struct {
		ep        Endpoint
		host      string
		bootstrap int
	}{
		{Endpoint{Address: "10.0.0.1:8000"}, "10.0.0.1", DefaultBootstrapPort},
		{Endpoint{Address: "[fd00::1]:8000", BootstrapPort: 9100}, "fd00::1", 9100},
		{Endpoint{Address: "no-port"}, "", DefaultBootstrapPort},
	}
	for _, tc := range tests {
		require.Equal(t, tc.host, tc.ep.Host(), tc.ep.Address)
		require.Equal(t, tc.bootstrap, tc.ep.Bootstrap(), tc.ep.Address)
	}
}

func TestParseHostSet(t *testing.T) {
	_, err := ParseHostSet([]string{"10.0.0.0/33"})
	require.ErrorContains(t, err, "not a CIDR prefix")
	_, err = ParseHostSet([]string{"bad host!"})
	require.ErrorContains(t, err, "not an IP address, a CIDR prefix or a DNS name")
	s, err := ParseHostSet([]string{"::ffff:10.1.2.3", "10.2.0.0/16"})
	require.NoError(t, err)
	require.True(t, s.Contains("10.1.2.3"), "IPv4-mapped addresses are their IPv4 address")
	require.True(t, s.Contains("10.2.255.1"))
	require.False(t, s.Contains("10.3.0.1"))
	require.False(t, HostSet{}.Contains("10.1.2.3"))
}

func TestRank(t *testing.T) {
	for _, tc := range []struct {
		name string
		rank Rank
		want int
		ok   bool
	}{
		{"zero value is none", Rank{}, -1, false},
		{"rank 0", RankOf(0), 0, true},
		{"rank 7", RankOf(7), 7, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := tc.rank.Get()
			require.Equal(t, tc.ok, ok)
			require.Equal(t, tc.want, got)
		})
	}
}
