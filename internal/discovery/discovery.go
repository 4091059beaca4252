// Package discovery feeds pools their engine endpoints from Kubernetes. It
// watches the pods and EndpointSlices of the pools' namespaces with client-go
// informers and, on every change, recomputes each pool's prefill and decode
// sets and hands them to the pool, before the next event is handled.
//
// Which pods are a pool's engines, and in which role, is set by the pool's
// config (configv1.KubernetesDiscovery): a Service's EndpointSlices give the
// addresses and readiness, the endpoints' pods (their targetRef) give the
// role and pairing labels; without a Service the matching pods are used
// directly.
package discovery

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"sync"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/endpoint"
)

// Target is a pool that discovery feeds.
type Target struct {
	// Pool names the pool in logs.
	Pool string
	// Prefills is the pool's connector's trait: without a prefill leg every
	// pod is a decode engine and roles are not read.
	Prefills bool
	// Spec says which pods are the pool's engines; config.Parse has
	// validated it and filled in its defaults.
	Spec *configv1.KubernetesDiscovery
	// Set receives the pool's current endpoints, sorted by address, each
	// time they change (routing.Pool.SetEndpoints). It is called with no
	// two calls at once.
	Set func(prefill, decode []endpoint.Endpoint)
}

// Event is an informer event that discovery has handled.
type Event struct {
	// Kind is "Pod" or "EndpointSlice".
	Kind string
	// Op is "add", "update" or "delete".
	Op              string
	Namespace, Name string
}

// Options configure a Discovery.
type Options struct {
	// Log receives changes of the pools' endpoint sets. nil: discarded.
	Log *slog.Logger
	// Handled, when set, is called after each informer event has been
	// handled, that is once every target of the event's namespace has its
	// new endpoints. Tests wait on it instead of sleeping.
	Handled func(Event)
}

// Discovery watches namespaces and keeps its targets' endpoints current.
type Discovery struct {
	client kubernetes.Interface
	log    *slog.Logger
	onDone func(Event)

	// mu guards the fields below, and serializes every recomputation, so
	// that a target gets its sets in the order of the events.
	mu      sync.Mutex
	targets []*target
	watched map[string]*watch // by namespace
	closed  bool
}

// target is a Target with the sets it was last given.
type target struct {
	Target
	prefill, decode []endpoint.Endpoint
	pushed          bool
}

// watch is the informers of one namespace.
type watch struct {
	factory informers.SharedInformerFactory
	pods    cache.SharedIndexInformer
	slices  cache.SharedIndexInformer
	cancel  context.CancelFunc
}

// New returns a Discovery using client. It watches nothing until
// SetTargets.
func New(client kubernetes.Interface, opts Options) *Discovery {
	log := opts.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Discovery{client: client, log: log, onDone: opts.Handled, watched: map[string]*watch{}}
}

// ErrClosed is returned by SetTargets after Close.
var ErrClosed = errors.New("discovery: closed")

// SetTargets makes targets the pools d feeds, in place of the previous ones.
// It starts watching the namespaces that are new to it and waits until their
// informers have listed them (or ctx ends: then it fails and the previous
// targets stay), gives every target its current endpoints, and stops
// watching namespaces no target is in any more. From its return on, every
// change in the cluster reaches the targets.
func (d *Discovery) SetTargets(ctx context.Context, targets []Target) error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return ErrClosed
	}
	var syncs []cache.InformerSynced
	for _, t := range targets {
		ns := t.Spec.GetNamespace()
		w := d.watched[ns]
		if w == nil {
			var err error
			if w, err = d.watch(ns); err != nil {
				d.mu.Unlock()
				return err
			}
			d.watched[ns] = w
		}
		syncs = append(syncs, w.pods.HasSynced, w.slices.HasSynced)
	}
	d.mu.Unlock()

	// Waiting holds no lock: event handlers run meanwhile.
	if !cache.WaitForCacheSync(ctx.Done(), syncs...) {
		d.mu.Lock()
		unused := d.unwatchUnused()
		d.mu.Unlock()
		stopAll(unused)
		return fmt.Errorf("discovery: the pods and endpointslices of namespaces %v were not listed: %w "+
			"(can pdx get, list and watch them?)", namespaces(targets), context.Cause(ctx))
	}

	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return ErrClosed
	}
	d.targets = d.targets[:0:0]
	for _, t := range targets {
		d.targets = append(d.targets, &target{Target: t})
	}
	for _, t := range d.targets {
		d.update(t)
	}
	unused := d.unwatchUnused()
	d.mu.Unlock()
	stopAll(unused)
	return nil
}

