package loopback_test

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/loopback"
)

var _ loopback.TB = testing.TB(nil)

// requireFree checks that addr is a loopback address one can listen on.
func requireFree(t *testing.T, addr string) {
	t.Helper()
	host, _, err := net.SplitHostPort(addr)
	require.NoError(t, err)
	require.Equal(t, "127.0.0.1", host)
	ln, err := net.Listen("tcp", addr)
	require.NoError(t, err, "the address is free")
	require.NoError(t, ln.Close())
}

// requireDistinctFree checks that addrs are n distinct free loopback
// addresses.
func requireDistinctFree(t *testing.T, addrs []string, n int) {
	t.Helper()
	require.Len(t, addrs, n)
	seen := map[string]bool{}
	for _, a := range addrs {
		require.False(t, seen[a], "the addresses differ: %v", addrs)
		seen[a] = true
		requireFree(t, a)
	}
}

func TestFreeAddr(t *testing.T) {
	addr := loopback.FreeAddr(t)
	requireFree(t, addr)
	_, err := net.Dial("tcp", addr)
	require.True(t, errors.Is(err, syscall.ECONNREFUSED), "nothing listens: %v", err)
}

func TestFreePort(t *testing.T) {
	port := loopback.FreePort(t)
	require.Positive(t, port)
	requireFree(t, (&net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: port}).String())
}

func TestFreeAddrs(t *testing.T) {
	addrs, err := loopback.FreeAddrs(5)
	require.NoError(t, err)
	requireDistinctFree(t, addrs, 5)
	none, err := loopback.FreeAddrs(0)
	require.NoError(t, err)
	require.Empty(t, none)
}

// TestListenLaterAddrs: distinct free addresses whose ports no dialer is
// given as its own (below the kernel's ephemeral range).
func TestListenLaterAddrs(t *testing.T) {
	low := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		low, err = strconv.Atoi(strings.Fields(string(b))[0])
		require.NoError(t, err)
	}
	addrs, err := loopback.ListenLaterAddrs(5)
	require.NoError(t, err)
	requireDistinctFree(t, addrs, 5)
	for _, a := range addrs {
		port := netip.MustParseAddrPort(a).Port()
		require.Less(t, int(port), low, a)
		require.GreaterOrEqual(t, int(port), 10000, a)
	}
}
