package tracing

import (
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestEnabled(t *testing.T) {
	for name, tc := range map[string]struct {
		env  map[string]string
		want bool
	}{
		"nothing set":      {env: nil, want: false},
		"endpoint":         {env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, want: true},
		"traces endpoint":  {env: map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, want: true},
		"SDK disabled":     {env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "x", "OTEL_SDK_DISABLED": "TRUE"}, want: false},
		"exporter none":    {env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "x", "OTEL_TRACES_EXPORTER": "none"}, want: false},
		"SDK not disabled": {env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "x", "OTEL_SDK_DISABLED": "false"}, want: true},
	} {
		t.Run(name, func(t *testing.T) {
			require.Equal(t, tc.want, Enabled(func(k string) string { return tc.env[k] }))
		})
	}
}

func TestFromEnvOff(t *testing.T) {
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
	tp, err := FromEnv(t.Context())
	require.NoError(t, err)
	require.Nil(t, tp, "no provider, so the processor keeps its nil tracer")
}
