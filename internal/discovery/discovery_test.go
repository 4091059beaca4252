package discovery

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/testbed/kubeapi"
)

// cluster is the real API server (and etcd) the tests watch, one for the
// package, started by the first test that needs it.
var cluster kubeapi.Package

func TestMain(m *testing.M) { goleak.VerifyTestMain(cluster.Wrap(m)) }

// Kthena's labels, the defaults.
const (
	roleLabel  = "modelserving.volcano.sh/role"
	groupLabel = "modelserving.volcano.sh/group-name"
)

// podSpec describes a test pod.
type podSpec struct {
	name, ip, role, group string
	notReady              bool
	labels                map[string]string // more labels
}

// newPod is the pod of s as a kubelet would have it: scheduled, running,
// with its IP and readiness. The harness creates it and then writes its
// status, as the API server takes no status on create.
func newPod(s podSpec) *corev1.Pod {
	labels := map[string]string{"app": "llm"}
	if s.role != "" {
		labels[roleLabel] = s.role
	}
	if s.group != "" {
		labels[groupLabel] = s.group
	}
	for k, v := range s.labels {
		labels[k] = v
	}
	ready := corev1.ConditionTrue
	if s.notReady {
		ready = corev1.ConditionFalse
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: s.name, Labels: labels},
		Spec: corev1.PodSpec{
			// Scheduled: deleting it is graceful, as for an engine's pod.
			NodeName: "node-a",
			Containers: []corev1.Container{
				{Name: "sidecar", Image: "sidecar", Ports: []corev1.ContainerPort{{Name: "metrics", ContainerPort: 9090}}},
				{Name: "engine", Image: "vllm", Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8000}}},
			},
		},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, Conditions: []corev1.PodCondition{
			{Type: corev1.PodScheduled, Status: corev1.ConditionTrue},
			{Type: corev1.PodReady, Status: ready},
		}},
	}
	if s.ip != "" {
		pod.Status.PodIP = s.ip
		pod.Status.PodIPs = []corev1.PodIP{{IP: s.ip}}
	}
	return pod
}

// sliceEP is one endpoint of a test EndpointSlice.
type sliceEP struct {
	pod, ip               string
	notReady, terminating bool
	uid                   string // targetRef UID; default the pod's
	noRef                 bool
}

// newSlice is an EndpointSlice of service, as the EndpointSlice controller
// would write it; the harness fills in its endpoints' pod UIDs.
func newSlice(name, service string, family discoveryv1.AddressType, eps ...sliceEP) *discoveryv1.EndpointSlice {
	port, http := int32(8000), "http"
	s := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Labels: map[string]string{discoveryv1.LabelServiceName: service}},
		AddressType: family,
		Ports:       []discoveryv1.EndpointPort{{Name: &http, Port: &port}},
	}
	for _, e := range eps {
		ready, terminating := !e.notReady, e.terminating
		ep := discoveryv1.Endpoint{
			Addresses:  []string{e.ip},
			Conditions: discoveryv1.EndpointConditions{Ready: &ready, Serving: &ready, Terminating: &terminating},
		}
		if !e.noRef {
			ep.TargetRef = &corev1.ObjectReference{Kind: "Pod", Name: e.pod, UID: types.UID(e.uid)}
		}
		s.Endpoints = append(s.Endpoints, ep)
	}
	return s
}

// harness runs a Discovery over a namespace of the real API server,
// feeding one pool.
type harness struct {
	t      *testing.T
	ns     string
	client kubernetes.Interface
	d      *Discovery
	pool   *routing.Pool
	target Target
	events chan Event
}

// newHarness builds the pool of a config pool body (the lines after
// "name: p"; its "namespace: llm" becomes the test's namespace), creates
// objs (pods and EndpointSlices) in the namespace, starts discovery for the
// pool, and waits until it has its first endpoints.
func newHarness(t *testing.T, poolYAML string, objs ...runtime.Object) *harness {
	t.Helper()
	srv := cluster.Server(t)
	h := &harness{t: t, ns: srv.Namespace(t), events: make(chan Event, 1000)}
	var err error
	h.client, err = kubernetes.NewForConfig(srv.Config())
	require.NoError(t, err)
	h.pool, h.target = newPool(t, h.poolYAML(poolYAML))
	for _, obj := range objs {
		switch o := obj.(type) {
		case *corev1.Pod:
			h.writePod(o)
		case *discoveryv1.EndpointSlice:
			h.writeSlice(o)
		default:
			t.Fatalf("newHarness: %T", obj)
		}
	}
	h.d = New(h.client, Options{Handled: func(ev Event) { h.events <- ev }})
	t.Cleanup(h.d.Close)
	require.NoError(t, h.d.SetTargets(t.Context(), []Target{h.target}))
	return h
}

