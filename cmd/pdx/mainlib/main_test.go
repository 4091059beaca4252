package mainlib

import (
	"bytes"
	"cmp"
	"flag"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/pdx-router/pdx/envoy"
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

// Every flag of envoy-config, under every profile, is either honoured (the
// output has what it sets, which Envoy accepts) or refused with the reason
// (an error naming the flag); none is silently dropped.
func TestEnvoyConfigFlagsByProfile(t *testing.T) {
	pki, err := stack.NewPKI(t.TempDir())
	require.NoError(t, err)
	bin, err := envoyproc.Binary()
	require.NoError(t, err)
	type outcome struct {
		want, wantErr string
		// asDefault: the flag sets what the profile has anyway.
		asDefault bool
		// names is the flag a refusal names, when it is another the row
		// needs (--decode-cluster eds for --decode-fallbacks); default
		// the row's.
		names string
	}
	both := func(o outcome) map[string]outcome {
		return map[string]outcome{envoy.ProfilePdx: o, envoy.ProfileAIGateway: o}
	}
	// pdxOnly: pdx's profile honours it, aigateway refuses it, or the
	// flag names it needs.
	pdxOnly := func(want, names string) map[string]outcome {
		return map[string]outcome{envoy.ProfilePdx: {want: want}, envoy.ProfileAIGateway: {wantErr: "profile aigateway", names: names}}
	}
	tls := []string{"--pdx-ca", pki.CAFile, "--pdx-sni", pki.ServerName}
	tests := []struct {
		name string
		flag string // the flag the row is about; a refusal names it
		args []string
		want map[string]outcome // by profile
	}{
		{"pdx address", "pdx-address", []string{"--pdx-address", "pdx.example:7000"}, both(outcome{want: "address: pdx.example, port_value: 7000 }"})},
		{"listen address", "listen-address", []string{"--listen-address", "0.0.0.0"}, both(outcome{want: "address: 0.0.0.0, port_value: 10000 }"})},
		{"listen port", "listen-port", []string{"--listen-port", "10500"}, both(outcome{want: "port_value: 10500 }"})},
		{"listen port out of range", "listen-port", []string{"--listen-port", "70000"}, both(outcome{wantErr: "listen port (--listen-port) 70000: want 0-65535"})},
		{"admin port", "admin-port", []string{"--admin-port", "9911"}, both(outcome{want: "address: 127.0.0.1, port_value: 9911 }"})},
		{"message timeout", "message-timeout", []string{"--message-timeout", "45s"}, map[string]outcome{
			envoy.ProfilePdx: {want: "message_timeout: 45s"},
			envoy.ProfileAIGateway: {wantErr: "message timeout 45s (--message-timeout): profile aigateway writes AI Gateway's translation's 5s, " +
				"which Envoy does not apply: both bodies are FULL_DUPLEX_STREAMED"}}},
		// With a streamed request body Envoy times the response headers'
		// exchange only, which pdx holds during an SGLang prefill.
		{"message timeout with streamed request bodies", "message-timeout", []string{"--request-body-mode", envoy.BodyFullDuplexStreamed, "--message-timeout", "45s"}, map[string]outcome{
			envoy.ProfilePdx:       {want: "message_timeout: 45s"},
			envoy.ProfileAIGateway: {wantErr: "message timeout 45s (--message-timeout)"}}},
		{"negative message timeout", "message-timeout", []string{"--message-timeout", "-1s"}, both(outcome{wantErr: "message timeout -1s (--message-timeout): must not be negative"})},
		{"buffer limit", "buffer-limit", []string{"--buffer-limit", "33554432"}, both(outcome{want: "per_connection_buffer_limit_bytes: 33554432"})},
		{"streamed bodies", "request-body-mode", []string{"--request-body-mode", envoy.BodyFullDuplexStreamed}, map[string]outcome{
			envoy.ProfilePdx:       {want: "request_body_mode: FULL_DUPLEX_STREAMED"},
			envoy.ProfileAIGateway: {want: "request_body_mode: FULL_DUPLEX_STREAMED", asDefault: true}}},
		{"buffered bodies", "request-body-mode", []string{"--request-body-mode", envoy.BodyBuffered}, map[string]outcome{
			envoy.ProfilePdx:       {want: "request_body_mode: BUFFERED", asDefault: true},
			envoy.ProfileAIGateway: {wantErr: "request body mode BUFFERED (--request-body-mode): profile aigateway sends both bodies FULL_DUPLEX_STREAMED"}}},
		{"unknown body mode", "request-body-mode", []string{"--request-body-mode", "STREAMED"}, both(outcome{wantErr: `request body mode "STREAMED" (--request-body-mode): want BUFFERED or FULL_DUPLEX_STREAMED`})},
		{"max request headers", "max-request-headers", []string{"--max-request-headers", "200"}, both(outcome{want: "max_headers_count: 200"})},
		{"max request headers KiB", "max-request-headers-kb", []string{"--max-request-headers-kb", "96"}, both(outcome{want: "max_request_headers_kb: 96"})},
		{"unknown profile", "profile", []string{"--profile", "gke"}, both(outcome{wantErr: `profile "gke" (--profile): want pdx or aigateway`})},
		{"EDS decode cluster", "decode-cluster", []string{"--decode-cluster", envoy.DecodeEDS}, pdxOnly("type: EDS", "")},
		{"unknown decode cluster", "decode-cluster", []string{"--decode-cluster", "static"}, both(outcome{wantErr: `decode cluster "static" (--decode-cluster)`})},
		{"decode fallbacks", "decode-fallbacks", []string{"--decode-cluster", envoy.DecodeEDS, "--decode-fallbacks", "3"}, pdxOnly("num_retries: 3", "decode-cluster")},
		{"decode fallbacks without EDS", "decode-fallbacks", []string{"--decode-fallbacks", "3"}, both(outcome{
			wantErr: "decode fallbacks 3 (--decode-fallbacks): they are Envoy's retries over the EDS decode cluster, which needs decode cluster eds (--decode-cluster eds)"})},
		{"xDS cluster", "xds-cluster", []string{"--decode-cluster", envoy.DecodeEDS, "--xds-cluster", "decode"}, pdxOnly("service_name: decode", "decode-cluster")},
		{"xDS cluster without EDS", "xds-cluster", []string{"--xds-cluster", "decode"}, both(outcome{wantErr: `xDS cluster "decode" (--xds-cluster)`})},
		{"observer", "observer", []string{"--observer"}, pdxOnly("name: pdx.observability", "")},
		{"observer address", "observer-address", []string{"--observer", "--observer-address", "observer.example:9100"}, pdxOnly("address: observer.example, port_value: 9100 }", "observer")},
		{"observer address without the pass", "observer-address", []string{"--observer-address", "observer.example:9100"}, both(outcome{
			wantErr: "observer address observer.example:9100 (--observer-address): the observability pass is off (--observer)"})},
		{"pdx CA and SNI", "pdx-ca", tls, pdxOnly("trusted_ca: { filename: "+pki.CAFile+" }", "")},
		{"pdx SNI", "pdx-sni", tls, pdxOnly("sni: "+pki.ServerName, "")},
		{"pdx CA without SNI", "pdx-sni", []string{"--pdx-ca", pki.CAFile}, both(outcome{wantErr: "(--pdx-ca and --pdx-sni)"})},
		{"mutual TLS", "pdx-client-cert", append([]string{"--pdx-client-cert", pki.ClientCertFile, "--pdx-client-key", pki.ClientKey}, tls...),
			pdxOnly("certificate_chain: { filename: "+pki.ClientCertFile+" }", "")},
		{"client key", "pdx-client-key", append([]string{"--pdx-client-cert", pki.ClientCertFile, "--pdx-client-key", pki.ClientKey}, tls...),
			pdxOnly("private_key: { filename: "+pki.ClientKey+" }", "")},
		{"client certificate without its key", "pdx-client-key", append([]string{"--pdx-client-cert", pki.ClientCertFile}, tls...), both(outcome{
			wantErr: "(--pdx-client-cert and --pdx-client-key)"})},
	}

	fs, _ := envoyConfigFlags(io.Discard)
	fs.VisitAll(func(f *flag.Flag) {
		require.True(t, slices.ContainsFunc(tests, func(tc struct {
			name string
			flag string
			args []string
			want map[string]outcome
		}) bool {
			return tc.flag == f.Name
		}), "no row for --%s", f.Name)
	})

	for _, profile := range []string{envoy.ProfilePdx, envoy.ProfileAIGateway} {
		var plain bytes.Buffer
		require.NoError(t, Main(t.Context(), []string{"envoy-config", "--profile", profile}, &plain, &plain))
		for _, tc := range tests {
			t.Run(profile+"/"+tc.name, func(t *testing.T) {
				o := tc.want[profile]
				var out bytes.Buffer
				err := Main(t.Context(), append([]string{"envoy-config", "--profile", profile}, tc.args...), &out, &out)
				if o.wantErr != "" {
					require.ErrorContains(t, err, o.wantErr)
					names := cmp.Or(o.names, tc.flag)
					require.ErrorContains(t, err, "--"+names, "the refusal names the flag")
					return
				}
				require.NoError(t, err)
				require.True(t, strings.Contains(out.String(), o.want), "the output has %q", o.want)
				if !o.asDefault {
					require.False(t, strings.Contains(plain.String(), o.want), "without the flag the output has no %q", o.want)
				}
				path := filepath.Join(t.TempDir(), "envoy.yaml")
				require.NoError(t, os.WriteFile(path, out.Bytes(), 0o600))
				require.NoError(t, envoyproc.ValidateFile(t.Context(), bin, path))
			})
		}
	}
}

// The generated file's header names commands that exist.
func TestEnvoyConfigHeaderNamesRealCommands(t *testing.T) {
	var out bytes.Buffer
	require.NoError(t, Main(t.Context(), []string{"envoy-config"}, &out, &out))
	var header strings.Builder
	for line := range strings.Lines(out.String()) {
		if !strings.HasPrefix(line, "#") {
			break
		}
		header.WriteString(line)
	}
	text := strings.ReplaceAll(header.String(), "\n# ", " ")
	makefile, err := os.ReadFile("../../../Makefile")
	require.NoError(t, err)
	commands := regexp.MustCompile("`(pdx|make) ([a-z-]+)[^`]*`").FindAllStringSubmatch(text, -1)
	require.NotEmpty(t, commands, "the header names how to make and run the file:\n%s", text)
	for _, m := range commands {
		switch m[1] {
		case "pdx":
			var help bytes.Buffer
			require.NoError(t, Main(t.Context(), []string{m[2], "--help"}, &help, &help), "`pdx %s` in the header", m[2])
		case "make":
			require.Regexp(t, "(?m)^"+regexp.QuoteMeta(m[2])+":", string(makefile), "`make %s` in the header", m[2])
		}
	}
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
