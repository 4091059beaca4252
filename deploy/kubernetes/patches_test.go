package kubernetes_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"

	egv1a1 "github.com/envoyproxy/gateway/api/v1alpha1"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/file/v3"        // in Envoy Gateway's listener
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/filters/cel/v3" // in the local reply mappers
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3" // in both listeners
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/least_request/v3" // in Envoy Gateway's cluster
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/retry/host/previous_hosts/v3"             // in Envoy Gateway's retry policy
	jsonpatch "github.com/evanphx/json-patch/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	gwv1 "sigs.k8s.io/gateway-api/apis/v1"
	"sigs.k8s.io/yaml"

	"github.com/pdx-router/pdx/envoy"
)

// The resources Envoy Gateway v1.9.1 generates for the manifests, as the
// EnvoyPatchPolicy of envoy-gateway-json-errors/ sees them before patching
// (protojson with proto field names), taken from `egctl x translate` on
// base/ and envoy-gateway/. The egctl test checks them against the real
// translation (and rewrites them with -update).
const (
	// egListenerFile is the Gateway's listener (its HTTP connection
	// manager, under the ClientTrafficPolicy and with the ext_proc filter).
	egListenerFile = "testdata/eg-listener.json"
	// egRouteConfigFile is the listener's route configuration.
	egRouteConfigFile = "testdata/eg-route-config.json"
)

// egResource is one xDS resource Envoy Gateway generates that an
// EnvoyPatchPolicy may patch, and the file holding it unpatched.
type egResource struct {
	typ, name, file string
}

// newMessage returns an empty proto of the resource's type.
func (r egResource) newMessage() proto.Message {
	switch r.typ {
	case string(egv1a1.ClusterEnvoyResourceType):
		return &clusterv3.Cluster{}
	case string(egv1a1.ListenerEnvoyResourceType):
		return &listenerv3.Listener{}
	case string(egv1a1.RouteConfigurationEnvoyResourceType):
		return &routev3.RouteConfiguration{}
	}
	panic("no resource type " + r.typ)
}

// Envoy Gateway's names (internal/xds/translator, with the default xDS name
// scheme): a rule's cluster is httproute/<namespace>/<route>/rule/<index>;
// a plain HTTP Gateway listener, its filter chain and its route
// configuration are <namespace>/<gateway>/<listener>.
func egRuleCluster(route *gwv1.HTTPRoute, rule int) string {
	return fmt.Sprintf("httproute/%s/%s/rule/%d", route.Namespace, route.Name, rule)
}

func egListenerName(gw *gwv1.Gateway, listener gwv1.SectionName) string {
	return fmt.Sprintf("%s/%s/%s", gw.Namespace, gw.Name, listener)
}

// patchesFor returns the operations of the policies on one resource, in
// the order Envoy Gateway applies them.
func patchesFor(policies []*egv1a1.EnvoyPatchPolicy, typ, name string) []egv1a1.JSONPatchOperation {
	var ops []egv1a1.JSONPatchOperation
	for _, p := range policies {
		for _, jp := range p.Spec.JSONPatches {
			if string(jp.Type) == typ && jp.Name == name {
				ops = append(ops, jp.Operation)
			}
		}
	}
	return ops
}

// patch applies operations to a resource in protojson the way Envoy
// Gateway does (evanphx/json-patch/v5, paths created on add), then decodes
// the result strictly (protojson: an unknown or misspelt field is an error)
// into msg.
func patch(doc []byte, ops []egv1a1.JSONPatchOperation, msg proto.Message) error {
	opts := jsonpatch.NewApplyOptions()
	opts.EnsurePathExistsOnAdd = true
	for i, op := range ops {
		if op.JSONPath != nil {
			return fmt.Errorf("patch %d: use path, not jsonPath", i)
		}
		if op.Path == nil {
			return fmt.Errorf("patch %d: no path", i)
		}
		o := map[string]any{"op": string(op.Op), "path": *op.Path}
		if op.Value != nil {
			o["value"] = json.RawMessage(op.Value.Raw)
		}
		if op.From != nil {
			o["from"] = *op.From
		}
		raw, err := json.Marshal([]any{o})
		if err != nil {
			return err
		}
		p, err := jsonpatch.DecodePatch(raw)
		if err != nil {
			return fmt.Errorf("patch %d: %w", i, err)
		}
		if doc, err = p.ApplyWithOptions(doc, opts); err != nil {
			return fmt.Errorf("patch %d (%s %s) does not apply to Envoy Gateway's resource: %w", i, op.Op, *op.Path, err)
		}
	}
	if err := protojson.Unmarshal(doc, msg); err != nil {
		return fmt.Errorf("the patched resource is not an Envoy %T: %w\n%s", msg, err, doc)
	}
	return nil
}