// poolYAML puts a pool body in the test's namespace.
func (h *harness) poolYAML(body string) string {
	require.Contains(h.t, body, "namespace: llm")
	return strings.ReplaceAll(body, "namespace: llm", "namespace: "+h.ns)
}

// newPool builds pool "p" from a config pool body (the lines after its
// name), and the discovery target feeding it.
func newPool(t *testing.T, poolYAML string) (*routing.Pool, Target) {
	t.Helper()
	cfg, err := config.Parse([]byte("pools:\n- name: p\n  default: true\n" + poolYAML))
	require.NoError(t, err)
	table, err := routing.New(cfg)
	require.NoError(t, err)
	pool, _ := table.Pool("p")
	pc := cfg.GetPools()[0]
	return pool, Target{Pool: "p", Prefills: pool.Traits.Prefills, Spec: pc.GetKubernetes(), Set: pool.SetEndpoints}
}

// await waits until discovery has handled the event of kind and op on name,
// passing over others (the initial list, say).
func (h *harness) await(kind, op, name string) {
	h.t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case ev := <-h.events:
			if ev.Kind == kind && ev.Op == op && ev.Name == name && ev.Namespace == h.ns {
				return
			}
		case <-timeout:
			h.t.Fatalf("no %s event for %s %s", op, kind, name)
		}
	}
}

func (h *harness) podUID(name string) types.UID {
	h.t.Helper()
	pod, err := h.client.CoreV1().Pods(h.ns).Get(h.t.Context(), name, metav1.GetOptions{})
	require.NoError(h.t, err)
	return pod.UID
}

// Actions on the cluster. Each returns once discovery has handled its
// events.

// writePod creates pod and then writes its status through the status
// subresource, as the kubelet does: the API server drops the status a
// create carries.
func (h *harness) writePod(pod *corev1.Pod) *corev1.Pod {
	h.t.Helper()
	pods := h.client.CoreV1().Pods(h.ns)
	created, err := pods.Create(h.t.Context(), pod, metav1.CreateOptions{})
	require.NoError(h.t, err)
	require.Equal(h.t, corev1.PodPending, created.Status.Phase, "no status on create")
	created.Status = pod.Status
	updated, err := pods.UpdateStatus(h.t.Context(), created, metav1.UpdateOptions{})
	require.NoError(h.t, err)
	return updated
}

func (h *harness) createPod(s podSpec) {
	h.t.Helper()
	h.writePod(newPod(s))
	h.await("Pod", "add", s.name)
	h.await("Pod", "update", s.name) // its status
}

func (h *harness) createPods(specs ...podSpec) {
	h.t.Helper()
	for _, s := range specs {
		h.createPod(s)
	}
}

// updatePod makes the pod's labels and status those of s, each written
// only if it changes (an update that changes nothing makes no event).
func (h *harness) updatePod(s podSpec) {
	h.t.Helper()
	pods := h.client.CoreV1().Pods(h.ns)
	want := newPod(s)
	cur, err := pods.Get(h.t.Context(), s.name, metav1.GetOptions{})
	require.NoError(h.t, err)
	writes := 0
	if !maps.Equal(cur.Labels, want.Labels) {
		cur.Labels = want.Labels
		cur, err = pods.Update(h.t.Context(), cur, metav1.UpdateOptions{})
		require.NoError(h.t, err)
		writes++
	}
	if podReady(cur) != !s.notReady || cur.Status.PodIP != want.Status.PodIP {
		cur.Status = want.Status
		_, err = pods.UpdateStatus(h.t.Context(), cur, metav1.UpdateOptions{})
		require.NoError(h.t, err)
		writes++
	}
	require.Positive(h.t, writes, "updatePod changes nothing")
	for range writes {
		h.await("Pod", "update", s.name)
	}
}

// deletePod deletes the pod at once (a grace period of 0): it is gone from
// the API.
func (h *harness) deletePod(name string) {
	h.t.Helper()
	require.NoError(h.t, h.client.CoreV1().Pods(h.ns).Delete(h.t.Context(), name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}))
	h.await("Pod", "delete", name)
}

