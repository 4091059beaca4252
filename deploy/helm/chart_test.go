package helm_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	egv1a1 "github.com/envoyproxy/gateway/api/v1alpha1"
	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/util/intstr"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"
	gwv1 "sigs.k8s.io/gateway-api/apis/v1"
	"sigs.k8s.io/yaml"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/discovery"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/objectives"
	"github.com/pdx-router/pdx/internal/ociimage"
	"github.com/pdx-router/pdx/internal/testbed/kubeapi"
	"github.com/pdx-router/pdx/processor"
)

// cluster is the real API server checkRBAC runs pdx's watchers against,
// with the InferenceObjective CRDs, started by the first test that does.
var cluster = kubeapi.Package{CRDs: kubeapi.InferenceCRDs}

// TestMain sends client-go's logs (the refused watches of checkRBAC) to
// nowhere.
func TestMain(m *testing.M) {
	klog.SetSlogLogger(slog.New(slog.DiscardHandler))
	os.Exit(cluster.Wrap(m).Run())
}

const (
	chartDir  = "pdx"
	release   = "pdx"
	namespace = "pdx"
	// rawDir holds the raw manifests the chart must reproduce.
	rawDir = "../kubernetes"
	h2c    = "kubernetes.io/h2c"
)

// codecs decodes every kind the chart renders into its upstream Go type,
// strictly: an unknown or wrongly-cased field, a duplicate field or an
// unregistered kind is an error.
var codecs = serializer.NewCodecFactory(newScheme(), serializer.EnableStrict)

func newScheme() *runtime.Scheme {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{
		corev1.AddToScheme, appsv1.AddToScheme, policyv1.AddToScheme, rbacv1.AddToScheme,
		gwv1.Install, egv1a1.AddToScheme, infv1.Install, monitoringv1.AddToScheme,
	} {
		if err := add(s); err != nil {
			panic(err)
		}
	}
	return s
}

// object is one decoded document of a rendered template or raw manifest.
type object struct {
	file string
	obj  runtime.Object
}

func (o object) String() string {
	m, _ := meta.Accessor(o.obj)
	return fmt.Sprintf("%s: %s %s/%s", o.file, o.obj.GetObjectKind().GroupVersionKind().Kind, m.GetNamespace(), m.GetName())
}

// decodeAll splits a YAML stream into documents, leaves out those holding
// only comments, and decodes each strictly.
func decodeAll(file string, data []byte) ([]object, error) {
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var objs []object
	for i := 1; ; i++ {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return objs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", file, err)
		}
		j, err := yaml.YAMLToJSON(doc)
		if err != nil {
			return nil, fmt.Errorf("%s: document %d: %w", file, i, err)
		}
		if string(j) == "null" {
			continue
		}
		obj, _, err := codecs.UniversalDeserializer().Decode(doc, nil, nil)
		if err != nil {
			return nil, fmt.Errorf("%s: document %d: %w", file, i, err)
		}
		objs = append(objs, object{file: file, obj: obj})
	}
}

// rendered is the chart rendered with some values: its objects, decoded,
// and NOTES.txt.
type rendered struct {
	objs  []object
	notes string
}

// render renders the chart as `helm install pdx deploy/helm/pdx -n pdx`
// would, with values over values.yaml, in strict mode (a template reading a
// value that does not exist fails), and decodes every object.
func render(t *testing.T, values map[string]any) (rendered, error) {
	t.Helper()
	chrt, err := loader.Load(chartDir)
	require.NoError(t, err)
	vals, err := chartutil.ToRenderValues(chrt, values,
		chartutil.ReleaseOptions{Name: release, Namespace: namespace, Revision: 1, IsInstall: true},
		chartutil.DefaultCapabilities)
	if err != nil {
		return rendered{}, err // values.schema.json refused the values
	}
	out, err := engine.Engine{Strict: true}.Render(chrt, vals)
	if err != nil {
		return rendered{}, err
	}
	var r rendered
	for _, name := range slices.Sorted(maps.Keys(out)) {
		base := path.Base(name)
		switch {
		case base == "NOTES.txt":
			r.notes = out[name]
			continue
		case strings.HasPrefix(base, "_"):
			continue
		}
		objs, err := decodeAll(name, []byte(out[name]))
		if err != nil {
			return rendered{}, err
		}
		r.objs = append(r.objs, objs...)
	}
	return r, nil
}

func mustRender(t *testing.T, values map[string]any) rendered {
	t.Helper()
	r, err := render(t, values)
	require.NoError(t, err)
	return r
}

func readValues(t *testing.T, file string) map[string]any {
	t.Helper()
	v, err := chartutil.ReadValuesFile(file)
	require.NoError(t, err)
	return v.AsMap()
}

// loadRaw decodes the raw manifests of deploy/kubernetes/dir.
func loadRaw(t *testing.T, dirs ...string) []object {
	t.Helper()
	var objs []object
	for _, dir := range dirs {
		files, err := filepath.Glob(filepath.Join(rawDir, dir, "*.yaml"))
		require.NoError(t, err)
		require.NotEmpty(t, files, dir)
		for _, f := range files {
			data, err := os.ReadFile(f)
			require.NoError(t, err)
			o, err := decodeAll(f, data)
			require.NoError(t, err)
			objs = append(objs, o...)
		}
	}
	return objs
}

func nameOf(o runtime.Object) string {
	m, err := meta.Accessor(o)
	if err != nil {
		return ""
	}
	return m.GetName()
}

func all[T runtime.Object](objs []object) []T {
	var out []T
	for _, o := range objs {
		if v, ok := o.obj.(T); ok {
			out = append(out, v)
		}
	}
	return out
}

// get returns the object of type T named name, failing the test without one.
func get[T runtime.Object](t *testing.T, objs []object, name string) T {
	t.Helper()
	for _, v := range all[T](objs) {
		if nameOf(v) == name {
			return v
		}
	}
	var zero T
	require.Failf(t, "no such object", "no %T named %q", zero, name)
	return zero
}

func kinds(objs []object) []string {
	var ks []string
	for _, o := range objs {
		ks = append(ks, o.obj.GetObjectKind().GroupVersionKind().Kind)
	}
	slices.Sort(ks)
	return ks
}

// pdx is the pdx Deployment, its container and its config, read from the
// ConfigMap the way the pod sees it.
type pdx struct {
	dep       *appsv1.Deployment
	container corev1.Container
	rawConfig string
	cfg       *configv1.Config
}