// patched applies the policies' operations on r to its file and returns the
// result, which Envoy's own validation rules accept.
func patched[T proto.Message](t *testing.T, policies []*egv1a1.EnvoyPatchPolicy, r egResource) T {
	t.Helper()
	doc, err := os.ReadFile(r.file)
	require.NoError(t, err)
	unpatched := r.newMessage()
	require.NoError(t, protojson.Unmarshal(doc, unpatched), r.file)
	require.Equal(t, r.name, unpatched.ProtoReflect().Get(unpatched.ProtoReflect().Descriptor().Fields().ByName("name")).String(),
		"%s holds another resource", r.file)
	msg := r.newMessage()
	require.NoError(t, patch(doc, patchesFor(policies, r.typ, r.name), msg), "%s %s", r.typ, r.name)
	if v, ok := msg.(interface{ ValidateAll() error }); ok {
		require.NoError(t, v.ValidateAll(), "%s %s after the patches", r.typ, r.name)
	}
	return msg.(T)
}

// hcmOf returns the HTTP connection manager of a listener's default filter
// chain (a plain HTTP Gateway listener has no other), which must be its
// first filter: the listener patch's path names it by index.
func hcmOf(t *testing.T, l *listenerv3.Listener) *hcmv3.HttpConnectionManager {
	t.Helper()
	fc := l.GetDefaultFilterChain()
	require.NotNil(t, fc, "listener %s has no default filter chain", l.GetName())
	require.NotEmpty(t, fc.GetFilters())
	f := fc.GetFilters()[0]
	require.Equal(t, "envoy.filters.network.http_connection_manager", f.GetName(), "listener %s: the first filter", l.GetName())
	var hcm hcmv3.HttpConnectionManager
	require.NoError(t, f.GetTypedConfig().UnmarshalTo(&hcm))
	return &hcm
}

// extProcOf returns the HTTP connection manager's ext_proc filter.
func extProcOf(t *testing.T, hcm *hcmv3.HttpConnectionManager) *extprocv3.ExternalProcessor {
	t.Helper()
	var found []*extprocv3.ExternalProcessor
	for _, f := range hcm.GetHttpFilters() {
		if f.GetName() == "envoy.filters.http.ext_proc" || strings.HasPrefix(f.GetName(), "envoy.filters.http.ext_proc/") {
			var ep extprocv3.ExternalProcessor
			require.NoError(t, f.GetTypedConfig().UnmarshalTo(&ep), f.GetName())
			found = append(found, &ep)
		}
	}
	require.Len(t, found, 1, "one ext_proc filter")
	return found[0]
}

// pdxEnvoy is pdx's own Envoy bootstrap as envoy.Render writes it with the
// defaults (those of pdx's config, which base/ keeps), decoded as Envoy's
// protos: what the Envoy Gateway variant must match.
type pdxEnvoy struct {
	hcm     *hcmv3.HttpConnectionManager
	route   *routev3.Route // the only route
	extProc *extprocv3.ExternalProcessor
}

func renderPdxEnvoy(t *testing.T) pdxEnvoy {
	t.Helper()
	var buf bytes.Buffer
	require.NoError(t, envoy.Render(&buf, envoy.Config{PdxAddress: "127.0.0.1:9002"}))
	j, err := yaml.YAMLToJSON(buf.Bytes())
	require.NoError(t, err)
	var b struct {
		StaticResources struct {
			Listeners []struct {
				FilterChains []struct {
					Filters []struct {
						Name        string          `json:"name"`
						TypedConfig json.RawMessage `json:"typed_config"`
					} `json:"filters"`
				} `json:"filter_chains"`
			} `json:"listeners"`
		} `json:"static_resources"`
	}
	require.NoError(t, json.Unmarshal(j, &b))
	ls := b.StaticResources.Listeners
	require.Len(t, ls, 1)
	require.Len(t, ls[0].FilterChains, 1)
	require.Len(t, ls[0].FilterChains[0].Filters, 1)
	f := ls[0].FilterChains[0].Filters[0]
	require.Equal(t, "envoy.filters.network.http_connection_manager", f.Name)
	var typed anypb.Any
	require.NoError(t, protojson.Unmarshal(f.TypedConfig, &typed))
	var hcm hcmv3.HttpConnectionManager
	require.NoError(t, typed.UnmarshalTo(&hcm))
	vhs := hcm.GetRouteConfig().GetVirtualHosts()
	require.Len(t, vhs, 1)
	require.Len(t, vhs[0].GetRoutes(), 1, "pdx's Envoy has one route; the patch puts its response headers on the whole route configuration")
	require.Empty(t, hcm.GetRouteConfig().GetResponseHeadersToAdd())
	require.Empty(t, vhs[0].GetResponseHeadersToAdd())
	return pdxEnvoy{hcm: &hcm, route: vhs[0].GetRoutes()[0], extProc: extProcOf(t, &hcm)}
}