// terminatePod deletes the pod gracefully, as `kubectl delete` does: the
// API server only marks it (a deletion timestamp) for its kubelet, which
// there is none of here, to stop it.
func (h *harness) terminatePod(name string) {
	h.t.Helper()
	pods := h.client.CoreV1().Pods(h.ns)
	require.NoError(h.t, pods.Delete(h.t.Context(), name, metav1.DeleteOptions{}))
	h.await("Pod", "update", name)
	pod, err := pods.Get(h.t.Context(), name, metav1.GetOptions{})
	require.NoError(h.t, err, "a scheduled pod outlives its deletion until its kubelet confirms it")
	require.NotNil(h.t, pod.DeletionTimestamp)
}

// writeSlice creates or replaces an EndpointSlice; an endpoint's targetRef
// without a UID gets its pod's.
func (h *harness) writeSlice(s *discoveryv1.EndpointSlice) (op string) {
	h.t.Helper()
	s = s.DeepCopy()
	for i := range s.Endpoints {
		ref := s.Endpoints[i].TargetRef
		if ref == nil {
			continue
		}
		ref.Namespace = h.ns
		if ref.UID == "" {
			pod, err := h.client.CoreV1().Pods(h.ns).Get(h.t.Context(), ref.Name, metav1.GetOptions{})
			if err == nil {
				ref.UID = pod.UID
			}
		}
	}
	slices := h.client.DiscoveryV1().EndpointSlices(h.ns)
	cur, err := slices.Get(h.t.Context(), s.Name, metav1.GetOptions{})
	if err == nil {
		s.ResourceVersion = cur.ResourceVersion
		_, err = slices.Update(h.t.Context(), s, metav1.UpdateOptions{})
		require.NoError(h.t, err)
		return "update"
	}
	require.True(h.t, apierrors.IsNotFound(err), "%v", err)
	_, err = slices.Create(h.t.Context(), s, metav1.CreateOptions{})
	require.NoError(h.t, err)
	return "add"
}

func (h *harness) applySlice(s *discoveryv1.EndpointSlice) {
	h.t.Helper()
	h.await("EndpointSlice", h.writeSlice(s), s.Name)
}

func (h *harness) deleteSlice(name string) {
	h.t.Helper()
	require.NoError(h.t, h.client.DiscoveryV1().EndpointSlices(h.ns).Delete(h.t.Context(), name, metav1.DeleteOptions{}))
	h.await("EndpointSlice", "delete", name)
}

// show renders endpoints as "ip:port" or "ip:port/group".
func show(eps []endpoint.Endpoint) []string {
	var out []string
	for _, ep := range eps {
		s := ep.Address
		if ep.Group != "" {
			s += "/" + ep.Group
		}
		out = append(out, s)
	}
	return out
}

// requirePicks checks the pool's sets, and that picking follows them: the
// decode endpoints picked in turn are exactly the set, and each one's
// prefill comes from the prefill set and its group.
func (h *harness) requirePicks(prefill, decode []string) {
	h.t.Helper()
	require.Equal(h.t, prefill, show(h.pool.Prefill.Set.Endpoints()), "prefill set")
	require.Equal(h.t, decode, show(h.pool.Decode.Set.Endpoints()), "decode set")
	if len(decode) == 0 {
		_, err := h.pool.PickDecode(picker.Request{})
		require.ErrorIs(h.t, err, routing.ErrNoEndpoint)
		return
	}
	var picked []string
	for range decode {
		lease, err := h.pool.PickDecode(picker.Request{})
		require.NoError(h.t, err)
		lease.End(picker.Released)
		d := lease.Endpoint()
		picked = append(picked, show([]endpoint.Endpoint{d})...)
		if len(prefill) == 0 {
			continue // connector none
		}
		lease, err = h.pool.PickPrefill(d, picker.Request{})
		require.NoError(h.t, err)
		lease.End(picker.Released)
		p := lease.Endpoint()
		require.Contains(h.t, prefill, show([]endpoint.Endpoint{p})[0])
		require.Equal(h.t, d.Group, p.Group, "paired within the group")
	}
	slices.Sort(picked)
	require.Equal(h.t, decode, picked, "every decode endpoint picked in turn")
}

const servicePool = `  connector: nixl
  kubernetes: {namespace: llm, service: engines, port_name: http}
`

