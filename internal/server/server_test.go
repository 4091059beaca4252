package server

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/testbed/loopback"
)

// TestMain fails the package if a server or client goroutine outlives the
// tests: Shutdown must stop everything Start began.
//
// zmq4's PUB writer goroutine outlives its socket's Close (a test's
// stand-in for an engine's KV event publisher); it holds nothing of pdx's.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}

// guard bounds waits that must not hang; it is not a speed expectation.
const guard = 10 * time.Second

var discard = slog.New(slog.DiscardHandler)

// testConfig parses a one-pool config; the engines are never called.
func testConfig(t *testing.T, grpcAddr, adminAddr string) *configv1.Config {
	t.Helper()
	cfg, err := config.Parse(fmt.Appendf(nil, `
grpc_address: %q
admin_address: %q
pools:
- name: p
  default: true
  connector: nixl
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:2}]
`, grpcAddr, adminAddr))
	require.NoError(t, err)
	return cfg
}

func dialGRPC(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	return conn
}

// get fetches an admin URL. Keep-alives are off so that no client connection
// is left behind for goleak or for the server's drain.
func get(t *testing.T, url string) (int, string, error) {
	t.Helper()
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: guard}
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, url, nil)
	if err != nil { // no require: get also runs outside the test goroutine
		return 0, "", err
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body), err
}

func shutdown(t *testing.T, s *Server) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), guard)
	defer cancel()
	return s.Shutdown(ctx)
}

func TestStartAndShutdown(t *testing.T) {
	s, err := Start(testConfig(t, "127.0.0.1:0", "127.0.0.1:0"), discard)
	require.NoError(t, err)
	grpcAddr, adminAddr := s.GRPCAddr(), s.AdminAddr()

	health := healthpb.NewHealthClient(dialGRPC(t, grpcAddr))
	for _, svc := range []string{"", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"} {
		resp, err := health.Check(t.Context(), &healthpb.HealthCheckRequest{Service: svc})
		require.NoError(t, err, "service %q", svc)
		require.Equal(t, healthpb.HealthCheckResponse_SERVING, resp.GetStatus(), "service %q", svc)
	}
	for _, path := range []string{"/healthz", "/readyz"} {
		code, body, err := get(t, "http://"+adminAddr+path)
		require.NoError(t, err, path)
		require.Equal(t, http.StatusOK, code, path)
		require.Equal(t, "ok\n", body, path)
	}

	require.NoError(t, shutdown(t, s))

	_, err = health.Check(t.Context(), &healthpb.HealthCheckRequest{Service: "readiness"})
	require.Error(t, err, "the health service must be gone")
	for _, addr := range []string{grpcAddr, adminAddr} {
		_, err := net.Dial("tcp", addr)
		require.Error(t, err, "%s must no longer accept connections", addr)
	}
}

func TestStartBusyAddress(t *testing.T) {
	for _, busy := range []string{"grpc_address", "admin_address"} {
		t.Run(busy, func(t *testing.T) {
			taken, err := net.Listen("tcp", "127.0.0.1:0")
			require.NoError(t, err)
			defer taken.Close()
			other := loopback.FreeAddr(t)

			addrs := map[string]string{busy: taken.Addr().String()}
			if busy == "grpc_address" {
				addrs["admin_address"] = other
			} else {
				addrs["grpc_address"] = other
			}
			s, err := Start(testConfig(t, addrs["grpc_address"], addrs["admin_address"]), discard)
			require.Nil(t, s)
			require.ErrorContains(t, err, busy+":")

			// The failed Start must have released whatever it had bound, so
			// the other address is free for a second Start.
			if busy == "grpc_address" {
				addrs["grpc_address"] = "127.0.0.1:0"
			} else {
				addrs["admin_address"] = "127.0.0.1:0"
			}
			s, err = Start(testConfig(t, addrs["grpc_address"], addrs["admin_address"]), discard)
			require.NoError(t, err)
			require.NoError(t, shutdown(t, s))
		})
	}
}

