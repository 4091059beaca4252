//go:build egctl

// This test needs Envoy Gateway's egctl (at the go.mod's version of
// github.com/envoyproxy/gateway) and the pinned Envoy; `make k8s-translate`
// installs the first and runs it:
//
//	EGCTL=$PWD/.tools/egctl/egctl go test -tags egctl -run TestEnvoyGatewayTranslation ./deploy/kubernetes/

package kubernetes_test

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	egv1a1 "github.com/envoyproxy/gateway/api/v1alpha1"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	overridehostv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/override_host/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/round_robin/v3" // the override_host fallback
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	gwv1 "sigs.k8s.io/gateway-api/apis/v1"
	"sigs.k8s.io/yaml"

	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/internal/testbed/envoyproc"
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

// update rewrites the testdata files of Envoy Gateway's unpatched
// resources (see egListenerFile) from the translation:
//
//	EGCTL=$PWD/.tools/egctl/egctl go test -tags egctl -run TestEnvoyGatewayTranslation ./deploy/kubernetes/ -update
var update = flag.Bool("update", false, "rewrite testdata/eg-*.json from egctl's translation")

// translate runs egctl on the manifests of dirs, leaving out the documents
// of the kinds skip.
func translate(t *testing.T, egctl string, dirs []string, skip ...string) translation {
	t.Helper()
	var in bytes.Buffer
	for _, f := range yamlFiles(t, dirs...) {
		data, err := os.ReadFile(f)
		require.NoError(t, err)
		docs, err := documents(data)
		require.NoError(t, err)
		for _, doc := range docs {
			var tm metav1.TypeMeta
			require.NoError(t, yaml.Unmarshal(doc, &tm), f)
			if slices.Contains(skip, tm.Kind) {
				continue
			}
			in.WriteString("---\n")
			in.Write(doc)
		}
	}
	inFile := filepath.Join(t.TempDir(), "in.yaml")
	require.NoError(t, os.WriteFile(inFile, in.Bytes(), 0o600))
	cmd := exec.CommandContext(t.Context(), egctl, "x", "translate", "--from", "gateway-api", "--to", "gateway-api,xds",
		"--type", "all", "--output", "json", "--add-missing-resources", "--file", inFile)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "egctl: %s", stderr.String())
	var tr translation
	require.NoError(t, json.Unmarshal(out, &tr))
	return tr
}

// dumpOf returns the xDS of the translation's only Gateway.
func dumpOf(t *testing.T, tr translation) xdsDump {
	t.Helper()
	require.Len(t, tr.XDS, 1, "one Gateway")
	var dump xdsDump
	for _, x := range tr.XDS {
		dump = newXDSDump(t, x.Configs)
	}
	return dump
}

