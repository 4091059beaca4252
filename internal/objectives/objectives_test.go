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
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic/fake"
	k8stesting "k8s.io/client-go/testing"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/flowcontrol"
)

// Close leaves no informer running.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const ns = "team"

var llmd, gie = Resources[1], Resources[0]

// objective is an InferenceObjective of res in ns; priority nil leaves
// spec.priority unset.
func objective(res schema.GroupVersionResource, name, pool string, priority any) *unstructured.Unstructured {
	spec := map[string]any{"poolRef": map[string]any{"group": res.Group, "kind": "InferencePool", "name": pool}}
	if priority != nil {
		spec["priority"] = priority
	}
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": res.GroupVersion().String(),
		"kind":       "InferenceObjective",
		"metadata":   map[string]any{"name": name, "namespace": ns},
		"spec":       spec,
	}}
}

func newClient(objs ...runtime.Object) *fake.FakeDynamicClient {
	kinds := map[schema.GroupVersionResource]string{}
	for _, r := range Resources {
		kinds[r] = "InferenceObjectiveList"
	}
	return fake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), kinds, objs...)
}

// harness runs a Watcher feeding one pool's Controller, and records the
// events it handled.
type harness struct {
	t      *testing.T
	client *fake.FakeDynamicClient
	ctrl   *flowcontrol.Controller
	w      *Watcher
	events chan Event
	log    *bytes.Buffer
	logMu  *sync.Mutex
}

func start(t *testing.T, client *fake.FakeDynamicClient, configured map[string]int) *harness {
	h := &harness{t: t, client: client, events: make(chan Event, 100), log: &bytes.Buffer{}, logMu: &sync.Mutex{}}
	h.ctrl = flowcontrol.New(flowcontrol.Config{Priorities: configured})
	h.w = New(client, Options{
		Log:     slog.New(slog.NewTextHandler(lockedWriter{h.log, h.logMu}, nil)),
		Handled: func(ev Event) { h.events <- ev },
	})
	t.Cleanup(h.w.Close)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	require.NoError(t, h.w.SetTargets(ctx, []Target{{
		Pool: "p", Spec: &configv1.KubernetesObjectives{Namespace: ns, Pool: "pool-a"}, Set: h.ctrl.SetObjectives,
	}}))
	return h
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
func (h *harness) await(op, name string) {
	h.t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case ev := <-h.events:
			if ev.Op == op && ev.Name == name && ev.Namespace == ns {
				return
			}
		case <-timeout:
			h.t.Fatalf("no %s event for %s", op, name)
		}
	}
}

func (h *harness) apply(op string, res schema.GroupVersionResource, obj *unstructured.Unstructured) {
	h.t.Helper()
	c := h.client.Resource(res).Namespace(ns)
	var err error
	switch op {
	case "add":
		_, err = c.Create(h.t.Context(), obj, metav1.CreateOptions{})
	case "update":
		_, err = c.Update(h.t.Context(), obj, metav1.UpdateOptions{})
	case "delete":
		err = c.Delete(h.t.Context(), obj.GetName(), metav1.DeleteOptions{})
	}
	require.NoError(h.t, err)
	h.await(op, obj.GetName())
}

