package kubernetes_test

import (
	"context"
	"os"
	"regexp"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/restmapper"
	"sigs.k8s.io/yaml"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/discovery"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/flowcontrol"
	"github.com/pdx-router/pdx/internal/objectives"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/testbed/kubeapi"
)

// cluster is a real API server with the CRDs the InferencePool variant
// uses, started by the first test that applies manifests to it.
var cluster = kubeapi.Package{CRDs: func(ctx context.Context) ([]*unstructured.Unstructured, error) {
	inference, err := kubeapi.InferenceCRDs(ctx)
	if err != nil {
		return nil, err
	}
	gateway, err := kubeapi.GatewayCRDs(ctx)
	return append(inference, gateway...), err
}}

func TestMain(m *testing.M) { os.Exit(cluster.Wrap(m).Run()) }

var inferencePools = schema.GroupVersionResource{Group: "inference.networking.k8s.io", Version: "v1", Resource: "inferencepools"}

// applier sends manifest documents to the API server as `kubectl apply
// --server-side` does: a server-side apply with strict field validation.
type applier struct {
	client dynamic.Interface
	mapper meta.RESTMapper
}

func newApplier(t *testing.T, srv *kubeapi.Server) *applier {
	t.Helper()
	client, err := dynamic.NewForConfig(srv.Config())
	require.NoError(t, err)
	typed, err := kubernetes.NewForConfig(srv.Config())
	require.NoError(t, err)
	return &applier{client: client, mapper: restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(typed.Discovery()))}
}

func (a *applier) apply(ctx context.Context, doc []byte, opts metav1.PatchOptions) (*unstructured.Unstructured, error) {
	u := &unstructured.Unstructured{}
	if err := yaml.Unmarshal(doc, &u.Object); err != nil {
		return nil, err
	}
	gvk := u.GroupVersionKind()
	m, err := a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		return nil, err
	}
	var res dynamic.ResourceInterface = a.client.Resource(m.Resource)
	if m.Scope.Name() == meta.RESTScopeNameNamespace {
		res = a.client.Resource(m.Resource).Namespace(u.GetNamespace())
	}
	data, err := u.MarshalJSON()
	if err != nil {
		return nil, err
	}
	force := true
	opts.FieldManager, opts.Force, opts.FieldValidation = "pdx-test", &force, "Strict"
	return res.Patch(ctx, u.GetName(), types.ApplyPatchType, data, opts)
}

