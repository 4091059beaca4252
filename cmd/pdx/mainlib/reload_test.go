package mainlib

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/pdx-router/pdx/internal/testbed/logbuf"
	"github.com/pdx-router/pdx/processor"
)

// aggregated is a config whose one pool sends every request to decode, with
// no prefill: routing needs no engine.
func aggregated(decode string) string {
	return `
grpc_address: 127.0.0.1:0
admin_address: 127.0.0.1:0
pools:
- name: p
  default: true
  connector: none
  decode: [{address: ` + decode + `}]
`
}

// TestServeReloadsConfig changes the config file under a running pdx
// serve: new streams are routed by the new config, and a broken file
// changes nothing.
func TestServeReloadsConfig(t *testing.T) {
	path := filepath.Join(t.TempDir(), "pdx.yaml")
	require.NoError(t, os.WriteFile(path, []byte(aggregated("127.0.0.1:2")), 0o600))
	ctx, cancel := context.WithCancel(t.Context())
	var log logbuf.Buffer
	done := make(chan error, 1)
	go func() {
		done <- Main(ctx, []string{"serve", "--config", path, "--config-poll-interval", "10ms"}, &log, &log)
	}()
	defer func() {
		cancel()
		require.NoError(t, <-done)
	}()
	var addr string
	require.Eventually(t, func() bool { addr = logged(log.String(), "pdx serving", "grpc"); return addr != "" },
		10*time.Second, 10*time.Millisecond)
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	client := extprocv3.NewExternalProcessorClient(conn)
	require.Equal(t, "127.0.0.1:2", mustRoute(t, client))

	require.NoError(t, os.WriteFile(path, []byte(aggregated("127.0.0.1:3")), 0o600))
	require.Eventually(t, func() bool { decode, _ := route(client); return decode == "127.0.0.1:3" }, 10*time.Second, 10*time.Millisecond,
		"log:\n%s", log.String())
	require.Contains(t, log.String(), `"msg":"config reloaded"`)

	require.NoError(t, os.WriteFile(path, []byte(aggregated("https://127.0.0.1:4")), 0o600))
	// A poll may also catch the file truncated, not yet written: that
	// reload fails too ("at least one pool"), and the next reads it whole.
	require.Eventually(t, func() bool { return strings.Contains(log.String(), `https is not supported`) }, 10*time.Second, 10*time.Millisecond)
	require.Contains(t, log.String(), "config reload failed")
	require.Equal(t, "127.0.0.1:3", mustRoute(t, client), "the running config stays")
}

// logged returns field of the first JSON log line with message msg.
func logged(log, msg, field string) string {
	for line := range strings.Lines(log) {
		var m map[string]any
		if json.Unmarshal([]byte(line), &m) == nil && m["msg"] == msg {
			s, _ := m[field].(string)
			return s
		}
	}
	return ""
}

// route sends one completion request through an ext_proc stream and
// returns the decode endpoint pdx chose. It returns errors rather than fail
// the test: Eventually calls it on another goroutine.
func route(client extprocv3.ExternalProcessorClient) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stream, err := client.Process(ctx)
	if err != nil {
		return "", err
	}
	hs := []*corev3.HeaderValue{{Key: ":method", RawValue: []byte("POST")}, {Key: ":path", RawValue: []byte("/v1/completions")}}
	if err := stream.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: hs}},
	}}); err != nil {
		return "", err
	}
	if _, err := stream.Recv(); err != nil {
		return "", err
	}
	if err := stream.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: []byte(`{"model":"m","prompt":"hi"}`), EndOfStream: true},
	}}); err != nil {
		return "", err
	}
	resp, err := stream.Recv()
	if err != nil {
		return "", err
	}
	for _, h := range resp.GetRequestBody().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == processor.DestinationHeader {
			return string(h.GetHeader().GetRawValue()), nil
		}
	}
	return "", fmt.Errorf("no %s in %v", processor.DestinationHeader, resp)
}

func mustRoute(t *testing.T, client extprocv3.ExternalProcessorClient) string {
	t.Helper()
	decode, err := route(client)
	require.NoError(t, err)
	return decode
}