// loadPdx follows the Deployment's --config flag to its volume mount, the
// ConfigMap and the key behind it, and parses the config with pdx's own
// loader.
func loadPdx(t *testing.T, objs []object) pdx {
	t.Helper()
	deps := all[*appsv1.Deployment](objs)
	require.Len(t, deps, 1)
	dep := deps[0]
	pod := dep.Spec.Template.Spec
	require.Len(t, pod.Containers, 1)
	c := pod.Containers[0]

	cfgPath, ok := flagValue(c.Args, "config")
	require.True(t, ok, "pdx's args have no --config: %v", c.Args)
	var mount *corev1.VolumeMount
	for i, m := range c.VolumeMounts {
		if m.MountPath == path.Dir(cfgPath) {
			mount = &c.VolumeMounts[i]
		}
	}
	require.NotNil(t, mount, "nothing is mounted at %s", path.Dir(cfgPath))
	require.True(t, mount.ReadOnly)
	var cm *corev1.ConfigMapVolumeSource
	for _, v := range pod.Volumes {
		if v.Name == mount.Name {
			cm = v.ConfigMap
		}
	}
	require.NotNil(t, cm, "volume %s is not a ConfigMap", mount.Name)
	key := path.Base(cfgPath)
	if len(cm.Items) > 0 {
		key = ""
		for _, it := range cm.Items {
			if it.Path == path.Base(cfgPath) {
				key = it.Key
			}
		}
		require.NotEmpty(t, key, "ConfigMap volume %s has no item at %s", cm.Name, path.Base(cfgPath))
	}
	data, ok := get[*corev1.ConfigMap](t, objs, cm.Name).Data[key]
	require.True(t, ok, "ConfigMap %s has no key %s", cm.Name, key)

	cfg, err := config.Parse([]byte(data))
	require.NoError(t, err, "ConfigMap %s, key %s:\n%s", cm.Name, key, data)
	return pdx{dep: dep, container: c, rawConfig: data, cfg: cfg}
}

func (p pdx) maxPrefillTimeout() time.Duration {
	var d time.Duration
	for _, pool := range p.cfg.GetPools() {
		d = max(d, pool.GetPrefillTimeout().AsDuration())
	}
	return d
}

func listenPort(t *testing.T, addr string) int32 {
	t.Helper()
	i := strings.LastIndex(addr, ":")
	require.Positive(t, i, "address %q", addr)
	host := strings.Trim(addr[:i], "[]")
	require.Contains(t, []string{"0.0.0.0", "::", ""}, host, "%s: the kubelet and Envoy connect to the pod IP", addr)
	port, err := strconv.ParseInt(addr[i+1:], 10, 32)
	require.NoError(t, err)
	return int32(port)
}

func containerPort(t *testing.T, c corev1.Container, name string) int32 {
	t.Helper()
	for _, p := range c.Ports {
		if p.Name == name {
			return p.ContainerPort
		}
	}
	require.Failf(t, "no container port", "container %s has no port named %s", c.Name, name)
	return 0
}

func resolvePort(t *testing.T, p intstr.IntOrString, c corev1.Container) int32 {
	t.Helper()
	if p.Type == intstr.String {
		return containerPort(t, c, p.StrVal)
	}
	return p.IntVal
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

// requirePdxService requires Service name, port to exist, select the pdx
// pods and send to pdx's grpc_address port.
func requirePdxService(t *testing.T, objs []object, p pdx, name string, port int32) {
	t.Helper()
	svc := get[*corev1.Service](t, objs, name)
	require.True(t, labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(p.dep.Spec.Template.Labels)),
		"Service %s does not select the pdx pods", name)
	i := slices.IndexFunc(svc.Spec.Ports, func(sp corev1.ServicePort) bool { return sp.Port == port })
	require.GreaterOrEqual(t, i, 0, "Service %s has no port %d", name, port)
	require.Equal(t, listenPort(t, p.cfg.GetGrpcAddress()), resolvePort(t, svc.Spec.Ports[i].TargetPort, p.container),
		"Service %s port %d does not reach pdx's grpc_address", name, port)
}

// requireGateway requires a route's parentRef to name a Gateway and its
// listener, and the Gateway the GatewayClass the chart renders or, when it
// renders none, the existing one the values name.
func requireGateway(t *testing.T, objs []object, ref gwv1.ParentReference, existingClass string) {
	t.Helper()
	require.NotNil(t, ref.Kind)
	require.Equal(t, gwv1.Kind("Gateway"), *ref.Kind)
	require.Nil(t, ref.Namespace, "the route's namespace")
	gw := get[*gwv1.Gateway](t, objs, string(ref.Name))
	if classes := all[*gwv1.GatewayClass](objs); len(classes) > 0 {
		require.Len(t, classes, 1)
		require.Equal(t, classes[0].Name, string(gw.Spec.GatewayClassName))
		require.Equal(t, gwv1.GatewayController("gateway.envoyproxy.io/gatewayclass-controller"), classes[0].Spec.ControllerName)
	} else {
		require.Equal(t, existingClass, string(gw.Spec.GatewayClassName), "the existing GatewayClass the values name")
	}
	require.NotNil(t, ref.SectionName)
	require.True(t, slices.ContainsFunc(gw.Spec.Listeners, func(l gwv1.Listener) bool { return l.Name == *ref.SectionName }),
		"Gateway %s has no listener %s", gw.Name, *ref.SectionName)
}

// requireEveryPath requires the route's only rule to take every request
// with no route timeout, and returns it.
func requireEveryPath(t *testing.T, route *gwv1.HTTPRoute) gwv1.HTTPRouteRule {
	t.Helper()
	require.Len(t, route.Spec.ParentRefs, 1)
	require.Len(t, route.Spec.Rules, 1, "HTTPRoute %s: one rule, for every path", route.Name)
	r := route.Spec.Rules[0]
	require.Len(t, r.Matches, 1)
	m := r.Matches[0]
	require.Nil(t, m.Method)
	require.Empty(t, m.Headers)
	require.NotNil(t, m.Path)
	require.Equal(t, gwv1.PathMatchPathPrefix, *m.Path.Type)
	require.Equal(t, "/", *m.Path.Value, "pdx answers unknown paths and GET /v1/models itself")
	require.Empty(t, r.Filters, "pdx, not the route, changes requests")
	require.NotNil(t, r.Timeouts)
	require.NotNil(t, r.Timeouts.Request)
	require.Equal(t, gwv1.Duration("0s"), *r.Timeouts.Request, "generations stream for minutes")
	require.Len(t, r.BackendRefs, 1)
	return r
}

func bufferLimit(t *testing.T, what string, q *resource.Quantity) int64 {
	t.Helper()
	require.NotNil(t, q, "%s: set bufferLimit", what)
	return q.Value()
}

func parseDuration(t *testing.T, what string, d *gwv1.Duration) time.Duration {
	t.Helper()
	require.NotNil(t, d, "set %s", what)
	v, err := time.ParseDuration(string(*d))
	require.NoError(t, err, what)
	return v
}

// existingClass names the GatewayClass a cluster already has, which the
// modes use unless they create their own.
const existingClass = "eg"

// The values of the modes.
var (
	envoyGatewayValues = map[string]any{"envoyGateway": map[string]any{
		"enabled": true, "gatewayClass": map[string]any{"name": existingClass}}}
	inferencePoolValues = map[string]any{"inferencePool": map[string]any{
		"enabled": true, "gatewayClass": map[string]any{"name": existingClass}}}
	// envoyGatewayOwnClassValues is the Envoy Gateway mode with the
	// chart's own GatewayClass.
	envoyGatewayOwnClassValues = map[string]any{"envoyGateway": map[string]any{
		"enabled": true, "gatewayClass": map[string]any{"create": true}}}
)

