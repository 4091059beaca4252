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
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
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

// ListenLaterAddrs returns n distinct loopback "ip:port"s free at the time
// of the call, whose ports lie below the kernel's range of ephemeral
// ports (net.ipv4.ip_local_port_range): for a listener that others dial
// before it listens (ZMQ dialers retry until it does). A port in that
// range can be given to such a dialer as its own source port, and a
// connection from a port to itself succeeds (TCP's simultaneous open):
// the dialer then holds the port the listener was to take.
func ListenLaterAddrs(n int) ([]string, error) {
	low := ephemeralLow()
	out := make([]string, 0, n)
	for tries := 0; len(out) < n; tries++ {
		if tries == 1000 {
			return nil, fmt.Errorf("finding %d free ports below %d: found %d", n, low, len(out))
		}
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(firstListenLater+rand.N(low-firstListenLater))))
		if err != nil {
			continue // taken
		}
		defer ln.Close() // all held until all are found, so they differ
		out = append(out, ln.Addr().String())
	}
	return out, nil
}

// firstListenLater is ListenLaterAddrs' lowest port: above the well-known
// and most registered services.
const firstListenLater = 10000

// ephemeralLow is the first port of the kernel's ephemeral range; Linux's
// default where it cannot be read or leaves too few ports above
// firstListenLater.
func ephemeralLow() int {
	const linuxDefault = 32768
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return linuxDefault
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return linuxDefault
	}
	low, err := strconv.Atoi(f[0])
	if err != nil || low <= firstListenLater+100 {
		return linuxDefault
	}
	return low
}