// requireProtoEqual requires two protos to be equal, showing where they
// first differ and want in full, as YAML (what the patch's value must be).
func requireProtoEqual(t *testing.T, want, got proto.Message, what string) {
	t.Helper()
	if proto.Equal(want, got) {
		return
	}
	w, g := protoYAML(t, want), protoYAML(t, got)
	wl, gl := strings.Split(w, "\n"), strings.Split(g, "\n")
	i := 0
	for i < len(wl) && i < len(gl) && wl[i] == gl[i] {
		i++
	}
	excerpt := func(lines []string) string {
		return strings.Join(lines[max(0, i-3):min(len(lines), i+3)], "\n")
	}
	require.Failf(t, what+" differs from pdx's own Envoy bootstrap",
		"first difference at line %d:\nenvoy.Render:\n%s\ngot:\n%s\n\nenvoy.Render in full:\n%s", i+1, excerpt(wl), excerpt(gl), w)
}

// protoYAML writes a proto as YAML with proto field names.
func protoYAML(t *testing.T, m proto.Message) string {
	t.Helper()
	j, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(m)
	require.NoError(t, err)
	y, err := yaml.JSONToYAML(j)
	require.NoError(t, err)
	return string(y)
}

// responseHeaders wraps response headers to add as one message, for
// requireProtoEqual.
func responseHeaders(opts []*corev3.HeaderValueOption) proto.Message {
	return &routev3.RouteConfiguration{ResponseHeadersToAdd: opts}
}

// TestPatchValuesDecodeStrictly: a patch's value is free-form JSON to
// Kubernetes (TestStrictDecodeRejectsUnknownFields cannot see into it), so
// the patched resources are decoded as Envoy's protos, strictly: a
// misspelt field, a wrong enum or a path that does not apply is an error,
// as it is for Envoy Gateway (which then leaves the policy unprogrammed).
// The patches as written apply.
func TestPatchValuesDecodeStrictly(t *testing.T) {
	objs := load(t, jsonErrorsDir)
	listener := egResource{typ: string(egv1a1.ListenerEnvoyResourceType), name: "pdx/pdx/http", file: egListenerFile}
	routeConfig := egResource{typ: string(egv1a1.RouteConfigurationEnvoyResourceType), name: "pdx/pdx/http", file: egRouteConfigFile}
	tests := []struct {
		name     string
		resource egResource
		// change edits the JSON of the resource's first patch operation.
		change  func(op map[string]any)
		wantErr string // "" means the patches apply
	}{
		{name: "listener as written", resource: listener},
		{name: "route configuration as written", resource: routeConfig},
		{
			name: "listener: misspelt mapper field", resource: listener,
			change: func(op map[string]any) {
				m := op["value"].(map[string]any)["mappers"].([]any)[0].(map[string]any)
				m["body_format_overide"] = m["body_format_override"]
				delete(m, "body_format_override")
			},
			wantErr: `unknown field "body_format_overide"`,
		},
		{
			name: "listener: misspelt CEL field", resource: listener,
			change: func(op map[string]any) {
				tc := op["value"].(map[string]any)["mappers"].([]any)[0].(map[string]any)["filter"].(map[string]any)["extension_filter"].(map[string]any)["typed_config"].(map[string]any)
				tc["expresion"] = tc["expression"]
				delete(tc, "expression")
			},
			wantErr: `unknown field "expresion"`,
		},
		{
			name: "listener: a path past the HTTP connection manager", resource: listener,
			change:  func(op map[string]any) { op["path"] = "/default_filter_chain/filters/0/local_reply_config" },
			wantErr: `unknown field "local_reply_config"`,
		},
		{
			name: "route configuration: wrong append action", resource: routeConfig,
			change: func(op map[string]any) {
				op["value"].([]any)[0].(map[string]any)["append_action"] = "OVERWRITE"
			},
			wantErr: `invalid value for enum field appendAction: "OVERWRITE"`,
		},
		{
			name: "listener: remove a field Envoy Gateway does not set", resource: listener,
			change:  func(op map[string]any) { op["op"], op["path"] = "remove", "/tcp_backlog_size" },
			wantErr: "does not apply to Envoy Gateway's resource",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ops := patchesFor(all[*egv1a1.EnvoyPatchPolicy](objs), tt.resource.typ, tt.resource.name)
			require.NotEmpty(t, ops)
			if tt.change != nil {
				raw, err := json.Marshal(ops[0])
				require.NoError(t, err)
				var op map[string]any
				require.NoError(t, json.Unmarshal(raw, &op))
				tt.change(op)
				raw, err = json.Marshal(op)
				require.NoError(t, err)
				ops = slices.Clone(ops)
				ops[0] = egv1a1.JSONPatchOperation{}
				require.NoError(t, json.Unmarshal(raw, &ops[0]))
			}
			doc, err := os.ReadFile(tt.resource.file)
			require.NoError(t, err)
			err = patch(doc, ops, tt.resource.newMessage())
			if tt.wantErr == "" {
				require.NoError(t, err)
				return
			}
			require.Error(t, err)
			require.Contains(t, err.Error(), tt.wantErr)
		})
	}
}