// chatHeaders is the first message of an ext_proc stream for a chat
// request: pdx answers it and waits for the body, keeping the stream open,
// without calling any engine.
func chatHeaders() *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
				{Key: ":method", RawValue: []byte("POST")},
				{Key: ":path", RawValue: []byte("/v1/chat/completions")},
			}},
		},
	}}
}

func TestShutdownDrainsThenCutsStreams(t *testing.T) {
	s, err := Start(testConfig(t, "127.0.0.1:0", "127.0.0.1:0"), discard)
	require.NoError(t, err)
	conn := dialGRPC(t, s.GRPCAddr())

	// A Watch stream opened before Shutdown is the only way to see gRPC
	// readiness during the drain: new RPCs are refused once it starts.
	watchCtx, stopWatch := context.WithCancel(t.Context())
	defer stopWatch()
	watch, err := healthpb.NewHealthClient(conn).Watch(watchCtx, &healthpb.HealthCheckRequest{Service: "readiness"})
	require.NoError(t, err)
	resp, err := watch.Recv()
	require.NoError(t, err)
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, resp.GetStatus())

	streamCtx, stopStream := context.WithCancel(t.Context())
	defer stopStream()
	stream, err := extprocv3.NewExternalProcessorClient(conn).Process(streamCtx)
	require.NoError(t, err)
	require.NoError(t, stream.Send(chatHeaders()))
	pr, err := stream.Recv()
	require.NoError(t, err)
	require.NotNil(t, pr.GetRequestHeaders(), "the headers are answered; pdx waits for the body")
	require.Nil(t, pr.GetImmediateResponse())

	// The drain deadline is a context cancelled by hand once the drain has
	// been observed, which makes the test independent of timing; Shutdown
	// treats it exactly like a deadline.
	drainCtx, endDrain := context.WithCancel(t.Context())
	defer endDrain()
	shutdownErr := make(chan error, 1)
	go func() { shutdownErr <- s.Shutdown(drainCtx) }()

	// Readiness turns to 503 while the open stream holds the drain.
	readyz := make(chan error, 1)
	go func() {
		for {
			code, _, err := get(t, "http://"+s.AdminAddr()+"/readyz")
			switch {
			case err != nil:
				readyz <- err
				return
			case code == http.StatusServiceUnavailable:
				readyz <- nil
				return
			}
		}
	}()
	select {
	case err := <-readyz:
		require.NoError(t, err, "/readyz must answer 503 during the drain")
	case <-time.After(guard):
		t.Fatal("/readyz did not turn 503")
	}
	resp, err = watch.Recv()
	require.NoError(t, err)
	require.Equal(t, healthpb.HealthCheckResponse_NOT_SERVING, resp.GetStatus())

	select {
	case err := <-shutdownErr:
		t.Fatalf("Shutdown returned (%v) while a stream was open and the drain not over", err)
	default:
	}

	endDrain()
	select {
	case err := <-shutdownErr:
		require.NoError(t, err)
	case <-time.After(guard):
		t.Fatal("Shutdown did not cut the open stream when its context ended")
	}
	_, err = stream.Recv()
	require.Error(t, err, "the stream must have been cut")
	_, err = watch.Recv()
	require.Error(t, err, "the watch must have been cut")
}

func TestShutdownCutsAdminConnections(t *testing.T) {
	s, err := Start(testConfig(t, "127.0.0.1:0", "127.0.0.1:0"), discard)
	require.NoError(t, err)

	// A probe caught mid-request when the drain ends, e.g. a slow kubelet.
	probe, err := net.Dial("tcp", s.AdminAddr())
	require.NoError(t, err)
	defer probe.Close()
	_, err = io.WriteString(probe, "GET /readyz HTTP/1.1\r\nHost: pdx\r\n")
	require.NoError(t, err)
	// The server accepts in order, so once a later connection is answered the
	// probe's is open on the server side too.
	code, _, err := get(t, "http://"+s.AdminAddr()+"/healthz")
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, code)

	ctx, cancel := context.WithCancel(t.Context())
	cancel() // the drain is already over: everything left is cut
	require.NoError(t, s.Shutdown(ctx), "cutting what is left is the expected end of a drain")

	require.NoError(t, probe.SetReadDeadline(time.Now().Add(guard)))
	_, err = probe.Read(make([]byte, 1))
	// Closed by Shutdown: a FIN, or a RST when the server closed it with
	// the probe's unfinished request still unread (which one depends on
	// whether its connection had read those bytes yet). A timeout means
	// the connection was left open.
	require.True(t, errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET),
		"the admin connection must be closed by Shutdown, got %v", err)
}