// TestServiceDiscovery follows a Service's EndpointSlices and their pods:
// after each event the pool picks from the new sets.
func TestServiceDiscovery(t *testing.T) {
	p1 := podSpec{name: "p1", ip: "10.0.0.1", role: "prefill"}
	p2 := podSpec{name: "p2", ip: "10.0.0.2", role: "prefill"}
	d1 := podSpec{name: "d1", ip: "10.0.0.11", role: "decode"}
	all := []sliceEP{{pod: "p1", ip: "10.0.0.1"}, {pod: "p2", ip: "10.0.0.2"}, {pod: "d1", ip: "10.0.0.11"}}
	tests := []struct {
		name            string
		steps           func(h *harness)
		prefill, decode []string
	}{
		{
			name: "pods and their endpoints appear",
			steps: func(h *harness) {
				h.createPod(p1)
				h.createPod(d1)
				h.requirePicks(nil, nil) // no slice yet: not ready as far as pdx knows
				h.applySlice(newSlice("engines-a", "engines", discoveryv1.AddressTypeIPv4, all[0], all[2]))
			},
			prefill: []string{"10.0.0.1:8000"}, decode: []string{"10.0.0.11:8000"},
		},
		{
			name: "an endpoint whose pod is not known yet waits for it",
			steps: func(h *harness) {
				h.applySlice(newSlice("engines-a", "engines", discoveryv1.AddressTypeIPv4, all...))
				h.createPod(d1)
				h.requirePicks(nil, []string{"10.0.0.11:8000"})
				h.createPod(p1)
			},
			prefill: []string{"10.0.0.1:8000"}, decode: []string{"10.0.0.11:8000"},
		},
		{
			name: "a pod changing role moves from prefill to decode",
			steps: func(h *harness) {
				h.createPods(p1, p2, d1)
				h.applySlice(newSlice("engines-a", "engines", discoveryv1.AddressTypeIPv4, all...))
				h.requirePicks([]string{"10.0.0.1:8000", "10.0.0.2:8000"}, []string{"10.0.0.11:8000"})
				p2 := p2
				p2.role = "decode"
				h.updatePod(p2)
			},
			prefill: []string{"10.0.0.1:8000"}, decode: []string{"10.0.0.11:8000", "10.0.0.2:8000"},
		},
		{
			name: "a pod losing its role leaves",
			steps: func(h *harness) {
				h.createPods(p1, p2, d1)
				h.applySlice(newSlice("engines-a", "engines", discoveryv1.AddressTypeIPv4, all...))
				p2 := p2
				p2.role = "router"
				h.updatePod(p2)
			},
			prefill: []string{"10.0.0.1:8000"}, decode: []string{"10.0.0.11:8000"},
		},
		{
			name: "an endpoint turning not ready is no longer picked",
			steps: func(h *harness) {
				h.createPods(p1, d1)
				h.applySlice(newSlice("engines-a", "engines", discoveryv1.AddressTypeIPv4, all...))
				h.requirePicks([]string{"10.0.0.1:8000"}, []string{"10.0.0.11:8000"})
				h.applySlice(newSlice("engines-a", "engines", discoveryv1.AddressTypeIPv4,
					all[0], sliceEP{pod: "d1", ip: "10.0.0.11", notReady: true}))
			},
			prefill: []string{"10.0.0.1:8000"}, decode: nil,
		},
		{
			name: "a terminating endpoint is no longer picked",
			steps: func(h *harness) {
				h.createPods(p1, p2, d1)
				h.applySlice(newSlice("engines-a", "engines", discoveryv1.AddressTypeIPv4,
					all[0], sliceEP{pod: "p2", ip: "10.0.0.2", terminating: true}, all[2]))
			},
			prefill: []string{"10.0.0.1:8000"}, decode: []string{"10.0.0.11:8000"},
		},
		{
			name: "a deleted pod is no longer picked, though its endpoint lingers",
			steps: func(h *harness) {
				h.createPods(p1, p2, d1)
				h.applySlice(newSlice("engines-a", "engines", discoveryv1.AddressTypeIPv4, all...))
				h.deletePod("p1")
			},
			prefill: []string{"10.0.0.2:8000"}, decode: []string{"10.0.0.11:8000"},
		},
		{
			name: "a deleted slice takes its endpoints",
			steps: func(h *harness) {
				h.createPods(p1, p2, d1)
				h.applySlice(newSlice("engines-a", "engines", discoveryv1.AddressTypeIPv4, all[0], all[2]))
				h.applySlice(newSlice("engines-b", "engines", discoveryv1.AddressTypeIPv4, all[1]))
				h.requirePicks([]string{"10.0.0.1:8000", "10.0.0.2:8000"}, []string{"10.0.0.11:8000"})
				h.deleteSlice("engines-a")
			},
			prefill: []string{"10.0.0.2:8000"}, decode: nil,
		},
		{
			name: "other services, stale and pod-less endpoints are not used",
			steps: func(h *harness) {
				h.createPods(p1, p2, d1)
				// p1 is replaced by a pod of the same name: the server
				// gives it another UID, and the slice still names the
				// former pod's.
				former := h.podUID("p1")
				h.deletePod("p1")
				h.createPod(p1)
				require.NotEqual(h.t, former, h.podUID("p1"))
				h.applySlice(newSlice("other-a", "other", discoveryv1.AddressTypeIPv4, all...))
				h.applySlice(newSlice("engines-a", "engines", discoveryv1.AddressTypeIPv4,
					sliceEP{pod: "p1", ip: "10.0.0.1", uid: string(former)},
					sliceEP{ip: "10.0.0.9", noRef: true}, all[1], all[2]))
			},
			prefill: []string{"10.0.0.2:8000"}, decode: []string{"10.0.0.11:8000"},
		},
		{
			name: "a dual-stack pod is used once, by its IPv4 address",
			steps: func(h *harness) {
				h.createPods(p1, d1)
				h.applySlice(newSlice("engines-6", "engines", discoveryv1.AddressTypeIPv6,
					sliceEP{pod: "p1", ip: "fd00::1"}, sliceEP{pod: "d1", ip: "fd00::11"}))
				h.requirePicks([]string{"[fd00::1]:8000"}, []string{"[fd00::11]:8000"})
				h.applySlice(newSlice("engines-4", "engines", discoveryv1.AddressTypeIPv4, all[0]))
			},
			prefill: []string{"10.0.0.1:8000"}, decode: []string{"[fd00::11]:8000"},
		},
		{
			name: "a slice without the named port is not used",
			steps: func(h *harness) {
				h.createPods(p1, d1)
				s := newSlice("engines-a", "engines", discoveryv1.AddressTypeIPv4, all[0], all[2])
				metrics := "metrics"
				s.Ports[0].Name = &metrics
				h.applySlice(s)
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, servicePool)
			tc.steps(h)
			h.requirePicks(tc.prefill, tc.decode)
		})
	}
}

