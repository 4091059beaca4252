package reload

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/pdx-router/pdx/internal/discovery"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/objectives"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/testbed/kubeapi"
)

// cluster is the real API server (and etcd) that the discovered pools and
// the objectives follow, one for the package, started by the first test
// that needs it.
var cluster = kubeapi.Package{CRDs: kubeapi.InferenceCRDs}

func TestMain(m *testing.M) { goleak.VerifyTestMain(cluster.Wrap(m)) }

// syncBuffer is a log sink safe for concurrent use.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

const static = `
pools:
- name: p
  models: [m]
  connector: nixl
  eject_after_failures: 1
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:9}]
`

func write(t *testing.T, path, content string) {
	t.Helper()
	require.NoError(t, os.WriteFile(path, []byte(content), 0o600))
}

// applied records the tables a Reloader hands over.
type applied struct {
	mu     sync.Mutex
	tables []*routing.Table
}

func (a *applied) apply(t *routing.Table) {
	a.mu.Lock()
	a.tables = append(a.tables, t)
	a.mu.Unlock()
}

func (a *applied) count() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.tables)
}

func addresses(eps []endpoint.Endpoint) []string {
	var out []string
	for _, ep := range eps {
		out = append(out, ep.Address)
	}
	return out
}

func lookup(t *testing.T, table *routing.Table, model string) *routing.Pool {
	t.Helper()
	p, ok := table.Lookup(model)
	require.True(t, ok, "model %s", model)
	return p
}

func TestReload(t *testing.T) {
	path := filepath.Join(t.TempDir(), "pdx.yaml")
	write(t, path, static)
	var logs syncBuffer
	r, err := New(t.Context(), Options{Path: path, Log: slog.New(slog.NewTextHandler(&logs, nil))})
	require.NoError(t, err)
	defer r.Close()
	first := r.Table()
	p := lookup(t, first, "m")
	require.Equal(t, []string{"127.0.0.1:1"}, addresses(p.Prefill.Set.Endpoints()))
	p.Prefill.Report(endpoint.Endpoint{Address: "127.0.0.1:1"}, false) // ejected

	var a applied
	changed, err := r.Reload(t.Context(), a.apply)
	require.NoError(t, err)
	require.False(t, changed, "same content: nothing to do")

	steps := []struct {
		name    string
		content string
		changed bool
		wantErr string
		check   func(t *testing.T, table *routing.Table)
	}{
		{
			name: "new endpoints and models", changed: true,
			content: `
pools:
- name: p
  models: [m, m2]
  connector: nixl
  eject_after_failures: 1
  prefill: [{address: 127.0.0.1:1}, {address: 127.0.0.1:2}]
  decode: [{address: 127.0.0.1:9}]
`,
			check: func(t *testing.T, table *routing.Table) {
				p := lookup(t, table, "m2")
				require.Equal(t, []string{"127.0.0.1:1", "127.0.0.1:2"}, addresses(p.Prefill.Set.Endpoints()))
				require.False(t, p.Prefill.Set.Healthy(endpoint.Endpoint{Address: "127.0.0.1:1"}), "passive health kept")
				require.True(t, p.Prefill.Set.Healthy(endpoint.Endpoint{Address: "127.0.0.1:2"}))
			},
		},
		{
			name: "a bad config keeps the running one", content: static + "  prefil: []\n",
			wantErr: `pdx.yaml:9: pools[0].prefil: unknown field, did you mean "prefill"?`,
		},
		{
			name: "the same bad config is not tried again", content: static + "  prefil: []\n",
		},
		{
			name: "a config naming an unknown connector keeps the running one", content: `
pools:
- name: p
  default: true
  connector: nixel
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:9}]
`,
			wantErr: `unknown connector "nixel"`,
		},
		{
			name: "discovery without a client keeps the running one", content: `
pools:
- name: p
  default: true
  connector: nixl
  kubernetes: {namespace: llm, service: engines, port: 8000}
`,
			wantErr: "pools discover their endpoints from Kubernetes, but pdx has no Kubernetes client",
		},
		{
			name: "start-only settings wait for a restart", changed: true,
			content: "grpc_address: 127.0.0.1:1\nmax_body_bytes: 10\nkv_events: {mode: dial, port: 5557}\nengine_metrics: {interval: 1s, stale_after: 5s}\npeers: {addresses: [127.0.0.1:2]}\n" + static,
			check: func(t *testing.T, table *routing.Table) {
				require.Equal(t, 16<<20, table.MaxBodyBytes())
				require.True(t, table.PrefixCache() == nil, "no kv_events at start: no prefix cache, which no subscription would feed")
				require.Nil(t, table.Journal(), "no peers at start: none after")
				require.Contains(t, logs.String(), `config reload: these settings take effect on restart only" kept="[grpc_address max_body_bytes kv_events engine_metrics peers]"`)
			},
		},
	}
	want := r.Table()
	for _, s := range steps {
		write(t, path, s.content)
		n := a.count()
		changed, err := r.Reload(t.Context(), a.apply)
		require.Equal(t, s.changed, changed, "%s: %v", s.name, err)
		if s.wantErr != "" {
			require.ErrorContains(t, err, s.wantErr, s.name)
			require.Contains(t, logs.String(), "config reload failed, keeping the running config", s.name)
		} else {
			require.NoError(t, err, s.name)
		}
		if !s.changed {
			require.Same(t, want, r.Table(), s.name)
			require.Equal(t, n, a.count(), "%s: nothing applied", s.name)
			continue
		}
		require.Equal(t, n+1, a.count(), s.name)
		want = r.Table()
		require.Same(t, want, a.tables[n], s.name)
		s.check(t, want)
	}
	// Streams that took the first table keep it as it was.
	require.Equal(t, []string{"127.0.0.1:1"}, addresses(lookup(t, first, "m").Prefill.Set.Endpoints()))
	_, ok := first.Lookup("m2")
	require.False(t, ok)
}