// unwatchUnused takes the namespaces no target is in out of d.watched and
// returns their informers, to be stopped outside d.mu: stopping waits for
// event handlers, which take it. d.mu is held.
func (d *Discovery) unwatchUnused() []*watch {
	var unused []*watch
	for ns, w := range d.watched {
		if !slices.ContainsFunc(d.targets, func(t *target) bool { return t.Spec.GetNamespace() == ns }) {
			unused = append(unused, w)
			delete(d.watched, ns)
		}
	}
	return unused
}

func stopAll(ws []*watch) {
	for _, w := range ws {
		w.stop()
	}
}

// Close stops every informer and waits for their goroutines. Targets get no
// more updates.
func (d *Discovery) Close() {
	d.mu.Lock()
	d.closed = true
	d.targets = nil
	watched := d.watched
	d.watched = map[string]*watch{}
	d.mu.Unlock()
	stopAll(slices.Collect(maps.Values(watched)))
}

// serviceIndex indexes EndpointSlices by the Service they belong to.
const serviceIndex = "service"

// watch starts the informers of namespace ns.
func (d *Discovery) watch(ns string) (*watch, error) {
	factory := informers.NewSharedInformerFactoryWithOptions(d.client, 0, informers.WithNamespace(ns))
	w := &watch{
		factory: factory,
		pods:    factory.Core().V1().Pods().Informer(),
		slices:  factory.Discovery().V1().EndpointSlices().Informer(),
	}
	// A namespace may hold many pods; keep only what picking reads.
	if err := w.pods.SetTransform(slimPod); err != nil {
		return nil, fmt.Errorf("discovery: %w", err)
	}
	if err := w.slices.AddIndexers(cache.Indexers{serviceIndex: func(obj any) ([]string, error) {
		s, ok := obj.(*discoveryv1.EndpointSlice)
		if !ok || s.Labels[discoveryv1.LabelServiceName] == "" {
			return nil, nil
		}
		return []string{s.Labels[discoveryv1.LabelServiceName]}, nil
	}}); err != nil {
		return nil, fmt.Errorf("discovery: %w", err)
	}
	for kind, inf := range map[string]cache.SharedIndexInformer{"Pod": w.pods, "EndpointSlice": w.slices} {
		_, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc:    func(obj any) { d.handle(kind, "add", obj) },
			UpdateFunc: func(_, obj any) { d.handle(kind, "update", obj) },
			DeleteFunc: func(obj any) { d.handle(kind, "delete", obj) },
		})
		if err != nil {
			return nil, fmt.Errorf("discovery: %w", err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	w.cancel = cancel
	factory.StartWithContext(ctx)
	return w, nil
}

func (w *watch) stop() {
	w.cancel()
	w.factory.Shutdown()
}

// handle recomputes the targets in the namespace of an event's object. The
// informer has stored the change before it calls the handler, so the sets
// computed here include it.
func (d *Discovery) handle(kind, op string, obj any) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	ev := Event{Kind: kind, Op: op}
	if m, ok := obj.(metav1.Object); ok {
		ev.Namespace, ev.Name = m.GetNamespace(), m.GetName()
	}
	d.mu.Lock()
	for _, t := range d.targets {
		if t.Spec.GetNamespace() == ev.Namespace {
			d.update(t)
		}
	}
	d.mu.Unlock()
	if d.onDone != nil {
		d.onDone(ev)
	}
}

// update computes t's endpoints and hands them over if they changed. d.mu
// is held.
func (d *Discovery) update(t *target) {
	w := d.watched[t.Spec.GetNamespace()]
	if w == nil {
		return
	}
	prefill, decode := endpoints(w, t.Target)
	if t.pushed && slices.Equal(prefill, t.prefill) && slices.Equal(decode, t.decode) {
		return
	}
	t.prefill, t.decode, t.pushed = prefill, decode, true
	t.Set(prefill, decode)
	d.log.Info("pool endpoints discovered", slog.String("pool", t.Pool),
		slog.Any("prefill", addresses(prefill)), slog.Any("decode", addresses(decode)))
}

// engine is a pod found to be one of a pool's engines, with the address it
// serves on.
type engine struct {
	pod  *corev1.Pod
	ip   netip.Addr
	port int
}

