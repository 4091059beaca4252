package envoy

import (
	"bytes"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestRenderValidates(t *testing.T) {
	bin, err := Binary()
	require.NoError(t, err, "the end-to-end tests need Envoy: run `make envoy` or set ENVOY_BIN")
	tests := []struct {
		name string
		cfg  Config
	}{
		{name: "loopback defaults", cfg: Config{PdxAddress: "127.0.0.1:9002"}},
		{name: "docker-style names and pass-through engines", cfg: Config{
			ListenAddress: "0.0.0.0", ListenPort: 10000, AdminPort: 9901,
			PdxAddress: "pdx:9002", DefaultEndpoints: []string{"decode-0:8000", "10.1.2.3:8000"},
			MessageTimeout: 90 * time.Second, BufferLimitBytes: 64 << 20,
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.NoError(t, Validate(t.Context(), bin, tc.cfg))
		})
	}
}

func TestRender(t *testing.T) {
	var buf bytes.Buffer
	require.NoError(t, Render(&buf, Config{PdxAddress: "127.0.0.1:9002", MessageTimeout: 1500 * time.Millisecond}))
	out := buf.String()
	require.Contains(t, out, "message_timeout: 1.5s")
	require.Contains(t, out, "failure_mode_allow: false")
	require.Contains(t, out, "http_header_name: x-gateway-destination-endpoint")
	require.Contains(t, out, "per_connection_buffer_limit_bytes: 16777216")

	require.ErrorContains(t, Render(&buf, Config{PdxAddress: "nope"}), "pdx address")
	require.ErrorContains(t, Render(&buf, Config{PdxAddress: "127.0.0.1:1", DefaultEndpoints: []string{"x:0"}}), "bad port")
}
