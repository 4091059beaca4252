//go:build egctl

// This test needs Envoy Gateway's egctl (at the go.mod's version of
// github.com/envoyproxy/gateway) and the pinned Envoy; `make k8s-translate`
// installs the first and runs it:
//
//	EGCTL=.tools/egctl/egctl go test -tags egctl -run TestEnvoyGatewayTranslation ./deploy/kubernetes/

package kubernetes_test

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	egv1a1 "github.com/envoyproxy/gateway/api/v1alpha1"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	gwv1 "sigs.k8s.io/gateway-api/apis/v1"

	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/processor"
)

// translation is what `egctl x translate --to gateway-api,xds -o json`
// prints: the resources with the status Envoy Gateway gives them, and per
// Gateway the xDS config dumps of its Envoy.
type translation struct {
	Gateways               []gwv1.Gateway                `json:"gateways"`
	HTTPRoutes             []gwv1.HTTPRoute              `json:"httpRoutes"`
	EnvoyExtensionPolicies []egv1a1.EnvoyExtensionPolicy `json:"envoyExtensionPolicies"`
	EnvoyPatchPolicies     []egv1a1.EnvoyPatchPolicy     `json:"envoyPatchPolicies"`
	ClientTrafficPolicies  []egv1a1.ClientTrafficPolicy  `json:"clientTrafficPolicies"`
	BackendTrafficPolicies []egv1a1.BackendTrafficPolicy `json:"backendTrafficPolicies"`
	XDS                    map[string]struct {
		Configs []map[string]any `json:"configs"`
	} `json:"xds"`
}