// TestPodDiscovery uses pods alone, without a Service.
func TestPodDiscovery(t *testing.T) {
	const pool = `  connector: sglang
  kubernetes:
    namespace: llm
    match_labels: {app: llm}
    role_label: pdx.io/role
    prefill_role: P
    decode_role: D
    port_name: http
    bootstrap_port: 9000
`
	role := func(s podSpec, r string) podSpec {
		s.role = "" // not Kthena's label here
		s.labels = map[string]string{"pdx.io/role": r}
		return s
	}
	p1 := role(podSpec{name: "p1", ip: "10.0.0.1"}, "P")
	d1 := role(podSpec{name: "d1", ip: "10.0.0.11"}, "D")
	tests := []struct {
		name            string
		steps           func(h *harness)
		prefill, decode []string
	}{
		{
			name:    "ready pods are picked",
			steps:   func(h *harness) { h.createPods(p1, d1) },
			prefill: []string{"10.0.0.1:8000"}, decode: []string{"10.0.0.11:8000"},
		},
		{
			name: "a pod turning ready is picked",
			steps: func(h *harness) {
				d1 := d1
				d1.notReady = true
				h.createPods(p1, d1)
				h.requirePicks([]string{"10.0.0.1:8000"}, nil)
				d1.notReady = false
				h.updatePod(d1)
			},
			prefill: []string{"10.0.0.1:8000"}, decode: []string{"10.0.0.11:8000"},
		},
		{
			name: "a pod turning not ready is no longer picked",
			steps: func(h *harness) {
				h.createPods(p1, d1)
				d1 := d1
				d1.notReady = true
				h.updatePod(d1)
			},
			prefill: []string{"10.0.0.1:8000"},
		},
		{
			name: "a pod being deleted is no longer picked",
			steps: func(h *harness) {
				h.createPods(p1, d1)
				h.terminatePod("p1")
			},
			decode: []string{"10.0.0.11:8000"},
		},
		{
			name: "a pod going away is no longer picked",
			steps: func(h *harness) {
				h.createPods(p1, d1)
				h.deletePod("d1")
			},
			prefill: []string{"10.0.0.1:8000"},
		},
		{
			name: "pods without an IP, the labels or the port are not used",
			steps: func(h *harness) {
				h.createPods(p1, d1)
				h.createPod(role(podSpec{name: "d2", ip: ""}, "D"))
				other := role(podSpec{name: "d3", ip: "10.0.0.13"}, "D")
				other.labels["app"] = "other"
				h.createPod(other)
				noPort := newPod(role(podSpec{name: "d4", ip: "10.0.0.14"}, "D"))
				noPort.Spec.Containers = []corev1.Container{{Name: "engine", Image: "vllm"}}
				h.writePod(noPort)
				h.await("Pod", "add", "d4")
				h.await("Pod", "update", "d4")
			},
			prefill: []string{"10.0.0.1:8000"}, decode: []string{"10.0.0.11:8000"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, pool)
			tc.steps(h)
			h.requirePicks(tc.prefill, tc.decode)
			for _, ep := range h.pool.Prefill.Set.Endpoints() {
				require.Equal(t, 9000, ep.BootstrapPort, "prefill endpoints carry the bootstrap port")
			}
		})
	}
}

