package kubernetes_test

import (
	"bufio"
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	egv1a1 "github.com/envoyproxy/gateway/api/v1alpha1"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/util/intstr"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"
	gwv1 "sigs.k8s.io/gateway-api/apis/v1"
	"sigs.k8s.io/yaml"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/processor"
)

// The directories: base is pdx itself (and the decode engines' Service);
// envoy-gateway and inferencepool are the two ways to put a Gateway in
// front of it, each applied on top of base.
const (
	baseDir = "base"
	egDir   = "envoy-gateway"
	// jsonErrorsDir is the optional patch of Envoy Gateway's listener for
	// pdx's JSON local replies.
	jsonErrorsDir = "envoy-gateway-json-errors"
	poolDir       = "inferencepool"
	// monitoringDir is the optional ServiceMonitor (Prometheus Operator).
	monitoringDir = "monitoring"
)

const (
	namespace = "pdx"
	// egController is Envoy Gateway's GatewayClass controllerName.
	egController = "gateway.envoyproxy.io/gatewayclass-controller"
	// h2c is the Gateway API's appProtocol for HTTP/2 over cleartext.
	h2c = "kubernetes.io/h2c"
)

// clusterScoped are the kinds without a namespace.
var clusterScoped = []string{"Namespace", "GatewayClass"}

// codecs decodes every kind the manifests use into its upstream Go type,
// strictly: an unknown field (also one in the wrong case), a duplicate
// field or an unregistered kind is an error.
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

// object is one document of a manifest file.
type object struct {
	file string // relative to deploy/kubernetes
	obj  runtime.Object
}

func (o object) String() string {
	m, _ := meta.Accessor(o.obj)
	return fmt.Sprintf("%s: %s %s", o.file, o.obj.GetObjectKind().GroupVersionKind().Kind, m.GetName())
}

// documents splits a YAML file into its documents, leaving out those that
// hold only comments.
func documents(data []byte) ([][]byte, error) {
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var docs [][]byte
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			return nil, err
		}
		j, err := yaml.YAMLToJSON(doc)
		if err != nil {
			return nil, err
		}
		if string(j) != "null" {
			docs = append(docs, doc)
		}
	}
}

// decode decodes one document strictly.
func decode(doc []byte) (runtime.Object, error) {
	obj, _, err := codecs.UniversalDeserializer().Decode(doc, nil, nil)
	if err != nil {
		return nil, err // strict errors come with an object; they are errors all the same
	}
	return obj, nil
}

func decodeFile(file string) ([]object, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	docs, err := documents(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	var objs []object
	for i, doc := range docs {
		obj, err := decode(doc)
		if err != nil {
			return nil, fmt.Errorf("%s: document %d: %w", file, i+1, err)
		}
		objs = append(objs, object{file: filepath.ToSlash(file), obj: obj})
	}
	return objs, nil
}

// yamlFiles lists the manifests under dirs, in the order kubectl applies
// them (by name).
func yamlFiles(t *testing.T, dirs ...string) []string {
	t.Helper()
	var files []string
	for _, dir := range dirs {
		err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err == nil && !d.IsDir() && (strings.HasSuffix(p, ".yaml") || strings.HasSuffix(p, ".yml")) {
				files = append(files, p)
			}
			return err
		})
		require.NoError(t, err)
	}
	require.NotEmpty(t, files, "no manifests in %v", dirs)
	return files
}