// TestChartRenders renders the chart in each mode and with overrides,
// decodes every object strictly into its upstream type (an unknown kind or
// field fails), and checks what ties the objects together: the config, as
// the pod sees it, passes pdx's loader; its listen ports are the container
// ports, the probes' and the Service's; selectors select the pdx pods; the
// drain fits the grace period; and each mode's references resolve.
func TestChartRenders(t *testing.T) {
	// The Services: pdx's, and the headless one its replicas find each
	// other by (peers).
	pdxKinds := []string{"ConfigMap", "Deployment", "PodDisruptionBudget", "Role", "RoleBinding", "Service", "Service", "ServiceAccount"}
	tests := []struct {
		name   string
		values map[string]any
		kinds  []string
		check  func(t *testing.T, r rendered, p pdx)
	}{
		{
			name:  "default",
			kinds: pdxKinds,
			check: func(t *testing.T, r rendered, p pdx) {
				require.Equal(t, ociimage.Repository+":0.1.0", p.container.Image, "the project's image at the chart's appVersion")
				require.EqualValues(t, 2, *p.dep.Spec.Replicas)
				require.NotEmpty(t, p.dep.Spec.Template.Annotations["checksum/config"], "a changed config restarts pdx")
				require.Contains(t, r.notes, "point your Envoy's ext_proc filter at pdx.pdx.svc:9002")
				peers := get[*corev1.Service](t, r.objs, "pdx-peers")
				require.Equal(t, corev1.ClusterIPNone, peers.Spec.ClusterIP, "headless: its name resolves to every pod")
				require.True(t, peers.Spec.PublishNotReadyAddresses, "a draining replica's prefills still run")
				require.Equal(t, get[*corev1.Service](t, r.objs, "pdx").Spec.Selector, peers.Spec.Selector)
				require.Equal(t, []string{"pdx-peers.pdx.svc:9003"}, p.cfg.GetPeers().GetAddresses())
			},
		},
		{
			name:   "peers off",
			values: map[string]any{"peers": map[string]any{"enabled": false}},
			kinds:  []string{"ConfigMap", "Deployment", "PodDisruptionBudget", "Role", "RoleBinding", "Service", "ServiceAccount"},
			check: func(t *testing.T, r rendered, p pdx) {
				require.Nil(t, p.cfg.GetPeers())
			},
		},
		{
			name:   "envoyGateway",
			values: envoyGatewayValues,
			kinds: append(slices.Clone(pdxKinds), "BackendTrafficPolicy", "ClientTrafficPolicy", "EnvoyExtensionPolicy",
				"Gateway", "HTTPRoute", "Service"),
			check: checkEnvoyGateway,
		},
		{
			name:   "envoyGateway, the chart's GatewayClass",
			values: envoyGatewayOwnClassValues,
			kinds: append(slices.Clone(pdxKinds), "BackendTrafficPolicy", "ClientTrafficPolicy", "EnvoyExtensionPolicy",
				"Gateway", "GatewayClass", "HTTPRoute", "Service"),
			check: func(t *testing.T, r rendered, p pdx) {
				require.EqualValues(t, "pdx", get[*gwv1.Gateway](t, r.objs, "pdx").Spec.GatewayClassName, "the full name")
				checkEnvoyGateway(t, r, p)
			},
		},
		{
			name: "envoyGateway, 4 MiB bodies",
			values: map[string]any{
				"envoyGateway": envoyGatewayValues["envoyGateway"],
				"config":       map[string]any{"max_body_bytes": 4 << 20},
			},
			kinds: append(slices.Clone(pdxKinds), "BackendTrafficPolicy", "ClientTrafficPolicy", "EnvoyExtensionPolicy",
				"Gateway", "HTTPRoute", "Service"),
			check: func(t *testing.T, r rendered, p pdx) {
				require.EqualValues(t, 4<<20, p.cfg.GetMaxBodyBytes())
				checkEnvoyGateway(t, r, p) // the buffer limits follow max_body_bytes
			},
		},
		{
			name:   "inferencePool",
			values: inferencePoolValues,
			kinds:  append(slices.Clone(pdxKinds), "Gateway", "HTTPRoute", "InferencePool"),
			check:  checkInferencePool,
		},
		{
			name: "inferencePool, the chart's GatewayClass",
			values: map[string]any{"inferencePool": map[string]any{
				"enabled": true, "gatewayClass": map[string]any{"create": true}}},
			kinds: append(slices.Clone(pdxKinds), "Gateway", "GatewayClass", "HTTPRoute", "InferencePool"),
			check: func(t *testing.T, r rendered, p pdx) {
				require.EqualValues(t, "pdx-inference", get[*gwv1.Gateway](t, r.objs, "pdx-inference").Spec.GatewayClassName)
				checkInferencePool(t, r, p)
			},
		},
		{
			name:   "overrides",
			values: readValues(t, "testdata/overrides.yaml"),
			// Static pools only: no discovery, so no Role.
			kinds: []string{"ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "Service", "ServiceAccount"},
			check: func(t *testing.T, r rendered, p pdx) {
				require.EqualValues(t, 3, *p.dep.Spec.Replicas)
				require.Equal(t, []string{"pdx-peers.pdx.svc:9103"}, p.cfg.GetPeers().GetAddresses(), "the peers follow ports.admin")
				require.Equal(t, map[string]string{
					"example.com/team":     "inference",
					"prometheus.io/scrape": "true", "prometheus.io/port": "9103", "prometheus.io/path": "/metrics",
				}, p.dep.Spec.Template.Annotations, "restartOnConfigChange: false; the scrape annotations follow ports.admin")
				require.Equal(t, "registry.example.com:5000/team/pdx@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", p.container.Image)
				require.Equal(t, "0.0.0.0:9102", p.cfg.GetGrpcAddress())
				require.Equal(t, "0.0.0.0:9103", p.cfg.GetAdminAddress())
				require.Equal(t, 20*time.Second, p.cfg.GetRequestBodyTimeout().AsDuration())
				require.Len(t, p.cfg.GetPools(), 2)
				for _, pool := range p.cfg.GetPools() {
					require.Nil(t, pool.GetKubernetes())
					require.NotEmpty(t, pool.GetPrefill())
					require.NotEmpty(t, pool.GetDecode())
				}
				require.NotContains(t, p.rawConfig, "max_body_bytes", "set to null: left to pdx")
				require.EqualValues(t, config.DefaultMaxBodyBytes, p.cfg.GetMaxBodyBytes())
				require.Equal(t, intstr.FromString("50%"), *get[*policyv1.PodDisruptionBudget](t, r.objs, "pdx").Spec.MaxUnavailable)
				require.Equal(t, "9102", strconv.Itoa(int(get[*corev1.Service](t, r.objs, "pdx").Spec.Ports[0].Port)))
			},
		},
		{
			// With the decode engines' Service of the Envoy Gateway mode,
			// which the ServiceMonitor must not select.
			name: "ServiceMonitor",
			values: map[string]any{
				"envoyGateway": envoyGatewayValues["envoyGateway"],
				"metrics": map[string]any{"scrapeAnnotations": false, "serviceMonitor": map[string]any{
					"enabled": true, "labels": map[string]any{"release": "kube-prometheus-stack"}, "interval": "15s", "scrapeTimeout": "5s"}},
			},
			kinds: append(slices.Clone(pdxKinds), "BackendTrafficPolicy", "ClientTrafficPolicy", "EnvoyExtensionPolicy",
				"Gateway", "HTTPRoute", "Service", "ServiceMonitor"),
			check: func(t *testing.T, r rendered, p pdx) {
				require.NotContains(t, p.dep.Spec.Template.Annotations, "prometheus.io/scrape")
				got := scrapes(t, r.objs, p)
				require.Len(t, got, 1)
				require.Equal(t, "ServiceMonitor pdx", got[0].what)
				sm := get[*monitoringv1.ServiceMonitor](t, r.objs, "pdx")
				require.Equal(t, "kube-prometheus-stack", sm.Labels["release"], "the label the Prometheus selects")
				require.EqualValues(t, "15s", sm.Spec.Endpoints[0].Interval)
				require.EqualValues(t, "5s", sm.Spec.Endpoints[0].ScrapeTimeout)
			},
		},
		{
			name: "discovery in two namespaces",
			values: map[string]any{"config": map[string]any{"pools": []any{
				map[string]any{
					"name": "a", "models": []any{"a"}, "connector": "nixl",
					"kubernetes": map[string]any{"namespace": "engines", "service": "a", "port": 8000},
				},
				map[string]any{
					"name": "b", "models": []any{"b"}, "connector": "none",
					"kubernetes": map[string]any{"match_labels": map[string]any{"app": "b"}, "port": 8000},
				},
			}}},
			kinds: append(slices.Clone(pdxKinds), "Role", "RoleBinding"),
			check: func(t *testing.T, r rendered, p pdx) {
				var ns []string
				for _, role := range all[*rbacv1.Role](r.objs) {
					ns = append(ns, role.Namespace)
				}
				require.ElementsMatch(t, []string{"engines", namespace}, ns)
				require.Equal(t, namespace, p.cfg.GetPools()[1].GetKubernetes().GetNamespace(), "the release namespace, filled in")
			},
		},
		{
			// Static endpoints, objectives from another namespace: a Role
			// there, and none in the release's.
			name: "objectives from the cluster",
			values: map[string]any{"config": map[string]any{"pools": []any{
				map[string]any{
					"name": "a", "models": []any{"a"}, "connector": "nixl",
					"prefill": []any{map[string]any{"address": "10.0.0.1:8000"}}, "decode": []any{map[string]any{"address": "10.0.0.2:8000"}},
					"flow_control": map[string]any{"kubernetes_objectives": map[string]any{"namespace": "tenants", "pool": "pool-a"}},
				},
			}}},
			kinds: pdxKinds,
			check: func(t *testing.T, r rendered, p pdx) {
				var ns []string
				for _, role := range all[*rbacv1.Role](r.objs) {
					ns = append(ns, role.Namespace)
				}
				require.Equal(t, []string{"tenants"}, ns)
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := mustRender(t, tt.values)
			require.Equal(t, slices.Sorted(slices.Values(tt.kinds)), kinds(r.objs))
			require.NotEmpty(t, r.notes)
			for _, o := range r.objs {
				m, err := meta.Accessor(o.obj)
				require.NoError(t, err)
				require.NotEmpty(t, m.GetName(), "%s", o)
				switch o.obj.(type) {
				case *gwv1.GatewayClass:
					require.Empty(t, m.GetNamespace(), "%s is cluster-scoped", o)
				case *rbacv1.Role, *rbacv1.RoleBinding:
					require.NotEmpty(t, m.GetNamespace(), "%s", o)
				default:
					require.Equal(t, namespace, m.GetNamespace(), "%s", o)
				}
				require.Equal(t, "pdx", m.GetLabels()["app.kubernetes.io/part-of"], "%s", o)
			}
			p := loadPdx(t, r.objs)
			checkWorkload(t, r.objs, p)
			checkRBAC(t, r.objs, p)
			tt.check(t, r, p)
		})
	}
}

// scrape is where a Prometheus scrapes pdx, and what told it to.
type scrape struct {
	what string
	port int32 // the pdx container's port
	path string
}

// scrapes are the targets a render gives a Prometheus: the pdx pods'
// prometheus.io annotations, and the endpoints of the ServiceMonitor,
// which must select only the pdx Service in its namespace and name a port
// of it. Each must be pdx's admin port.
func scrapes(t *testing.T, objs []object, p pdx) []scrape {
	t.Helper()
	podLabels := labels.Set(p.dep.Spec.Template.Labels)
	var out []scrape
	if ann := p.dep.Spec.Template.Annotations; ann["prometheus.io/scrape"] == "true" {
		port, err := strconv.ParseInt(ann["prometheus.io/port"], 10, 32)
		require.NoError(t, err, "annotation prometheus.io/port")
		out = append(out, scrape{what: "the pods' prometheus.io annotations", port: int32(port), path: ann["prometheus.io/path"]})
	}
	for _, sm := range all[*monitoringv1.ServiceMonitor](objs) {
		require.False(t, sm.Spec.NamespaceSelector.Any, "ServiceMonitor %s: pdx's namespace only", sm.Name)
		require.Empty(t, sm.Spec.NamespaceSelector.MatchNames, "ServiceMonitor %s: its own namespace", sm.Name)
		sel, err := metav1.LabelSelectorAsSelector(&sm.Spec.Selector)
		require.NoError(t, err)
		require.False(t, sel.Empty(), "ServiceMonitor %s selects every Service", sm.Name)
		var svcs []*corev1.Service
		for _, svc := range all[*corev1.Service](objs) {
			if svc.Namespace == sm.Namespace && sel.Matches(labels.Set(svc.Labels)) {
				require.True(t, labels.SelectorFromSet(svc.Spec.Selector).Matches(podLabels),
					"ServiceMonitor %s selects Service %s, which is not pdx's", sm.Name, svc.Name)
				svcs = append(svcs, svc)
			}
		}
		require.Len(t, svcs, 1, "ServiceMonitor %s: the pdx Service", sm.Name)
		require.NotEmpty(t, sm.Spec.Endpoints)
		for _, ep := range sm.Spec.Endpoints {
			require.Nil(t, ep.TargetPort, "ServiceMonitor %s: name the Service's port", sm.Name)
			i := slices.IndexFunc(svcs[0].Spec.Ports, func(sp corev1.ServicePort) bool { return sp.Name == ep.Port })
			require.GreaterOrEqual(t, i, 0, "ServiceMonitor %s: Service %s has no port %q", sm.Name, svcs[0].Name, ep.Port)
			require.Nil(t, ep.Scheme, "pdx's admin port is plain HTTP")
			out = append(out, scrape{what: "ServiceMonitor " + sm.Name, port: resolvePort(t, svcs[0].Spec.Ports[i].TargetPort, p.container), path: ep.Path})
		}
	}
	for _, s := range out {
		require.Equal(t, listenPort(t, p.cfg.GetAdminAddress()), s.port, "%s: not pdx's admin port", s.what)
		require.Equal(t, "/metrics", s.path, s.what)
	}
	return out
}

// checkWorkload checks the pdx Deployment, Service and PDB against pdx's
// config and each other, in every mode.
func checkWorkload(t *testing.T, objs []object, p pdx) {
	t.Helper()
	dep, c := p.dep, p.container
	podLabels := labels.Set(dep.Spec.Template.Labels)
	selects := func(what string, sel *metav1.LabelSelector) {
		t.Helper()
		require.NotNil(t, sel, what)
		s, err := metav1.LabelSelectorAsSelector(sel)
		require.NoError(t, err, what)
		require.False(t, s.Empty(), "%s selects everything", what)
		require.True(t, s.Matches(podLabels), "%s (%s) does not select pdx's pods %v", what, s, podLabels)
	}
	selects("the Deployment's selector", dep.Spec.Selector)
	require.NotEmpty(t, dep.Spec.Template.Spec.TopologySpreadConstraints)
	for _, tc := range dep.Spec.Template.Spec.TopologySpreadConstraints {
		selects("a topology spread constraint", tc.LabelSelector)
	}
	svc := get[*corev1.Service](t, objs, dep.Name)
	selects("the pdx Service", &metav1.LabelSelector{MatchLabels: svc.Spec.Selector})
	pdb := get[*policyv1.PodDisruptionBudget](t, objs, dep.Name)
	selects("the PodDisruptionBudget", pdb.Spec.Selector)
	replicas := int(*dep.Spec.Replicas)
	require.NotNil(t, pdb.Spec.MaxUnavailable)
	v, err := intstr.GetScaledValueFromIntOrPercent(pdb.Spec.MaxUnavailable, replicas, true)
	require.NoError(t, err)
	require.Less(t, v, replicas, "the PDB lets every pdx go")
	require.Equal(t, dep.Spec.Template.Spec.ServiceAccountName, get[*corev1.ServiceAccount](t, objs, dep.Spec.Template.Spec.ServiceAccountName).Name)

	// Ports: the config's listen addresses are the container's ports, the
	// Service's target and the probes'.
	grpcPort := listenPort(t, p.cfg.GetGrpcAddress())
	adminPort := listenPort(t, p.cfg.GetAdminAddress())
	require.Equal(t, grpcPort, containerPort(t, c, "grpc"))
	require.Equal(t, adminPort, containerPort(t, c, "admin"))
	require.Len(t, svc.Spec.Ports, 2)
	sp := svc.Spec.Ports[1]
	require.Equal(t, "admin", sp.Name, "the admin port, for Prometheus")
	require.Equal(t, adminPort, resolvePort(t, sp.TargetPort, c))
	sp = svc.Spec.Ports[0]
	require.Equal(t, "grpc", sp.Name)
	require.Equal(t, grpcPort, resolvePort(t, sp.TargetPort, c))
	scrapes(t, objs, p) // Prometheus's targets are the admin port
	tls := p.cfg.GetTls().GetSelfSigned()
	if tls {
		require.Nil(t, sp.AppProtocol, "pdx serves TLS: not h2c")
	} else {
		require.NotNil(t, sp.AppProtocol)
		require.Equal(t, h2c, *sp.AppProtocol, "ext_proc is gRPC: HTTP/2 without TLS")
	}
	for name, probe := range map[string]*corev1.Probe{"liveness": c.LivenessProbe, "readiness": c.ReadinessProbe} {
		require.NotNil(t, probe, "%s probe", name)
		// The admin port's HTTP, with or without TLS on the gRPC port
		// (the kubelet's gRPC probes do not speak TLS).
		require.Nil(t, probe.GRPC, "%s probe", name)
		require.NotNil(t, probe.HTTPGet, "%s probe", name)
		require.Equal(t, adminPort, resolvePort(t, probe.HTTPGet.Port, c), "%s probe", name)
		require.Equal(t, map[string]string{"liveness": "/healthz", "readiness": "/readyz"}[name], probe.HTTPGet.Path)
	}

	// Drain: preStop sleep, then --drain-timeout, within the grace period;
	// the drain lets the slowest prefill finish.
	require.Empty(t, c.Command)
	require.Equal(t, "serve", c.Args[0])
	drainFlag, ok := flagValue(c.Args, "drain-timeout")
	require.True(t, ok)
	drain, err := time.ParseDuration(drainFlag)
	require.NoError(t, err)
	require.GreaterOrEqual(t, drain, p.maxPrefillTimeout())
	require.NotNil(t, c.Lifecycle)
	require.NotNil(t, c.Lifecycle.PreStop)
	require.NotNil(t, c.Lifecycle.PreStop.Sleep, "the image has no shell")
	preStop := time.Duration(c.Lifecycle.PreStop.Sleep.Seconds) * time.Second
	require.Positive(t, preStop)
	grace := dep.Spec.Template.Spec.TerminationGracePeriodSeconds
	require.NotNil(t, grace)
	require.Greater(t, time.Duration(*grace)*time.Second, preStop+drain)

	// Locked down, GOMEMLIMIT from the memory limit.
	psc, csc := dep.Spec.Template.Spec.SecurityContext, c.SecurityContext
	require.NotNil(t, psc)
	require.NotNil(t, csc)
	require.True(t, *psc.RunAsNonRoot)
	require.NotZero(t, *psc.RunAsUser)
	require.Equal(t, corev1.SeccompProfileTypeRuntimeDefault, psc.SeccompProfile.Type)
	require.True(t, *csc.ReadOnlyRootFilesystem)
	require.False(t, *csc.AllowPrivilegeEscalation)
	require.Equal(t, []corev1.Capability{"ALL"}, csc.Capabilities.Drop)
	require.False(t, c.Resources.Limits.Memory().IsZero())
	require.True(t, slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool {
		return e.Name == "GOMEMLIMIT" && e.ValueFrom != nil && e.ValueFrom.ResourceFieldRef != nil && e.ValueFrom.ResourceFieldRef.Resource == "limits.memory"
	}))
}