// TestEnvoyGatewayTranslation runs Envoy Gateway's own translator on base/
// and envoy-gateway/, requires every route and policy to be accepted, checks
// the generated ext_proc filter, listener buffer limit and ORIGINAL_DST
// cluster, and has the pinned Envoy validate the result (as a static
// bootstrap: EDS endpoints and RDS routes inlined).
func TestEnvoyGatewayTranslation(t *testing.T) {
	egctl := os.Getenv("EGCTL")
	require.NotEmpty(t, egctl, "set EGCTL to Envoy Gateway's egctl (make k8s-translate installs it)")
	bin, err := envoy.Binary()
	require.NoError(t, err, "run `make envoy` or set ENVOY_BIN")

	var in bytes.Buffer
	for _, f := range yamlFiles(t, baseDir, egDir) {
		data, err := os.ReadFile(f)
		require.NoError(t, err)
		in.WriteString("---\n")
		in.Write(data)
	}
	dir := t.TempDir()
	inFile := filepath.Join(dir, "in.yaml")
	require.NoError(t, os.WriteFile(inFile, in.Bytes(), 0o600))
	cmd := exec.CommandContext(t.Context(), egctl, "x", "translate", "--from", "gateway-api", "--to", "gateway-api,xds",
		"--type", "all", "--output", "json", "--add-missing-resources", "--file", inFile)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "egctl: %s", stderr.String())
	var tr translation
	require.NoError(t, json.Unmarshal(out, &tr))

	// Everything accepted, every reference resolved.
	accepted := func(what string, conds []metav1.Condition, want ...string) {
		t.Helper()
		got := map[string]bool{}
		for _, c := range conds {
			require.Equal(t, metav1.ConditionTrue, c.Status, "%s: %s %s: %s", what, c.Type, c.Reason, c.Message)
			got[c.Type] = true
		}
		for _, w := range want {
			require.True(t, got[w], "%s: no %s condition in %v", what, w, conds)
		}
	}
	require.Len(t, tr.HTTPRoutes, 1)
	for _, r := range tr.HTTPRoutes {
		require.NotEmpty(t, r.Status.Parents, r.Name)
		for _, p := range r.Status.Parents {
			accepted("HTTPRoute "+r.Name, p.Conditions, "Accepted", "ResolvedRefs")
		}
	}
	for _, g := range tr.Gateways {
		for _, l := range g.Status.Listeners {
			accepted("Gateway "+g.Name+" listener "+string(l.Name), l.Conditions, "Accepted", "Programmed")
		}
	}
	policies := map[string][]gwv1.PolicyAncestorStatus{}
	for _, p := range tr.EnvoyExtensionPolicies {
		policies["EnvoyExtensionPolicy "+p.Name] = p.Status.Ancestors
	}
	for _, p := range tr.EnvoyPatchPolicies {
		policies["EnvoyPatchPolicy "+p.Name] = p.Status.Ancestors
	}
	for _, p := range tr.ClientTrafficPolicies {
		policies["ClientTrafficPolicy "+p.Name] = p.Status.Ancestors
	}
	for _, p := range tr.BackendTrafficPolicies {
		policies["BackendTrafficPolicy "+p.Name] = p.Status.Ancestors
	}
	require.Len(t, policies, 4)
	for name, ancestors := range policies {
		require.NotEmpty(t, ancestors, name)
		for _, a := range ancestors {
			accepted(name, a.Conditions, "Accepted")
		}
	}

	// The generated xDS.
	require.Len(t, tr.XDS, 1, "one Gateway")
	var dump xdsDump
	for _, x := range tr.XDS {
		dump = newXDSDump(t, x.Configs)
	}
	objs := load(t, baseDir, egDir)
	ctp := get[*egv1a1.ClientTrafficPolicy](t, objs, "pdx")

	decode := dump.clusters["httproute/pdx/openai/rule/0"]
	require.NotNil(t, decode, "no cluster httproute/pdx/openai/rule/0: Envoy Gateway names clusters differently")
	require.Equal(t, "ORIGINAL_DST", decode["type"])
	require.Equal(t, "CLUSTER_PROVIDED", decode["lbPolicy"])
	require.NotContains(t, decode, "edsClusterConfig")
	require.NotContains(t, decode, "loadBalancingPolicy")
	require.Equal(t, map[string]any{"useHttpHeader": true, "httpHeaderName": processor.DestinationHeader}, decode["originalDstLbConfig"])
	require.Equal(t, "EDS", dump.clusters["httproute/pdx/openai/rule/1"]["type"], "the pass-through rule keeps its EDS cluster")

	var extProc []map[string]any
	var listeners int
	for _, l := range dump.listeners {
		walk(l, func(m map[string]any) {
			if tc, ok := m["typedConfig"].(map[string]any); ok &&
				tc["@type"] == "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor" {
				extProc = append(extProc, tc)
			}
		})
		if strings.HasPrefix(l["name"].(string), "pdx/pdx/") {
			listeners++
			require.EqualValues(t, ctp.Spec.Connection.BufferLimit.Value(), l["perConnectionBufferLimitBytes"], "listener %s", l["name"])
		}
	}
	require.Equal(t, 1, listeners, "the Gateway's listener")
	require.Len(t, extProc, 1)
	ep := extProc[0]
	require.Equal(t, map[string]any{
		"requestHeaderMode":   "SEND",
		"requestBodyMode":     "BUFFERED",
		"requestTrailerMode":  "SKIP",
		"responseHeaderMode":  "SKIP",
		"responseTrailerMode": "SKIP",
	}, ep["processingMode"])
	require.NotContains(t, ep, "failureModeAllow", "fail closed (false is the default)")
	require.Equal(t, true, ep["allowModeOverride"])
	require.Equal(t, "40s", ep["messageTimeout"])
	require.Equal(t, map[string]any{"receivingNamespaces": map[string]any{"untyped": []any{processor.MetadataNamespace}}}, ep["metadataOptions"])

	// The real Envoy accepts it.
	bootstrap := filepath.Join(dir, "envoy.json")
	data, err := json.MarshalIndent(dump.staticBootstrap(t), "", "  ")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(bootstrap, data, 0o600))
	require.NoError(t, envoy.ValidateFile(t.Context(), bin, bootstrap))
}

// xdsDump is one Envoy's config as egctl prints it (admin config dumps, in
// protojson).
type xdsDump struct {
	bootstrap map[string]any
	clusters  map[string]map[string]any
	endpoints map[string]map[string]any
	listeners []map[string]any
	routes    map[string]map[string]any
	secrets   []map[string]any
}

