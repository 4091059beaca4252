package connectors

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"

	"github.com/pdx-router/pdx/internal/engines"
)

// A prefill answer that names the host the decode pulls KV from (vLLM
// NIXL's remote_host and remote_port) would, if passed on blindly, let a
// misbehaving or compromised prefill engine point a decode engine at any
// host: to read another tenant's KV, or to make it connect somewhere. pdx
// passes on only the engine it called.

// sameHost reports whether two hosts name the same machine: equal IP
// addresses (however written), or equal names.
func sameHost(a []byte, b string) bool {
	if string(a) == b {
		return true // the common case, without parsing (which allocates)
	}
	ia, errA := netip.ParseAddr(string(a))
	ib, errB := netip.ParseAddr(b)
	if errA == nil && errB == nil {
		return ia.Unmap() == ib.Unmap()
	}
	return strings.EqualFold(string(a), b)
}

// checkKVSource checks a KV source that a prefill answer names, host and
// port, against the prefill endpoint pdx called: with a kv_address
// configured (or discovered) for it, the source must be that port, on that
// host or an allowed one; without, any port on the endpoint's own host or an
// allowed one (see checkKVHost). Each DP rank of a vLLM engine has a side
// channel of its own, on the configured port plus its rank (vLLM's NIXL
// scheduler: VLLM_NIXL_SIDE_CHANNEL_PORT + data_parallel_index): a prefill
// on rank r must name that one.
func checkKVSource(req *Request, host []byte, port int) error {
	ep := req.Prefill
	if ep.KVAddress == "" {
		return checkKVHost(req, host)
	}
	kvHost, kvPort, err := net.SplitHostPort(ep.KVAddress)
	if err != nil {
		return fmt.Errorf("%w: kv_address %q is not host:port", engines.ErrBadAnswer, ep.KVAddress)
	}
	p, err := strconv.Atoi(kvPort)
	rank, ranked := req.PrefillRank.Get()
	if ranked {
		p += rank
	}
	if err != nil || p != port || !(sameHost(host, kvHost) || req.KVHosts.Contains(string(host))) {
		of := ""
		if ranked {
			of = fmt.Sprintf(" (its DP rank %d's side channel port is %d)", rank, p)
		}
		return fmt.Errorf("%w: the answer names KV source %s, but the engine's kv_address is %s%s",
			engines.ErrBadAnswer, net.JoinHostPort(string(host), strconv.Itoa(port)), ep.KVAddress, of)
	}
	return nil
}

// checkKVHost checks a host that a prefill answer names: the prefill
// endpoint's own host or an allowed one. vLLM advertises "localhost" unless
// VLLM_NIXL_SIDE_CHANNEL_HOST is set; that is the engine itself only when
// pdx reaches it on loopback too.
func checkKVHost(req *Request, host []byte) error {
	own := req.Prefill.Host()
	if sameHost(host, own) || req.KVHosts.Contains(string(host)) || strings.EqualFold(string(host), "localhost") && loopback(own) {
		return nil
	}
	return fmt.Errorf("%w: the answer names KV source host %q, not the engine's own %s (list other hosts in the pool's allowed_kv_hosts)",
		engines.ErrBadAnswer, host, own)
}

func loopback(host string) bool {
	ip, err := netip.ParseAddr(host)
	return err == nil && ip.IsLoopback()
}

// jsonString decodes raw, a JSON value, as a string. Hosts are plain ASCII:
// one without escapes is the bytes between the quotes, not a copy.
func jsonString(raw []byte) ([]byte, bool) {
	if len(raw) < 2 || raw[0] != '"' {
		return nil, false
	}
	if !bytes.ContainsRune(raw, '\\') {
		return raw[1 : len(raw)-1], true
	}
	var s string
	if json.Unmarshal(raw, &s) != nil {
		return nil, false
	}
	return []byte(s), true
}

// jsonPort decodes raw, a JSON value, as a port number.
func jsonPort(raw []byte) (int, bool) {
	if len(raw) == 0 || len(raw) > 5 {
		return 0, false
	}
	n := 0
	for _, c := range raw {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int(c-'0')
	}
	return n, n >= 1 && n <= 65535
}