// load decodes every manifest of dirs, failing the test on any error.
func load(t *testing.T, dirs ...string) []object {
	t.Helper()
	var objs []object
	for _, f := range yamlFiles(t, dirs...) {
		o, err := decodeFile(f)
		require.NoError(t, err)
		objs = append(objs, o...)
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

// all returns the objects of type T.
func all[T runtime.Object](objs []object) []T {
	var out []T
	for _, o := range objs {
		if v, ok := o.obj.(T); ok {
			out = append(out, v)
		}
	}
	return out
}

// find returns the object of type T named name; the last one, when a
// later directory replaces it (kubectl apply: the last applied wins).
func find[T runtime.Object](objs []object, name string) (T, bool) {
	var found T
	ok := false
	for _, v := range all[T](objs) {
		if nameOf(v) == name {
			found, ok = v, true
		}
	}
	return found, ok
}

// get is find that fails the test when there is no such object.
func get[T runtime.Object](t *testing.T, objs []object, name string) T {
	t.Helper()
	v, ok := find[T](objs, name)
	require.True(t, ok, "no %T named %q", v, name)
	return v
}

// TestManifestsDecodeStrictly: every document of every manifest decodes
// into its upstream Go type with no unknown field, lives in the pdx
// namespace, and the set of kinds is what docs/kubernetes.md describes.
func TestManifestsDecodeStrictly(t *testing.T) {
	kinds := map[string]int{}
	for _, f := range yamlFiles(t, ".") {
		objs, err := decodeFile(f)
		require.NoError(t, err)
		require.NotEmpty(t, objs, "%s holds no object", f)
		for _, o := range objs {
			kind := o.obj.GetObjectKind().GroupVersionKind().Kind
			kinds[kind]++
			m, err := meta.Accessor(o.obj)
			require.NoError(t, err)
			require.NotEmpty(t, m.GetName(), "%s: %s without a name", f, kind)
			if slices.Contains(clusterScoped, kind) {
				require.Empty(t, m.GetNamespace(), "%s is cluster-scoped", o)
			} else {
				require.Equal(t, namespace, m.GetNamespace(), "%s", o)
			}
		}
	}
	require.ElementsMatch(t, []string{
		"Namespace", "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Deployment", "Service", "PodDisruptionBudget",
		"GatewayClass", "Gateway", "HTTPRoute",
		"EnvoyExtensionPolicy", "EnvoyPatchPolicy", "ClientTrafficPolicy", "BackendTrafficPolicy",
		"InferencePool", "ServiceMonitor",
	}, slices.Collect(maps.Keys(kinds)))
}

// mutation changes a manifest document, as parsed YAML, before decoding.
type mutation func(t *testing.T, doc map[string]any)

// at returns the map at a dotted path of doc ("spec.extProc.0").
func at(t *testing.T, doc map[string]any, p string) map[string]any {
	t.Helper()
	var cur any = doc
	for _, k := range strings.Split(p, ".") {
		switch v := cur.(type) {
		case map[string]any:
			require.Contains(t, v, k, "path %s", p)
			cur = v[k]
		case []any:
			i, err := strconv.Atoi(k)
			require.NoError(t, err, "path %s", p)
			require.Less(t, i, len(v), "path %s", p)
			cur = v[i]
		default:
			require.Failf(t, "bad path", "%s: %s is not a map or list", p, k)
		}
	}
	m, ok := cur.(map[string]any)
	require.True(t, ok, "path %s is not a map", p)
	return m
}

// addField adds key: value at path.
func addField(p, key string, value any) mutation {
	return func(t *testing.T, doc map[string]any) {
		m := at(t, doc, p)
		require.NotContains(t, m, key)
		m[key] = value
	}
}

// renameField renames the field from at path to to, keeping its value.
func renameField(p, from, to string) mutation {
	return func(t *testing.T, doc map[string]any) {
		m := at(t, doc, p)
		require.Contains(t, m, from)
		m[to] = m[from]
		delete(m, from)
	}
}

// TestStrictDecodeRejectsUnknownFields: the decoder the other tests use
// fails on a misspelt field in each kind of manifest, on a field in the
// wrong case (encoding/json alone would accept it), on a duplicated field
// and on an unknown kind; the manifests as written pass.
func TestStrictDecodeRejectsUnknownFields(t *testing.T) {
	tests := []struct {
		name    string
		file    string
		doc     int // document index in the file
		mutate  mutation
		text    func(string) string // a change to the document's text instead
		wantErr string              // "" means decoding succeeds
	}{
		{name: "EnvoyExtensionPolicy as written", file: egDir + "/20-envoyextensionpolicy.yaml"},
		{name: "EnvoyPatchPolicy pdx-responses as written", file: jsonErrorsDir + "/30-envoypatchpolicy.yaml"},
		{name: "BackendTrafficPolicy as written", file: egDir + "/50-backendtrafficpolicy.yaml"},
		{name: "ClientTrafficPolicy as written", file: egDir + "/40-clienttrafficpolicy.yaml"},
		{name: "Deployment as written", file: baseDir + "/30-pdx-deployment.yaml"},
		{name: "InferencePool as written", file: poolDir + "/10-inferencepool.yaml"},
		{
			name: "EnvoyExtensionPolicy: misspelt processingMode", file: egDir + "/20-envoyextensionpolicy.yaml",
			mutate:  addField("spec.extProc.0", "procesingMode", map[string]any{"request": map[string]any{}}),
			wantErr: `unknown field "spec.extProc[0].procesingMode"`,
		},
		{
			name: "EnvoyExtensionPolicy: messageTimeout in the wrong case", file: egDir + "/20-envoyextensionpolicy.yaml",
			mutate:  renameField("spec.extProc.0", "messageTimeout", "messagetimeout"),
			wantErr: `unknown field "spec.extProc[0].messagetimeout"`,
		},
		{
			name: "EnvoyExtensionPolicy: duplicated field", file: egDir + "/20-envoyextensionpolicy.yaml",
			text: func(s string) string {
				return strings.Replace(s, "      failOpen: false\n", "      failOpen: false\n      failOpen: true\n", 1)
			},
			wantErr: `"failOpen" already set`,
		},
		{
			name: "EnvoyPatchPolicy: misspelt value", file: jsonErrorsDir + "/30-envoypatchpolicy.yaml",
			mutate:  addField("spec.jsonPatches.0.operation", "vaule", "x"),
			wantErr: `unknown field "spec.jsonPatches[0].operation.vaule"`,
		},
		{
			name: "BackendTrafficPolicy: misspelt endpointOverride", file: egDir + "/50-backendtrafficpolicy.yaml",
			mutate:  renameField("spec.loadBalancer", "endpointOverride", "endpointOveride"),
			wantErr: `unknown field "spec.loadBalancer.endpointOveride"`,
		},
		{
			name: "EnvoyPatchPolicy pdx-responses: misspelt name", file: jsonErrorsDir + "/30-envoypatchpolicy.yaml",
			mutate:  renameField("spec.jsonPatches.0", "name", "nmae"),
			wantErr: `unknown field "spec.jsonPatches[0].nmae"`,
		},
		{
			name: "ClientTrafficPolicy: misspelt initialStreamWindowSize", file: egDir + "/40-clienttrafficpolicy.yaml",
			mutate:  renameField("spec.http2", "initialStreamWindowSize", "initialStreamWindow"),
			wantErr: `unknown field "spec.http2.initialStreamWindow"`,
		},
		{
			name: "ClientTrafficPolicy: bufferLimit in the wrong case", file: egDir + "/40-clienttrafficpolicy.yaml",
			mutate:  renameField("spec.connection", "bufferLimit", "bufferlimit"),
			wantErr: `unknown field "spec.connection.bufferlimit"`,
		},
		{
			name: "BackendTrafficPolicy: misspelt circuitBreaker", file: egDir + "/50-backendtrafficpolicy.yaml",
			mutate:  renameField("spec", "circuitBreaker", "circuitBreakers"),
			wantErr: `unknown field "spec.circuitBreakers"`,
		},
		{
			name: "HTTPRoute: backendRef for backendRefs", file: egDir + "/10-httproute.yaml",
			mutate:  renameField("spec.rules.0", "backendRefs", "backendRef"),
			wantErr: `unknown field "spec.rules[0].backendRef"`,
		},
		{
			name: "Gateway: misspelt listener field", file: egDir + "/00-gateway.yaml", doc: 1,
			mutate:  addField("spec.listeners.0", "hostnames", []any{"a.example"}),
			wantErr: `unknown field "spec.listeners[0].hostnames"`,
		},
		{
			name: "Deployment: misspelt securityContext", file: baseDir + "/30-pdx-deployment.yaml",
			mutate:  renameField("spec.template.spec.containers.0", "securityContext", "securityContex"),
			wantErr: `unknown field "spec.template.spec.containers[0].securityContex"`,
		},
		{
			name: "Service: misspelt appProtocol", file: baseDir + "/40-pdx-service.yaml",
			mutate:  renameField("spec.ports.0", "appProtocol", "appProtocl"),
			wantErr: `unknown field "spec.ports[0].appProtocl"`,
		},
		{
			name: "PodDisruptionBudget: misspelt maxUnavailable", file: baseDir + "/50-pdx-pdb.yaml",
			mutate:  renameField("spec", "maxUnavailable", "maxUnavaliable"),
			wantErr: `unknown field "spec.maxUnavaliable"`,
		},
		{
			name: "Role: misspelt apiGroups", file: baseDir + "/10-pdx-rbac.yaml", doc: 1,
			mutate:  renameField("rules.1", "apiGroups", "apiGroup"),
			wantErr: `unknown field "rules[1].apiGroup"`,
		},
		{
			name: "ConfigMap: data under spec", file: baseDir + "/20-pdx-config.yaml",
			mutate:  addField("metadata", "data", map[string]any{"a": "b"}),
			wantErr: `unknown field "metadata.data"`,
		},
		{
			name: "InferencePool: misspelt failureMode", file: poolDir + "/10-inferencepool.yaml",
			mutate:  renameField("spec.endpointPickerRef", "failureMode", "failureMod"),
			wantErr: `unknown field "spec.endpointPickerRef.failureMod"`,
		},
		{
			name: "unknown kind", file: jsonErrorsDir + "/30-envoypatchpolicy.yaml",
			text: func(s string) string {
				return strings.Replace(s, "kind: EnvoyPatchPolicy", "kind: EnvoyPatchPolicie", 1)
			},
			wantErr: `no kind "EnvoyPatchPolicie" is registered`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			data, err := os.ReadFile(tt.file)
			require.NoError(t, err)
			docs, err := documents(data)
			require.NoError(t, err)
			require.Less(t, tt.doc, len(docs))
			doc := docs[tt.doc]
			if tt.mutate != nil {
				var m map[string]any
				require.NoError(t, yaml.Unmarshal(doc, &m))
				tt.mutate(t, m)
				doc, err = yaml.Marshal(m)
				require.NoError(t, err)
			}
			if tt.text != nil {
				changed := tt.text(string(doc))
				require.NotEqual(t, string(doc), changed, "the text change did not apply")
				doc = []byte(changed)
			}
			_, err = decode(doc)
			if tt.wantErr == "" {
				require.NoError(t, err)
				return
			}
			require.Error(t, err)
			require.Contains(t, err.Error(), tt.wantErr)
		})
	}
}

// pdxConfig is the pdx Deployment's configuration, read from its ConfigMap
// the way the pod sees it, and parsed by pdx's own loader.
type pdxConfig struct {
	cfg       *configv1.Config
	container corev1.Container
}

func loadPdx(t *testing.T, objs []object) pdxConfig {
	t.Helper()
	dep := get[*appsv1.Deployment](t, objs, "pdx")
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
	require.NoError(t, err, "ConfigMap %s, key %s", cm.Name, key)
	return pdxConfig{cfg: cfg, container: c}
}

// maxPrefillTimeout is the longest prefill_timeout of the config's pools.
func (p pdxConfig) maxPrefillTimeout() time.Duration {
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
	require.Contains(t, []string{"0.0.0.0", "::", ""}, host, "%s: the kubelet and Envoy connect to the pod IP, so listen on all addresses", addr)
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

// imageRef checks the image tag policy: a registry host, a fixed version
// tag or a digest, never latest or no tag.
var imageRef = regexp.MustCompile(`^[a-z0-9.-]+\.[a-z]+(:\d+)?/[a-z0-9._/-]+(:v?\d+\.\d+\.\d+[0-9A-Za-z.+-]*|@sha256:[0-9a-f]{64})$`)

// TestPdxWorkload: the pdx Deployment runs locked down, its Service, PDB and
// RBAC select and name what exists, its config (the ConfigMap, as mounted)
// passes pdx's loader, the ports and probes are the ones pdx listens on, and
// shutdown fits in the grace period.
func TestPdxWorkload(t *testing.T) {
	objs := load(t, baseDir)
	ns := get[*corev1.Namespace](t, objs, namespace)
	require.Equal(t, namespace, ns.Name)

	dep := get[*appsv1.Deployment](t, objs, "pdx")
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
	for _, c := range dep.Spec.Template.Spec.TopologySpreadConstraints {
		selects("a topology spread constraint", c.LabelSelector)
	}
	svc := get[*corev1.Service](t, objs, "pdx")
	selects("Service pdx", &metav1.LabelSelector{MatchLabels: svc.Spec.Selector})
	pdb := get[*policyv1.PodDisruptionBudget](t, objs, "pdx")
	selects("PodDisruptionBudget pdx", pdb.Spec.Selector)
	require.NotNil(t, dep.Spec.Replicas)
	replicas := int(*dep.Spec.Replicas)
	require.GreaterOrEqual(t, replicas, 2, "one pdx is a single point of failure (failOpen: false)")
	switch {
	case pdb.Spec.MaxUnavailable != nil:
		v, err := intstr.GetScaledValueFromIntOrPercent(pdb.Spec.MaxUnavailable, replicas, true)
		require.NoError(t, err)
		require.Less(t, v, replicas, "the PDB lets every pdx go")
	case pdb.Spec.MinAvailable != nil:
		v, err := intstr.GetScaledValueFromIntOrPercent(pdb.Spec.MinAvailable, replicas, true)
		require.NoError(t, err)
		require.Positive(t, v)
		require.Less(t, v, replicas, "the PDB blocks every drain")
	default:
		require.Fail(t, "the PDB sets neither maxUnavailable nor minAvailable")
	}
	if s := dep.Spec.Strategy.RollingUpdate; s != nil && s.MaxUnavailable != nil {
		v, err := intstr.GetScaledValueFromIntOrPercent(s.MaxUnavailable, replicas, false)
		require.NoError(t, err)
		require.Less(t, v, replicas, "a rollout may take every pdx down")
	}

	// Identity: the ServiceAccount exists and is bound to a read-only
	// discovery Role in the namespace.
	pod := dep.Spec.Template.Spec
	sa := get[*corev1.ServiceAccount](t, objs, pod.ServiceAccountName)
	var bound []rbacv1.PolicyRule
	for _, rb := range all[*rbacv1.RoleBinding](objs) {
		for _, s := range rb.Subjects {
			if s.Kind == rbacv1.ServiceAccountKind && s.Name == sa.Name && s.Namespace == sa.Namespace {
				require.Equal(t, rbacv1.GroupName, rb.RoleRef.APIGroup, rb.Name)
				require.Equal(t, "Role", rb.RoleRef.Kind, "%s: bind a Role, not cluster-wide rights", rb.Name)
				bound = append(bound, get[*rbacv1.Role](t, objs, rb.RoleRef.Name).Rules...)
			}
		}
	}
	want := map[string]bool{
		"/pods": true, "discovery.k8s.io/endpointslices": true,
		"llm-d.ai/inferenceobjectives": true, "inference.networking.x-k8s.io/inferenceobjectives": true,
	}
	got := map[string]bool{}
	for _, r := range bound {
		require.ElementsMatch(t, []string{"get", "list", "watch"}, r.Verbs, "pdx only reads")
		require.Empty(t, r.ResourceNames)
		for _, g := range r.APIGroups {
			for _, res := range r.Resources {
				got[g+"/"+res] = true
			}
		}
	}
	require.Equal(t, want, got, "pdx's Role: get/list/watch pods, discovery.k8s.io endpointslices and inferenceobjectives")
	// ... in every namespace a pool discovers its engines in.
	for _, pool := range loadPdx(t, objs).cfg.GetPools() {
		if k := pool.GetKubernetes(); k != nil {
			require.Equal(t, sa.Namespace, k.GetNamespace(), "pool %s watches a namespace pdx's Role does not cover", pool.GetName())
		}
	}

	// Security.
	c := loadPdx(t, objs).container
	psc := pod.SecurityContext
	require.NotNil(t, psc)
	require.NotNil(t, c.SecurityContext)
	csc := c.SecurityContext
	require.True(t, (psc.RunAsNonRoot != nil && *psc.RunAsNonRoot) || (csc.RunAsNonRoot != nil && *csc.RunAsNonRoot), "runAsNonRoot")
	uid := psc.RunAsUser
	if csc.RunAsUser != nil {
		uid = csc.RunAsUser
	}
	require.NotNil(t, uid)
	require.NotZero(t, *uid)
	seccomp := psc.SeccompProfile
	if csc.SeccompProfile != nil {
		seccomp = csc.SeccompProfile
	}
	require.NotNil(t, seccomp)
	require.Equal(t, corev1.SeccompProfileTypeRuntimeDefault, seccomp.Type)
	require.NotNil(t, csc.ReadOnlyRootFilesystem)
	require.True(t, *csc.ReadOnlyRootFilesystem)
	require.NotNil(t, csc.AllowPrivilegeEscalation)
	require.False(t, *csc.AllowPrivilegeEscalation)
	require.Nil(t, csc.Privileged)
	require.NotNil(t, csc.Capabilities)
	require.Equal(t, []corev1.Capability{"ALL"}, csc.Capabilities.Drop)
	require.Empty(t, csc.Capabilities.Add)
	require.False(t, pod.HostNetwork || pod.HostPID || pod.HostIPC)

	// Image tag policy.
	require.Regexp(t, imageRef, c.Image, "pin a registry image by version tag or digest (never latest)")
	require.Equal(t, corev1.PullIfNotPresent, c.ImagePullPolicy)
	require.Empty(t, c.Command, "run the image's entrypoint, /pdx")
	require.Equal(t, "serve", c.Args[0])

	// Resources: requests for scheduling, a memory limit the Go runtime
	// follows.
	require.False(t, c.Resources.Requests.Cpu().IsZero(), "cpu request")
	require.False(t, c.Resources.Requests.Memory().IsZero(), "memory request")
	require.False(t, c.Resources.Limits.Memory().IsZero(), "memory limit")
	var gomemlimit bool
	for _, e := range c.Env {
		if e.Name == "GOMEMLIMIT" {
			require.NotNil(t, e.ValueFrom)
			require.NotNil(t, e.ValueFrom.ResourceFieldRef)
			require.Equal(t, "limits.memory", e.ValueFrom.ResourceFieldRef.Resource)
			gomemlimit = true
		}
	}
	require.True(t, gomemlimit, "GOMEMLIMIT from the memory limit")
}

// TestPdxPortsProbesAndDrain: the ports and probes are the ones pdx's
// config makes it listen on, the Service speaks h2c on the gRPC port, and
// the grace period covers the preStop sleep and the drain, which covers the
// slowest prefill.
func TestPdxPortsProbesAndDrain(t *testing.T) {
	objs := load(t, baseDir)
	p := loadPdx(t, objs)
	c := p.container
	grpcPort := listenPort(t, p.cfg.GetGrpcAddress())
	adminPort := listenPort(t, p.cfg.GetAdminAddress())
	require.Equal(t, grpcPort, containerPort(t, c, "grpc"))
	require.Equal(t, adminPort, containerPort(t, c, "admin"))

	svc := get[*corev1.Service](t, objs, "pdx")
	require.Len(t, svc.Spec.Ports, 2)
	sp := svc.Spec.Ports[0]
	require.Equal(t, "grpc", sp.Name)
	require.NotNil(t, sp.AppProtocol)
	require.Equal(t, h2c, *sp.AppProtocol, "ext_proc is gRPC: HTTP/2 without TLS")
	require.Equal(t, grpcPort, servicePortTarget(t, sp, c))
	sp = svc.Spec.Ports[1]
	require.Equal(t, "admin", sp.Name, "the admin port, for Prometheus")
	require.Equal(t, adminPort, servicePortTarget(t, sp, c))

	for name, probe := range map[string]*corev1.Probe{"liveness": c.LivenessProbe, "readiness": c.ReadinessProbe} {
		require.NotNil(t, probe, "%s probe", name)
		switch {
		case probe.GRPC != nil:
			require.Equal(t, grpcPort, probe.GRPC.Port, "%s probe", name)
			require.NotNil(t, probe.GRPC.Service, "%s probe: name the health service", name)
		case probe.HTTPGet != nil:
			require.Equal(t, adminPort, resolvePort(t, probe.HTTPGet.Port, c), "%s probe", name)
		default:
			require.Failf(t, "probe", "%s probe: gRPC health or the admin's HTTP endpoints", name)
		}
	}
	require.Contains(t, []string{"readiness", "/readyz"}, probeTarget(c.ReadinessProbe), "readiness must follow pdx's drain")

	// Drain: preStop sleep, then SIGTERM and --drain-timeout, all within the
	// grace period; the drain lets the slowest prefill finish.
	drainFlag, ok := flagValue(c.Args, "drain-timeout")
	require.True(t, ok, "set --drain-timeout explicitly")
	drain, err := time.ParseDuration(drainFlag)
	require.NoError(t, err)
	require.GreaterOrEqual(t, drain, p.maxPrefillTimeout(), "--drain-timeout must let an in-flight prefill finish")
	var preStop time.Duration
	if c.Lifecycle != nil && c.Lifecycle.PreStop != nil {
		require.NotNil(t, c.Lifecycle.PreStop.Sleep, "the image has no shell: use the sleep action")
		preStop = time.Duration(c.Lifecycle.PreStop.Sleep.Seconds) * time.Second
	}
	require.Positive(t, preStop, "a preStop sleep lets Envoy drop the pod before pdx stops taking streams")
	grace := get[*appsv1.Deployment](t, objs, "pdx").Spec.Template.Spec.TerminationGracePeriodSeconds
	require.NotNil(t, grace)
	require.Greater(t, time.Duration(*grace)*time.Second, preStop+drain,
		"terminationGracePeriodSeconds must exceed the preStop sleep (%s) plus --drain-timeout (%s)", preStop, drain)
}

// scrape is where a Prometheus scrapes pdx, and what told it to.
type scrape struct {
	what string
	port int32 // the pdx container's port
	path string
}

// scrapes are the targets objs give a Prometheus: the pdx pods'
// prometheus.io annotations, and the endpoints of every ServiceMonitor,
// which must select only Services of the pdx pods in their namespace and
// name a port of them. Each must be pdx's admin port.
func scrapes(t *testing.T, objs []object, p pdxConfig) []scrape {
	t.Helper()
	dep := get[*appsv1.Deployment](t, objs, "pdx")
	podLabels := labels.Set(dep.Spec.Template.Labels)
	var out []scrape
	if ann := dep.Spec.Template.Annotations; ann["prometheus.io/scrape"] == "true" {
		port, err := strconv.ParseInt(ann["prometheus.io/port"], 10, 32)
		require.NoError(t, err, "annotation prometheus.io/port")
		out = append(out, scrape{what: "the pods' prometheus.io annotations", port: int32(port), path: cmp.Or(ann["prometheus.io/path"], "/metrics")})
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
			out = append(out, scrape{what: "ServiceMonitor " + sm.Name, port: servicePortTarget(t, svcs[0].Spec.Ports[i], p.container), path: cmp.Or(ep.Path, "/metrics")})
		}
	}
	for _, s := range out {
		require.Equal(t, listenPort(t, p.cfg.GetAdminAddress()), s.port, "%s: not pdx's admin port", s.what)
	}
	return out
}

// TestMetricsScrape: the pods' annotations and monitoring/'s ServiceMonitor
// both point a Prometheus at pdx's admin port (TestProbesAnswer asks a
// running pdx for their paths).
func TestMetricsScrape(t *testing.T) {
	objs := load(t, baseDir, monitoringDir)
	var what []string
	for _, s := range scrapes(t, objs, loadPdx(t, objs)) {
		what = append(what, s.what)
	}
	require.ElementsMatch(t, []string{"the pods' prometheus.io annotations", "ServiceMonitor pdx"}, what)
}

// probeTarget is the gRPC health service or the HTTP path a probe checks.
func probeTarget(p *corev1.Probe) string {
	switch {
	case p == nil:
		return ""
	case p.GRPC != nil && p.GRPC.Service != nil:
		return *p.GRPC.Service
	case p.HTTPGet != nil:
		return p.HTTPGet.Path
	}
	return ""
}

// resolvePort turns a named or numbered port of c into its number.
func resolvePort(t *testing.T, p intstr.IntOrString, c corev1.Container) int32 {
	t.Helper()
	if p.Type == intstr.String {
		return containerPort(t, c, p.StrVal)
	}
	return p.IntVal
}

// servicePortTarget is the container port a Service port sends to.
func servicePortTarget(t *testing.T, sp corev1.ServicePort, c corev1.Container) int32 {
	t.Helper()
	if sp.TargetPort.Type == intstr.Int && sp.TargetPort.IntVal == 0 {
		return sp.Port
	}
	return resolvePort(t, sp.TargetPort, c)
}

// serviceHasPort requires Service name to have port, and returns the port.
func serviceHasPort(t *testing.T, objs []object, name string, port int32) corev1.ServicePort {
	t.Helper()
	svc := get[*corev1.Service](t, objs, name)
	for _, sp := range svc.Spec.Ports {
		if sp.Port == port {
			return sp
		}
	}
	require.Failf(t, "no such port", "Service %s has no port %d", name, port)
	return corev1.ServicePort{}
}

// requirePdxService requires a reference to Service name, port to reach the
// pdx pods on pdx's gRPC port.
func requirePdxService(t *testing.T, objs []object, p pdxConfig, name string, port int32) {
	t.Helper()
	sp := serviceHasPort(t, objs, name, port)
	require.Equal(t, listenPort(t, p.cfg.GetGrpcAddress()), servicePortTarget(t, sp, p.container), "Service %s port %d does not reach pdx's grpc_address", name, port)
	svc := get[*corev1.Service](t, objs, name)
	dep := get[*appsv1.Deployment](t, objs, "pdx")
	require.True(t, labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(dep.Spec.Template.Labels)), "Service %s does not select the pdx pods", name)
}

