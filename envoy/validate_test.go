package envoy_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/internal/testbed/envoyproc"
)

// The pinned Envoy accepts every bootstrap pdx renders.
func TestRenderValidates(t *testing.T) {
	bin, err := envoyproc.Binary()
	require.NoError(t, err, "the end-to-end tests need Envoy: run `make envoy` or set ENVOY_BIN")
	tests := []struct {
		name string
		cfg  envoy.Config
	}{
		{name: "loopback defaults", cfg: envoy.Config{PdxAddress: "127.0.0.1:9002"}},
		{name: "docker-style names, own limits", cfg: envoy.Config{
			ListenAddress: "0.0.0.0", ListenPort: 10000, AdminPort: 9901, PdxAddress: "pdx:9002",
			MessageTimeout: 90 * time.Second, BufferLimitBytes: 64 << 20, MaxRequestHeaders: 200, MaxRequestHeadersKB: 96,
		}},
		{name: "pdx replicas", cfg: envoy.Config{PdxAddress: "127.0.0.1:9002", PdxAddresses: []string{"127.0.0.1:9003", "127.0.0.1:9004"}}},
		{name: "full-duplex streamed body", cfg: envoy.Config{PdxAddress: "127.0.0.1:9002", RequestBodyMode: envoy.BodyFullDuplexStreamed}},
		{name: "AI Gateway's InferencePool translation", cfg: envoy.Config{PdxAddress: "127.0.0.1:9002", Profile: envoy.ProfileAIGateway}},
		{name: "AI Gateway with a subset hint", cfg: envoy.Config{PdxAddress: "pdx:9002", Profile: envoy.ProfileAIGateway, SubsetHintHeader: "x-test-subset"}},
		{name: "pdx's own with a subset hint", cfg: envoy.Config{PdxAddress: "127.0.0.1:9002", SubsetHintHeader: "x-test-subset"}},
		{name: "decode fallback over EDS", cfg: envoy.Config{PdxAddress: "127.0.0.1:9002", DecodeCluster: envoy.DecodeEDS, DecodeFallbacks: 2}},
		{name: "decode fallback over EDS, full-duplex, replicas", cfg: envoy.Config{
			PdxAddress: "pdx:9002", PdxAddresses: []string{"pdx-2:9002"}, DecodeCluster: envoy.DecodeEDS, XDSCluster: "decode",
			RequestBodyMode: envoy.BodyFullDuplexStreamed,
		}},
		{name: "observability pass", cfg: envoy.Config{PdxAddress: "127.0.0.1:9002", Observer: true}},
		{name: "observability pass to its own server", cfg: envoy.Config{PdxAddress: "127.0.0.1:9002", Observer: true, ObserverAddress: "observer:9003"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.NoError(t, envoyproc.Validate(t.Context(), bin, tc.cfg))
		})
	}
}
