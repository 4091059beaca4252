package endpoint

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
)

// Address is where an engine is, as a config names it: a literal IP or a
// host name, and a port. A name stands for every address it resolves to
// (package resolver), each an engine on Port.
type Address struct {
	// IP is the literal IP address; invalid when Name is set.
	IP netip.Addr
	// Name is the host name, in lower case; "" when IP is set.
	Name string
	Port uint16
}

// IsName reports whether a names a host rather than an IP.
func (a Address) IsName() bool { return a.Name != "" }

// Host is a's IP, or its name.
func (a Address) Host() string {
	if a.IsName() {
		return a.Name
	}
	return a.IP.String()
}

// String is a as "host:port" (IPv6 in brackets), the form Endpoint.Address
// takes once resolved.
func (a Address) String() string {
	return net.JoinHostPort(a.Host(), strconv.Itoa(int(a.Port)))
}

// At is the "ip:port" of the engine at ip, on a's port.
func (a Address) At(ip netip.Addr) string {
	return netip.AddrPortFrom(ip, a.Port).String()
}

// ParseAddress parses an engine's HTTP address: "host:port" or a URL
// "http://host:port" (what vLLM's router and SGLang's gateway take), with
// host a literal IP (IPv6 in brackets) or a host name. The URL may end in
// "/" but have no other path: pdx names the API paths itself. Errors say
// what to write instead.
func ParseAddress(s string) (Address, error) {
	if scheme, rest, ok := strings.Cut(s, "://"); ok {
		return parseURL(s, scheme, rest)
	}
	return ParseHostPort(s)
}

// ParseHostPort parses "host:port", host a literal IP (IPv6 in brackets)
// or a host name.
func ParseHostPort(s string) (Address, error) {
	host, port, err := net.SplitHostPort(s)
	switch {
	case err != nil && strings.Count(s, ":") > 1 && !strings.HasPrefix(s, "["):
		return Address{}, fmt.Errorf("%q is not host:port: write an IPv6 address in brackets, e.g. [fd00::1]:8000", s)
	case err != nil:
		return Address{}, fmt.Errorf("%q is not host:port (e.g. 10.0.0.5:8000 or vllm-decode-0:8000)", s)
	}
	return parseParts(s, host, port)
}

func parseURL(s, scheme, rest string) (Address, error) {
	switch strings.ToLower(scheme) {
	case "http":
	case "https":
		return Address{}, fmt.Errorf("%q: https is not supported: pdx and Envoy's decode cluster speak plain HTTP to engines; write http://%s", s, rest)
	default:
		return Address{}, fmt.Errorf("%q: scheme %q is not supported: write host:port or http://host:port", s, scheme)
	}
	u, err := url.Parse(s)
	if err != nil {
		return Address{}, fmt.Errorf("%q is not a URL: %w", s, errors.Unwrap(err))
	}
	base := "http://" + u.Host
	switch {
	case u.User != nil:
		return Address{}, fmt.Errorf("%q has user information, which pdx does not send: write %s", s, base)
	case u.Path != "" && u.Path != "/":
		return Address{}, fmt.Errorf("%q has a path %q: write the engine's base address, %s; pdx adds the API paths itself", s, u.Path, base)
	case u.RawQuery != "" || u.ForceQuery || u.Fragment != "":
		return Address{}, fmt.Errorf("%q has a query or fragment: write %s", s, base)
	case u.Port() == "":
		return Address{}, fmt.Errorf("%q has no port: write the engine's port, e.g. http://%s:8000", s, u.Hostname())
	}
	return parseParts(s, u.Hostname(), u.Port())
}

func parseParts(s, host, port string) (Address, error) {
	n, err := strconv.ParseUint(port, 10, 16)
	if err != nil || n == 0 {
		return Address{}, fmt.Errorf("%q has port %q, want 1-65535", s, port)
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		if ip.IsUnspecified() {
			return Address{}, fmt.Errorf("%q has an unspecified IP, which cannot be connected to", s)
		}
		return Address{IP: ip.Unmap(), Port: uint16(n)}, nil
	}
	if strings.Contains(host, ":") {
		return Address{}, fmt.Errorf("%q is not host:port: write an IPv6 address in brackets, e.g. [fd00::1]:8000", s)
	}
	if !hostName(host) {
		return Address{}, fmt.Errorf("%q: %q is neither an IP address nor a host name", s, host)
	}
	return Address{Name: strings.ToLower(strings.TrimSuffix(host, ".")), Port: uint16(n)}, nil
}

// hostName reports whether h can be looked up: a DNS name whose labels may
// also hold '_', as Go's resolver and Docker's service names allow.
func hostName(h string) bool {
	h = strings.TrimSuffix(h, ".")
	if h == "" || len(h) > 253 {
		return false
	}
	// An all-numeric last label is a mistyped IP (10.0.0.256), not a name.
	if strings.Trim(h[strings.LastIndexByte(h, '.')+1:], "0123456789") == "" {
		return false
	}
	for label := range strings.SplitSeq(h, ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for i := 0; i < len(label); i++ {
			c := label[i]
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return false
			}
		}
	}
	return true
}
