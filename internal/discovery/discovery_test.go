package discovery

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	clienttesting "k8s.io/client-go/testing"

	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/routing"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const ns = "llm"

// Kthena's labels, the defaults.
const (
	roleLabel  = "modelserving.volcano.sh/role"
	groupLabel = "modelserving.volcano.sh/group-name"
)

// podSpec describes a test pod.
type podSpec struct {
	name, ip, role, group string
	notReady              bool
	deleting              bool
	labels                map[string]string // more labels
}

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
		ObjectMeta: metav1.ObjectMeta{Name: s.name, Namespace: ns, UID: types.UID("uid-" + s.name), Labels: labels},
		Spec: corev1.PodSpec{Containers: []corev1.Container{
			{Name: "sidecar", Ports: []corev1.ContainerPort{{Name: "metrics", ContainerPort: 9090}}},
			{Name: "engine", Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8000}}},
		}},
		Status: corev1.PodStatus{PodIP: s.ip, Conditions: []corev1.PodCondition{
			{Type: corev1.PodScheduled, Status: corev1.ConditionTrue},
			{Type: corev1.PodReady, Status: ready},
		}},
	}
	if s.deleting {
		now := metav1.Now()
		pod.DeletionTimestamp = &now
		pod.Finalizers = []string{"test"} // a deleting pod has some
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

func newSlice(name, service string, family discoveryv1.AddressType, eps ...sliceEP) *discoveryv1.EndpointSlice {
	port, http := int32(8000), "http"
	s := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{discoveryv1.LabelServiceName: service}},
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
			uid := e.uid
			if uid == "" {
				uid = "uid-" + e.pod
			}
			ep.TargetRef = &corev1.ObjectReference{Kind: "Pod", Namespace: ns, Name: e.pod, UID: types.UID(uid)}
		}
		s.Endpoints = append(s.Endpoints, ep)
	}
	return s
}

// harness runs a Discovery over a fake clientset feeding one pool.
type harness struct {
	t      *testing.T
	client *fake.Clientset
	d      *Discovery
	pool   *routing.Pool
	target Target
	events chan Event
}

// newHarness builds the pool of a config pool body (the lines after
// "name: p"), starts discovery for it over objs, and waits until it has its
// first endpoints.
func newHarness(t *testing.T, poolYAML string, objs ...runtime.Object) *harness {
	t.Helper()
	pool, target := newPool(t, poolYAML)
	h := &harness{t: t, client: fake.NewClientset(objs...), pool: pool, target: target, events: make(chan Event, 1000)}
	h.d = New(h.client, Options{Handled: func(ev Event) { h.events <- ev }})
	t.Cleanup(h.d.Close)
	require.NoError(t, h.d.SetTargets(t.Context(), []Target{h.target}))
	return h
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
			if ev.Kind == kind && ev.Op == op && ev.Name == name && ev.Namespace == ns {
				return
			}
		case <-timeout:
			h.t.Fatalf("no %s event for %s %s", op, kind, name)
		}
	}
}

// Actions on the cluster. Each returns once discovery has handled its event.

func (h *harness) createPod(s podSpec) {
	h.t.Helper()
	_, err := h.client.CoreV1().Pods(ns).Create(h.t.Context(), newPod(s), metav1.CreateOptions{})
	require.NoError(h.t, err)
	h.await("Pod", "add", s.name)
}

func (h *harness) updatePod(s podSpec) {
	h.t.Helper()
	_, err := h.client.CoreV1().Pods(ns).Update(h.t.Context(), newPod(s), metav1.UpdateOptions{})
	require.NoError(h.t, err)
	h.await("Pod", "update", s.name)
}

func (h *harness) deletePod(name string) {
	h.t.Helper()
	require.NoError(h.t, h.client.CoreV1().Pods(ns).Delete(h.t.Context(), name, metav1.DeleteOptions{}))
	h.await("Pod", "delete", name)
}

func (h *harness) applySlice(s *discoveryv1.EndpointSlice) {
	h.t.Helper()
	slices := h.client.DiscoveryV1().EndpointSlices(ns)
	if _, err := slices.Get(h.t.Context(), s.Name, metav1.GetOptions{}); err == nil {
		_, err = slices.Update(h.t.Context(), s, metav1.UpdateOptions{})
		require.NoError(h.t, err)
		h.await("EndpointSlice", "update", s.Name)
		return
	}
	_, err := slices.Create(h.t.Context(), s, metav1.CreateOptions{})
	require.NoError(h.t, err)
	h.await("EndpointSlice", "add", s.Name)
}

func (h *harness) deleteSlice(name string) {
	h.t.Helper()
	require.NoError(h.t, h.client.DiscoveryV1().EndpointSlices(ns).Delete(h.t.Context(), name, metav1.DeleteOptions{}))
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
				h.applySlice(newSlice("other-a", "other", discoveryv1.AddressTypeIPv4, all...))
				h.applySlice(newSlice("engines-a", "engines", discoveryv1.AddressTypeIPv4,
					sliceEP{pod: "p1", ip: "10.0.0.1", uid: "uid-of-a-former-p1"},
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

func (h *harness) createPods(specs ...podSpec) {
	h.t.Helper()
	for _, s := range specs {
		h.createPod(s)
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
				p1 := p1
				p1.deleting = true
				h.updatePod(p1)
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
				noPort.Spec.Containers = nil
				_, err := h.client.CoreV1().Pods(ns).Create(h.t.Context(), noPort, metav1.CreateOptions{})
				require.NoError(h.t, err)
				h.await("Pod", "add", "d4")
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
	h.pool, h.target = newPool(t, servicePool)
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

// TestSetTargetsUnlisted fails when the informers cannot list, as without
// RBAC, and leaves nothing running.
func TestSetTargetsUnlisted(t *testing.T) {
	_, target := newPool(t, servicePool)
	target.Set = func(_, _ []endpoint.Endpoint) { t.Error("no endpoints can be known") }
	client := fake.NewClientset()
	client.PrependReactor("list", "pods", func(clienttesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New(`pods is forbidden: User "system:serviceaccount:llm:pdx" cannot list resource "pods"`)
	})
	d := New(client, Options{})
	defer d.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	err := d.SetTargets(ctx, []Target{target})
	require.ErrorContains(t, err, "discovery: the pods and endpointslices of namespaces [llm] were not listed")
	require.ErrorIs(t, err, context.DeadlineExceeded)
	d.mu.Lock()
	require.Empty(t, d.watched, "informers stopped")
	d.mu.Unlock()
}

// TestSlimPod keeps what discovery reads.
func TestSlimPod(t *testing.T) {
	pod := newPod(podSpec{name: "p", ip: "10.0.0.1", role: "prefill", deleting: true})
	pod.Annotations = map[string]string{"big": strings.Repeat("x", 1000)}
	pod.Spec.Containers[1].Image = "vllm"
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
