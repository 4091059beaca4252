package kubeapi_test

import (
	"context"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/pdx-router/pdx/internal/testbed/kubeapi"
)

var cluster = kubeapi.Package{CRDs: func(ctx context.Context) ([]*unstructured.Unstructured, error) {
	inference, err := kubeapi.InferenceCRDs(ctx)
	if err != nil {
		return nil, err
	}
	gateway, err := kubeapi.GatewayCRDs(ctx)
	return append(inference, gateway...), err
}}

func TestMain(m *testing.M) { goleak.VerifyTestMain(cluster.Wrap(m)) }

// TestMissingBinaries: without the binaries, a test fails and says how to
// build them.
func TestMissingBinaries(t *testing.T) {
	dir := t.TempDir()
	t.Setenv(kubeapi.DirEnv, dir)
	_, err := kubeapi.Dir()
	require.ErrorContains(t, err, "no kube-apiserver in "+dir+": run `make kube`")
	_, err = kubeapi.Start(t.Context())
	require.ErrorContains(t, err, "run `make kube`")

	require.NoError(t, os.WriteFile(filepath.Join(dir, "kube-apiserver"), nil, 0o755))
	_, err = kubeapi.Dir()
	require.ErrorContains(t, err, "no etcd in "+dir+": run `make kube`")
}

// TestVersion: the API server is client-go's release, as mk/kube.mk means
// it to be, and reports its version as clients expect.
func TestVersion(t *testing.T) {
	srv := cluster.Server(t)
	dc, err := discovery.NewDiscoveryClientForConfig(srv.Config())
	require.NoError(t, err)
	v, err := dc.ServerVersion()
	require.NoError(t, err)

	out, err := exec.CommandContext(t.Context(), "go", "list", "-m", "-f", "{{.Version}}", "k8s.io/client-go").Output()
	require.NoError(t, err)
	clientGo := strings.TrimSpace(string(out))
	// client-go v0.X.Y is Kubernetes v1.X.Y.
	require.True(t, strings.HasPrefix(clientGo, "v0."), "client-go %q", clientGo)
	minor, _, _ := strings.Cut(strings.TrimPrefix(clientGo, "v0."), ".")
	require.Equal(t, "1", v.Major)
	require.Equal(t, minor, v.Minor, "kube-apiserver %s is not client-go %s's release: see mk/kube.mk", v.GitVersion, clientGo)
	require.True(t, strings.HasPrefix(v.GitVersion, "v1."+minor+"."), v.GitVersion)
}

// TestCRDs: the package's CRDs are served, and the server applies their
// defaults.
func TestCRDs(t *testing.T) {
	srv := cluster.Server(t)
	ns := srv.Namespace(t)
	client, err := dynamic.NewForConfig(srv.Config())
	require.NoError(t, err)
	crds, err := cluster.CRDs(t.Context())
	require.NoError(t, err)
	names := map[string]bool{}
	for _, crd := range crds {
		names[crd.GetName()] = true
		for _, gvr := range kubeapi.CRDResources(crd) {
			_, err := client.Resource(gvr).List(t.Context(), metav1.ListOptions{})
			require.NoError(t, err, "%s", gvr)
		}
	}
	for _, name := range []string{kubeapi.InferencePoolCRD, kubeapi.GIEObjectiveCRD, kubeapi.LLMDObjectiveCRD} {
		require.True(t, names[name], name)
	}

	for group, defaulted := range map[string]string{"llm-d.ai": "llm-d.ai", "inference.networking.x-k8s.io": "inference.networking.k8s.io"} {
		obj := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": group + "/v1alpha2", "kind": "InferenceObjective",
			"metadata": map[string]any{"name": "chat"},
			"spec":     map[string]any{"poolRef": map[string]any{"name": "llama"}},
		}}
		got, err := client.Resource(kubeapi.CRDResources(findCRD(t, crds, "inferenceobjectives."+group))[0]).Namespace(ns).
			Create(t.Context(), obj, metav1.CreateOptions{})
		require.NoError(t, err)
		ref, _, _ := unstructured.NestedStringMap(got.Object, "spec", "poolRef")
		require.Equal(t, map[string]string{"name": "llama", "group": defaulted, "kind": "InferencePool"}, ref)
	}
}

func findCRD(t *testing.T, crds []*unstructured.Unstructured, name string) *unstructured.Unstructured {
	t.Helper()
	for _, crd := range crds {
		if crd.GetName() == name {
			return crd
		}
	}
	t.Fatalf("no CRD %s", name)
	return nil
}