// checkRBAC creates the rendered Roles and RoleBindings in a real API
// server (for this test only) and runs pdx's discovery and objectives
// watcher for the config's pools as the rendered ServiceAccount: RBAC must
// let each list and watch everything it needs, in every namespace it
// watches. The check can fail: without the EndpointSlice rule, discovery
// cannot list.
func checkRBAC(t *testing.T, objs []object, p pdx) {
	t.Helper()
	sa := get[*corev1.ServiceAccount](t, objs, p.dep.Spec.Template.Spec.ServiceAccountName)
	rules := boundRules(t, objs, sa)
	var targets []discovery.Target
	var objTargets []objectives.Target
	for _, pool := range p.cfg.GetPools() {
		if k := pool.GetKubernetes(); k != nil {
			targets = append(targets, discovery.Target{Pool: pool.GetName(), Prefills: true, Spec: k, Set: func(_, _ []endpoint.Endpoint) {}})
		}
		if k := pool.GetFlowControl().GetKubernetesObjectives(); k != nil {
			objTargets = append(objTargets, objectives.Target{Pool: pool.GetName(), Spec: k, Set: func(map[string]int) {}})
		}
	}
	if len(targets) == 0 && len(objTargets) == 0 {
		require.Empty(t, rules, "no pool discovers engines or objectives: pdx needs no rights")
		return
	}

	srv := cluster.Server(t)
	admin, err := kubernetes.NewForConfig(srv.Config())
	require.NoError(t, err)
	var roles []*rbacv1.Role
	for _, o := range objs {
		switch v := o.obj.(type) {
		case *rbacv1.Role:
			ensureNamespace(t, admin, v.Namespace)
			_, err := admin.RbacV1().Roles(v.Namespace).Create(t.Context(), v, metav1.CreateOptions{})
			require.NoError(t, err, "%s", o)
			roles = append(roles, v)
			t.Cleanup(func() {
				require.NoError(t, admin.RbacV1().Roles(v.Namespace).Delete(context.Background(), v.Name, metav1.DeleteOptions{}))
			})
		case *rbacv1.RoleBinding:
			ensureNamespace(t, admin, v.Namespace)
			_, err := admin.RbacV1().RoleBindings(v.Namespace).Create(t.Context(), v, metav1.CreateOptions{})
			require.NoError(t, err, "%s", o)
			t.Cleanup(func() {
				require.NoError(t, admin.RbacV1().RoleBindings(v.Namespace).Delete(context.Background(), v.Name, metav1.DeleteOptions{}))
			})
		}
	}
	asPdx := srv.ConfigAs("system:serviceaccount:"+sa.Namespace+":"+sa.Name, "system:serviceaccounts", "system:serviceaccounts:"+sa.Namespace)
	client, err := kubernetes.NewForConfig(asPdx)
	require.NoError(t, err)
	dyn, err := dynamic.NewForConfig(asPdx)
	require.NoError(t, err)

	// RBAC's authorizer learns of the new Roles through its own watch; the
	// informers retry until it has.
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	d := discovery.New(client, discovery.Options{})
	defer d.Close()
	require.NoError(t, d.SetTargets(ctx, targets), "pdx's discovery with the rights the chart grants")
	w := objectives.New(dyn, objectives.Options{})
	defer w.Close()
	require.NoError(t, w.SetTargets(ctx, objTargets), "pdx's objectives with the rights the chart grants")
	if len(targets) == 0 {
		return
	}

	// Without the EndpointSlice rule, discovery cannot list.
	for _, role := range roles {
		cur, err := admin.RbacV1().Roles(role.Namespace).Get(t.Context(), role.Name, metav1.GetOptions{})
		require.NoError(t, err)
		cur.Rules = slices.DeleteFunc(cur.Rules, func(r rbacv1.PolicyRule) bool { return slices.Contains(r.Resources, "endpointslices") })
		_, err = admin.RbacV1().Roles(role.Namespace).Update(t.Context(), cur, metav1.UpdateOptions{})
		require.NoError(t, err)
	}
	ns := targets[0].Spec.GetNamespace()
	require.Eventually(t, func() bool {
		_, err := client.DiscoveryV1().EndpointSlices(ns).List(t.Context(), metav1.ListOptions{})
		return apierrors.IsForbidden(err)
	}, 10*time.Second, 20*time.Millisecond, "the narrowed Role applies")
	fewer := discovery.New(client, discovery.Options{})
	ctx, cancel = context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	err = fewer.SetTargets(ctx, targets)
	fewer.Close()
	require.ErrorContains(t, err, "were not listed")
}

