package objectives

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/fake"
	"k8s.io/client-go/kubernetes"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/flowcontrol"
	"github.com/pdx-router/pdx/internal/testbed/kubeapi"
)

// cluster is the real API server (and etcd) the tests watch, with the
// InferenceObjective CRDs of both groups installed, one for the package.
var cluster = kubeapi.Package{CRDs: kubeapi.InferenceCRDs}

// Close leaves no informer running.
func TestMain(m *testing.M) { goleak.VerifyTestMain(cluster.Wrap(m)) }

var llmd, gie = Resources[1], Resources[0]

// objective is an InferenceObjective of res; priority nil leaves
// spec.priority unset. The harness puts it in its namespace.
func objective(res schema.GroupVersionResource, name, pool string, priority any) *unstructured.Unstructured {
	spec := map[string]any{"poolRef": map[string]any{"group": res.Group, "kind": "InferencePool", "name": pool}}
	if priority != nil {
		spec["priority"] = priority
	}
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": res.GroupVersion().String(),
		"kind":       "InferenceObjective",
		"metadata":   map[string]any{"name": name},
		"spec":       spec,
	}}
}

// harness runs a Watcher over a namespace of the real API server, feeding
// one pool's Controller, and records the events it handled.
type harness struct {
	t      *testing.T
	ns     string
	client dynamic.Interface
	ctrl   *flowcontrol.Controller
	w      *Watcher
	events chan Event
	log    *bytes.Buffer
	logMu  *sync.Mutex
}

// start creates existing in a new namespace and starts a Watcher on it for
// pool "pool-a".
func start(t *testing.T, existing []*unstructured.Unstructured, configured map[string]int) *harness {
	t.Helper()
	srv := cluster.Server(t)
	h := &harness{t: t, ns: srv.Namespace(t), events: make(chan Event, 100), log: &bytes.Buffer{}, logMu: &sync.Mutex{}}
	var err error
	h.client, err = dynamic.NewForConfig(srv.Config())
	require.NoError(t, err)
	for _, obj := range existing {
		h.create(obj)
	}
	h.ctrl = flowcontrol.New(flowcontrol.Config{Priorities: configured})
	h.w = New(h.client, Options{
		Log:     slog.New(slog.NewTextHandler(lockedWriter{h.log, h.logMu}, nil)),
		Handled: func(ev Event) { h.events <- ev },
	})
	t.Cleanup(h.w.Close)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	require.NoError(t, h.w.SetTargets(ctx, []Target{h.target(h.ctrl)}))
	return h
}

func (h *harness) target(ctrl *flowcontrol.Controller) Target {
	return Target{Pool: "p", Spec: &configv1.KubernetesObjectives{Namespace: h.ns, Pool: "pool-a"}, Set: ctrl.SetObjectives}
}

type lockedWriter struct {
	b  *bytes.Buffer
	mu *sync.Mutex
}

