package dnsserver_test

import (
	"errors"
	"net"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/dnsserver"
)

// TestServerAnswersGoResolver: Go's DNS client reads what the server holds,
// and tells a missing name from a failing server.
func TestServerAnswersGoResolver(t *testing.T) {
	s, err := dnsserver.Start()
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, s.Close()) })
	r := s.Resolver()
	lookup := func(name string) ([]netip.Addr, error) { return r.LookupNetIP(t.Context(), "ip", name) }

	s.Set("engines.pdx.test", netip.MustParseAddr("127.0.0.2"), netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("fd00::1"))
	addrs, err := lookup("engines.pdx.test")
	require.NoError(t, err)
	require.ElementsMatch(t, []netip.Addr{netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("127.0.0.2"), netip.MustParseAddr("fd00::1")}, addrs)
	addrs, err = lookup("ENGINES.pdx.test.")
	require.NoError(t, err, "names are case-insensitive, fully qualified or not")
	require.Len(t, addrs, 3)

	_, err = lookup("gone.pdx.test")
	var dnsErr *net.DNSError
	require.True(t, errors.As(err, &dnsErr), "%v", err)
	require.True(t, dnsErr.IsNotFound, "NXDOMAIN: %v", err)

	s.Fail("engines.pdx.test")
	_, err = lookup("engines.pdx.test")
	require.True(t, errors.As(err, &dnsErr), "%v", err)
	require.False(t, dnsErr.IsNotFound, "SERVFAIL is a failure, not an absence: %v", err)

	s.Set("engines.pdx.test")
	_, err = lookup("engines.pdx.test")
	require.True(t, errors.As(err, &dnsErr) && dnsErr.IsNotFound, "%v", err)
	require.Positive(t, s.Queries())
}
