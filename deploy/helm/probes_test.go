package helm_test

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

// TestChartProbesAnswer runs pdx's server with the chart's config (on
// loopback; in inferencePool mode without its TLS, which only the gRPC
// port serves) and asks it what the rendered probes ask: each gRPC health
// service answers SERVING, each admin HTTP path 200. A probe of a service
// or path pdx does not serve would fail here as in the kubelet. Prometheus's
// scrapes (annotations, ServiceMonitor) get pdx's metrics.
func TestChartProbesAnswer(t *testing.T) {
	for name, values := range map[string]map[string]any{
		"default":                              nil,
		"inferencePool (TLS on the gRPC port)": inferencePoolValues,
		"ServiceMonitor":                       {"metrics": map[string]any{"serviceMonitor": map[string]any{"enabled": true}}},
	} {
		t.Run(name, func(t *testing.T) {
			r := mustRender(t, values)
			p := loadPdx(t, r.objs)
			cfg := proto.Clone(p.cfg).(*configv1.Config)
			cfg.GrpcAddress = "127.0.0.1:0"
			cfg.AdminAddress = "127.0.0.1:0"
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

			for probeName, probe := range map[string]*corev1.Probe{"liveness": p.container.LivenessProbe, "readiness": p.container.ReadinessProbe} {
				ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
				switch {
				case probe.GRPC != nil:
					resp, err := health.Check(ctx, &healthpb.HealthCheckRequest{Service: *probe.GRPC.Service})
					require.NoError(t, err, "%s probe", probeName)
					require.Equal(t, healthpb.HealthCheckResponse_SERVING, resp.GetStatus(), "%s probe", probeName)
				case probe.HTTPGet != nil:
					require.Equal(t, containerPort(t, p.container, "admin"), resolvePort(t, probe.HTTPGet.Port, p.container))
					req, err := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("http://%s%s", srv.AdminAddr(), probe.HTTPGet.Path), nil)
					require.NoError(t, err)
					resp, err := http.DefaultClient.Do(req)
					require.NoError(t, err, "%s probe", probeName)
					resp.Body.Close()
					require.Equal(t, http.StatusOK, resp.StatusCode, "%s probe: GET %s", probeName, probe.HTTPGet.Path)
				default:
					require.Failf(t, "probe", "%s probe is neither gRPC nor HTTP", probeName)
				}
				cancel()
			}
			for _, sc := range scrapes(t, r.objs, p) {
				ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
				req, err := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("http://%s%s", srv.AdminAddr(), sc.path), nil)
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
		})
	}
}