func TestWatcher(t *testing.T) {
	type step struct {
		op  string
		res schema.GroupVersionResource
		obj *unstructured.Unstructured
	}
	tests := []struct {
		name       string
		existing   []runtime.Object
		configured map[string]int
		steps      []step
		// want is the Controller's priority of each objective after the
		// steps.
		want map[string]int
		// wantLog is logged, once.
		wantLog string
	}{
		{name: "listed at start", existing: []runtime.Object{objective(llmd, "critical", "pool-a", int64(10)), objective(llmd, "batch", "pool-a", int64(-5))},
			want: map[string]int{"critical": 10, "batch": -5, "unknown": 0}},
		{name: "added", steps: []step{{"add", llmd, objective(llmd, "critical", "pool-a", int64(10))}},
			want: map[string]int{"critical": 10}},
		{name: "priority changed", existing: []runtime.Object{objective(llmd, "critical", "pool-a", int64(10))},
			steps: []step{{"update", llmd, objective(llmd, "critical", "pool-a", int64(3))}},
			want:  map[string]int{"critical": 3}},
		{name: "deleted", existing: []runtime.Object{objective(llmd, "critical", "pool-a", int64(10)), objective(llmd, "batch", "pool-a", int64(-5))},
			steps: []step{{"delete", llmd, objective(llmd, "critical", "pool-a", nil)}},
			want:  map[string]int{"critical": 0, "batch": -5}},
		{name: "another pool's objectives ignored", existing: []runtime.Object{objective(llmd, "critical", "pool-b", int64(10))},
			steps: []step{{"add", llmd, objective(llmd, "batch", "pool-b", int64(-5))}},
			want:  map[string]int{"critical": 0, "batch": 0}},
		{name: "moved to another pool", existing: []runtime.Object{objective(llmd, "critical", "pool-a", int64(10))},
			steps: []step{{"update", llmd, objective(llmd, "critical", "pool-b", int64(10))}},
			want:  map[string]int{"critical": 0}},
		{name: "unset priority is 0", existing: []runtime.Object{objective(llmd, "plain", "pool-a", nil)},
			want: map[string]int{"plain": 0}},
		{name: "malformed priority is 0, logged once",
			existing: []runtime.Object{objective(llmd, "bad", "pool-a", "high"), objective(llmd, "ok", "pool-a", int64(2))},
			// Events on other objects recompute the pool again.
			steps: []step{{"update", llmd, objective(llmd, "ok", "pool-a", int64(4))}, {"add", llmd, objective(llmd, "other", "pool-a", int64(1))}},
			want:  map[string]int{"bad": 0, "ok": 4, "other": 1}, wantLog: `spec.priority is not an integer`},
		{name: "fractional priority is malformed", existing: []runtime.Object{objective(llmd, "bad", "pool-a", 1.5)},
			want: map[string]int{"bad": 0}, wantLog: `priority=1.5`},
		{name: "out of int32 range is malformed", existing: []runtime.Object{objective(llmd, "bad", "pool-a", int64(1)<<40)},
			want: map[string]int{"bad": 0}, wantLog: `priority=1099511627776`},
		{name: "config entry wins", configured: map[string]int{"critical": 100},
			existing: []runtime.Object{objective(llmd, "critical", "pool-a", int64(10)), objective(llmd, "batch", "pool-a", int64(-5))},
			want:     map[string]int{"critical": 100, "batch": -5}},
		{name: "older group", existing: []runtime.Object{objective(gie, "critical", "pool-a", int64(7))},
			steps: []step{{"add", gie, objective(gie, "batch", "pool-a", int64(-1))}},
			want:  map[string]int{"critical": 7, "batch": -1}},
		{name: "llm-d's wins over the older group's of the same name",
			existing: []runtime.Object{objective(gie, "critical", "pool-a", int64(7)), objective(llmd, "critical", "pool-a", int64(9))},
			want:     map[string]int{"critical": 9}},
		{name: "poolRefs", existing: []runtime.Object{func() *unstructured.Unstructured {
			o := objective(llmd, "multi", "", int64(6))
			o.Object["spec"] = map[string]any{"priority": int64(6), "poolRefs": []any{
				map[string]any{"name": "pool-b"}, map[string]any{"name": "pool-a"},
			}}
			return o
		}()}, want: map[string]int{"multi": 6}},
		{name: "a reference of another kind", existing: []runtime.Object{func() *unstructured.Unstructured {
			o := objective(llmd, "svc", "pool-a", int64(6))
			o.Object["spec"].(map[string]any)["poolRef"].(map[string]any)["kind"] = "Service"
			return o
		}()}, want: map[string]int{"svc": 0}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := start(t, newClient(tt.existing...), tt.configured)
			for _, s := range tt.steps {
				h.apply(s.op, s.res, s.obj)
			}
			for name, want := range tt.want {
				require.Equal(t, want, h.ctrl.Priority(name), "objective %s", name)
			}
			if tt.wantLog != "" {
				require.Equal(t, 1, strings.Count(h.logged(), tt.wantLog), h.logged())
			} else {
				require.NotContains(t, h.logged(), "not an integer")
			}
		})
	}
}

// TestAbsentCRD: a cluster that serves only llm-d's group (the older CRD
// not installed) is listed, and its objectives reach the pool.
func TestAbsentCRD(t *testing.T) {
	client := newClient(objective(llmd, "critical", "pool-a", int64(10)))
	client.PrependReactor("list", "inferenceobjectives", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetResource().Group == gie.Group {
			return true, nil, apierrors.NewNotFound(gie.GroupResource(), "")
		}
		return false, nil, nil
	})
	h := start(t, client, nil)
	require.Equal(t, 10, h.ctrl.Priority("critical"))
}

// TestRefused: without the rights to list, SetTargets fails by its
// context, naming the namespace.
func TestRefused(t *testing.T) {
	client := newClient()
	client.PrependReactor("list", "inferenceobjectives", func(a k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewForbidden(a.GetResource().GroupResource(), "", nil)
	})
	w := New(client, Options{})
	defer w.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	err := w.SetTargets(ctx, []Target{{Pool: "p", Spec: &configv1.KubernetesObjectives{Namespace: ns, Pool: "pool-a"}, Set: func(map[string]int) {}}})
	require.ErrorContains(t, err, "inferenceobjectives of namespaces [team] were not listed")
}

// TestRetarget: a new target (a reloaded config's new Controller) gets the
// current objectives at once, and the old one no more updates; a
// namespace no target is in stops being watched.
func TestRetarget(t *testing.T) {
	h := start(t, newClient(objective(llmd, "critical", "pool-a", int64(10))), nil)
	newCtrl := flowcontrol.New(flowcontrol.Config{})
	require.NoError(t, h.w.SetTargets(t.Context(), []Target{{
		Pool: "p", Spec: &configv1.KubernetesObjectives{Namespace: ns, Pool: "pool-a"}, Set: newCtrl.SetObjectives,
	}}))
	require.Equal(t, 10, newCtrl.Priority("critical"))
	h.apply("update", llmd, objective(llmd, "critical", "pool-a", int64(2)))
	require.Equal(t, 2, newCtrl.Priority("critical"))
	require.Equal(t, 10, h.ctrl.Priority("critical"), "the old target is not fed")

	require.NoError(t, h.w.SetTargets(t.Context(), nil))
	h.w.mu.Lock()
	require.Empty(t, h.w.watched)
	h.w.mu.Unlock()

	h.w.Close()
	require.ErrorIs(t, h.w.SetTargets(t.Context(), nil), ErrClosed)
}