// requireGateway requires a parentRef to name a Gateway of Envoy Gateway's
// controller and a listener of it.
func requireGateway(t *testing.T, objs []object, ref gwv1.ParentReference) {
	t.Helper()
	require.NotNil(t, ref.Kind)
	require.Equal(t, gwv1.Kind("Gateway"), *ref.Kind)
	require.Nil(t, ref.Namespace, "the route's namespace")
	gw := get[*gwv1.Gateway](t, objs, string(ref.Name))
	gc := get[*gwv1.GatewayClass](t, objs, string(gw.Spec.GatewayClassName))
	require.Equal(t, gwv1.GatewayController(egController), gc.Spec.ControllerName)
	if ref.SectionName != nil {
		require.True(t, slices.ContainsFunc(gw.Spec.Listeners, func(l gwv1.Listener) bool { return l.Name == *ref.SectionName }),
			"Gateway %s has no listener %s", gw.Name, *ref.SectionName)
	}
}

// requireServiceRef requires a backendRef to name a Service port that exists.
func requireServiceRef(t *testing.T, objs []object, ref gwv1.BackendObjectReference) corev1.ServicePort {
	t.Helper()
	require.NotNil(t, ref.Kind)
	require.Equal(t, gwv1.Kind("Service"), *ref.Kind)
	require.NotNil(t, ref.Group)
	require.Equal(t, gwv1.Group(""), *ref.Group)
	require.Nil(t, ref.Namespace, "same namespace: no ReferenceGrant needed")
	require.NotNil(t, ref.Port, "backendRef to Service %s needs a port", ref.Name)
	return serviceHasPort(t, objs, string(ref.Name), int32(*ref.Port))
}