// TestEnvoyGatewayTranslation runs Envoy Gateway's own translator on base/
// and envoy-gateway/, requires every route and policy to be accepted and
// no EnvoyPatchPolicy, checks that the generated Envoy config is pdx's own
// bootstrap where pdx depends on it (ext_proc filter, buffer and header
// limits, one route to the decode cluster, whose load balancing policy is
// override_host on pdx's header, with retries for the decode fallback),
// checks the testdata the manifest tests patch against the translation,
// and has the pinned Envoy validate the result (as a static bootstrap: EDS
// endpoints and RDS routes inlined). With the optional
// envoy-gateway-json-errors/ patch on top, the listener has pdx's local
// replies and the route configuration pdx's x-request-id headers, and the
// pinned Envoy validates that too.
func TestEnvoyGatewayTranslation(t *testing.T) {
	egctl := os.Getenv("EGCTL")
	require.NotEmpty(t, egctl, "set EGCTL to Envoy Gateway's egctl (make k8s-translate installs it)")
	bin, err := envoyproc.Binary()
	require.NoError(t, err, "run `make envoy` or set ENVOY_BIN")
	dirs := []string{baseDir, egDir}
	tr := translate(t, egctl, dirs)

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
	require.Empty(t, tr.EnvoyPatchPolicies, "the default set needs no EnvoyPatchPolicy")
	require.Len(t, policies, 3)
	for name, ancestors := range policies {
		require.NotEmpty(t, ancestors, name)
		for _, a := range ancestors {
			accepted(name, a.Conditions, "Accepted")
		}
	}

	// The generated xDS.
	dump := dumpOf(t, tr)
	objs := load(t, dirs...)
	p := loadPdx(t, objs)
	own := renderPdxEnvoy(t)
	ctp := get[*egv1a1.ClientTrafficPolicy](t, objs, "pdx")
	eep := get[*egv1a1.EnvoyExtensionPolicy](t, objs, "pdx")
	route := get[*gwv1.HTTPRoute](t, objs, "openai")
	gw := get[*gwv1.Gateway](t, objs, "pdx")
	name := egListenerName(gw, *route.Spec.ParentRefs[0].SectionName)
	bufferLimit := ctp.Spec.Connection.BufferLimit.Value()

	// Every rule's cluster takes the host pdx names (override_host on its
	// header) among the decode Service's endpoints.
	for i := range route.Spec.Rules {
		c := egRuleCluster(route, i)
		requireOverrideHost(t, dump, c)
	}

	// The route configuration: one route, every path, no timeout, to the
	// decode cluster, retried on the next host pdx named.
	require.Len(t, dump.routes, 1)
	rc := xdsResource[*routev3.RouteConfiguration](t, dump.routes[name], "route configuration "+name)
	require.Len(t, rc.GetVirtualHosts(), 1)
	var routes int
	for _, vh := range rc.GetVirtualHosts() {
		for _, r := range vh.GetRoutes() {
			routes++
			c := r.GetRoute().GetCluster()
			require.NotNil(t, dump.clusters[c], "route %s: no cluster %s", r.GetName(), c)
			requireOverrideHost(t, dump, c)
			rp := r.GetRoute().GetRetryPolicy()
			require.NotNil(t, rp, "route %s: decode fallback needs retries", r.GetName())
			require.GreaterOrEqual(t, int(rp.GetNumRetries().GetValue()), maxDecodeFallbacks(p), r.GetName())
			for _, on := range []string{"connect-failure", "refused-stream", "5xx"} {
				require.Contains(t, strings.Split(rp.GetRetryOn(), ","), on, "route %s", r.GetName())
			}
			require.Equal(t, "/", r.GetMatch().GetPrefix(), r.GetName())
			require.Empty(t, r.GetMatch().GetHeaders(), r.GetName())
			require.Equal(t, own.route.GetRoute().GetTimeout().AsDuration(), r.GetRoute().GetTimeout().AsDuration(), "route %s: no timeout", r.GetName())
			require.NotNil(t, r.GetRoute().GetTimeout(), "route %s: Envoy's default is 15s", r.GetName())
			require.Empty(t, r.GetResponseHeadersToAdd(), r.GetName())
		}
		require.Empty(t, vh.GetResponseHeadersToAdd(), vh.GetName())
	}
	require.Equal(t, 1, routes)
	require.Empty(t, rc.GetResponseHeadersToAdd(), "pdx itself sets x-request-id on the response (without envoy-gateway-json-errors/)")

	// The Gateway's listener.
	var listeners []*listenerv3.Listener
	for _, l := range dump.listeners {
		if strings.HasPrefix(l["name"].(string), gw.Namespace+"/"+gw.Name+"/") {
			listeners = append(listeners, xdsResource[*listenerv3.Listener](t, l, "listener "+l["name"].(string)))
		}
	}
	require.Len(t, listeners, 1, "the Gateway's listener")
	l := listeners[0]
	require.Equal(t, name, l.GetName())
	require.EqualValues(t, bufferLimit, l.GetPerConnectionBufferLimitBytes().GetValue())
	hcm := hcmOf(t, l)
	require.Equal(t, name, hcm.GetRds().GetRouteConfigName())
	require.EqualValues(t, bufferLimit, hcm.GetHttp2ProtocolOptions().GetInitialStreamWindowSize().GetValue(), "HTTP/2 bodies are bounded alike")
	require.Nil(t, hcm.GetLocalReplyConfig(), "Envoy's own local replies (without envoy-gateway-json-errors/)")
	// No header limits set: Envoy's defaults, as in pdx's own Envoy and pdx.
	require.Nil(t, hcm.GetMaxRequestHeadersKb())
	require.Nil(t, hcm.GetCommonHttpProtocolOptions().GetMaxHeadersCount())
	require.Equal(t, own.hcm.GetMaxRequestHeadersKb().GetValue(), p.cfg.GetMaxRequestHeadersKb())
	require.Equal(t, own.hcm.GetCommonHttpProtocolOptions().GetMaxHeadersCount().GetValue(), p.cfg.GetMaxRequestHeaders())
	require.EqualValues(t, envoy.DefaultMaxRequestHeadersKB, p.cfg.GetMaxRequestHeadersKb())
	require.EqualValues(t, envoy.DefaultMaxRequestHeaders, p.cfg.GetMaxRequestHeaders())
	// Request ids, paths and timeouts as in pdx's own Envoy.
	require.Equal(t, own.hcm.GetGenerateRequestId().GetValue(), hcm.GetGenerateRequestId().GetValue())
	require.Equal(t, own.hcm.GetPreserveExternalRequestId(), hcm.GetPreserveExternalRequestId())
	require.Equal(t, own.hcm.GetNormalizePath().GetValue(), hcm.GetNormalizePath().GetValue())
	require.Equal(t, own.hcm.GetMergeSlashes(), hcm.GetMergeSlashes())
	require.Equal(t, own.hcm.GetPathWithEscapedSlashesAction(), hcm.GetPathWithEscapedSlashesAction())
	require.Equal(t, own.hcm.GetStreamIdleTimeout().AsDuration(), hcm.GetStreamIdleTimeout().AsDuration())
	require.Equal(t, own.hcm.GetRequestHeadersTimeout().AsDuration(), hcm.GetRequestHeadersTimeout().AsDuration())
	require.Equal(t, own.hcm.GetRequestTimeout().AsDuration(), hcm.GetRequestTimeout().AsDuration())

	// The ext_proc filter.
	ep := extProcOf(t, hcm)
	require.Equal(t, extprocv3.ProcessingMode_BUFFERED, ep.GetProcessingMode().GetRequestBodyMode())
	mode := proto.Clone(own.extProc.GetProcessingMode()).(*extprocv3.ProcessingMode)
	mode.ResponseHeaderMode = extprocv3.ProcessingMode_SEND // pdx sets x-request-id and learns the decode that served
	requireProtoEqual(t, mode, ep.GetProcessingMode(), "the ext_proc processing mode")
	require.Equal(t, []string{processor.UpstreamAddressAttribute}, ep.GetResponseAttributes())
	require.False(t, ep.GetFailureModeAllow(), "fail closed")
	require.True(t, ep.GetAllowModeOverride())
	require.Equal(t, string(*eep.Spec.ExtProc[0].MessageTimeout), ep.GetMessageTimeout().AsDuration().String())
	require.Greater(t, ep.GetMessageTimeout().AsDuration(), p.maxPrefillTimeout())
	require.Equal(t, own.extProc.GetStatusOnError().GetCode(), ep.GetStatusOnError().GetCode())
	require.Equal(t, []string{processor.MetadataNamespace, processor.RequestMetadataNamespace}, ep.GetMetadataOptions().GetReceivingNamespaces().GetUntyped())
	require.ElementsMatch(t, own.extProc.GetMetadataOptions().GetReceivingNamespaces().GetUntyped(), ep.GetMetadataOptions().GetReceivingNamespaces().GetUntyped())

	// The testdata the manifest tests apply the optional patch to is
	// Envoy Gateway's translation of the default set.
	gen := map[string]map[string]any{
		egRouteConfigFile: dump.routes[name],
	}
	for _, l := range dump.listeners {
		if l["name"] == name {
			gen[egListenerFile] = l
		}
	}
	for _, r := range []egResource{
		{typ: string(egv1a1.ListenerEnvoyResourceType), file: egListenerFile},
		{typ: string(egv1a1.RouteConfigurationEnvoyResourceType), file: egRouteConfigFile},
	} {
		require.NotNil(t, gen[r.file], "no resource for %s in the translation", r.file)
		want := xdsResourceAs(t, gen[r.file], r.newMessage(), r.file)
		if *update {
			writeTestdata(t, r.file, want)
			continue
		}
		doc, err := os.ReadFile(r.file)
		require.NoError(t, err)
		got := r.newMessage()
		require.NoError(t, protojson.Unmarshal(doc, got), r.file)
		if !proto.Equal(want, got) {
			require.Failf(t, "stale testdata", "%s is not Envoy Gateway's translation of the manifests (rerun with -update):\n%s", r.file, protoYAML(t, want))
		}
	}

	// The real Envoy accepts it.
	requireValidates(t, bin, dump)

	// With the optional patch: pdx's JSON local replies and x-request-id
	// response headers, accepted and valid.
	withJSON := translate(t, egctl, append(dirs, jsonErrorsDir))
	require.Len(t, withJSON.EnvoyPatchPolicies, 1)
	for _, p := range withJSON.EnvoyPatchPolicies {
		require.NotEmpty(t, p.Status.Ancestors, p.Name)
		for _, a := range p.Status.Ancestors {
			accepted("EnvoyPatchPolicy "+p.Name, a.Conditions, "Accepted")
		}
	}
	jd := dumpOf(t, withJSON)
	jrc := xdsResource[*routev3.RouteConfiguration](t, jd.routes[name], "route configuration "+name)
	requireProtoEqual(t, responseHeaders(own.route.GetResponseHeadersToAdd()), responseHeaders(jrc.GetResponseHeadersToAdd()), "the route configuration's response_headers_to_add")
	var jl *listenerv3.Listener
	for _, l := range jd.listeners {
		if l["name"] == name {
			jl = xdsResource[*listenerv3.Listener](t, l, "listener "+name)
		}
	}
	require.NotNil(t, jl)
	requireProtoEqual(t, own.hcm.GetLocalReplyConfig(), hcmOf(t, jl).GetLocalReplyConfig(), "the listener's local_reply_config")
	requireOverrideHost(t, jd, egRuleCluster(route, 0))
	requireValidates(t, bin, jd)
}