func (w lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (h *harness) logged() string {
	h.logMu.Lock()
	defer h.logMu.Unlock()
	return h.log.String()
}

// await waits for the event of op on name.
func (h *harness) await(op, name string, timeout time.Duration) {
	h.t.Helper()
	deadline := time.After(timeout)
	for {
		select {
		case ev := <-h.events:
			if ev.Op == op && ev.Name == name && ev.Namespace == h.ns {
				return
			}
		case <-deadline:
			h.t.Fatalf("no %s event for %s", op, name)
		}
	}
}

func (h *harness) resource(obj *unstructured.Unstructured) dynamic.ResourceInterface {
	gv, err := schema.ParseGroupVersion(obj.GetAPIVersion())
	require.NoError(h.t, err)
	return h.client.Resource(gv.WithResource("inferenceobjectives")).Namespace(h.ns)
}

func (h *harness) create(obj *unstructured.Unstructured) {
	h.t.Helper()
	_, err := h.resource(obj).Create(h.t.Context(), obj, metav1.CreateOptions{})
	require.NoError(h.t, err)
}

// apply creates, replaces (its spec) or deletes obj, and waits until the
// watcher has handled the change.
func (h *harness) apply(op string, obj *unstructured.Unstructured) {
	h.t.Helper()
	c := h.resource(obj)
	var err error
	switch op {
	case "add":
		_, err = c.Create(h.t.Context(), obj, metav1.CreateOptions{})
	case "update":
		var cur *unstructured.Unstructured
		if cur, err = c.Get(h.t.Context(), obj.GetName(), metav1.GetOptions{}); err == nil {
			cur.Object["spec"] = obj.Object["spec"]
			_, err = c.Update(h.t.Context(), cur, metav1.UpdateOptions{})
		}
	case "delete":
		err = c.Delete(h.t.Context(), obj.GetName(), metav1.DeleteOptions{})
	}
	require.NoError(h.t, err)
	h.await(op, obj.GetName(), 10*time.Second)
}

type step struct {
	op  string
	obj *unstructured.Unstructured
}

func TestWatcher(t *testing.T) {
	tests := []struct {
		name       string
		existing   []*unstructured.Unstructured
		configured map[string]int
		steps      []step
		// want is the Controller's priority of each objective after the
		// steps.
		want map[string]int
		// wantLog is logged, once.
		wantLog string
	}{
		{name: "listed at start", existing: []*unstructured.Unstructured{objective(llmd, "critical", "pool-a", int64(10)), objective(llmd, "batch", "pool-a", int64(-5))},
			want: map[string]int{"critical": 10, "batch": -5, "unknown": 0}},
		{name: "added", steps: []step{{"add", objective(llmd, "critical", "pool-a", int64(10))}},
			want: map[string]int{"critical": 10}},
		{name: "priority changed", existing: []*unstructured.Unstructured{objective(llmd, "critical", "pool-a", int64(10))},
			steps: []step{{"update", objective(llmd, "critical", "pool-a", int64(3))}},
			want:  map[string]int{"critical": 3}},
		{name: "deleted", existing: []*unstructured.Unstructured{objective(llmd, "critical", "pool-a", int64(10)), objective(llmd, "batch", "pool-a", int64(-5))},
			steps: []step{{"delete", objective(llmd, "critical", "pool-a", nil)}},
			want:  map[string]int{"critical": 0, "batch": -5}},
		{name: "another pool's objectives ignored", existing: []*unstructured.Unstructured{objective(llmd, "critical", "pool-b", int64(10))},
			steps: []step{{"add", objective(llmd, "batch", "pool-b", int64(-5))}},
			want:  map[string]int{"critical": 0, "batch": 0}},
		{name: "moved to another pool", existing: []*unstructured.Unstructured{objective(llmd, "critical", "pool-a", int64(10))},
			steps: []step{{"update", objective(llmd, "critical", "pool-b", int64(10))}},
			want:  map[string]int{"critical": 0}},
		{name: "unset priority is 0", existing: []*unstructured.Unstructured{objective(llmd, "plain", "pool-a", nil)},
			want: map[string]int{"plain": 0}},
		{name: "config entry wins", configured: map[string]int{"critical": 100},
			existing: []*unstructured.Unstructured{objective(llmd, "critical", "pool-a", int64(10)), objective(llmd, "batch", "pool-a", int64(-5))},
			want:     map[string]int{"critical": 100, "batch": -5}},
		{name: "older group", existing: []*unstructured.Unstructured{objective(gie, "critical", "pool-a", int64(7))},
			steps: []step{{"add", objective(gie, "batch", "pool-a", int64(-1))}},
			want:  map[string]int{"critical": 7, "batch": -1}},
		{name: "llm-d's wins over the older group's of the same name",
			existing: []*unstructured.Unstructured{objective(gie, "critical", "pool-a", int64(7)), objective(llmd, "critical", "pool-a", int64(9))},
			want:     map[string]int{"critical": 9}},
		{name: "the extreme int32 priorities", existing: []*unstructured.Unstructured{
			objective(llmd, "top", "pool-a", int64(1<<31-1)), objective(llmd, "bottom", "pool-a", int64(-1<<31)),
		}, want: map[string]int{"top": 1<<31 - 1, "bottom": -1 << 31}},
		// The CRD says format: int32, which the API server does not
		// enforce: it stores the number, and pdx takes it as malformed.
		{name: "beyond int32 is stored, and malformed", existing: []*unstructured.Unstructured{objective(llmd, "bad", "pool-a", int64(1)<<40)},
			want: map[string]int{"bad": 0}, wantLog: `priority=1099511627776`},
		{name: "a reference without group and kind (the server defaults them)", existing: []*unstructured.Unstructured{func() *unstructured.Unstructured {
			o := objective(llmd, "bare", "", int64(6))
			o.Object["spec"].(map[string]any)["poolRef"] = map[string]any{"name": "pool-a"}
			return o
		}()}, want: map[string]int{"bare": 6}},
		{name: "a reference of another kind", existing: []*unstructured.Unstructured{func() *unstructured.Unstructured {
			o := objective(llmd, "svc", "pool-a", int64(6))
			o.Object["spec"].(map[string]any)["poolRef"].(map[string]any)["kind"] = "Service"
			return o
		}()}, want: map[string]int{"svc": 0}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := start(t, tt.existing, tt.configured)
			for _, s := range tt.steps {
				h.apply(s.op, s.obj)
			}
			for name, want := range tt.want {
				require.Equal(t, want, h.ctrl.Priority(name), "objective %s", name)
			}
			requireLogged(t, h.logged(), tt.wantLog)
		})
	}
}