// requireTargets requires policy targetRefs to name objects of kind that
// exist.
func requireTargets(t *testing.T, objs []object, refs []gwv1.LocalPolicyTargetReferenceWithSectionName, kind string) {
	t.Helper()
	require.NotEmpty(t, refs)
	for _, r := range refs {
		require.Equal(t, gwv1.Group(gwv1.GroupName), r.Group)
		require.Equal(t, gwv1.Kind(kind), r.Kind)
		switch kind {
		case "HTTPRoute":
			get[*gwv1.HTTPRoute](t, objs, string(r.Name))
		case "Gateway":
			get[*gwv1.Gateway](t, objs, string(r.Name))
		}
	}
}

// requireEveryPath requires route to have one rule, matching every
// request (PathPrefix /, no method, header or query match): pdx sees every
// request and the rule's cluster, the one patched to ORIGINAL_DST, takes
// every request pdx lets through.
func requireEveryPath(t *testing.T, route *gwv1.HTTPRoute) gwv1.HTTPRouteRule {
	t.Helper()
	require.Len(t, route.Spec.Rules, 1, "HTTPRoute %s: one rule, for every path", route.Name)
	r := route.Spec.Rules[0]
	require.Len(t, r.Matches, 1, "HTTPRoute %s", route.Name)
	m := r.Matches[0]
	require.Nil(t, m.Method, "pdx answers every method itself")
	require.Empty(t, m.Headers)
	require.Empty(t, m.QueryParams)
	require.NotNil(t, m.Path)
	require.NotNil(t, m.Path.Type)
	require.Equal(t, gwv1.PathMatchPathPrefix, *m.Path.Type)
	require.NotNil(t, m.Path.Value)
	require.Equal(t, "/", *m.Path.Value, "pdx answers unknown paths and GET /v1/models itself")
	require.Empty(t, r.Filters, "pdx, not the route, changes requests")
	require.NotNil(t, r.Timeouts, "Envoy's default route timeout (15s) would cut generations")
	require.NotNil(t, r.Timeouts.Request)
	require.Equal(t, gwv1.Duration("0s"), *r.Timeouts.Request, "generations stream for minutes")
	require.Nil(t, r.Timeouts.BackendRequest)
	return r
}