const discovered = `
pools:
- name: p
  models: [m]
  connector: nixl
  prefill_attempts: %d
  kubernetes: {namespace: llm, service: engines, port: 8000}
`

// createPod creates a ready engine pod in ns, its status written as its
// kubelet would.
func createPod(t *testing.T, client kubernetes.Interface, ns, name, ip, role string) *corev1.Pod {
	t.Helper()
	pod, err := client.CoreV1().Pods(ns).Create(t.Context(), &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"modelserving.volcano.sh/role": role}},
		Spec:       corev1.PodSpec{NodeName: "node-a", Containers: []corev1.Container{{Name: "engine", Image: "vllm"}}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}},
		Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}}
	pod, err = client.CoreV1().Pods(ns).UpdateStatus(t.Context(), pod, metav1.UpdateOptions{})
	require.NoError(t, err)
	return pod
}

// TestReloadDiscovered keeps a discovered pool fed across reloads: the new
// table's pool has the endpoints at once and follows the cluster from then
// on; the old table's pool is left as it was.
func TestReloadDiscovered(t *testing.T) {
	srv := cluster.Server(t)
	ns := srv.Namespace(t)
	client, err := kubernetes.NewForConfig(srv.Config())
	require.NoError(t, err)
	ready := true
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: "engines-a", Labels: map[string]string{discoveryv1.LabelServiceName: "engines"}},
		AddressType: discoveryv1.AddressTypeIPv4,
	}
	for _, p := range []struct{ name, ip, role string }{{"p1", "10.0.0.1", "prefill"}, {"d1", "10.0.0.11", "decode"}} {
		pod := createPod(t, client, ns, p.name, p.ip, p.role)
		slice.Endpoints = append(slice.Endpoints, discoveryv1.Endpoint{
			Addresses: []string{p.ip}, Conditions: discoveryv1.EndpointConditions{Ready: &ready},
			TargetRef: &corev1.ObjectReference{Kind: "Pod", Name: p.name, Namespace: ns, UID: pod.UID},
		})
	}
	_, err = client.DiscoveryV1().EndpointSlices(ns).Create(t.Context(), slice, metav1.CreateOptions{})
	require.NoError(t, err)
	discovered := strings.ReplaceAll(discovered, "namespace: llm", "namespace: "+ns)
	clients := 0
	events := make(chan discovery.Event, 100)
	path := filepath.Join(t.TempDir(), "pdx.yaml")
	write(t, path, fmt.Sprintf(discovered, 1))
	r, err := New(t.Context(), Options{
		Path: path,
		Kube: func() (kubernetes.Interface, error) { clients++; return client, nil },
		Discovery: discovery.Options{Handled: func(ev discovery.Event) {
			if ev.Op == "delete" {
				events <- ev
			}
		}},
	})
	require.NoError(t, err)
	defer r.Close()
	first := lookup(t, r.Table(), "m")
	require.Equal(t, []string{"10.0.0.1:8000"}, addresses(first.Prefill.Set.Endpoints()))
	require.Equal(t, []string{"10.0.0.11:8000"}, addresses(first.Decode.Set.Endpoints()))

	write(t, path, fmt.Sprintf(discovered, 2))
	var a applied
	changed, err := r.Reload(t.Context(), a.apply)
	require.NoError(t, err)
	require.True(t, changed)
	second := lookup(t, r.Table(), "m")
	require.NotSame(t, first, second)
	require.Equal(t, 2, second.Attempts)
	require.Equal(t, []string{"10.0.0.1:8000"}, addresses(second.Prefill.Set.Endpoints()), "fed before it is handed over")
	require.Equal(t, 1, clients, "one client for all reloads")

	require.NoError(t, client.CoreV1().Pods(ns).Delete(t.Context(), "p1", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}))
	select {
	case <-events:
	case <-time.After(10 * time.Second):
		t.Fatal("the pod's deletion was not handled")
	}
	require.Empty(t, second.Prefill.Set.Endpoints(), "the new pool follows the cluster")
	require.Equal(t, []string{"10.0.0.1:8000"}, addresses(first.Prefill.Set.Endpoints()), "the old one is left alone")

	// Back to static endpoints: nothing is watched any more (goleak checks
	// at the end that no informer is left running either way).
	write(t, path, static)
	changed, err = r.Reload(t.Context(), a.apply)
	require.NoError(t, err)
	require.True(t, changed)
	require.Equal(t, []string{"127.0.0.1:1"}, addresses(lookup(t, r.Table(), "m").Prefill.Set.Endpoints()))
}