// TestRoleValues: with llm-d's role label, pods take the legs llm-d's
// prefill-filter and decode-filter give them; with another label the
// same values name no role.
func TestRoleValues(t *testing.T) {
	pods := func(label string) []podSpec {
		var out []podSpec
		for i, v := range []string{"prefill", "decode", "both", "prefill-decode", "encode-prefill",
			"encode-prefill-decode", "encode", "router", ""} {
			s := podSpec{name: fmt.Sprintf("pod-%d", i), ip: fmt.Sprintf("10.0.0.%d", i+1)}
			if v != "" {
				s.labels = map[string]string{label: v}
			}
			out = append(out, s)
		}
		return out
	}
	for _, tc := range []struct {
		label           string
		prefill, decode []string
	}{
		{
			label:   LLMDRoleLabel,
			prefill: []string{"10.0.0.1:8000", "10.0.0.3:8000", "10.0.0.4:8000", "10.0.0.5:8000", "10.0.0.6:8000"},
			decode:  []string{"10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000", "10.0.0.6:8000"},
		},
		{
			label:   "app.kubernetes.io/component",
			prefill: []string{"10.0.0.1:8000"},
			decode:  []string{"10.0.0.2:8000"},
		},
	} {
		t.Run(tc.label, func(t *testing.T) {
			h := newHarness(t, fmt.Sprintf(`  connector: nixl
  kubernetes: {namespace: llm, match_labels: {app: llm}, role_label: %s, port: 8000}
`, tc.label))
			h.createPods(pods(tc.label)...)
			h.requirePicks(tc.prefill, tc.decode)
		})
	}
}

// TestGroupPairing pairs prefill and decode pods by their group label.
func TestGroupPairing(t *testing.T) {
	const pool = `  connector: nixl
  kubernetes: {namespace: llm, service: engines, port: 8000, group_label: modelserving.volcano.sh/group-name}
`
	pods := []podSpec{
		{name: "g1-p", ip: "10.0.1.1", role: "prefill", group: "g1"},
		{name: "g1-d", ip: "10.0.1.11", role: "decode", group: "g1"},
		{name: "g2-d", ip: "10.0.2.11", role: "decode", group: "g2"},
		{name: "g3-p", ip: "10.0.3.1", role: "prefill", group: "g3"},
		{name: "nogroup-p", ip: "10.0.9.1", role: "prefill"},
	}
	var eps []sliceEP
	for _, p := range pods {
		eps = append(eps, sliceEP{pod: p.name, ip: p.ip})
	}
	h := newHarness(t, pool)
	h.createPods(pods...)
	h.applySlice(newSlice("engines-a", "engines", discoveryv1.AddressTypeIPv4, eps...))
	// g2 has no prefill and g3 no decode: only g1 is complete.
	h.requirePicks([]string{"10.0.1.1:8000/g1"}, []string{"10.0.1.11:8000/g1"})

	// g2 gets a prefill: its decode is picked from this event on, and pairs
	// only with it.
	h.createPod(podSpec{name: "g2-p", ip: "10.0.2.1", role: "prefill", group: "g2"})
	h.applySlice(newSlice("engines-a", "engines", discoveryv1.AddressTypeIPv4, append(eps, sliceEP{pod: "g2-p", ip: "10.0.2.1"})...))
	h.requirePicks([]string{"10.0.1.1:8000/g1", "10.0.2.1:8000/g2"}, []string{"10.0.1.11:8000/g1", "10.0.2.11:8000/g2"})
	for range 4 {
		p, err := h.pool.PickPrefill(endpoint.Endpoint{Address: "10.0.2.11:8000", Group: "g2"}, picker.Request{})
		require.NoError(t, err)
		p.End(picker.Released)
		require.Equal(t, "10.0.2.1:8000", p.Endpoint().Address)
	}

	// A pod moving to another group moves its pairing.
	h.updatePod(podSpec{name: "g2-p", ip: "10.0.2.1", role: "prefill", group: "g1"})
	h.requirePicks([]string{"10.0.1.1:8000/g1", "10.0.2.1:8000/g1"}, []string{"10.0.1.11:8000/g1"})
}