// TestSchema: the CRDs' schema makes the API server refuse most of what pdx
// would otherwise have to read as malformed (not an integer beyond int32:
// TestWatcher), and default and prune what it stores, where client-go's
// fake client stores any object as it is given.
func TestSchema(t *testing.T) {
	srv := cluster.Server(t)
	ns := srv.Namespace(t)
	client, err := dynamic.NewForConfig(srv.Config())
	require.NoError(t, err)
	kinds := map[schema.GroupVersionResource]string{}
	for _, r := range Resources {
		kinds[r] = "InferenceObjectiveList"
	}
	fakeClient := fake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), kinds)

	for _, tc := range []struct {
		name    string
		obj     *unstructured.Unstructured
		wantErr string
	}{
		{name: "a string priority", obj: objective(llmd, "string", "pool-a", "high"),
			wantErr: `spec.priority: Invalid value: "string": spec.priority in body must be of type integer: "string"`},
		{name: "a fractional priority", obj: objective(llmd, "fraction", "pool-a", 1.5),
			wantErr: `spec.priority: Invalid value: "number": spec.priority in body must be of type integer: "number"`},
		{name: "no poolRef", obj: func() *unstructured.Unstructured {
			o := objective(llmd, "no-ref", "", int64(1))
			delete(o.Object["spec"].(map[string]any), "poolRef")
			return o
		}(), wantErr: `spec.poolRef: Required value`},
		{name: "a poolRef without a name", obj: objective(gie, "no-name", "", int64(1)),
			wantErr: `spec.poolRef.name`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gvr := schema.FromAPIVersionAndKind(tc.obj.GetAPIVersion(), "").GroupVersion().WithResource("inferenceobjectives")
			_, err := client.Resource(gvr).Namespace(ns).Create(t.Context(), tc.obj, metav1.CreateOptions{})
			require.True(t, apierrors.IsInvalid(err), "the API server refuses it: %v", err)
			require.ErrorContains(t, err, tc.wantErr)

			_, err = fakeClient.Resource(gvr).Namespace(ns).Create(t.Context(), tc.obj, metav1.CreateOptions{})
			require.NoError(t, err, "the fake client stores it")
		})
	}

	t.Run("defaults and pruning", func(t *testing.T) {
		obj := objective(llmd, "typo", "pool-a", nil)
		spec := obj.Object["spec"].(map[string]any)
		spec["poolRef"] = map[string]any{"name": "pool-a"}
		spec["priorty"] = int64(10)
		res := client.Resource(llmd).Namespace(ns)

		// A client that asks for strict field validation is told of the
		// misspelt field.
		_, err := res.Create(t.Context(), obj, metav1.CreateOptions{FieldValidation: "Strict"})
		require.ErrorContains(t, err, `unknown field "spec.priorty"`)

		// By default the server drops it (with a warning) and fills in the
		// reference's defaults: the objective has no priority.
		got, err := res.Create(t.Context(), obj, metav1.CreateOptions{})
		require.NoError(t, err)
		gotSpec := got.Object["spec"].(map[string]any)
		require.NotContains(t, gotSpec, "priorty")
		require.Equal(t, map[string]any{"name": "pool-a", "group": "llm-d.ai", "kind": "InferencePool"}, gotSpec["poolRef"])

		got, err = fakeClient.Resource(llmd).Namespace(ns).Create(t.Context(), obj, metav1.CreateOptions{})
		require.NoError(t, err)
		require.Contains(t, got.Object["spec"], "priorty", "the fake client keeps it")
		require.Equal(t, map[string]any{"name": "pool-a"}, got.Object["spec"].(map[string]any)["poolRef"])
	})
}