func newXDSDump(t *testing.T, configs []map[string]any) xdsDump {
	t.Helper()
	d := xdsDump{clusters: map[string]map[string]any{}, endpoints: map[string]map[string]any{}, routes: map[string]map[string]any{}}
	list := func(m map[string]any, key string) []map[string]any {
		var out []map[string]any
		if l, ok := m[key].([]any); ok {
			for _, e := range l {
				out = append(out, e.(map[string]any))
			}
		}
		return out
	}
	resource := func(m map[string]any) map[string]any {
		delete(m, "@type")
		return m
	}
	for _, c := range configs {
		switch typ := c["@type"].(string); {
		case strings.HasSuffix(typ, ".BootstrapConfigDump"):
			d.bootstrap = c["bootstrap"].(map[string]any)
		case strings.HasSuffix(typ, ".ClustersConfigDump"):
			for _, e := range append(list(c, "staticClusters"), list(c, "dynamicActiveClusters")...) {
				cl := resource(e["cluster"].(map[string]any))
				d.clusters[cl["name"].(string)] = cl
			}
		case strings.HasSuffix(typ, ".EndpointsConfigDump"):
			for _, e := range append(list(c, "staticEndpointConfigs"), list(c, "dynamicEndpointConfigs")...) {
				ep := resource(e["endpointConfig"].(map[string]any))
				d.endpoints[ep["clusterName"].(string)] = ep
			}
		case strings.HasSuffix(typ, ".ListenersConfigDump"):
			for _, e := range list(c, "dynamicListeners") {
				d.listeners = append(d.listeners, resource(e["activeState"].(map[string]any)["listener"].(map[string]any)))
			}
		case strings.HasSuffix(typ, ".RoutesConfigDump"):
			for _, e := range list(c, "dynamicRouteConfigs") {
				rc := resource(e["routeConfig"].(map[string]any))
				d.routes[rc["name"].(string)] = rc
			}
		case strings.HasSuffix(typ, ".SecretsConfigDump"):
			for _, e := range list(c, "dynamicActiveSecrets") {
				d.secrets = append(d.secrets, resource(e["secret"].(map[string]any)))
			}
		default:
			require.Failf(t, "unknown config dump", "%s", typ)
		}
	}
	require.NotNil(t, d.bootstrap)
	return d
}

// staticBootstrap turns the dump into one bootstrap Envoy can load without
// Envoy Gateway: no xDS source, EDS clusters given their endpoints inline,
// RDS replaced by the route configurations.
func (d xdsDump) staticBootstrap(t *testing.T) map[string]any {
	t.Helper()
	b := d.bootstrap
	delete(b, "dynamicResources")
	static := b["staticResources"].(map[string]any)
	inline := func(cl map[string]any) map[string]any {
		if cl["type"] == "EDS" {
			name := cl["name"].(string)
			if eds, ok := cl["edsClusterConfig"].(map[string]any); ok && eds["serviceName"] != nil {
				name = eds["serviceName"].(string)
			}
			delete(cl, "edsClusterConfig")
			cl["type"] = "STATIC"
			cl["loadAssignment"] = map[string]any{"clusterName": name}
			if ep, ok := d.endpoints[name]; ok {
				cl["loadAssignment"] = ep
			}
		}
		return cl
	}
	var clusters []any
	for _, c := range static["clusters"].([]any) {
		cl := c.(map[string]any)
		if cl["name"] == "xds_cluster" {
			continue // Envoy Gateway's own xDS connection, with certificates from files
		}
		clusters = append(clusters, inline(cl))
	}
	for _, cl := range d.clusters {
		clusters = append(clusters, inline(cl))
	}
	static["clusters"] = clusters
	listeners, _ := static["listeners"].([]any)
	for _, l := range d.listeners {
		walk(l, func(m map[string]any) {
			rds, ok := m["rds"].(map[string]any)
			if !ok {
				return
			}
			rc, ok := d.routes[rds["routeConfigName"].(string)]
			require.True(t, ok, "no route configuration %v", rds["routeConfigName"])
			delete(m, "rds")
			m["routeConfig"] = rc
		})
		listeners = append(listeners, l)
	}
	static["listeners"] = listeners
	if len(d.secrets) > 0 {
		var secrets []any
		for _, s := range d.secrets {
			secrets = append(secrets, s)
		}
		static["secrets"] = secrets
	}
	return b
}

// walk calls f on every JSON object in v.
func walk(v any, f func(map[string]any)) {
	switch v := v.(type) {
	case map[string]any:
		f(v)
		for _, e := range v {
			walk(e, f)
		}
	case []any:
		for _, e := range v {
			walk(e, f)
		}
	}
}