// TestInferencePoolOnAPIServer applies the InferencePool variant (base and
// inferencepool/) to a real API server and runs pdx's discovery and
// objectives against it as pdx's ServiceAccount:
//   - the server takes every object, the InferencePool, Gateway and
//     HTTPRoute checked against their CRDs' schemas and CEL rules;
//   - with the variant's config and Role, as the server stores them, pdx's
//     decode engines are exactly the ready pods the InferencePool selects,
//     on its target port, also after one turns not ready;
//   - the InferenceObjectives that name the pool reach its flow control.
func TestInferencePoolOnAPIServer(t *testing.T) {
	srv := cluster.Server(t)
	a := newApplier(t, srv)
	// The manifests' namespace is the test's: every reference to it is a
	// "namespace: pdx" line (the Namespace object itself is not applied).
	ns := srv.Namespace(t)
	inNamespace := regexp.MustCompile(`(?m)^(\s*namespace: )pdx$`)
	for _, f := range yamlFiles(t, baseDir, poolDir) {
		data, err := os.ReadFile(f)
		require.NoError(t, err)
		docs, err := documents(data)
		require.NoError(t, err)
		for i, doc := range docs {
			obj, err := decode(doc)
			require.NoError(t, err)
			if _, ok := obj.(*corev1.Namespace); ok {
				continue
			}
			_, err = a.apply(t.Context(), inNamespace.ReplaceAll(doc, []byte("${1}"+ns)), metav1.PatchOptions{})
			require.NoError(t, err, "%s: document %d", f, i+1)
		}
	}

	// The pdx Deployment's config and identity, as the server has them.
	admin, err := kubernetes.NewForConfig(srv.Config())
	require.NoError(t, err)
	dep, err := admin.AppsV1().Deployments(ns).Get(t.Context(), "pdx", metav1.GetOptions{})
	require.NoError(t, err)
	dep.SetGroupVersionKind(appsv1.SchemeGroupVersion.WithKind("Deployment"))
	objs := []object{{file: "server", obj: dep}}
	cms, err := admin.CoreV1().ConfigMaps(ns).List(t.Context(), metav1.ListOptions{})
	require.NoError(t, err)
	for i := range cms.Items {
		objs = append(objs, object{file: "server", obj: &cms.Items[i]})
	}
	p := loadPdx(t, objs)
	require.True(t, p.cfg.GetTls().GetSelfSigned(), "the InferencePool variant's ConfigMap replaced base's")
	table, err := routing.New(p.cfg)
	require.NoError(t, err)
	require.Len(t, p.cfg.GetPools(), 1)
	pc := p.cfg.GetPools()[0]
	require.NotNil(t, pc.GetKubernetes(), "the variant's pool discovers its engines")
	pool, _ := table.Pool(pc.GetName())
	sa := "system:serviceaccount:" + ns + ":" + dep.Spec.Template.Spec.ServiceAccountName
	asPdx := srv.ConfigAs(sa, "system:serviceaccounts", "system:serviceaccounts:"+ns)
	pdxClient, err := kubernetes.NewForConfig(asPdx)
	require.NoError(t, err)

	// The engines, as their kubelets would report them. The labels are
	// the ones the variant's config and InferencePool select by.
	engine := func(name, component, ip string, ready bool) {
		t.Helper()
		pod, err := admin.CoreV1().Pods(ns).Create(t.Context(), &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{
				"app.kubernetes.io/name": "llm-engine", "app.kubernetes.io/component": component,
			}},
			Spec: corev1.PodSpec{NodeName: "node-a", Containers: []corev1.Container{{
				Name: "vllm", Image: "vllm", Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8000}},
			}}},
		}, metav1.CreateOptions{})
		require.NoError(t, err)
		status := corev1.ConditionTrue
		if !ready {
			status = corev1.ConditionFalse
		}
		pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}},
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: status}}}
		_, err = admin.CoreV1().Pods(ns).UpdateStatus(t.Context(), pod, metav1.UpdateOptions{})
		require.NoError(t, err)
	}
	engine("prefill-0", "prefill", "10.1.0.1", true)
	engine("decode-0", "decode", "10.1.0.11", true)
	engine("decode-1", "decode", "10.1.0.12", true)
	engine("decode-2", "decode", "10.1.0.13", false)
	engine("router-0", "router", "10.1.0.21", true)

	// The variant's RoleBinding reaches the authorizer through its watch.
	require.Eventually(t, func() bool {
		_, err := pdxClient.CoreV1().Pods(ns).List(t.Context(), metav1.ListOptions{})
		return err == nil
	}, 10*time.Second, 20*time.Millisecond, "the variant's Role lets pdx list pods")

	events := make(chan discovery.Event, 100)
	d := discovery.New(pdxClient, discovery.Options{Handled: func(ev discovery.Event) { events <- ev }})
	defer d.Close()
	require.NoError(t, d.SetTargets(t.Context(), []discovery.Target{{
		Pool: pc.GetName(), Prefills: pool.Traits.Prefills, Spec: pc.GetKubernetes(), Set: pool.SetEndpoints,
	}}))

	// What the gateway routes to: the ready pods the InferencePool, as
	// stored, selects, on its target port.
	dyn, err := dynamic.NewForConfig(srv.Config())
	require.NoError(t, err)
	ip, err := dyn.Resource(inferencePools).Namespace(ns).Get(t.Context(), "llm-decode", metav1.GetOptions{})
	require.NoError(t, err)
	selector, _, _ := unstructured.NestedStringMap(ip.Object, "spec", "selector", "matchLabels")
	ports, _, _ := unstructured.NestedSlice(ip.Object, "spec", "targetPorts")
	require.Len(t, ports, 1)
	port, _, _ := unstructured.NestedInt64(ports[0].(map[string]any), "number")
	poolEndpoints := func() []string {
		pods, err := admin.CoreV1().Pods(ns).List(t.Context(), metav1.ListOptions{LabelSelector: labels.SelectorFromSet(selector).String()})
		require.NoError(t, err)
		var out []string
		for _, pod := range pods.Items {
			for _, c := range pod.Status.Conditions {
				if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
					out = append(out, pod.Status.PodIP+":"+strconv.Itoa(int(port)))
				}
			}
		}
		slices.Sort(out)
		return out
	}
	addresses := func(eps []endpoint.Endpoint) []string {
		var out []string
		for _, ep := range eps {
			out = append(out, ep.Address)
		}
		return out
	}
	require.Equal(t, []string{"10.1.0.11:8000", "10.1.0.12:8000"}, poolEndpoints())
	require.Equal(t, poolEndpoints(), addresses(pool.Decode.Set.Endpoints()), "pdx's decode engines are the InferencePool's")
	require.Equal(t, []string{"10.1.0.1:8000"}, addresses(pool.Prefill.Set.Endpoints()))

	// decode-1 turns not ready: it leaves both sets.
	pod, err := admin.CoreV1().Pods(ns).Get(t.Context(), "decode-1", metav1.GetOptions{})
	require.NoError(t, err)
	pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionFalse}}
	_, err = admin.CoreV1().Pods(ns).UpdateStatus(t.Context(), pod, metav1.UpdateOptions{})
	require.NoError(t, err)
	for timeout := time.After(10 * time.Second); ; {
		select {
		case ev := <-events:
			if ev.Name != "decode-1" || ev.Op != "update" {
				continue
			}
		case <-timeout:
			t.Fatal("the readiness change was not handled")
		}
		break
	}
	require.Equal(t, []string{"10.1.0.11:8000"}, poolEndpoints())
	require.Equal(t, poolEndpoints(), addresses(pool.Decode.Set.Endpoints()))

	// Objectives of the InferencePool, in both groups, read as pdx.
	for _, o := range []struct {
		group, name, pool string
		priority          int64
	}{
		{"llm-d.ai", "chat", ip.GetName(), 10},
		{"inference.networking.x-k8s.io", "batch", ip.GetName(), -2},
		{"llm-d.ai", "elsewhere", "another-pool", 7},
	} {
		obj := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": o.group + "/v1alpha2", "kind": "InferenceObjective",
			"metadata": map[string]any{"name": o.name, "namespace": ns},
			"spec":     map[string]any{"priority": o.priority, "poolRef": map[string]any{"name": o.pool}},
		}}
		_, err := dyn.Resource(schema.GroupVersionResource{Group: o.group, Version: "v1alpha2", Resource: "inferenceobjectives"}).
			Namespace(ns).Create(t.Context(), obj, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	pdxDyn, err := dynamic.NewForConfig(asPdx)
	require.NoError(t, err)
	w := objectives.New(pdxDyn, objectives.Options{})
	defer w.Close()
	ctrl := flowcontrol.New(flowcontrol.Config{})
	require.NoError(t, w.SetTargets(t.Context(), []objectives.Target{{
		Pool: pc.GetName(), Spec: &configv1.KubernetesObjectives{Namespace: ns, Pool: ip.GetName()}, Set: ctrl.SetObjectives,
	}}))
	require.Equal(t, 10, ctrl.Priority("chat"))
	require.Equal(t, -2, ctrl.Priority("batch"))
	require.Equal(t, 0, ctrl.Priority("elsewhere"), "another pool's")
}

