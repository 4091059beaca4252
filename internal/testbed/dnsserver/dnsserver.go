// Package dnsserver is an authoritative DNS server for tests, on a loopback
// UDP port: it answers A and AAAA queries for the names a test gives it, and
// a test changes them while pdx runs. Go's own DNS client (a net.Resolver,
// see Resolver) queries it over the wire as it would any name server, so
// the answers reach pdx's resolver the way a cluster's DNS answers do:
// NXDOMAIN, an empty answer, SERVFAIL, records with a TTL.
package dnsserver

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/net/dns/dnsmessage"
)

// TTL is the TTL of every record served, in seconds. pdx does not follow
// TTLs (Envoy's respect_dns_ttl is off by default too): it looks names up
// again every dns_refresh_rate.
const TTL = 30

// Server is a running DNS server. It is safe for concurrent use.
type Server struct {
	conn net.PacketConn
	done chan struct{}

	mu      sync.Mutex
	records map[string][]netip.Addr // by FQDN, lower case
	failing map[string]bool         // answered SERVFAIL
	queries atomic.Int64
}

// Start listens on a free loopback UDP port and serves until Close.
func Start() (*Server, error) {
	conn, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &Server{conn: conn, done: make(chan struct{}), records: map[string][]netip.Addr{}, failing: map[string]bool{}}
	go s.serve()
	return s, nil
}

// Addr is the server's "ip:port".
func (s *Server) Addr() string { return s.conn.LocalAddr().String() }

// Set makes name resolve to addrs; with none, name does not exist
// (NXDOMAIN). It ends a Fail of name.
func (s *Server) Set(name string, addrs ...netip.Addr) {
	s.mu.Lock()
	defer s.mu.Unlock()
	key := fqdn(name)
	delete(s.failing, key)
	if len(addrs) == 0 {
		delete(s.records, key)
		return
	}
	s.records[key] = addrs
}

// Fail makes queries for name fail (SERVFAIL: the server cannot answer),
// until Set.
func (s *Server) Fail(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failing[fqdn(name)] = true
}

// Queries is how many queries the server has answered.
func (s *Server) Queries() int64 { return s.queries.Load() }

// Resolver is Go's DNS client sending every query to s, whatever
// /etc/resolv.conf names (names in /etc/hosts are still read from it).
func (s *Server) Resolver() *net.Resolver {
	return &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "udp", s.Addr())
	}}
}

// Close stops the server.
func (s *Server) Close() error {
	err := s.conn.Close()
	<-s.done
	return err
}

func (s *Server) serve() {
	defer close(s.done)
	buf := make([]byte, 1500)
	for {
		n, from, err := s.conn.ReadFrom(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		if answer, ok := s.answer(buf[:n]); ok {
			_, _ = s.conn.WriteTo(answer, from)
			s.queries.Add(1)
		}
	}
}

// answer builds the response to a query.
func (s *Server) answer(query []byte) ([]byte, bool) {
	var p dnsmessage.Parser
	h, err := p.Start(query)
	if err != nil {
		return nil, false
	}
	q, err := p.Question()
	if err != nil {
		return nil, false
	}
	key := strings.ToLower(q.Name.String())
	s.mu.Lock()
	addrs, known, failing := s.records[key], s.records[key] != nil, s.failing[key]
	s.mu.Unlock()

	rh := dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true, RecursionDesired: h.RecursionDesired, RecursionAvailable: true}
	switch {
	case failing:
		rh.RCode = dnsmessage.RCodeServerFailure
	case !known:
		rh.RCode = dnsmessage.RCodeNameError
	}
	b := dnsmessage.NewBuilder(nil, rh)
	b.EnableCompression()
	if b.StartQuestions() != nil || b.Question(q) != nil || b.StartAnswers() != nil {
		return nil, false
	}
	for _, a := range addrs {
		if failing {
			break
		}
		rr := dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: TTL}
		switch {
		case q.Type == dnsmessage.TypeA && a.Is4():
			err = b.AResource(rr, dnsmessage.AResource{A: a.As4()})
		case q.Type == dnsmessage.TypeAAAA && a.Is6():
			err = b.AAAAResource(rr, dnsmessage.AAAAResource{AAAA: a.As16()})
		}
		if err != nil {
			return nil, false
		}
	}
	out, err := b.Finish()
	return out, err == nil
}

func fqdn(name string) string {
	name = strings.ToLower(name)
	if !strings.HasSuffix(name, ".") {
		name += "."
	}
	return name
}