// TestConnectorNone makes every selected pod a decode endpoint.
func TestConnectorNone(t *testing.T) {
	h := newHarness(t, `  connector: none
  kubernetes: {namespace: llm, service: engines, port: 8000}
`)
	h.createPods(podSpec{name: "a", ip: "10.0.0.1", role: "prefill"}, podSpec{name: "b", ip: "10.0.0.2"})
	h.applySlice(newSlice("engines-a", "engines", discoveryv1.AddressTypeIPv4, sliceEP{pod: "a", ip: "10.0.0.1"}, sliceEP{pod: "b", ip: "10.0.0.2"}))
	h.requirePicks(nil, []string{"10.0.0.1:8000", "10.0.0.2:8000"})
}

// TestP2PKVAddress gives each engine its pod IP and the kv_port.
func TestP2PKVAddress(t *testing.T) {
	h := newHarness(t, `  connector: p2p-nccl
  kubernetes: {namespace: llm, service: engines, port: 8000, kv_port: 21001}
`)
	h.createPods(podSpec{name: "p", ip: "10.0.0.1", role: "prefill"}, podSpec{name: "d", ip: "10.0.0.2", role: "decode"})
	h.applySlice(newSlice("engines-a", "engines", discoveryv1.AddressTypeIPv4, sliceEP{pod: "p", ip: "10.0.0.1"}, sliceEP{pod: "d", ip: "10.0.0.2"}))
	require.Equal(t, []endpoint.Endpoint{{Address: "10.0.0.1:8000", KVAddress: "10.0.0.1:21001"}}, h.pool.Prefill.Set.Endpoints())
	require.Equal(t, []endpoint.Endpoint{{Address: "10.0.0.2:8000", KVAddress: "10.0.0.2:21001"}}, h.pool.Decode.Set.Endpoints())
}

// TestDPSize gives every discovered engine the pool's dp_size, and the
// decode pods decode_dp_size when set.
func TestDPSize(t *testing.T) {
	for _, tc := range []struct {
		name            string
		sizes           string
		prefill, decode int
	}{
		{"one size", "dp_size: 4", 4, 4},
		{"decode differs", "dp_size: 2, decode_dp_size: 8", 2, 8},
		{"none", "group_label: \"\"", 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, "  connector: sglang\n  kubernetes: {namespace: llm, service: engines, port: 8000, "+tc.sizes+"}\n")
			h.createPods(podSpec{name: "p", ip: "10.0.0.1", role: "prefill"}, podSpec{name: "d", ip: "10.0.0.2", role: "decode"})
			h.applySlice(newSlice("engines-a", "engines", discoveryv1.AddressTypeIPv4, sliceEP{pod: "p", ip: "10.0.0.1"}, sliceEP{pod: "d", ip: "10.0.0.2"}))
			require.Equal(t, []endpoint.Endpoint{{Address: "10.0.0.1:8000", DPSize: tc.prefill}}, h.pool.Prefill.Set.Endpoints())
			require.Equal(t, []endpoint.Endpoint{{Address: "10.0.0.2:8000", DPSize: tc.decode}}, h.pool.Decode.Set.Endpoints())
		})
	}
}

// TestSetTargets replaces the pools fed, as a config reload does.
func TestSetTargets(t *testing.T) {
	objs := []runtime.Object{
		newPod(podSpec{name: "p1", ip: "10.0.0.1", role: "prefill"}),
		newPod(podSpec{name: "d1", ip: "10.0.0.11", role: "decode"}),
		newSlice("engines-a", "engines", discoveryv1.AddressTypeIPv4, sliceEP{pod: "p1", ip: "10.0.0.1"}, sliceEP{pod: "d1", ip: "10.0.0.11"}),
	}
	h := newHarness(t, servicePool, objs...)
	h.requirePicks([]string{"10.0.0.1:8000"}, []string{"10.0.0.11:8000"})

	// A new pool for the same cluster gets the current endpoints at once,
	// and the old one no more updates.
	old := h.pool
	h.pool, h.target = newPool(t, h.poolYAML(servicePool))
	require.Empty(t, h.pool.Decode.Set.Endpoints())
	require.NoError(t, h.d.SetTargets(t.Context(), []Target{h.target}))
	h.requirePicks([]string{"10.0.0.1:8000"}, []string{"10.0.0.11:8000"})
	h.deletePod("p1")
	h.requirePicks(nil, []string{"10.0.0.11:8000"})
	require.Equal(t, []string{"10.0.0.1:8000"}, show(old.Prefill.Set.Endpoints()), "the replaced pool is left alone")

	// No target: the namespace is no longer watched.
	require.NoError(t, h.d.SetTargets(t.Context(), nil))
	h.d.mu.Lock()
	require.Empty(t, h.d.watched)
	h.d.mu.Unlock()

	h.d.Close()
	require.ErrorIs(t, h.d.SetTargets(t.Context(), []Target{h.target}), ErrClosed)
}

