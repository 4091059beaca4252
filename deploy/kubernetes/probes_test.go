package kubernetes_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/server"
)

// TestProbesAnswer runs pdx's server with the ConfigMap's config (on
// loopback, engines moved to closed loopback ports) and asks it what the
// Deployment's liveness and readiness probes ask: each gRPC health service
// answers SERVING, each HTTP path 200. A probe on a service pdx does not
// register would fail here as it would in the kubelet. Prometheus's
// scrapes (annotations, ServiceMonitor) get pdx's metrics.
func TestProbesAnswer(t *testing.T) {
	objs := load(t, baseDir, monitoringDir)
	p := loadPdx(t, objs)
	cfg := proto.Clone(p.cfg).(*configv1.Config)
	cfg.GrpcAddress = "127.0.0.1:0"
	cfg.AdminAddress = "127.0.0.1:0"
	port := 1
	for _, pool := range cfg.GetPools() {
		for _, ep := range append(pool.GetPrefill(), pool.GetDecode()...) {
			ep.Address = fmt.Sprintf("127.0.0.1:%d", port) // nothing listens there
			port++
		}
	}
	srv, err := server.Start(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		require.NoError(t, srv.Shutdown(ctx))
	})

	conn, err := grpc.NewClient(srv.GRPCAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	health := healthpb.NewHealthClient(conn)

	for name, probe := range map[string]*corev1.Probe{"liveness": p.container.LivenessProbe, "readiness": p.container.ReadinessProbe} {
		require.NotNil(t, probe, name)
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		switch {
		case probe.GRPC != nil:
			service := ""
			if probe.GRPC.Service != nil {
				service = *probe.GRPC.Service
			}
			resp, err := health.Check(ctx, &healthpb.HealthCheckRequest{Service: service})
			require.NoError(t, err, "%s probe: gRPC health service %q", name, service)
			require.Equal(t, healthpb.HealthCheckResponse_SERVING, resp.GetStatus(), "%s probe: service %q", name, service)
		case probe.HTTPGet != nil:
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+srv.AdminAddr()+probe.HTTPGet.Path, nil)
			require.NoError(t, err)
			resp, err := http.DefaultClient.Do(req)
			require.NoError(t, err, "%s probe", name)
			resp.Body.Close()
			require.Equal(t, http.StatusOK, resp.StatusCode, "%s probe: GET %s", name, probe.HTTPGet.Path)
		default:
			require.Failf(t, "probe", "%s probe is neither gRPC nor HTTP", name)
		}
		cancel()
	}

	for _, sc := range scrapes(t, objs, p) {
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+srv.AdminAddr()+sc.path, nil)
		require.NoError(t, err)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err, sc.what)
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		cancel()
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode, "%s: GET %s", sc.what, sc.path)
		require.Contains(t, string(body), "pdx_streams_in_flight", "%s: GET %s", sc.what, sc.path)
	}
}
