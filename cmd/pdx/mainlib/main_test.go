package mainlib

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/pdx-router/pdx/internal/testbed/envoyproc"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestUsageAndConfigErrors(t *testing.T) {
	bad := filepath.Join(t.TempDir(), "pdx.yaml")
	require.NoError(t, os.WriteFile(bad, []byte("pools:\n- name: p\n  modles: [m]\n"), 0o600))
	tests := []struct {
		name    string
		args    []string
		wantErr string
		usage   bool
	}{
		{name: "no command", args: nil, wantErr: "bad usage", usage: true},
		{name: "unknown command", args: []string{"srve"}, wantErr: `unknown command "srve"`, usage: true},
		{name: "serve without config", args: []string{"serve"}, wantErr: "serve needs --config"},
		{name: "serve with missing file", args: []string{"serve", "--config", "/nonexistent/pdx.yaml"}, wantErr: "no such file"},
		{name: "serve with a typo in the config", args: []string{"serve", "--config", bad}, wantErr: `pdx.yaml:3: pools[0].modles: unknown field, did you mean "models"?`},
		{name: "bad log level", args: []string{"serve", "--config", bad, "--log-level", "loud"}, wantErr: "--log-level"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			err := Main(t.Context(), tc.args, &stdout, &stderr)
			require.ErrorContains(t, err, tc.wantErr)
			if tc.usage {
				require.Contains(t, stderr.String(), "usage: pdx")
			}
		})
	}
}

func TestHelp(t *testing.T) {
	for _, args := range [][]string{{"help"}, {"serve", "--help"}, {"envoy-config", "--help"}} {
		var stdout, stderr bytes.Buffer
		require.NoError(t, Main(t.Context(), args, &stdout, &stderr), args)
		require.NotEmpty(t, stdout.String()+stderr.String(), args)
	}
}

func TestEnvoyConfigValidates(t *testing.T) {
	pki, err := stack.NewPKI(t.TempDir())
	require.NoError(t, err)
	bin, err := envoyproc.Binary()
	require.NoError(t, err)
	for name, args := range map[string][]string{
		"plaintext": {"--pdx-address", "pdx:9002", "--listen-address", "0.0.0.0", "--max-request-headers", "200", "--max-request-headers-kb", "96"},
		"mutual TLS": {"--pdx-address", "pdx:9002", "--pdx-ca", pki.CAFile, "--pdx-sni", pki.ServerName,
			"--pdx-client-cert", pki.ClientCertFile, "--pdx-client-key", pki.ClientKey},
		"full-duplex streamed body": {"--pdx-address", "pdx:9002", "--request-body-mode", "FULL_DUPLEX_STREAMED"},
		"decode fallback over EDS":  {"--pdx-address", "pdx:9002", "--decode-cluster", "eds", "--decode-fallbacks", "2", "--xds-cluster", "decode"},
	} {
		t.Run(name, func(t *testing.T) {
			var out bytes.Buffer
			require.NoError(t, Main(t.Context(), append([]string{"envoy-config"}, args...), &out, &out))
			require.Contains(t, out.String(), "address: pdx")
			path := filepath.Join(t.TempDir(), "envoy.yaml")
			require.NoError(t, os.WriteFile(path, out.Bytes(), 0o600))
			require.NoError(t, envoyproc.ValidateFile(t.Context(), bin, path))
		})
	}
	var out bytes.Buffer
	require.ErrorContains(t, Main(t.Context(), []string{"envoy-config", "--pdx-client-cert", "c.pem"}, &out, &out), "CA file and an SNI")
	require.ErrorContains(t, Main(t.Context(), []string{"envoy-config", "--request-body-mode", "STREAMED"}, &out, &out), `request body mode "STREAMED"`)
	require.ErrorContains(t, Main(t.Context(), []string{"envoy-config", "--decode-cluster", "static"}, &out, &out), `decode cluster "static"`)
}

// The product binary links nothing of the test wing: no engine simulator,
// no load harness, no Envoy launcher.
func TestProductLinksNoTestbed(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "github.com/pdx-router/pdx/cmd/pdx").CombinedOutput()
	require.NoError(t, err, "%s", out)
	deps := strings.Fields(string(out))
	require.Contains(t, deps, "github.com/pdx-router/pdx/processor")
	for _, dep := range deps {
		require.False(t, strings.HasPrefix(dep, "github.com/pdx-router/pdx/internal/testbed"), "cmd/pdx links %s", dep)
	}
}