// endpoints computes a target's prefill and decode endpoints from w's
// caches, each sorted by address.
func endpoints(w *watch, t Target) (prefill, decode []endpoint.Endpoint) {
	spec := t.Spec
	var engines []engine
	if spec.GetService() != "" {
		engines = serviceEngines(w, spec)
	} else {
		engines = podEngines(w, spec)
	}
	for _, e := range engines {
		isPrefill, isDecode := false, true
		if t.Prefills {
			if isPrefill, isDecode = roles(e.pod.Labels, spec); !isPrefill && !isDecode {
				continue // another role (a router, a proxy) or none
			}
		}
		ep := endpoint.Endpoint{Address: net.JoinHostPort(e.ip.String(), strconv.Itoa(e.port))}
		if g := spec.GetGroupLabel(); g != "" {
			if ep.Group = e.pod.Labels[g]; ep.Group == "" {
				continue // cannot be paired
			}
		}
		if kp := spec.GetKvPort(); kp != 0 {
			ep.KVAddress = net.JoinHostPort(e.ip.String(), strconv.Itoa(int(kp)))
		}
		ep.DPSize = int(spec.GetDpSize())
		if isPrefill {
			p := ep
			p.BootstrapPort = int(spec.GetBootstrapPort())
			prefill = append(prefill, p)
		}
		if isDecode {
			if d := spec.GetDecodeDpSize(); d != 0 {
				ep.DPSize = int(d)
			}
			decode = append(decode, ep)
		}
	}
	if spec.GetGroupLabel() != "" {
		// A decode engine without a prefill in its group cannot serve a
		// request, and a prefill without a decode is never asked: use
		// only complete groups.
		prefill, decode = paired(prefill, decode)
	}
	byAddress := func(a, b endpoint.Endpoint) int {
		return cmp.Or(cmp.Compare(a.Address, b.Address), cmp.Compare(a.Group, b.Group))
	}
	slices.SortFunc(prefill, byAddress)
	slices.SortFunc(decode, byAddress)
	return prefill, decode
}

// LLMDRoleLabel is llm-d's role label. With it as role_label, the values
// llm-d's prefill-filter and decode-filter accept beyond prefill_role and
// decode_role are read as they read them: a pod that serves both legs
// (prefill-decode, both, its older name, and encode-prefill-decode) is a
// prefill and a decode endpoint, and an encode-prefill pod a prefill one.
const LLMDRoleLabel = "llm-d.ai/role"

// roles tells which legs a pod with labels serves.
func roles(labels map[string]string, spec *configv1.KubernetesDiscovery) (prefill, decode bool) {
	switch v := labels[spec.GetRoleLabel()]; {
	case v == "":
		return false, false
	case v == spec.GetPrefillRole():
		return true, false
	case v == spec.GetDecodeRole():
		return false, true
	case spec.GetRoleLabel() != LLMDRoleLabel:
		return false, false
	case v == "prefill-decode" || v == "both" || v == "encode-prefill-decode":
		return true, true
	case v == "encode-prefill":
		return true, false
	}
	return false, false
}

// paired keeps the endpoints of the groups that have both roles.
func paired(prefill, decode []endpoint.Endpoint) ([]endpoint.Endpoint, []endpoint.Endpoint) {
	has := func(eps []endpoint.Endpoint) map[string]bool {
		m := map[string]bool{}
		for _, ep := range eps {
			m[ep.Group] = true
		}
		return m
	}
	withPrefill, withDecode := has(prefill), has(decode)
	prefill = slices.DeleteFunc(prefill, func(ep endpoint.Endpoint) bool { return !withDecode[ep.Group] })
	decode = slices.DeleteFunc(decode, func(ep endpoint.Endpoint) bool { return !withPrefill[ep.Group] })
	return prefill, decode
}

// serviceEngines finds the engines among the service's EndpointSlices: the
// endpoints that are ready and not terminating, whose pod is known and
// matches the labels. A pod listed in several slices (a dual-stack service
// has one per address family) is used once, by its IPv4 address if it has
// one.
func serviceEngines(w *watch, spec *configv1.KubernetesDiscovery) []engine {
	objs, _ := w.slices.GetIndexer().ByIndex(serviceIndex, spec.GetService())
	byPod := map[string]engine{}
	var order []string // pods in the order first met, for determinism
	for _, obj := range objs {
		slice, ok := obj.(*discoveryv1.EndpointSlice)
		if !ok || (slice.AddressType != discoveryv1.AddressTypeIPv4 && slice.AddressType != discoveryv1.AddressTypeIPv6) {
			continue // FQDN endpoints have no IP for Envoy to connect to
		}
		port, ok := slicePort(slice, spec)
		if !ok {
			continue
		}
		for _, ep := range slice.Endpoints {
			if !usable(ep.Conditions) || len(ep.Addresses) == 0 {
				continue
			}
			ref := ep.TargetRef
			if ref == nil || ref.Kind != "Pod" {
				continue // no pod, no role
			}
			pod := cachedPod(w, slice.Namespace, ref.Name)
			if pod == nil || (ref.UID != "" && ref.UID != pod.UID) || !matches(pod, spec.GetMatchLabels()) {
				continue // not (yet) known, a former pod of that name, or not selected
			}
			// Per the API, consumers use the first address.
			ip, err := netip.ParseAddr(ep.Addresses[0])
			if err != nil || ip.IsUnspecified() {
				continue
			}
			e := engine{pod: pod, ip: ip.Unmap(), port: port}
			prev, seen := byPod[pod.Name]
			switch {
			case !seen:
				order = append(order, pod.Name)
			case prev.ip.Is4() || !e.ip.Is4():
				continue
			}
			byPod[pod.Name] = e
		}
	}
	engines := make([]engine, 0, len(order))
	for _, name := range order {
		engines = append(engines, byPod[name])
	}
	return engines
}