// bufferLimitPattern is the CRDs' pattern for bufferLimit quantities, which
// a Go decode does not check.
var bufferLimitPattern = regexp.MustCompile(`^[1-9]+[0-9]*([EPTGMK]i|[EPTGMk])?$`)

func bufferLimit(t *testing.T, what string, q *resource.Quantity) int64 {
	t.Helper()
	require.NotNil(t, q, "%s: set bufferLimit", what)
	require.Regexp(t, bufferLimitPattern, q.String(), what)
	return q.Value()
}

// TestEnvoyGatewayManifests: every reference of the Envoy Gateway variant
// resolves, and the route, the ext_proc filter, the buffer and header
// limits and the patches (ORIGINAL_DST, local replies, x-request-id) make
// Envoy Gateway's Envoy what pdx's own bootstrap is.
func TestEnvoyGatewayManifests(t *testing.T) {
	objs := load(t, baseDir, egDir)
	p := loadPdx(t, objs)
	maxBody := int64(p.cfg.GetMaxBodyBytes())
	own := renderPdxEnvoy(t)

	// The route and what it points at.
	route := get[*gwv1.HTTPRoute](t, objs, "openai")
	require.Len(t, route.Spec.ParentRefs, 1)
	parent := route.Spec.ParentRefs[0]
	requireGateway(t, objs, parent)
	require.NotNil(t, parent.SectionName, "name the Gateway's listener: the patches name its resources")
	gw := get[*gwv1.Gateway](t, objs, string(parent.Name))
	rule := requireEveryPath(t, route)
	require.Len(t, rule.BackendRefs, 1)
	requireServiceRef(t, objs, rule.BackendRefs[0].BackendObjectReference)

	// The ext_proc filter.
	eep := get[*egv1a1.EnvoyExtensionPolicy](t, objs, "pdx")
	requireTargets(t, objs, eep.Spec.TargetRefs, "HTTPRoute")
	require.Len(t, eep.Spec.ExtProc, 1)
	ep := eep.Spec.ExtProc[0]
	require.Nil(t, ep.BackendRef, "Envoy Gateway accepts backendRefs only")
	require.Len(t, ep.BackendRefs, 1)
	b := ep.BackendRefs[0].BackendObjectReference
	requireServiceRef(t, objs, b)
	requirePdxService(t, objs, p, string(b.Name), int32(*b.Port))
	require.NotNil(t, ep.ProcessingMode)
	require.NotNil(t, ep.ProcessingMode.Request, "without processingMode.request Envoy Gateway skips the request headers")
	require.NotNil(t, ep.ProcessingMode.Request.Body)
	require.Equal(t, egv1a1.BufferedExtProcBodyProcessingMode, *ep.ProcessingMode.Request.Body)
	require.True(t, ep.ProcessingMode.AllowModeOverride, "pdx switches phases per request")
	require.NotNil(t, ep.FailOpen, "state failOpen: false explicitly")
	require.False(t, *ep.FailOpen, "fail closed: a request pdx did not see must not reach an engine")
	require.Nil(t, ep.ShadowMode)
	require.NotNil(t, ep.MessageTimeout)
	mt, err := time.ParseDuration(string(*ep.MessageTimeout))
	require.NoError(t, err)
	require.Greater(t, mt, p.maxPrefillTimeout(), "messageTimeout must exceed every pool's prefill_timeout")
	require.NotNil(t, ep.Metadata)
	require.Contains(t, ep.Metadata.WritableNamespaces, processor.MetadataNamespace, "the decode endpoint")
	require.Contains(t, ep.Metadata.WritableNamespaces, processor.RequestMetadataNamespace, "the client's request id")
	require.Subset(t, ep.Metadata.WritableNamespaces, own.extProc.GetMetadataOptions().GetReceivingNamespaces().GetUntyped(),
		"what pdx's own Envoy lets pdx write")
	require.NotNil(t, ep.StatusOnError, "state statusOnError: 503 explicitly")
	require.EqualValues(t, own.extProc.GetStatusOnError().GetCode(), *ep.StatusOnError, "pdx unavailable: 503, retryable")
	require.NotNil(t, ep.BackendSettings)
	require.NotNil(t, ep.BackendSettings.Connection)
	require.GreaterOrEqual(t, bufferLimit(t, "ext_proc backendSettings", ep.BackendSettings.Connection.BufferLimit), maxBody)

	// The client side: buffer limits (HTTP/1 and HTTP/2), request ids,
	// paths and timeouts as in pdx's own Envoy.
	ctp := get[*egv1a1.ClientTrafficPolicy](t, objs, "pdx")
	requireTargets(t, objs, ctp.Spec.TargetRefs, "Gateway")
	require.Equal(t, gw.Name, string(ctp.Spec.TargetRefs[0].Name))
	require.NotNil(t, ctp.Spec.Connection)
	client := bufferLimit(t, "ClientTrafficPolicy", ctp.Spec.Connection.BufferLimit)
	require.Greater(t, client, maxBody, "above max_body_bytes, so that pdx answers an oversized body with its JSON 413")
	require.LessOrEqual(t, client, maxBody+envoy.BufferHeadroom, "at most max_body_bytes + envoy.BufferHeadroom")
	require.Nil(t, ctp.Spec.Connection.ConnectionLimit, "a connection_limit filter would come before the HTTP connection manager the listener patch names by index")
	require.NotNil(t, ctp.Spec.HTTP2, "Envoy Gateway's HTTP/2 stream window (64 KiB) would be an HTTP/2 client's body limit")
	require.Equal(t, client, bufferLimit(t, "ClientTrafficPolicy http2.initialStreamWindowSize", ctp.Spec.HTTP2.InitialStreamWindowSize),
		"over HTTP/2 a stream's buffer limit is its window: the same as the connection buffer limit")
	require.NotNil(t, ctp.Spec.Headers)
	require.NotNil(t, ctp.Spec.Headers.RequestID)
	require.True(t, own.hcm.GetPreserveExternalRequestId() && own.hcm.GetGenerateRequestId().GetValue())
	require.Equal(t, egv1a1.RequestIDActionPreserveOrGenerate, *ctp.Spec.Headers.RequestID, "keep the client's x-request-id")
	require.NotNil(t, ctp.Spec.Path)
	require.NotNil(t, ctp.Spec.Path.EscapedSlashesAction)
	require.Equal(t, hcmv3.HttpConnectionManager_REJECT_REQUEST, own.hcm.GetPathWithEscapedSlashesAction())
	require.Equal(t, egv1a1.RejectRequestAction, *ctp.Spec.Path.EscapedSlashesAction)
	require.Nil(t, ctp.Spec.Path.DisableMergeSlashes, "merge slashes, as pdx's Envoy")
	require.True(t, own.hcm.GetMergeSlashes())
	require.NotNil(t, ctp.Spec.Timeout)
	require.NotNil(t, ctp.Spec.Timeout.HTTP)
	h := ctp.Spec.Timeout.HTTP
	duration := func(what string, d *gwv1.Duration) time.Duration {
		t.Helper()
		require.NotNil(t, d, "set %s", what)
		v, err := time.ParseDuration(string(*d))
		require.NoError(t, err, what)
		return v
	}
	require.Equal(t, own.hcm.GetStreamIdleTimeout().AsDuration(), duration("streamIdleTimeout", h.StreamIdleTimeout))
	require.Equal(t, own.hcm.GetRequestHeadersTimeout().AsDuration(), duration("requestHeadersReceivedTimeout", h.RequestHeadersReceivedTimeout))
	require.Nil(t, h.RequestReceivedTimeout, "pdx's request_body_timeout bounds the body, nothing the whole request")

	// The upstream side: the decode engines, the one pdx picked (and its
	// fallbacks on retries), no EnvoyPatchPolicy.
	btp := get[*egv1a1.BackendTrafficPolicy](t, objs, "pdx-decode")
	requireTargets(t, objs, btp.Spec.TargetRefs, "HTTPRoute")
	require.NotNil(t, btp.Spec.Connection)
	require.GreaterOrEqual(t, bufferLimit(t, "BackendTrafficPolicy", btp.Spec.Connection.BufferLimit), client)
	require.NotNil(t, btp.Spec.LoadBalancer)
	require.NotNil(t, btp.Spec.LoadBalancer.EndpointOverride, "the decode engine pdx names, by endpointOverride")
	require.Len(t, btp.Spec.LoadBalancer.EndpointOverride.ExtractFrom, 1)
	require.NotNil(t, btp.Spec.LoadBalancer.EndpointOverride.ExtractFrom[0].Header)
	require.Equal(t, processor.DestinationHeader, *btp.Spec.LoadBalancer.EndpointOverride.ExtractFrom[0].Header)
	require.NotNil(t, btp.Spec.Retry, "decode fallback: Envoy retries on the next host pdx named")
	require.NotNil(t, btp.Spec.Retry.NumRetries)
	require.GreaterOrEqual(t, int(*btp.Spec.Retry.NumRetries), maxDecodeFallbacks(p))
	require.NotNil(t, btp.Spec.Retry.RetryOn)
	require.Subset(t, btp.Spec.Retry.RetryOn.Triggers, []egv1a1.TriggerEnum{egv1a1.ConnectFailure, egv1a1.RefusedStream, egv1a1.Error5XX})
	require.Empty(t, all[*egv1a1.EnvoyPatchPolicy](objs), "the default set needs no EnvoyPatchPolicy")
	require.NotNil(t, ep.ProcessingMode.Response, "the response headers: pdx sets x-request-id and learns the decode that served")
	require.Nil(t, ep.ProcessingMode.Response.Body, "no response body to pdx")
	require.Equal(t, []string{processor.UpstreamAddressAttribute}, ep.ProcessingMode.Response.Attributes)
}

