// Package endpoint is the vocabulary pdx's packages share about the engines
// they route to: an engine endpoint, and sets of hosts. It depends on no
// other package of pdx.
package endpoint

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
)

// Endpoint is an engine picked for one leg of a request.
type Endpoint struct {
	// Address is the engine's HTTP address, a literal "ip:port" in every
	// pool; "host:port" with a host name only as a config lists it, before
	// package resolver gives the pool an endpoint per address.
	Address string
	// BootstrapPort is a prefill engine's KV bootstrap port (SGLang, upstream
	// vLLM Mooncake); 0 means DefaultBootstrapPort.
	BootstrapPort int
	// KVAddress is the engine's KV "ip:port": P2P NCCL's ZMQ address, or
	// the NIXL side channel its prefill answers must name.
	KVAddress string
	// Group pairs engines: a decode endpoint's prefill is picked only among
	// the prefill endpoints of its group (Kubernetes discovery with a
	// group_label). Empty: unpaired. Connectors do not use it.
	Group string
	// DPSize is how many data-parallel ranks the engine serves behind its
	// one address (vLLM --data-parallel-size, SGLang --dp-size). pdx names
	// a rank per request only when it is over 1.
	DPSize int
	// KVEventsPort and KVEventsReplayPort are the ports of the engine's KV
	// event publisher and replay socket (rank 0's) when they are not the
	// config's kv_events ports; 0: those.
	KVEventsPort, KVEventsReplayPort int
}

// DefaultBootstrapPort is SGLang's and vLLM Mooncake's default bootstrap port.
const DefaultBootstrapPort = 8998

// Host is the IP part of Address.
func (e Endpoint) Host() string {
	host, _, _ := net.SplitHostPort(e.Address)
	return host
}

// Bootstrap returns the bootstrap port, defaulted.
func (e Endpoint) Bootstrap() int {
	if e.BootstrapPort == 0 {
		return DefaultBootstrapPort
	}
	return e.BootstrapPort
}

// Rank is a data-parallel rank of an engine, or none (the zero value): an
// engine without DP ranks, or a request the engine places itself.
type Rank struct {
	plus1 int32 // the rank + 1; 0: none
}

// RankOf returns rank n (n >= 0).
func RankOf(n int) Rank { return Rank{plus1: int32(n) + 1} }

// Get returns the rank, and false for none.
func (r Rank) Get() (int, bool) { return int(r.plus1) - 1, r.plus1 > 0 }

// HostSet is a set of hosts: IP addresses, CIDR prefixes and DNS names. The
// zero value is empty. It is not changed once parsed.
type HostSet struct {
	prefixes []netip.Prefix
	names    []string // lower case
}

// ParseHostSet parses hosts, each an IP address ("10.1.0.5"), a CIDR
// prefix ("10.1.0.0/16") or a DNS name ("kv-0.example").
func ParseHostSet(hosts []string) (HostSet, error) {
	var s HostSet
	for _, h := range hosts {
		switch {
		case strings.Contains(h, "/"):
			p, err := netip.ParsePrefix(h)
			if err != nil {
				return HostSet{}, fmt.Errorf("%q is not a CIDR prefix: %w", h, err)
			}
			s.prefixes = append(s.prefixes, p.Masked())
		default:
			if ip, err := netip.ParseAddr(h); err == nil {
				s.prefixes = append(s.prefixes, netip.PrefixFrom(ip.Unmap(), ip.Unmap().BitLen()))
				continue
			}
			if !dnsName(h) {
				return HostSet{}, fmt.Errorf("%q is not an IP address, a CIDR prefix or a DNS name", h)
			}
			s.names = append(s.names, strings.ToLower(h))
		}
	}
	return s, nil
}

// Contains reports whether host, an IP address or a DNS name, is in s.
func (s HostSet) Contains(host string) bool {
	if ip, err := netip.ParseAddr(host); err == nil {
		ip = ip.Unmap()
		for _, p := range s.prefixes {
			if p.Contains(ip) {
				return true
			}
		}
		return false
	}
	for _, n := range s.names {
		if strings.EqualFold(n, host) {
			return true
		}
	}
	return false
}

func dnsName(h string) bool {
	if h == "" || len(h) > 253 {
		return false
	}
	for label := range strings.SplitSeq(strings.TrimSuffix(h, "."), ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for i := 0; i < len(label); i++ {
			c := label[i]
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-') {
				return false
			}
		}
	}
	return true
}