// requireOverrideHost requires the cluster named c to take its host from
// pdx's header by the override_host load balancing policy, among the
// endpoints Envoy Gateway gives it (EDS).
func requireOverrideHost(t *testing.T, dump xdsDump, c string) {
	t.Helper()
	decode := dump.clusters[c]
	require.NotNil(t, decode, "no cluster %s: Envoy Gateway names clusters differently", c)
	require.Equal(t, "EDS", decode["type"], c)
	require.NotContains(t, decode, "originalDstLbConfig", c)
	raw, err := json.Marshal(decode["loadBalancingPolicy"])
	require.NoError(t, err)
	var lb clusterv3.LoadBalancingPolicy
	require.NoError(t, protojson.Unmarshal(raw, &lb), c)
	require.NotEmpty(t, lb.GetPolicies(), c)
	var oh overridehostv3.OverrideHost
	require.NoError(t, lb.GetPolicies()[0].GetTypedExtensionConfig().GetTypedConfig().UnmarshalTo(&oh), "%s: the first policy is override_host", c)
	require.NotEmpty(t, oh.GetOverrideHostSources(), c)
	require.Equal(t, processor.DestinationHeader, oh.GetOverrideHostSources()[0].GetHeader(), c)
}

// requireValidates has the pinned Envoy validate dump as a static
// bootstrap.
func requireValidates(t *testing.T, bin string, dump xdsDump) {
	t.Helper()
	bootstrap := filepath.Join(t.TempDir(), "envoy.json")
	data, err := json.MarshalIndent(dump.staticBootstrap(t), "", "  ")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(bootstrap, data, 0o600))
	require.NoError(t, envoyproc.ValidateFile(t.Context(), bin, bootstrap))
}

// xdsResource decodes one resource of a config dump (protojson) as
// Envoy's proto, strictly.
func xdsResource[T proto.Message](t *testing.T, r map[string]any, what string) T {
	t.Helper()
	var zero T
	return xdsResourceAs(t, r, zero.ProtoReflect().New().Interface(), what).(T)
}

func xdsResourceAs(t *testing.T, r map[string]any, msg proto.Message, what string) proto.Message {
	t.Helper()
	require.NotNil(t, r, "no %s", what)
	raw, err := json.Marshal(r)
	require.NoError(t, err)
	require.NoError(t, protojson.Unmarshal(raw, msg), what)
	return msg
}

// writeTestdata writes m as indented protojson with proto field names, the
// way Envoy Gateway's EnvoyPatchPolicy sees it.
func writeTestdata(t *testing.T, file string, m proto.Message) {
	t.Helper()
	raw, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(m)
	require.NoError(t, err)
	var out bytes.Buffer
	require.NoError(t, json.Indent(&out, raw, "", "  "))
	out.WriteByte('\n')
	require.NoError(t, os.WriteFile(file, out.Bytes(), 0o644))
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