// slicePort is the engines' port in a slice: the configured number, or the
// slice's port of the configured name.
func slicePort(slice *discoveryv1.EndpointSlice, spec *configv1.KubernetesDiscovery) (int, bool) {
	if spec.GetPort() != 0 {
		return int(spec.GetPort()), true
	}
	for _, p := range slice.Ports {
		if p.Name != nil && *p.Name == spec.GetPortName() && p.Port != nil &&
			(p.Protocol == nil || *p.Protocol == corev1.ProtocolTCP) {
			return int(*p.Port), true
		}
	}
	return 0, false
}

// usable reports whether an EndpointSlice endpoint may take new requests:
// ready (unset means ready, as the API says) and not terminating. A
// terminating endpoint that is still serving finishes what it has but gets
// nothing new.
func usable(c discoveryv1.EndpointConditions) bool {
	return (c.Ready == nil || *c.Ready) && (c.Terminating == nil || !*c.Terminating)
}

// podEngines finds the engines among the namespace's pods: those matching
// the labels, ready, not being deleted and with an IP.
func podEngines(w *watch, spec *configv1.KubernetesDiscovery) []engine {
	var engines []engine
	for _, obj := range w.pods.GetStore().List() {
		pod, ok := obj.(*corev1.Pod)
		if !ok || pod.DeletionTimestamp != nil || !podReady(pod) || !matches(pod, spec.GetMatchLabels()) {
			continue
		}
		ip, err := netip.ParseAddr(pod.Status.PodIP)
		if err != nil || ip.IsUnspecified() {
			continue
		}
		port := int(spec.GetPort())
		if port == 0 {
			if port = containerPort(pod, spec.GetPortName()); port == 0 {
				continue
			}
		}
		engines = append(engines, engine{pod: pod, ip: ip.Unmap(), port: port})
	}
	return engines
}

func podReady(pod *corev1.Pod) bool {
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// containerPort is the number of the pod's TCP container port named name, or
// 0.
func containerPort(pod *corev1.Pod, name string) int {
	for _, c := range pod.Spec.Containers {
		for _, p := range c.Ports {
			if p.Name == name && (p.Protocol == "" || p.Protocol == corev1.ProtocolTCP) {
				return int(p.ContainerPort)
			}
		}
	}
	return 0
}

func matches(pod *corev1.Pod, labels map[string]string) bool {
	for k, v := range labels {
		if got, ok := pod.Labels[k]; !ok || got != v {
			return false
		}
	}
	return true
}

func cachedPod(w *watch, ns, name string) *corev1.Pod {
	obj, ok, err := w.pods.GetStore().GetByKey(ns + "/" + name)
	if err != nil || !ok {
		return nil
	}
	pod, _ := obj.(*corev1.Pod)
	return pod
}

// slimPod keeps of a pod what discovery reads, so that watching a namespace
// with many pods costs little memory.
func slimPod(obj any) (any, error) {
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil // a tombstone: nothing is read from it
	}
	slim := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name:              pod.Name,
			Namespace:         pod.Namespace,
			UID:               pod.UID,
			ResourceVersion:   pod.ResourceVersion,
			Labels:            pod.Labels,
			DeletionTimestamp: pod.DeletionTimestamp,
		},
		Status: corev1.PodStatus{PodIP: pod.Status.PodIP},
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			slim.Status.Conditions = []corev1.PodCondition{{Type: c.Type, Status: c.Status}}
		}
	}
	for _, c := range pod.Spec.Containers {
		if len(c.Ports) > 0 {
			slim.Spec.Containers = append(slim.Spec.Containers, corev1.Container{Name: c.Name, Ports: c.Ports})
		}
	}
	return slim, nil
}

func addresses(eps []endpoint.Endpoint) []string {
	out := make([]string, len(eps))
	for i, ep := range eps {
		out[i] = ep.Address
		if ep.Group != "" {
			out[i] += " (" + ep.Group + ")"
		}
	}
	return out
}

func namespaces(targets []Target) []string {
	var out []string
	for _, t := range targets {
		if ns := t.Spec.GetNamespace(); !slices.Contains(out, ns) {
			out = append(out, ns)
		}
	}
	slices.Sort(out)
	return out
}
