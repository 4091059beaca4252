// Package loopback finds loopback addresses nothing listens on: for a
// server or child process a test starts to listen on, or for an engine a
// test wants unreachable (connection refused).
//
// A port found free can be taken by another process before it is used;
// the tests accept that small race, which an OS-chosen port makes rare.
//
// It imports nothing of pdx, so that any package's tests can use it, and
// not package testing either: loadtest's rig, built into pdx-bench, uses
// FreeAddrs.
package loopback

import (
	"fmt"
	"net"
	"net/netip"
)

// TB is the part of testing.TB that FreeAddr and FreePort use.
type TB interface {
	Helper()
	Fatalf(format string, args ...any)
}

// FreeAddr returns a loopback "ip:port" whose port was free a moment ago,
// and fails t if none is.
func FreeAddr(t TB) string {
	t.Helper()
	addrs, err := FreeAddrs(1)
	if err != nil {
		t.Fatalf("%v", err)
	}
	return addrs[0]
}

// FreePort returns the port of a FreeAddr.
func FreePort(t TB) int {
	t.Helper()
	return int(netip.MustParseAddrPort(FreeAddr(t)).Port())
}

// FreeAddrs returns n distinct loopback "ip:port"s whose ports were free at
// the time of the call.
func FreeAddrs(n int) ([]string, error) {
	out := make([]string, 0, n)
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("finding a free port: %w", err)
		}
		defer ln.Close() // all held until all are found, so they differ
		out = append(out, ln.Addr().String())
	}
	return out, nil
}