func ensureNamespace(t *testing.T, client kubernetes.Interface, name string) {
	t.Helper()
	_, err := client.CoreV1().Namespaces().Create(t.Context(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if !apierrors.IsAlreadyExists(err) {
		require.NoError(t, err)
	}
}

// boundRules are the rules of the Roles bound to sa, by the Role's
// namespace.
func boundRules(t *testing.T, objs []object, sa *corev1.ServiceAccount) map[string][]rbacv1.PolicyRule {
	t.Helper()
	rules := map[string][]rbacv1.PolicyRule{}
	for _, rb := range all[*rbacv1.RoleBinding](objs) {
		for _, s := range rb.Subjects {
			if s.Kind != rbacv1.ServiceAccountKind || s.Name != sa.Name || s.Namespace != sa.Namespace {
				continue
			}
			require.Equal(t, rbacv1.GroupName, rb.RoleRef.APIGroup)
			require.Equal(t, "Role", rb.RoleRef.Kind, "%s: a Role, not cluster-wide rights", rb.Name)
			var role *rbacv1.Role
			for _, r := range all[*rbacv1.Role](objs) {
				if r.Name == rb.RoleRef.Name && r.Namespace == rb.Namespace {
					role = r
				}
			}
			require.NotNil(t, role, "RoleBinding %s/%s binds Role %s, which is not rendered", rb.Namespace, rb.Name, rb.RoleRef.Name)
			for _, r := range role.Rules {
				require.Subset(t, []string{"get", "list", "watch"}, r.Verbs, "pdx only reads")
				require.Empty(t, r.ResourceNames)
			}
			rules[rb.Namespace] = append(rules[rb.Namespace], role.Rules...)
		}
	}
	return rules
}

// checkEnvoyGateway: the route sends every request through pdx's ext_proc
// filter to the decode engines' Service, the decode request goes to the
// engine pdx names (endpointOverride) and is retried on the next, and the
// buffer limits lie where pdx's JSON 413 needs them.
func checkEnvoyGateway(t *testing.T, r rendered, p pdx) {
	objs := r.objs
	require.Empty(t, all[*egv1a1.EnvoyPatchPolicy](objs), "Envoy Gateway's own APIs only")
	maxBody := int64(p.cfg.GetMaxBodyBytes())

	routes := all[*gwv1.HTTPRoute](objs)
	require.Len(t, routes, 1)
	route := routes[0]
	requireGateway(t, objs, route.Spec.ParentRefs[0], existingClass)
	gw := get[*gwv1.Gateway](t, objs, string(route.Spec.ParentRefs[0].Name))
	rule := requireEveryPath(t, route)
	b := rule.BackendRefs[0].BackendObjectReference
	require.Equal(t, gwv1.Kind("Service"), *b.Kind)
	decode := get[*corev1.Service](t, objs, string(b.Name))
	require.Equal(t, map[string]string{"app.kubernetes.io/name": "llm-engine", "app.kubernetes.io/component": "decode"}, decode.Spec.Selector)
	require.Len(t, decode.Spec.Ports, 1)
	require.Equal(t, int32(*b.Port), decode.Spec.Ports[0].Port)
	require.False(t, labels.SelectorFromSet(decode.Spec.Selector).Matches(labels.Set(p.dep.Spec.Template.Labels)), "the decode Service must not select pdx")

	eep := get[*egv1a1.EnvoyExtensionPolicy](t, objs, "pdx")
	require.Len(t, eep.Spec.TargetRefs, 1)
	require.Equal(t, gwv1.Kind("HTTPRoute"), eep.Spec.TargetRefs[0].Kind)
	require.Equal(t, route.Name, string(eep.Spec.TargetRefs[0].Name))
	require.Len(t, eep.Spec.ExtProc, 1)
	ep := eep.Spec.ExtProc[0]
	require.Len(t, ep.BackendRefs, 1)
	eb := ep.BackendRefs[0].BackendObjectReference
	require.Equal(t, gwv1.Kind("Service"), *eb.Kind)
	requirePdxService(t, objs, p, string(eb.Name), int32(*eb.Port))
	require.Equal(t, egv1a1.BufferedExtProcBodyProcessingMode, *ep.ProcessingMode.Request.Body)
	require.NotNil(t, ep.ProcessingMode.Response, "pdx sees the response headers")
	require.Equal(t, []string{"upstream.address"}, ep.ProcessingMode.Response.Attributes, "the decode that served")
	require.True(t, ep.ProcessingMode.AllowModeOverride)
	require.False(t, *ep.FailOpen, "fail closed")
	require.EqualValues(t, 503, *ep.StatusOnError)
	mt, err := time.ParseDuration(string(*ep.MessageTimeout))
	require.NoError(t, err)
	require.Greater(t, mt, p.maxPrefillTimeout(), "messageTimeout must exceed every pool's prefill_timeout")
	require.ElementsMatch(t, []string{processor.MetadataNamespace, processor.RequestMetadataNamespace}, ep.Metadata.WritableNamespaces)
	require.GreaterOrEqual(t, bufferLimit(t, "ext_proc", ep.BackendSettings.Connection.BufferLimit), maxBody+1<<20, "pdx's gRPC message limit")

	ctp := get[*egv1a1.ClientTrafficPolicy](t, objs, "pdx")
	require.Equal(t, gw.Name, string(ctp.Spec.TargetRefs[0].Name))
	client := bufferLimit(t, "ClientTrafficPolicy", ctp.Spec.Connection.BufferLimit)
	require.Greater(t, client, maxBody, "pdx answers an oversized body with its JSON 413")
	require.LessOrEqual(t, client, maxBody+envoy.BufferHeadroom)
	require.Equal(t, client, bufferLimit(t, "http2 window", ctp.Spec.HTTP2.InitialStreamWindowSize))
	require.Equal(t, egv1a1.RequestIDActionPreserveOrGenerate, *ctp.Spec.Headers.RequestID)
	require.Equal(t, egv1a1.RejectRequestAction, *ctp.Spec.Path.EscapedSlashesAction)
	require.Positive(t, parseDuration(t, "streamIdleTimeout", ctp.Spec.Timeout.HTTP.StreamIdleTimeout))
	require.EqualValues(t, envoy.DefaultMaxRequestHeaders, p.cfg.GetMaxRequestHeaders(), "Envoy Gateway's header count limit is Envoy's default")
	require.EqualValues(t, envoy.DefaultMaxRequestHeadersKB, p.cfg.GetMaxRequestHeadersKb())

	btps := all[*egv1a1.BackendTrafficPolicy](objs)
	require.Len(t, btps, 1)
	btp := btps[0]
	require.Len(t, btp.Spec.TargetRefs, 1)
	require.Equal(t, gwv1.Kind("HTTPRoute"), btp.Spec.TargetRefs[0].Kind)
	require.Equal(t, route.Name, string(btp.Spec.TargetRefs[0].Name))
	lb := btp.Spec.LoadBalancer
	require.NotNil(t, lb)
	require.NotNil(t, lb.EndpointOverride)
	require.Len(t, lb.EndpointOverride.ExtractFrom, 1)
	require.NotNil(t, lb.EndpointOverride.ExtractFrom[0].Header)
	require.Equal(t, processor.DestinationHeader, *lb.EndpointOverride.ExtractFrom[0].Header)
	retry := btp.Spec.Retry
	require.NotNil(t, retry)
	require.EqualValues(t, 1, *retry.NumRetries)
	require.ElementsMatch(t, []egv1a1.TriggerEnum{egv1a1.ConnectFailure, egv1a1.RefusedStream, egv1a1.ResetBeforeRequest, egv1a1.Error5XX}, retry.RetryOn.Triggers)
	require.Empty(t, retry.RetryOn.HTTPStatusCodes)
	require.GreaterOrEqual(t, bufferLimit(t, "BackendTrafficPolicy", btp.Spec.Connection.BufferLimit), client)

	require.Contains(t, r.notes, "Envoy Gateway mode")
}

// checkInferencePool: the route sends every request to the pool, the pool
// is the decode pods with pdx's gRPC Service as endpoint picker, failing
// closed, and pdx serves self-signed TLS.
func checkInferencePool(t *testing.T, r rendered, p pdx) {
	objs := r.objs
	require.True(t, p.cfg.GetTls().GetSelfSigned(), "tls.self_signed: true in pdx's config:\n%s", p.rawConfig)
	routes := all[*gwv1.HTTPRoute](objs)
	require.Len(t, routes, 1)
	route := routes[0]
	requireGateway(t, objs, route.Spec.ParentRefs[0], existingClass)
	b := requireEveryPath(t, route).BackendRefs[0]
	require.Equal(t, gwv1.Group(infv1.GroupName), *b.Group)
	require.Equal(t, gwv1.Kind("InferencePool"), *b.Kind)
	require.Nil(t, b.Port)
	pool := get[*infv1.InferencePool](t, objs, string(b.Name))
	sel := map[string]string{}
	for k, v := range pool.Spec.Selector.MatchLabels {
		sel[string(k)] = string(v)
	}
	require.Equal(t, map[string]string{"app.kubernetes.io/name": "llm-engine", "app.kubernetes.io/component": "decode"}, sel)
	require.Equal(t, []infv1.Port{{Number: 8000}}, pool.Spec.TargetPorts)
	ref := pool.Spec.EndpointPickerRef
	require.Equal(t, infv1.Group(""), *ref.Group)
	require.Equal(t, infv1.Kind("Service"), ref.Kind)
	require.NotNil(t, ref.Port)
	require.EqualValues(t, 9002, ref.Port.Number, "the endpoint-picker port")
	requirePdxService(t, objs, p, string(ref.Name), int32(ref.Port.Number))
	require.Equal(t, infv1.EndpointPickerFailClose, ref.FailureMode)
	require.Contains(t, r.notes, "InferencePool mode")
}

// TestChartMatchesManifests: with its default values the chart renders
// pdx as deploy/kubernetes does: the same container (image, args, ports,
// probes, resources, security), pod settings, Service ports, disruption
// budget, RBAC rules and config; and its Envoy Gateway and InferencePool
// objects the same ext_proc filter, client policy and pool.
func TestChartMatchesManifests(t *testing.T) {
	base := loadRaw(t, "base")
	chart := mustRender(t, nil).objs

	rawDep, dep := get[*appsv1.Deployment](t, base, "pdx"), get[*appsv1.Deployment](t, chart, "pdx")
	rawC, c := rawDep.Spec.Template.Spec.Containers[0], dep.Spec.Template.Spec.Containers[0]
	rawC.VolumeMounts, c.VolumeMounts = nil, nil // names of the chart's choosing; loadPdx follows them
	semanticEqual(t, rawC, c)
	rawPod, pod := rawDep.Spec.Template.Spec, dep.Spec.Template.Spec
	require.Equal(t, rawPod.SecurityContext, pod.SecurityContext)
	require.Equal(t, rawPod.TerminationGracePeriodSeconds, pod.TerminationGracePeriodSeconds)
	require.Equal(t, rawDep.Spec.Replicas, dep.Spec.Replicas)
	require.Equal(t, rawDep.Spec.Strategy, dep.Spec.Strategy)
	require.Equal(t, rawDep.Spec.RevisionHistoryLimit, dep.Spec.RevisionHistoryLimit)
	require.Len(t, pod.TopologySpreadConstraints, len(rawPod.TopologySpreadConstraints))
	for i := range pod.TopologySpreadConstraints {
		rawTSC, tsc := rawPod.TopologySpreadConstraints[i], pod.TopologySpreadConstraints[i]
		rawTSC.LabelSelector, tsc.LabelSelector = nil, nil // the pods' labels differ; checkWorkload checks they select
		require.Equal(t, rawTSC, tsc)
	}

	require.Equal(t, get[*corev1.Service](t, base, "pdx").Spec.Ports, get[*corev1.Service](t, chart, "pdx").Spec.Ports)
	require.Equal(t, get[*policyv1.PodDisruptionBudget](t, base, "pdx").Spec.MaxUnavailable, get[*policyv1.PodDisruptionBudget](t, chart, "pdx").Spec.MaxUnavailable)
	require.Equal(t, get[*rbacv1.Role](t, base, "pdx-discovery").Rules, get[*rbacv1.Role](t, chart, "pdx-discovery").Rules)
	rawCfg, cfg := loadPdx(t, base).cfg, loadPdx(t, chart).cfg
	require.True(t, proto.Equal(rawCfg, cfg), "pdx's config:\nraw   %v\nchart %v", rawCfg, cfg)

	eg := loadRaw(t, "base", "envoy-gateway")
	egChart := mustRender(t, envoyGatewayValues).objs
	semanticEqual(t, get[*egv1a1.EnvoyExtensionPolicy](t, eg, "pdx").Spec.ExtProc, get[*egv1a1.EnvoyExtensionPolicy](t, egChart, "pdx").Spec.ExtProc)
	semanticEqual(t, get[*egv1a1.ClientTrafficPolicy](t, eg, "pdx").Spec, get[*egv1a1.ClientTrafficPolicy](t, egChart, "pdx").Spec)
	rawBTP, btp := get[*egv1a1.BackendTrafficPolicy](t, eg, "pdx-decode"), get[*egv1a1.BackendTrafficPolicy](t, egChart, "pdx-decode")
	semanticEqual(t, rawBTP.Spec.Connection, btp.Spec.Connection)
	semanticEqual(t, rawBTP.Spec.CircuitBreaker, btp.Spec.CircuitBreaker)

	ip := loadRaw(t, "base", "inferencepool")
	ipChart := mustRender(t, inferencePoolValues).objs
	require.Equal(t, get[*infv1.InferencePool](t, ip, "llm-decode").Spec, get[*infv1.InferencePool](t, ipChart, "pdx-decode").Spec)
}

// semanticEqual requires want and got equal as Kubernetes compares
// objects: quantities by value ("17Mi" is "17408Ki").
func semanticEqual(t *testing.T, want, got any) {
	t.Helper()
	if !equality.Semantic.DeepEqual(want, got) {
		require.Equal(t, want, got) // for the diff
		require.Fail(t, "not semantically equal", "%+v\n%+v", want, got)
	}
}

// TestChartRefuses: values the chart cannot render, and values
// values.schema.json does not know or allow, fail with a message that says
// what to change.
func TestChartRefuses(t *testing.T) {
	tests := []struct {
		name    string
		values  map[string]any
		wantErr string
	}{
		{
			name:    "both modes",
			values:  map[string]any{"envoyGateway": map[string]any{"enabled": true}, "inferencePool": map[string]any{"enabled": true}},
			wantErr: "envoyGateway.enabled and inferencePool.enabled cannot both be true",
		},
		{
			name:    "listen address in the config",
			values:  map[string]any{"config": map[string]any{"grpc_address": "0.0.0.0:1"}},
			wantErr: "config.grpc_address is set by the chart",
		},
		{
			name:    "tls in the config",
			values:  map[string]any{"config": map[string]any{"tls": map[string]any{"self_signed": true}}},
			wantErr: "config.tls is set by the chart",
		},
		{
			name:    "misspelt value",
			values:  map[string]any{"replicaCont": 3},
			wantErr: "replicaCont",
		},
		{
			name:    "misspelt nested value",
			values:  map[string]any{"envoyGateway": map[string]any{"enabeld": true}},
			wantErr: "enabeld",
		},
		{
			name:    "value of the wrong type",
			values:  map[string]any{"replicaCount": "two"},
			wantErr: "/replicaCount",
		},
		{
			name:    "image tag latest",
			values:  map[string]any{"image": map[string]any{"tag": "latest"}},
			wantErr: "/image/tag",
		},
		{
			name:    "unknown retry trigger",
			values:  map[string]any{"envoyGateway": map[string]any{"decode": map[string]any{"retry": map[string]any{"triggers": []any{"5xxx"}}}}},
			wantErr: "/envoyGateway/decode/retry/triggers/0",
		},
		{
			name:    "envoyGateway without a GatewayClass",
			values:  map[string]any{"envoyGateway": map[string]any{"enabled": true}},
			wantErr: "envoyGateway.gatewayClass.name is required: name an existing GatewayClass",
		},
		{
			name:    "inferencePool without a GatewayClass",
			values:  map[string]any{"inferencePool": map[string]any{"enabled": true}},
			wantErr: "inferencePool.gatewayClass.create=true to have the chart create one",
		},
		{
			name:    "ServiceMonitor interval not a duration",
			values:  map[string]any{"metrics": map[string]any{"serviceMonitor": map[string]any{"interval": "30"}}},
			wantErr: "/metrics/serviceMonitor/interval",
		},
		{
			name:    "no ServiceAccount name",
			values:  map[string]any{"serviceAccount": map[string]any{"create": false}},
			wantErr: "serviceAccount.name is required",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := render(t, tt.values)
			require.ErrorContains(t, err, tt.wantErr)
		})
	}
}

// TestStrictDecodeRejects: the decoder the tests use fails on a misspelt
// field, a field in the wrong case and an unknown kind, so a chart template
// with one would fail TestChartRenders.
func TestStrictDecodeRejects(t *testing.T) {
	tests := []struct {
		name, from, to, wantErr string
	}{
		{"as rendered", "", "", ""},
		{"misspelt field", "      failOpen: false", "      failOpn: false", `unknown field "spec.extProc[0].failOpn"`},
		{"wrong case", "messageTimeout:", "messagetimeout:", `unknown field "spec.extProc[0].messagetimeout"`},
		{"unknown kind", "kind: EnvoyExtensionPolicy", "kind: EnvoyExtensionPolicie", `no kind "EnvoyExtensionPolicie" is registered`},
	}
	chrt, err := loader.Load(chartDir)
	require.NoError(t, err)
	vals, err := chartutil.ToRenderValues(chrt, envoyGatewayValues, chartutil.ReleaseOptions{Name: release, Namespace: namespace}, chartutil.DefaultCapabilities)
	require.NoError(t, err)
	out, err := engine.Engine{Strict: true}.Render(chrt, vals)
	require.NoError(t, err)
	doc := out["pdx/templates/envoy-gateway/envoyextensionpolicy.yaml"]
	require.NotEmpty(t, doc)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			changed := strings.Replace(doc, tt.from, tt.to, 1)
			if tt.from != "" {
				require.NotEqual(t, doc, changed)
			}
			_, err := decodeAll("eep", []byte(changed))
			if tt.wantErr == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tt.wantErr)
		})
	}
}

// TestChartLints runs Helm's linter (`helm lint --strict`) with each set of
// values: no warning or error.
func TestChartLints(t *testing.T) {
	for name, values := range map[string]map[string]any{
		"default":        nil,
		"envoyGateway":   envoyGatewayValues,
		"inferencePool":  inferencePoolValues,
		"overrides":      readValues(t, "testdata/overrides.yaml"),
		"serviceMonitor": {"metrics": map[string]any{"serviceMonitor": map[string]any{"enabled": true}}},
	} {
		t.Run(name, func(t *testing.T) {
			l := lint.All(chartDir, values, namespace, true)
			for _, m := range l.Messages {
				if m.Severity >= support.WarningSev {
					t.Errorf("helm lint: %s", m)
				} else {
					t.Logf("helm lint: %s", m)
				}
			}
		})
	}
}
