package mainlib

import (
	"bytes"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/version"
)

func writeConfig(t *testing.T, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "pdx.yaml")
	require.NoError(t, os.WriteFile(path, []byte(content), 0o600))
	return path
}

const validPool = `pools:
- name: p
  models: [m]
  connector: nixl
  prefill: [{address: "10.0.0.1:8000"}]
  decode: [{address: "10.0.0.2:8000"}]
`

func TestValidate(t *testing.T) {
	bad := writeConfig(t, `grpc_address: 127.0.0.1:0
pools:
- name: p
  models: [m]
  connector: nixl
  prefil: [{address: "10.0.0.1:8000"}]
  decode: [{address: "10.0.0.2:8000"}]
  saturation: {kv_usage: "80%"}
  flow_control: {bands: [{priority: 2.5}]}
- name: Q
  models: [q]
  connector: nixl
  prefill: [{address: "10.0.0.1:8000"}]
  decode: [{address: "10.0.0.2:8000"}]
`)
	tests := []struct {
		name       string
		file       string
		wantStdout []string
		wantErr    []string // the lines of the error, each a problem
	}{
		{name: "the example config", file: "../../../deploy/pdx.yaml", wantStdout: []string{
			"../../../deploy/pdx.yaml: valid; ext_proc on 127.0.0.1:9002, admin on 127.0.0.1:9003\n",
			"  pool demo: models demo-model and every unlisted one, connector nixl, 2 prefill and 2 decode endpoints\n"}},
		{name: "docker-compose's config", file: "../../../deploy/docker-compose.pdx.yaml", wantStdout: []string{"valid"}},
		{name: "discovered endpoints are not looked up", file: writeConfig(t, `pools:
- name: k
  default: true
  connector: nixl
  kubernetes: {namespace: llm, service: engines, port: 8000}
`), wantStdout: []string{"  pool k: every model, connector nixl, endpoints from Kubernetes namespace llm (not contacted)\n"}},
		{name: "every problem at once, in the file's order", file: bad, wantErr: []string{
			bad + `:6: pools[0].prefil: unknown field, did you mean "prefill"?`,
			bad + `:8: pools[0].saturation.kv_usage: expected a number, got string "80%" (a fraction: 0.8 for 80%)`,
			bad + `:9: pools[0].flow_control.bands[0].priority: expected a whole number from -2147483648 to 2147483647, got number 2.5`,
			bad + `:10: pools[1].name: "Q" must match [a-z0-9-]+`,
		}},
		{name: "TLS files are loaded", file: writeConfig(t, validPool+"tls: {cert_file: /nonexistent/cert.pem, key_file: /nonexistent/key.pem}\n"),
			wantErr: []string{"tls: loading cert_file /nonexistent/cert.pem and key_file /nonexistent/key.pem"}},
		{name: "a missing file", file: "/nonexistent/pdx.yaml", wantErr: []string{"config: open /nonexistent/pdx.yaml: no such file or directory"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			err := Main(t.Context(), []string{"validate", "--config", tt.file}, &stdout, &stderr)
			var status bytes.Buffer
			code := ExitStatus(err, &status)
			if tt.wantErr == nil {
				require.NoError(t, err)
				require.Equal(t, 0, code)
				for _, want := range tt.wantStdout {
					require.Contains(t, stdout.String(), want)
				}
				return
			}
			require.Equal(t, 1, code)
			require.Empty(t, stdout.String())
			lines := strings.Split(strings.TrimSuffix(status.String(), "\n"), "\n")
			require.Len(t, lines, len(tt.wantErr), status.String())
			for i, want := range tt.wantErr {
				require.True(t, strings.HasPrefix(lines[i], "pdx: "), lines[i])
				require.Contains(t, lines[i], want, "line %d", i)
			}
		})
	}

	// serve says the same of the file, before it listens anywhere.
	var stdout, stderr bytes.Buffer
	serveErr := Main(t.Context(), []string{"serve", "--config", bad}, &stdout, &stderr)
	validateErr := Main(t.Context(), []string{"validate", "--config", bad}, &stdout, &stderr)
	require.Error(t, serveErr)
	require.Equal(t, validateErr.Error(), serveErr.Error())
}

func TestVersion(t *testing.T) {
	for _, args := range [][]string{{"version"}, {"--version"}} {
		var stdout, stderr bytes.Buffer
		require.NoError(t, Main(t.Context(), args, &stdout, &stderr), args)
		require.Equal(t, version.Get().String(), stdout.String(), args)
		require.Contains(t, stdout.String(), "pdx ")
		require.Contains(t, stdout.String(), "commit: ")
		require.Contains(t, stdout.String(), "go:     "+runtime.Version())
		require.Contains(t, stdout.String(), "envoy:  "+version.Envoy)
	}
}

// Nothing on the command line is silently ignored.
func TestArgumentsRefused(t *testing.T) {
	good := writeConfig(t, validPool)
	tests := []struct {
		name    string
		args    []string
		wantErr string
	}{
		{"serve", []string{"serve", "--config", good, "extra-arg"}, `unexpected argument "extra-arg": serve takes only flags (pdx serve --help lists them)`},
		{"a flag after an argument", []string{"serve", "extra-arg", "--config", good}, `unexpected argument "extra-arg"`},
		{"validate", []string{"validate", "--config", good, "other.yaml"}, `unexpected argument "other.yaml": validate takes only flags`},
		{"validate without --config", []string{"validate"}, "validate needs --config"},
		{"envoy-config", []string{"envoy-config", "out.yaml"}, `unexpected argument "out.yaml": envoy-config takes only flags`},
		{"version", []string{"version", "--short"}, "flag provided but not defined: -short"},
		{"version argument", []string{"version", "now"}, `unexpected argument "now"`},
		{"check", []string{"check"}, `unknown command "check"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			err := Main(t.Context(), tt.args, &stdout, &stderr)
			require.ErrorIs(t, err, ErrUsage)
			require.ErrorContains(t, err, tt.wantErr)
			require.Empty(t, stdout.String())
		})
	}
}
