package server

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestMetricsEndpoint: each server serves its own metrics on its admin
// listener; two servers in one process register theirs without colliding.
func TestMetricsEndpoint(t *testing.T) {
	var servers []*Server
	for range 2 {
		s, err := Start(testConfig(t, "127.0.0.1:0", "127.0.0.1:0"), discard)
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, shutdown(t, s)) })
		servers = append(servers, s)
	}
	for _, s := range servers {
		code, body, err := get(t, "http://"+s.AdminAddr()+"/metrics")
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, code)
		require.Contains(t, body, `pdx_endpoint_healthy{endpoint="127.0.0.1:1",pool="p",role="prefill"} 1`)
		require.Contains(t, body, `pdx_requests_total{connector="nixl",outcome="routed",pool="p"} 0`, "series of the common outcomes exist from the start")
		require.Contains(t, body, "pdx_streams_in_flight 0")
		require.Contains(t, body, "go_goroutines ")
	}
}