// maxDecodeFallbacks is the most decode_fallbacks of the pools of p.
func maxDecodeFallbacks(p pdxConfig) int {
	n := 0
	for _, pool := range p.cfg.GetPools() {
		n = max(n, int(pool.GetDecodeFallbacks()))
	}
	return n
}

// TestEnvoyGatewayJSONErrors: the optional patch gives Envoy Gateway's
// listener pdx's JSON local replies and its route configuration pdx's
// x-request-id response headers, each applied to the resource Envoy
// Gateway generates.
func TestEnvoyGatewayJSONErrors(t *testing.T) {
	objs := load(t, baseDir, egDir, jsonErrorsDir)
	p := loadPdx(t, objs)
	own := renderPdxEnvoy(t)
	route := get[*gwv1.HTTPRoute](t, objs, "openai")
	parent := route.Spec.ParentRefs[0]
	gw := get[*gwv1.Gateway](t, objs, string(parent.Name))
	ctp := get[*egv1a1.ClientTrafficPolicy](t, objs, "pdx")
	client := bufferLimit(t, "ClientTrafficPolicy", ctp.Spec.Connection.BufferLimit)
	ep := get[*egv1a1.EnvoyExtensionPolicy](t, objs, "pdx").Spec.ExtProc[0]

	epps := all[*egv1a1.EnvoyPatchPolicy](objs)
	require.Len(t, epps, 1)
	listenerName := egListenerName(gw, *parent.SectionName)
	resources := []egResource{
		{typ: string(egv1a1.ListenerEnvoyResourceType), name: listenerName, file: egListenerFile},
		{typ: string(egv1a1.RouteConfigurationEnvoyResourceType), name: listenerName, file: egRouteConfigFile},
	}
	for _, epp := range epps {
		require.Equal(t, egv1a1.JSONPatchEnvoyPatchType, epp.Spec.Type)
		require.Equal(t, gwv1.Group(gwv1.GroupName), epp.Spec.TargetRef.Group)
		require.Equal(t, gwv1.Kind("Gateway"), epp.Spec.TargetRef.Kind)
		require.Equal(t, gw.Name, string(epp.Spec.TargetRef.Name), "EnvoyPatchPolicy %s must target the Gateway of route %s", epp.Name, route.Name)
		require.NotEmpty(t, epp.Spec.JSONPatches)
		for _, jp := range epp.Spec.JSONPatches {
			require.True(t, slices.ContainsFunc(resources, func(r egResource) bool { return r.typ == string(jp.Type) && r.name == jp.Name }),
				"EnvoyPatchPolicy %s patches %s %s, which Envoy Gateway does not generate (or this test does not know)", epp.Name, jp.Type, jp.Name)
		}
	}
	for _, r := range resources {
		require.NotEmpty(t, patchesFor(epps, r.typ, r.name), "nothing patches %s %s", r.typ, r.name)
	}

	// The listener: pdx's local replies; header limits Envoy's defaults,
	// which pdx's must be.
	l := patched[*listenerv3.Listener](t, epps, resources[0])
	require.EqualValues(t, client, l.GetPerConnectionBufferLimitBytes().GetValue(), "%s is not Envoy Gateway's listener for these manifests", egListenerFile)
	hcm := hcmOf(t, l)
	require.EqualValues(t, client, hcm.GetHttp2ProtocolOptions().GetInitialStreamWindowSize().GetValue(), egListenerFile)
	requireProtoEqual(t, own.hcm.GetLocalReplyConfig(), hcm.GetLocalReplyConfig(), "the listener's local_reply_config")
	require.Len(t, own.hcm.GetLocalReplyConfig().GetMappers(), 2*len(envoy.LocalReplies), "each in Anthropic's shape and OpenAI's")
	require.Nil(t, hcm.GetMaxRequestHeadersKb(), "Envoy Gateway sets no header size limit: Envoy's default")
	require.Nil(t, hcm.GetCommonHttpProtocolOptions().GetMaxHeadersCount(), "Envoy Gateway sets no header count limit: Envoy's default")
	require.EqualValues(t, envoy.DefaultMaxRequestHeadersKB, own.hcm.GetMaxRequestHeadersKb().GetValue(), "Envoy's default")
	require.EqualValues(t, envoy.DefaultMaxRequestHeaders, own.hcm.GetCommonHttpProtocolOptions().GetMaxHeadersCount().GetValue(), "Envoy's default")
	require.EqualValues(t, envoy.DefaultMaxRequestHeadersKB, p.cfg.GetMaxRequestHeadersKb(), "pdx's max_request_headers_kb must be the Gateway's limit")
	require.EqualValues(t, envoy.DefaultMaxRequestHeaders, p.cfg.GetMaxRequestHeaders(), "pdx's max_request_headers must be the Gateway's limit")
	ext := extProcOf(t, hcm)
	require.ElementsMatch(t, ep.Metadata.WritableNamespaces, ext.GetMetadataOptions().GetReceivingNamespaces().GetUntyped(), egListenerFile)

	// The route configuration: the client's x-request-id back, on the only
	// route, the rule's.
	rc := patched[*routev3.RouteConfiguration](t, epps, resources[1])
	requireProtoEqual(t, responseHeaders(own.route.GetResponseHeadersToAdd()), responseHeaders(rc.GetResponseHeadersToAdd()), "the route configuration's response_headers_to_add")
	require.Len(t, rc.GetVirtualHosts(), 1)
	require.Len(t, rc.GetVirtualHosts()[0].GetRoutes(), 1)
	rt := rc.GetVirtualHosts()[0].GetRoutes()[0]
	require.Equal(t, "/", rt.GetMatch().GetPrefix())
	require.Equal(t, egRuleCluster(route, 0), rt.GetRoute().GetCluster())
	require.Empty(t, rt.GetResponseHeadersToAdd(), "the x-request-id headers are the route configuration's only")
	require.Empty(t, rc.GetVirtualHosts()[0].GetResponseHeadersToAdd())
}

