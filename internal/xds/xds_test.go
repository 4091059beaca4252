package xds_test

import (
	"fmt"
	"io"
	"log/slog"
	"net"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	endpointservice "github.com/envoyproxy/go-control-plane/envoy/service/endpoint/v3"
	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/xds"
)

func table(t *testing.T, yaml string) *routing.Table {
	t.Helper()
	cfg, err := config.Parse([]byte(yaml))
	require.NoError(t, err)
	tb, err := routing.New(cfg)
	require.NoError(t, err)
	return tb
}

const twoPools = `
pools:
- name: a
  models: [a]
  connector: nixl
  prefill: [{address: 10.0.0.1:8000}]
  decode: [{address: 10.0.0.2:8000}, {address: 10.0.0.3:8000}]
- name: b
  models: [b]
  connector: none
  decode: [{address: 10.0.0.3:8000}, {address: "[fd00::4]:9000"}]
`

func addrs(cla *endpointv3.ClusterLoadAssignment) []string {
	var out []string
	for _, l := range cla.GetEndpoints() {
		for _, lb := range l.GetLbEndpoints() {
			sa := lb.GetEndpoint().GetAddress().GetSocketAddress()
			out = append(out, net.JoinHostPort(sa.GetAddress(), fmt.Sprint(sa.GetPortValue())))
		}
	}
	return out
}

// The assignment holds every pool's decode endpoints, each once, and no
// prefill endpoint.
func TestAssignment(t *testing.T) {
	for _, tc := range []struct {
		name, yaml string
		want       []string
	}{
		{"two pools", twoPools, []string{"10.0.0.2:8000", "10.0.0.3:8000", "[fd00::4]:9000"}},
		{"one decode", "pools:\n- name: p\n  default: true\n  connector: nixl\n  prefill: [{address: 10.0.0.1:1}]\n  decode: [{address: 10.0.0.9:2}]\n", []string{"10.0.0.9:2"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cla := xds.Assignment("pdx_decode", table(t, tc.yaml))
			require.Equal(t, "pdx_decode", cla.GetClusterName())
			require.Equal(t, tc.want, addrs(cla))
		})
	}
}

// A real gRPC EDS client gets the assignment, then a new one when a pool's
// endpoints change (discovery) and when the table is replaced (reload).
func TestServeFollowsTheTable(t *testing.T) {
	tb := table(t, twoPools)
	srv := xds.New("pdx_decode", tb, slog.New(slog.DiscardHandler))
	g := grpc.NewServer()
	srv.Register(t.Context(), g)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go g.Serve(ln)
	t.Cleanup(g.Stop)
	go srv.Run(t.Context())

	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	stream, err := endpointservice.NewEndpointDiscoveryServiceClient(conn).StreamEndpoints(t.Context())
	require.NoError(t, err)
	node := &corev3.Node{Id: "envoy-1", Cluster: "test"}
	req := &discoveryv3.DiscoveryRequest{Node: node, TypeUrl: resourcev3.EndpointType, ResourceNames: []string{"pdx_decode"}}
	require.NoError(t, stream.Send(req))

	recv := func() []string {
		t.Helper()
		resp, err := stream.Recv()
		require.NoError(t, err)
		require.Equal(t, resourcev3.EndpointType, resp.GetTypeUrl())
		require.Len(t, resp.GetResources(), 1)
		var cla endpointv3.ClusterLoadAssignment
		require.NoError(t, resp.GetResources()[0].UnmarshalTo(&cla))
		require.Equal(t, "pdx_decode", cla.GetClusterName())
		// ACK, as Envoy does, so that the next version is sent.
		require.NoError(t, stream.Send(&discoveryv3.DiscoveryRequest{Node: node, TypeUrl: resourcev3.EndpointType,
			ResourceNames: []string{"pdx_decode"}, VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce()}))
		return addrs(&cla)
	}
	require.Equal(t, []string{"10.0.0.2:8000", "10.0.0.3:8000", "[fd00::4]:9000"}, recv())

	pa, _ := tb.Pool("a")
	pa.SetEndpoints([]endpoint.Endpoint{{Address: "10.0.0.1:8000"}}, []endpoint.Endpoint{{Address: "10.0.0.5:8000"}})
	require.Equal(t, []string{"10.0.0.5:8000", "10.0.0.3:8000", "[fd00::4]:9000"}, recv())

	srv.SetTable(table(t, "pools:\n- name: p\n  default: true\n  connector: nixl\n  prefill: [{address: 10.0.0.1:1}]\n  decode: [{address: 10.0.0.7:2}]\n"))
	require.Equal(t, []string{"10.0.0.7:2"}, recv())

	require.NoError(t, stream.CloseSend())
	_, err = stream.Recv()
	require.ErrorIs(t, err, io.EOF)
}