// tls.self_signed: pdx serves a certificate of its own; a client that does
// not verify (the InferencePool gateways) reaches every health service
// over TLS, and a plaintext client is refused.
func TestSelfSignedTLS(t *testing.T) {
	cfg := testConfig(t, "127.0.0.1:0", "127.0.0.1:0")
	cfg.Tls = &configv1.TLS{SelfSigned: true}
	s, err := Start(cfg, discard)
	require.NoError(t, err)
	defer func() { require.NoError(t, shutdown(t, s)) }()

	var peerCert *x509.Certificate
	creds := credentials.NewTLS(&tls.Config{
		InsecureSkipVerify: true, // as the gateways do: pdx's certificate is its own
		VerifyConnection: func(cs tls.ConnectionState) error {
			peerCert = cs.PeerCertificates[0]
			return nil
		},
	})
	conn, err := grpc.NewClient(s.GRPCAddr(), grpc.WithTransportCredentials(creds))
	require.NoError(t, err)
	defer conn.Close()
	health := healthpb.NewHealthClient(conn)
	for _, svc := range []string{"liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"} {
		resp, err := health.Check(t.Context(), &healthpb.HealthCheckRequest{Service: svc})
		require.NoError(t, err, "service %q", svc)
		require.Equal(t, healthpb.HealthCheckResponse_SERVING, resp.GetStatus(), "service %q", svc)
	}
	require.NotNil(t, peerCert)
	require.Contains(t, peerCert.DNSNames, "localhost")
	require.NoError(t, peerCert.VerifyHostname("127.0.0.1"))
	require.True(t, peerCert.NotAfter.After(time.Now().AddDate(0, 11, 0)), "valid for a year")

	_, err = healthpb.NewHealthClient(dialGRPC(t, s.GRPCAddr())).Check(t.Context(), &healthpb.HealthCheckRequest{Service: "readiness"})
	require.Error(t, err, "a plaintext client must not be served")
}

// pdx starts serving once every engine's metrics have been read once (or
// failed to be): a decode it routes at once can be detached (its stream
// ended at routing, picker.Lease.Detach), which needs the engine's load.
func TestStartReadsTheEnginesFirst(t *testing.T) {
	for _, tc := range []struct {
		name     string
		slow     time.Duration // the engine's metrics answer after it
		detached bool
	}{
		{name: "metrics answer", detached: true},
		{name: "metrics time out", slow: 2 * firstRoundWait},
	} {
		t.Run(tc.name, func(t *testing.T) {
			engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				select {
				case <-time.After(tc.slow):
				case <-r.Context().Done():
					return
				}
				fmt.Fprintln(w, "vllm:num_requests_running 1\nvllm:num_requests_waiting 0")
			}))
			defer engine.Close()
			addr := strings.TrimPrefix(engine.URL, "http://")
			cfg, err := config.Parse(fmt.Appendf(nil, `
grpc_address: 127.0.0.1:0
admin_address: 127.0.0.1:0
pools:
- name: p
  default: true
  connector: nixl
  prefill: [{address: %q}]
  decode: [{address: %q}]
`, addr, addr))
			require.NoError(t, err)
			s, err := Start(cfg, discard)
			require.NoError(t, err)
			defer func() { require.NoError(t, shutdown(t, s)) }()

			l, ok := s.proc.Table().Pools()[0].Decode.Pick(picker.Request{})
			require.True(t, ok)
			defer l.End(picker.Released)
			require.Equal(t, tc.detached, l.Detach())
		})
	}
}