// TestInferencePoolManifests: the InferencePool variant's references
// resolve: every request goes to the pool, the pool is the decode Service's
// pods on its port, its endpoint picker is pdx's gRPC Service, and it fails
// closed.
func TestInferencePoolManifests(t *testing.T) {
	objs := load(t, baseDir, poolDir)
	p := loadPdx(t, objs)

	// pdx's config is base's, with TLS: the gateway reaches its endpoint
	// picker over TLS and verifies nothing.
	require.True(t, p.cfg.GetTls().GetSelfSigned(), "the InferencePool variant's pdx serves TLS")
	base := loadPdx(t, load(t, baseDir))
	require.Nil(t, base.cfg.GetTls(), "base's pdx is reached by Envoy Gateway in plaintext")
	withoutTLS := proto.Clone(p.cfg).(*configv1.Config)
	withoutTLS.Tls = nil
	require.True(t, proto.Equal(base.cfg, withoutTLS), "the two configs differ only in tls")

	route := get[*gwv1.HTTPRoute](t, objs, "openai-inference")
	require.NotEmpty(t, route.Spec.ParentRefs)
	for _, ref := range route.Spec.ParentRefs {
		requireGateway(t, objs, ref)
	}
	// Every request goes to the pool, so the gateway asks pdx about every
	// one, as pdx's own Envoy does.
	r := requireEveryPath(t, route)
	require.Len(t, r.BackendRefs, 1)
	b := r.BackendRefs[0]
	require.NotNil(t, b.Group)
	require.Equal(t, gwv1.Group(infv1.GroupName), *b.Group)
	require.NotNil(t, b.Kind)
	require.Equal(t, gwv1.Kind("InferencePool"), *b.Kind)
	require.Nil(t, b.Port, "an InferencePool backendRef has no port")
	get[*infv1.InferencePool](t, objs, string(b.Name))

	pool := get[*infv1.InferencePool](t, objs, "llm-decode")
	decode := get[*corev1.Service](t, objs, "llm-decode")
	sel := map[string]string{}
	for k, v := range pool.Spec.Selector.MatchLabels {
		sel[string(k)] = string(v)
	}
	require.Equal(t, decode.Spec.Selector, sel, "the pool selects the decode Service's pods")
	require.Len(t, pool.Spec.TargetPorts, 1)
	require.Len(t, decode.Spec.Ports, 1)
	require.Equal(t, decode.Spec.Ports[0].TargetPort.IntValue(), int(pool.Spec.TargetPorts[0].Number), "the pool's port is the decode engines' port")

	ref := pool.Spec.EndpointPickerRef
	require.NotNil(t, ref.Group)
	require.Equal(t, infv1.Group(""), *ref.Group)
	require.Equal(t, infv1.Kind("Service"), ref.Kind)
	require.NotNil(t, ref.Port, "a Service endpoint picker needs its port")
	requirePdxService(t, objs, p, string(ref.Name), int32(ref.Port.Number))
	require.Equal(t, infv1.EndpointPickerFailClose, ref.FailureMode, "fail closed: a request pdx did not see must not reach an engine")
}