// TestInferencePoolRefused: InferencePools that the strict decoding of the
// other tests takes but a real API server refuses, by the CRD's enum and
// CEL rules.
func TestInferencePoolRefused(t *testing.T) {
	srv := cluster.Server(t)
	a := newApplier(t, srv)
	ns := srv.Namespace(t)
	data, err := os.ReadFile(poolDir + "/10-inferencepool.yaml")
	require.NoError(t, err)
	docs, err := documents(data)
	require.NoError(t, err)
	require.Len(t, docs, 1)
	for _, tc := range []struct {
		name    string
		mutate  mutation
		wantErr string
	}{
		{name: "as written"},
		{
			name: "failureMode not one of the values",
			mutate: func(t *testing.T, doc map[string]any) {
				at(t, doc, "spec.endpointPickerRef")["failureMode"] = "FailClosed"
			},
			wantErr: `spec.endpointPickerRef.failureMode: Unsupported value: "FailClosed": supported values: "FailOpen", "FailClose"`,
		},
		{
			name: "a Service endpoint picker without its port",
			mutate: func(t *testing.T, doc map[string]any) {
				delete(at(t, doc, "spec.endpointPickerRef"), "port")
			},
			wantErr: `port is required when kind is 'Service'`,
		},
		{
			name: "a target port twice",
			mutate: func(t *testing.T, doc map[string]any) {
				spec := at(t, doc, "spec")
				spec["targetPorts"] = append(spec["targetPorts"].([]any), map[string]any{"number": int64(8000)})
			},
			wantErr: `port number must be unique`,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var m map[string]any
			require.NoError(t, yaml.Unmarshal(docs[0], &m))
			at(t, m, "metadata")["namespace"] = ns
			if tc.mutate != nil {
				tc.mutate(t, m)
			}
			doc, err := yaml.Marshal(m)
			require.NoError(t, err)
			_, err = decode(doc)
			require.NoError(t, err, "strict decoding takes it")

			_, err = a.apply(t.Context(), doc, metav1.PatchOptions{DryRun: []string{metav1.DryRunAll}})
			if tc.wantErr == "" {
				require.NoError(t, err)
				return
			}
			require.True(t, apierrors.IsInvalid(err), "the API server refuses it: %v", err)
			require.ErrorContains(t, err, tc.wantErr)
		})
	}
}