func TestNewFails(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "pdx.yaml")
	_, err := New(t.Context(), Options{Path: path})
	require.ErrorIs(t, err, os.ErrNotExist)

	write(t, path, fmt.Sprintf(discovered, 1))
	_, err = New(t.Context(), Options{Path: path, Kube: func() (kubernetes.Interface, error) {
		return nil, errors.New("unable to load in-cluster configuration")
	}})
	require.EqualError(t, err, "kubernetes client: unable to load in-cluster configuration")

	// A cluster that cannot be listed (RBAC grants the user nothing: 403)
	// fails the start after SyncTimeout.
	srv := cluster.Server(t)
	ns := srv.Namespace(t)
	write(t, path, strings.ReplaceAll(fmt.Sprintf(discovered, 1), "namespace: llm", "namespace: "+ns))
	client, err := kubernetes.NewForConfig(srv.ConfigAs("system:serviceaccount:" + ns + ":pdx"))
	require.NoError(t, err)
	_, err = New(t.Context(), Options{Path: path, SyncTimeout: 300 * time.Millisecond,
		Kube: func() (kubernetes.Interface, error) { return client, nil }})
	require.ErrorContains(t, err, "were not listed")
}

// TestRun polls the file and follows a ConfigMap-style update: the file is
// a symlink into a directory that is swapped whole.
func TestRun(t *testing.T) {
	dir := t.TempDir()
	swap := func(name, content string) {
		require.NoError(t, os.Mkdir(filepath.Join(dir, name), 0o700))
		write(t, filepath.Join(dir, name, "pdx.yaml"), content)
		tmp := filepath.Join(dir, "..data_tmp")
		require.NoError(t, os.Symlink(name, tmp))
		require.NoError(t, os.Rename(tmp, filepath.Join(dir, "..data")))
	}
	swap("v1", static)
	path := filepath.Join(dir, "pdx.yaml")
	require.NoError(t, os.Symlink(filepath.Join("..data", "pdx.yaml"), path))

	r, err := New(t.Context(), Options{Path: path, Interval: 5 * time.Millisecond})
	require.NoError(t, err)
	defer r.Close()
	got := make(chan *routing.Table, 1)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.Run(ctx, func(table *routing.Table) { got <- table })
	}()
	defer func() { cancel(); <-done }()

	swap("v2", strings.Replace(static, "127.0.0.1:1}", "127.0.0.1:2}", 1))
	select {
	case table := <-got:
		require.Equal(t, []string{"127.0.0.1:2"}, addresses(lookup(t, table, "m").Prefill.Set.Endpoints()))
		require.Same(t, table, r.Table())
	case <-time.After(10 * time.Second):
		t.Fatal("the swapped config was not loaded")
	}
}

// TestPollWaitsForSettledContent loads new content only once it has been
// the same at two checks: a file being written is not loaded half-way.
func TestPollWaitsForSettledContent(t *testing.T) {
	path := filepath.Join(t.TempDir(), "pdx.yaml")
	write(t, path, static)
	var logs syncBuffer
	r, err := New(t.Context(), Options{Path: path, Log: slog.New(slog.NewTextHandler(&logs, nil))})
	require.NoError(t, err)
	defer r.Close()
	var a applied
	var seen [32]byte
	decodeOf := func() string { return lookup(t, r.Table(), "m").Decode.Set.Endpoints()[0].Address }
	for i, step := range []struct {
		write string // "" writes nothing
		want  string // decode endpoint after the check
	}{
		{want: "127.0.0.1:9"},
		{write: strings.Replace(static, "127.0.0.1:9", "127.0.0.1:8", 1), want: "127.0.0.1:9"}, // first seen
		{want: "127.0.0.1:8"},                                // unchanged since: loaded
		{write: static[:len(static)/2], want: "127.0.0.1:8"}, // half-written
		{write: strings.Replace(static, "127.0.0.1:9", "127.0.0.1:7", 1), want: "127.0.0.1:8"}, // changed again
		{want: "127.0.0.1:7"},
		{want: "127.0.0.1:7"},
	} {
		if step.write != "" {
			write(t, path, step.write)
		}
		r.poll(t.Context(), a.apply, &seen)
		require.Equal(t, step.want, decodeOf(), "check %d", i)
	}
	require.Equal(t, 2, a.count())
	require.NotContains(t, logs.String(), "failed", "the half-written file was never loaded")

	// A file that goes away is reported once.
	require.NoError(t, os.Remove(path))
	for range 3 {
		r.poll(t.Context(), a.apply, &seen)
	}
	require.Equal(t, 1, strings.Count(logs.String(), "cannot read the file"))
	_, err = r.Reload(t.Context(), a.apply)
	require.ErrorIs(t, err, os.ErrNotExist)
}