// TestPods: what a test must do for a pod, as there is no kubelet: a new
// pod is Pending whatever status it was created with; its status is
// written through the status subresource, and an update of the pod itself
// leaves the status alone. A watch sees each change.
func TestPods(t *testing.T) {
	srv := cluster.Server(t)
	ns := srv.Namespace(t)
	client, err := kubernetes.NewForConfig(srv.Config())
	require.NoError(t, err)
	pods := client.CoreV1().Pods(ns)
	w, err := pods.Watch(t.Context(), metav1.ListOptions{})
	require.NoError(t, err)
	defer w.Stop()

	running := corev1.PodStatus{
		Phase:      corev1.PodRunning,
		PodIP:      "10.0.0.1",
		PodIPs:     []corev1.PodIP{{IP: "10.0.0.1"}},
		Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}},
	}
	pod, err := pods.Create(t.Context(), &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "engine"},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "vllm", Image: "vllm"}}},
		Status:     running,
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	require.Equal(t, corev1.PodPending, pod.Status.Phase)
	require.Empty(t, pod.Status.PodIP)
	requireEvent(t, w, watch.Added, "")

	pod.Status = running
	pod, err = pods.UpdateStatus(t.Context(), pod, metav1.UpdateOptions{})
	require.NoError(t, err)
	require.Equal(t, "10.0.0.1", pod.Status.PodIP)
	requireEvent(t, w, watch.Modified, "10.0.0.1")

	pod.Labels = map[string]string{"role": "decode"}
	pod.Status.PodIP, pod.Status.PodIPs = "10.0.0.2", []corev1.PodIP{{IP: "10.0.0.2"}}
	pod, err = pods.Update(t.Context(), pod, metav1.UpdateOptions{})
	require.NoError(t, err)
	require.Equal(t, "10.0.0.1", pod.Status.PodIP, "an update of the pod leaves its status")
	requireEvent(t, w, watch.Modified, "10.0.0.1")

	// Unscheduled, it goes without a kubelet's word: marked for deletion,
	// then deleted.
	require.NoError(t, pods.Delete(t.Context(), "engine", metav1.DeleteOptions{}))
	deleting := requireEvent(t, w, watch.Modified, "10.0.0.1")
	require.NotNil(t, deleting.DeletionTimestamp)
	requireEvent(t, w, watch.Deleted, "10.0.0.1")
	_, err = pods.Get(t.Context(), "engine", metav1.GetOptions{})
	require.True(t, apierrors.IsNotFound(err))
}

func requireEvent(t *testing.T, w watch.Interface, typ watch.EventType, ip string) *corev1.Pod {
	t.Helper()
	select {
	case ev := <-w.ResultChan():
		require.Equal(t, typ, ev.Type)
		pod := ev.Object.(*corev1.Pod)
		require.Equal(t, ip, pod.Status.PodIP)
		return pod
	case <-time.After(10 * time.Second):
		t.Fatalf("no %s event", typ)
		return nil
	}
}

// TestConfigAs: a user acts with the rights RBAC grants them: none here.
func TestConfigAs(t *testing.T) {
	srv := cluster.Server(t)
	ns := srv.Namespace(t)
	client, err := kubernetes.NewForConfig(srv.ConfigAs("system:serviceaccount:" + ns + ":pdx"))
	require.NoError(t, err)
	_, err = client.CoreV1().Pods(ns).List(t.Context(), metav1.ListOptions{})
	require.True(t, apierrors.IsForbidden(err), "%v", err)
	require.ErrorContains(t, err, `User "system:serviceaccount:`+ns+`:pdx" cannot list resource "pods"`)
}

// TestStartStop runs a server of its own: Stop ends both processes and
// frees the port. The times are logged (go test -v), not asserted.
func TestStartStop(t *testing.T) {
	began := time.Now()
	srv, err := kubeapi.Start(t.Context())
	require.NoError(t, err)
	started := time.Since(began)
	u, err := url.Parse(srv.Config().Host)
	require.NoError(t, err)
	conn, err := net.Dial("tcp", u.Host)
	require.NoError(t, err)
	conn.Close()
	pids := srv.Pids()
	require.Len(t, pids, 2)

	began = time.Now()
	srv.Stop()
	t.Logf("kube-apiserver and etcd: ready in %v, stopped in %v", started.Round(time.Millisecond), time.Since(began).Round(time.Millisecond))
	for _, pid := range pids {
		require.ErrorIs(t, syscall.Kill(pid, 0), syscall.ESRCH, "process %d ended", pid)
	}
	_, err = net.Dial("tcp", u.Host)
	require.Error(t, err)
}
