package server

import (
	"fmt"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	endpointservice "github.com/envoyproxy/go-control-plane/envoy/service/endpoint/v3"
	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/routing"
)

// With xds enabled, the gRPC listener of ext_proc serves the decode
// endpoints over EDS, follows a reloaded table, and a shutdown ends the EDS
// streams rather than waiting on them.
func TestServesDecodeEndpointsOverEDS(t *testing.T) {
	withXDS, err := config.Parse([]byte(`
grpc_address: 127.0.0.1:0
admin_address: 127.0.0.1:0
xds: {enabled: true, cluster_name: decode}
pools:
- name: p
  default: true
  connector: nixl
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:2}]
`))
	require.NoError(t, err)
	s, err := Start(withXDS, discard)
	require.NoError(t, err)

	stream, err := endpointservice.NewEndpointDiscoveryServiceClient(dialGRPC(t, s.GRPCAddr())).StreamEndpoints(t.Context())
	require.NoError(t, err)
	node := &corev3.Node{Id: "envoy", Cluster: "envoy"}
	require.NoError(t, stream.Send(&discoveryv3.DiscoveryRequest{Node: node, TypeUrl: resourcev3.EndpointType, ResourceNames: []string{"decode"}}))
	recv := func() []string {
		t.Helper()
		resp, err := stream.Recv()
		require.NoError(t, err)
		require.Len(t, resp.GetResources(), 1)
		var cla endpointv3.ClusterLoadAssignment
		require.NoError(t, resp.GetResources()[0].UnmarshalTo(&cla))
		require.Equal(t, "decode", cla.GetClusterName())
		require.NoError(t, stream.Send(&discoveryv3.DiscoveryRequest{Node: node, TypeUrl: resourcev3.EndpointType,
			ResourceNames: []string{"decode"}, VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce()}))
		var out []string
		for _, l := range cla.GetEndpoints() {
			for _, lb := range l.GetLbEndpoints() {
				sa := lb.GetEndpoint().GetAddress().GetSocketAddress()
				out = append(out, fmt.Sprintf("%s:%d", sa.GetAddress(), sa.GetPortValue()))
			}
		}
		return out
	}
	require.Equal(t, []string{"127.0.0.1:2"}, recv())

	reloaded, err := config.Parse([]byte(`
pools:
- name: p
  default: true
  connector: nixl
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:3}, {address: 127.0.0.1:4}]
`))
	require.NoError(t, err)
	table, err := routing.New(reloaded)
	require.NoError(t, err)
	s.SetTable(table)
	require.Equal(t, []string{"127.0.0.1:3", "127.0.0.1:4"}, recv())

	start := time.Now()
	require.NoError(t, shutdown(t, s))
	require.Less(t, time.Since(start), guard/2, "the open EDS stream did not hold the shutdown")
	_, err = stream.Recv()
	require.Error(t, err, "the EDS stream ended")
}
