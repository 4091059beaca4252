// Package xds serves Envoy the decode endpoints pdx routes to, over the
// endpoint discovery service (EDS), for the decode-fallback profile: Envoy's
// decode cluster is an EDS cluster whose override_host load balancing
// policy takes the hosts pdx names, and skips any host not in the cluster.
// So the cluster holding exactly the decode endpoints of pdx's pools is what
// keeps every decode connection on an engine pdx knows, whatever a client
// sends.
//
// It is plain EDS (not ADS): pdx serves one resource type and nothing that
// must be ordered with it; listeners, routes and clusters stay in Envoy's
// bootstrap.
package xds

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"sync/atomic"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	endpointservice "github.com/envoyproxy/go-control-plane/envoy/service/endpoint/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	xdslog "github.com/envoyproxy/go-control-plane/pkg/log"
	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"google.golang.org/grpc"

	"github.com/pdx-router/pdx/internal/routing"
)

// Server serves one ClusterLoadAssignment, named for Envoy's decode
// cluster, holding every decode endpoint of every pool of the routing table
// it follows. It is safe for concurrent use.
type Server struct {
	cluster string
	cache   *cachev3.LinearCache
	log     *slog.Logger
	// table is the routing table followed; swapped is told when SetTable
	// replaces it.
	table   atomic.Pointer[routing.Table]
	swapped chan struct{}
	// last is the address list of the assignment served, for Run to skip
	// updates that change nothing.
	last []string
}

// New returns a server of cluster's endpoints, following table.
func New(cluster string, table *routing.Table, log *slog.Logger) *Server {
	s := &Server{
		cluster: cluster,
		log:     log,
		swapped: make(chan struct{}, 1),
		cache: cachev3.NewLinearCache(resourcev3.EndpointType, cachev3.WithLogger(xdslog.LoggerFuncs{
			WarnFunc:  func(f string, a ...any) { log.Warn(fmt.Sprintf(f, a...), slog.String("component", "xds")) },
			ErrorFunc: func(f string, a ...any) { log.Error(fmt.Sprintf(f, a...), slog.String("component", "xds")) },
		})),
	}
	s.table.Store(table)
	s.update(table)
	return s
}

// Register adds the endpoint discovery service to g, next to ext_proc.
func (s *Server) Register(ctx context.Context, g *grpc.Server) {
	endpointservice.RegisterEndpointDiscoveryServiceServer(g, serverv3.NewServer(ctx, s.cache, nil))
}

// SetTable follows t from now on (a reloaded config).
func (s *Server) SetTable(t *routing.Table) {
	s.table.Store(t)
	select {
	case s.swapped <- struct{}{}:
	default:
	}
}

// Run keeps the served assignment up to date with the table followed, its
// pools' endpoint changes (Kubernetes discovery) and its replacements,
// until ctx ends.
func (s *Server) Run(ctx context.Context) {
	for {
		t := s.table.Load()
		s.update(t)
		select {
		case <-ctx.Done():
			return
		case <-t.Changes():
		case <-s.swapped:
		}
	}
}

// Assignment is the ClusterLoadAssignment of cluster for t: every decode
// endpoint of every pool, each address once, in pool order.
func Assignment(cluster string, t *routing.Table) *endpointv3.ClusterLoadAssignment {
	return assignment(cluster, addresses(t))
}

func addresses(t *routing.Table) []string {
	var out []string
	for _, p := range t.Pools() {
		for _, a := range p.Decode.Set.Addresses() {
			if !slices.Contains(out, a) {
				out = append(out, a)
			}
		}
	}
	return out
}

func assignment(cluster string, addrs []string) *endpointv3.ClusterLoadAssignment {
	lbs := make([]*endpointv3.LbEndpoint, 0, len(addrs))
	for _, a := range addrs {
		host, port, err := net.SplitHostPort(a)
		if err != nil {
			continue // config validation admits ip:port only
		}
		n, err := strconv.ParseUint(port, 10, 32)
		if err != nil {
			continue
		}
		lbs = append(lbs, &endpointv3.LbEndpoint{HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{
			Address: &corev3.Address{Address: &corev3.Address_SocketAddress{SocketAddress: &corev3.SocketAddress{
				Address: host, PortSpecifier: &corev3.SocketAddress_PortValue{PortValue: uint32(n)},
			}}},
		}}})
	}
	return &endpointv3.ClusterLoadAssignment{
		ClusterName: cluster,
		Endpoints:   []*endpointv3.LocalityLbEndpoints{{LbEndpoints: lbs}},
	}
}

// update serves t's endpoints if they changed. Only Run and New call it.
func (s *Server) update(t *routing.Table) {
	addrs := addresses(t)
	if s.last != nil && slices.Equal(addrs, s.last) {
		return
	}
	s.last = addrs
	if addrs == nil {
		s.last = []string{}
	}
	if err := s.cache.UpdateResource(s.cluster, types.Resource(assignment(s.cluster, addrs))); err != nil {
		s.log.Error("serving the decode endpoints over EDS failed", slog.String("cluster", s.cluster), slog.String("error", err.Error()))
		return
	}
	s.log.Info("decode endpoints served over EDS", slog.String("cluster", s.cluster), slog.Int("endpoints", len(addrs)))
}