// TestMalformedPriority: under a CRD without a schema for spec (a
// cluster's own, or an older release's), the server stores any priority;
// pdx takes one that is not an int32 as 0 and logs it once, and reads
// spec.poolRefs, which newer llm-d objects carry.
func TestMalformedPriority(t *testing.T) {
	srv := cluster.Server(t)
	permissive(t, srv)
	poolRefs := objective(llmd, "multi", "", int64(6))
	poolRefs.Object["spec"] = map[string]any{"priority": int64(6), "poolRefs": []any{
		map[string]any{"name": "pool-b"}, map[string]any{"name": "pool-a"},
	}}
	for _, tc := range []struct {
		name     string
		existing []*unstructured.Unstructured
		steps    []step
		want     map[string]int
		wantLog  string
	}{
		{name: "a string",
			existing: []*unstructured.Unstructured{objective(llmd, "bad", "pool-a", "high"), objective(llmd, "ok", "pool-a", int64(2))},
			// Events on other objects recompute the pool again.
			steps: []step{{"update", objective(llmd, "ok", "pool-a", int64(4))}, {"add", objective(llmd, "other", "pool-a", int64(1))}},
			want:  map[string]int{"bad": 0, "ok": 4, "other": 1}, wantLog: `priority=high`},
		{name: "a fraction", existing: []*unstructured.Unstructured{objective(llmd, "bad", "pool-a", 1.5)},
			want: map[string]int{"bad": 0}, wantLog: `priority=1.5`},
		{name: "poolRefs", existing: []*unstructured.Unstructured{poolRefs}, want: map[string]int{"multi": 6}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := start(t, tc.existing, nil)
			for _, s := range tc.steps {
				h.apply(s.op, s.obj)
			}
			for name, want := range tc.want {
				require.Equal(t, want, h.ctrl.Priority(name), "objective %s", name)
			}
			requireLogged(t, h.logged(), tc.wantLog)
		})
	}
}

// requireLogged checks that a malformed priority was logged once, with
// want, or, want empty, that none was.
func requireLogged(t *testing.T, logged, want string) {
	t.Helper()
	if want == "" {
		require.NotContains(t, logged, "not an integer")
		return
	}
	require.Equal(t, 1, strings.Count(logged, "spec.priority is not an integer"), logged)
	require.Contains(t, logged, want)
}