// objectivesConfig is a static pool that learns objectives from the
// cluster; %d is its prefill_attempts, to make reloads differ.
const objectivesConfig = `
pools:
- name: p
  models: [m]
  connector: nixl
  prefill_attempts: %d
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:9}]
  flow_control:
    objectives: [{name: pinned, priority: 50}]
    kubernetes_objectives: {namespace: team, pool: pool-a}
`

func inferenceObjective(name string, priority int64) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceObjective",
		"metadata": map[string]any{"name": name},
		"spec":     map[string]any{"priority": priority, "poolRef": map[string]any{"name": "pool-a"}},
	}}
}

// TestReloadObjectives: a pool's flow control has the cluster's objectives
// when its table is handed over, on start and after a reload (a new
// Controller), and follows the cluster; back to a config without
// kubernetes_objectives, nothing is watched.
func TestReloadObjectives(t *testing.T) {
	srv := cluster.Server(t)
	ns := srv.Namespace(t)
	client, err := dynamic.NewForConfig(srv.Config())
	require.NoError(t, err)
	res := client.Resource(objectives.Resources[1]).Namespace(ns)
	for _, o := range []*unstructured.Unstructured{inferenceObjective("critical", 10), inferenceObjective("pinned", -1)} {
		_, err := res.Create(t.Context(), o, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	objectivesConfig := strings.ReplaceAll(objectivesConfig, "namespace: team", "namespace: "+ns)
	events := make(chan objectives.Event, 100)
	path := filepath.Join(t.TempDir(), "pdx.yaml")
	write(t, path, fmt.Sprintf(objectivesConfig, 1))
	clients := 0
	r, err := New(t.Context(), Options{
		Path:       path,
		Dynamic:    func() (dynamic.Interface, error) { clients++; return client, nil },
		Objectives: objectives.Options{Handled: func(ev objectives.Event) { events <- ev }},
	})
	require.NoError(t, err)
	defer r.Close()
	first := lookup(t, r.Table(), "m").Saturated.Flow
	require.Equal(t, 10, first.Priority("critical"))
	require.Equal(t, 50, first.Priority("pinned"), "the config's entry wins")

	write(t, path, fmt.Sprintf(objectivesConfig, 2))
	var a applied
	changed, err := r.Reload(t.Context(), a.apply)
	require.NoError(t, err)
	require.True(t, changed)
	second := lookup(t, r.Table(), "m").Saturated.Flow
	require.NotSame(t, first, second)
	require.Equal(t, 10, second.Priority("critical"), "fed before it is handed over")
	require.Equal(t, 1, clients, "one client for all reloads")

	cur, err := res.Get(t.Context(), "critical", metav1.GetOptions{})
	require.NoError(t, err)
	cur.Object["spec"] = inferenceObjective("critical", 3).Object["spec"]
	_, err = res.Update(t.Context(), cur, metav1.UpdateOptions{})
	require.NoError(t, err)
	for timeout := time.After(10 * time.Second); ; {
		select {
		case ev := <-events:
			if ev.Op != "update" {
				continue // the initial listing's
			}
		case <-timeout:
			t.Fatal("the update was not handled")
		}
		break
	}
	require.Equal(t, 3, second.Priority("critical"), "the new pool follows the cluster")
	require.Equal(t, 10, first.Priority("critical"), "the old one is left alone")

	write(t, path, static)
	changed, err = r.Reload(t.Context(), a.apply)
	require.NoError(t, err)
	require.True(t, changed)
	for len(events) > 0 {
		<-events
	}
	require.NoError(t, res.Delete(t.Context(), "critical", metav1.DeleteOptions{}))
	select {
	case ev := <-events:
		t.Fatalf("%+v handled: the namespace is still watched", ev)
	case <-time.After(300 * time.Millisecond):
	}
}