// TestSetTargetsRBAC: as a ServiceAccount that RBAC does not let list the
// pods, SetTargets fails (the API server answers 403 and the informers
// retry until the context ends) and leaves nothing running; once a Role
// grants get, list and watch on pods and EndpointSlices (what
// docs/discovery.md asks for), the same client is fed.
func TestSetTargetsRBAC(t *testing.T) {
	srv := cluster.Server(t)
	ns := srv.Namespace(t)
	sa := "system:serviceaccount:" + ns + ":pdx"
	client, err := kubernetes.NewForConfig(srv.ConfigAs(sa, "system:serviceaccounts", "system:serviceaccounts:"+ns))
	require.NoError(t, err)
	_, err = client.CoreV1().Pods(ns).List(t.Context(), metav1.ListOptions{})
	require.True(t, apierrors.IsForbidden(err), "listing without a Role: %v", err)

	_, target := newPool(t, strings.ReplaceAll(servicePool, "namespace: llm", "namespace: "+ns))
	target.Set = func(_, _ []endpoint.Endpoint) { t.Error("no endpoints can be known") }
	d := New(client, Options{})
	defer d.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
	defer cancel()
	err = d.SetTargets(ctx, []Target{target})
	require.ErrorContains(t, err, "discovery: the pods and endpointslices of namespaces ["+ns+"] were not listed")
	require.ErrorIs(t, err, context.DeadlineExceeded)
	d.mu.Lock()
	require.Empty(t, d.watched, "informers stopped")
	d.mu.Unlock()

	admin, err := kubernetes.NewForConfig(srv.Config())
	require.NoError(t, err)
	verbs := []string{"get", "list", "watch"}
	_, err = admin.RbacV1().Roles(ns).Create(t.Context(), &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: "pdx"},
		Rules: []rbacv1.PolicyRule{
			{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: verbs},
			{APIGroups: []string{"discovery.k8s.io"}, Resources: []string{"endpointslices"}, Verbs: verbs},
		},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = admin.RbacV1().RoleBindings(ns).Create(t.Context(), &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "pdx"},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: "pdx", Namespace: ns}},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "pdx"},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	// The authorizer learns of the binding through its own watch.
	require.Eventually(t, func() bool {
		_, err := client.DiscoveryV1().EndpointSlices(ns).List(t.Context(), metav1.ListOptions{})
		return err == nil
	}, 10*time.Second, 20*time.Millisecond)

	fed := make(chan struct{}, 1)
	target.Set = func(_, _ []endpoint.Endpoint) { fed <- struct{}{} }
	require.NoError(t, d.SetTargets(t.Context(), []Target{target}))
	select {
	case <-fed:
	default:
		t.Fatal("SetTargets returned before feeding the target")
	}
}

// TestSlimPod keeps what discovery reads.
func TestSlimPod(t *testing.T) {
	pod := newPod(podSpec{name: "p", ip: "10.0.0.1", role: "prefill"})
	pod.DeletionTimestamp = &metav1.Time{Time: time.Now()}
	pod.Annotations = map[string]string{"big": strings.Repeat("x", 1000)}
	got, err := slimPod(pod)
	require.NoError(t, err)
	slim := got.(*corev1.Pod)
	require.Equal(t, pod.Labels, slim.Labels)
	require.Equal(t, pod.DeletionTimestamp, slim.DeletionTimestamp)
	require.Equal(t, pod.UID, slim.UID)
	require.Empty(t, slim.Annotations)
	require.Equal(t, "10.0.0.1", slim.Status.PodIP)
	require.True(t, podReady(slim))
	require.Equal(t, 8000, containerPort(slim, "http"))
	require.Empty(t, slim.Spec.Containers[1].Image)

	tomb := "not a pod"
	got, err = slimPod(tomb)
	require.NoError(t, err)
	require.Equal(t, tomb, got)
}