// permissive replaces llm-d's InferenceObjective CRD, for t, by one whose
// spec takes anything, and puts the original back after t.
func permissive(t *testing.T, srv *kubeapi.Server) {
	t.Helper()
	crds, err := kubeapi.InferenceCRDs(t.Context())
	require.NoError(t, err)
	var original *unstructured.Unstructured
	for _, crd := range crds {
		if crd.GetName() == kubeapi.LLMDObjectiveCRD {
			original = crd
		}
	}
	require.NotNil(t, original)
	loose := original.DeepCopy()
	versions, _, _ := unstructured.NestedSlice(loose.Object, "spec", "versions")
	for _, v := range versions {
		require.NoError(t, unstructured.SetNestedField(v.(map[string]any),
			map[string]any{"type": "object", "x-kubernetes-preserve-unknown-fields": true},
			"schema", "openAPIV3Schema", "properties", "spec"))
	}
	require.NoError(t, unstructured.SetNestedSlice(loose.Object, versions, "spec", "versions"))

	client, err := dynamic.NewForConfig(srv.Config())
	require.NoError(t, err)
	ns := srv.Namespace(t)
	// The server takes a new schema a moment after it stores it: probe
	// with a dry run until it applies.
	accepts := func() bool {
		_, err := client.Resource(llmd).Namespace(ns).Create(context.Background(), objective(llmd, "probe", "pool-a", "high"),
			metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err == nil
	}
	require.NoError(t, srv.ApplyCRD(t.Context(), loose))
	require.Eventually(t, accepts, 10*time.Second, 20*time.Millisecond, "the loose schema applies")
	// After t, whose context is done by then.
	t.Cleanup(func() {
		require.NoError(t, srv.ApplyCRD(context.Background(), original))
		require.Eventually(t, func() bool { return !accepts() }, 10*time.Second, 20*time.Millisecond, "the CRD's schema applies again")
	})
}

// TestAbsentCRD: a cluster that serves only llm-d's group (the older CRD
// not installed: the server answers 404) is listed, and its objectives
// reach the pool; once the older CRD is installed, the watcher, which kept
// trying, picks its objects up.
func TestAbsentCRD(t *testing.T) {
	srv := cluster.Server(t)
	crds, err := kubeapi.InferenceCRDs(t.Context())
	require.NoError(t, err)
	var gieCRD *unstructured.Unstructured
	for _, crd := range crds {
		if crd.GetName() == kubeapi.GIEObjectiveCRD {
			gieCRD = crd
		}
	}
	require.NotNil(t, gieCRD)
	require.NoError(t, srv.DeleteCRD(t.Context(), kubeapi.GIEObjectiveCRD))
	t.Cleanup(func() { require.NoError(t, srv.ApplyCRD(context.Background(), gieCRD)) })

	h := start(t, []*unstructured.Unstructured{objective(llmd, "critical", "pool-a", int64(10))}, nil)
	require.Equal(t, 10, h.ctrl.Priority("critical"))
	_, err = h.client.Resource(gie).Namespace(h.ns).List(t.Context(), metav1.ListOptions{})
	require.True(t, apierrors.IsNotFound(err), "the older group is not served: %v", err)

	require.NoError(t, srv.ApplyCRD(t.Context(), gieCRD))
	h.create(objective(gie, "batch", "pool-a", int64(-3)))
	// The informer retries its list with a backoff of up to seconds.
	h.await("add", "batch", 60*time.Second)
	require.Equal(t, -3, h.ctrl.Priority("batch"))
}

// TestRBAC: as a ServiceAccount RBAC does not let list the objectives (the
// API server answers 403), SetTargets fails by its context, naming the
// namespace; with the Role docs/multi-tenant.md gives, it succeeds.
func TestRBAC(t *testing.T) {
	srv := cluster.Server(t)
	ns := srv.Namespace(t)
	client, err := dynamic.NewForConfig(srv.ConfigAs("system:serviceaccount:"+ns+":pdx", "system:serviceaccounts"))
	require.NoError(t, err)
	_, err = client.Resource(llmd).Namespace(ns).List(t.Context(), metav1.ListOptions{})
	require.True(t, apierrors.IsForbidden(err), "listing without a Role: %v", err)

	w := New(client, Options{})
	defer w.Close()
	ctrl := flowcontrol.New(flowcontrol.Config{})
	target := Target{Pool: "p", Spec: &configv1.KubernetesObjectives{Namespace: ns, Pool: "pool-a"}, Set: ctrl.SetObjectives}
	ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
	defer cancel()
	err = w.SetTargets(ctx, []Target{target})
	require.ErrorContains(t, err, "inferenceobjectives of namespaces ["+ns+"] were not listed")

	admin, err := kubernetes.NewForConfig(srv.Config())
	require.NoError(t, err)
	_, err = admin.RbacV1().Roles(ns).Create(t.Context(), &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: "pdx"},
		Rules: []rbacv1.PolicyRule{{
			APIGroups: []string{"llm-d.ai", "inference.networking.x-k8s.io"},
			Resources: []string{"inferenceobjectives"},
			Verbs:     []string{"get", "list", "watch"},
		}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = admin.RbacV1().RoleBindings(ns).Create(t.Context(), &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "pdx"},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: "pdx", Namespace: ns}},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "pdx"},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	adminDyn, err := dynamic.NewForConfig(srv.Config())
	require.NoError(t, err)
	o := objective(gie, "critical", "pool-a", int64(4))
	_, err = adminDyn.Resource(gie).Namespace(ns).Create(t.Context(), o, metav1.CreateOptions{})
	require.NoError(t, err)
	// The authorizer learns of the binding through its own watch.
	require.Eventually(t, func() bool {
		_, err := client.Resource(gie).Namespace(ns).List(t.Context(), metav1.ListOptions{})
		return err == nil
	}, 10*time.Second, 20*time.Millisecond)

	require.NoError(t, w.SetTargets(t.Context(), []Target{target}))
	require.Equal(t, 4, ctrl.Priority("critical"))
}

// TestRetarget: a new target (a reloaded config's new Controller) gets the
// current objectives at once, and the old one no more updates; a
// namespace no target is in stops being watched.
func TestRetarget(t *testing.T) {
	h := start(t, []*unstructured.Unstructured{objective(llmd, "critical", "pool-a", int64(10))}, nil)
	newCtrl := flowcontrol.New(flowcontrol.Config{})
	require.NoError(t, h.w.SetTargets(t.Context(), []Target{h.target(newCtrl)}))
	require.Equal(t, 10, newCtrl.Priority("critical"))
	h.apply("update", objective(llmd, "critical", "pool-a", int64(2)))
	require.Equal(t, 2, newCtrl.Priority("critical"))
	require.Equal(t, 10, h.ctrl.Priority("critical"), "the old target is not fed")

	require.NoError(t, h.w.SetTargets(t.Context(), nil))
	h.w.mu.Lock()
	require.Empty(t, h.w.watched)
	h.w.mu.Unlock()

	h.w.Close()
	require.ErrorIs(t, h.w.SetTargets(t.Context(), nil), ErrClosed)
}
