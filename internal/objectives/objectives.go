// Package objectives feeds pools' flow control the priorities of the
// cluster's InferenceObjective objects. It watches them with client-go's
// dynamic informers, in the namespaces the pools name, and on every change
// hands each pool a fresh map of objective name to priority (the objects
// whose spec.poolRef names the pool's InferencePool), before the next event
// is handled. It is discovery's counterpart for objectives: retargeted on
// every config load, stopped by Close.
package objectives

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"slices"
	"sync"
	"sync/atomic"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/tools/cache"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
)

// Resources are the InferenceObjective APIs watched: the Gateway API
// Inference Extension's older group and llm-d's, whose v1alpha2 schemas
// agree on spec.priority and spec.poolRef. An objective of the same name in
// both is llm-d's (the later).
var Resources = []schema.GroupVersionResource{
	{Group: "inference.networking.x-k8s.io", Version: "v1alpha2", Resource: "inferenceobjectives"},
	{Group: "llm-d.ai", Version: "v1alpha2", Resource: "inferenceobjectives"},
}

// Target is a pool whose flow control learns its objectives from the
// cluster.
type Target struct {
	// Pool names the pool in logs.
	Pool string
	// Spec names the namespace and the InferencePool; config.Parse has
	// validated it.
	Spec *configv1.KubernetesObjectives
	// Set receives the pool's objectives each time they change
	// (flowcontrol.Controller.SetObjectives). It is called with no two
	// calls at once, and owns the map.
	Set func(map[string]int)
}

// Event is an informer event that the watcher has handled.
type Event struct {
	Resource schema.GroupVersionResource
	// Op is "add", "update" or "delete".
	Op              string
	Namespace, Name string
}

// Options configure a Watcher.
type Options struct {
	// Log receives the pools' objectives as they change, and malformed
	// objects. nil: discarded.
	Log *slog.Logger
	// Handled, when set, is called after each informer event has been
	// handled, that is once every target of the event's namespace has its
	// new objectives. Tests wait on it instead of sleeping.
	Handled func(Event)
}

// Watcher watches InferenceObjectives and keeps its targets' objectives
// current.
type Watcher struct {
	client dynamic.Interface
	log    *slog.Logger
	onDone func(Event)

	// mu guards the fields below and serializes every recomputation, so
	// that a target gets its maps in the order of the events.
	mu      sync.Mutex
	targets []*target
	watched map[string]*watch // by namespace
	// malformed holds the spec.priority last logged as malformed, by
	// object, so that each bad value is logged once and not at every
	// recomputation.
	malformed map[objectKey]string
	closed    bool
}

type target struct {
	Target
	last   map[string]int
	pushed bool
}

// watch is the informers of one namespace, one per resource.
type watch struct {
	informers []*informer
	cancel    context.CancelFunc
	done      sync.WaitGroup
}

type informer struct {
	resource schema.GroupVersionResource
	inf      cache.SharedIndexInformer
	// absent is set when the API server does not serve the resource (its
	// CRD is not installed): it then counts as listed, and empty, so that
	// a cluster with one of the two groups is enough. The informer keeps
	// trying, and picks objects up once the CRD is installed.
	absent atomic.Bool
}

type objectKey struct {
	group, namespace, name string
}

// New returns a Watcher using client. It watches nothing until SetTargets.
func New(client dynamic.Interface, opts Options) *Watcher {
	log := opts.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Watcher{client: client, log: log, onDone: opts.Handled, watched: map[string]*watch{}, malformed: map[objectKey]string{}}
}

// ErrClosed is returned by SetTargets after Close.
var ErrClosed = errors.New("objectives: closed")

// SetTargets makes targets the pools w feeds, in place of the previous
// ones. It starts watching the namespaces that are new to it and waits until
// their informers have listed them (or ctx ends: then it fails and the
// previous targets stay), gives every target its current objectives, and
// stops watching namespaces no target is in any more.
func (w *Watcher) SetTargets(ctx context.Context, targets []Target) error {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return ErrClosed
	}
	var syncs []cache.InformerSynced
	for _, t := range targets {
		ns := t.Spec.GetNamespace()
		wa := w.watched[ns]
		if wa == nil {
			var err error
			if wa, err = w.watch(ns); err != nil {
				w.mu.Unlock()
				return err
			}
			w.watched[ns] = wa
		}
		for _, i := range wa.informers {
			syncs = append(syncs, func() bool { return i.absent.Load() || i.inf.HasSynced() })
		}
	}
	w.mu.Unlock()

	// Waiting holds no lock: event handlers run meanwhile.
	if !cache.WaitForCacheSync(ctx.Done(), syncs...) {
		w.mu.Lock()
		unused := w.unwatchUnused()
		w.mu.Unlock()
		stopAll(unused)
		return fmt.Errorf("objectives: the inferenceobjectives of namespaces %v were not listed: %w "+
			"(can pdx get, list and watch them?)", namespaces(targets), context.Cause(ctx))
	}

	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return ErrClosed
	}
	w.targets = w.targets[:0:0]
	for _, t := range targets {
		w.targets = append(w.targets, &target{Target: t})
	}
	for _, t := range w.targets {
		w.update(t)
	}
	unused := w.unwatchUnused()
	w.mu.Unlock()
	stopAll(unused)
	return nil
}

// unwatchUnused takes the namespaces no target is in out of w.watched and
// returns them, to be stopped outside w.mu: stopping waits for event
// handlers, which take it. w.mu is held.
func (w *Watcher) unwatchUnused() []*watch {
	var unused []*watch
	for ns, wa := range w.watched {
		if !slices.ContainsFunc(w.targets, func(t *target) bool { return t.Spec.GetNamespace() == ns }) {
			unused = append(unused, wa)
			delete(w.watched, ns)
		}
	}
	return unused
}

func stopAll(ws []*watch) {
	for _, wa := range ws {
		wa.cancel()
		wa.done.Wait()
	}
}

// Close stops every informer and waits for their goroutines. Targets get no
// more updates.
func (w *Watcher) Close() {
	w.mu.Lock()
	w.closed = true
	w.targets = nil
	watched := w.watched
	w.watched = map[string]*watch{}
	w.mu.Unlock()
	stopAll(slices.Collect(maps.Values(watched)))
}

// watch starts the informers of namespace ns.
func (w *Watcher) watch(ns string) (*watch, error) {
	ctx, cancel := context.WithCancel(context.Background())
	wa := &watch{cancel: cancel}
	for _, res := range Resources {
		i := &informer{
			resource: res,
			inf:      dynamicinformer.NewFilteredDynamicInformer(w.client, res, ns, 0, cache.Indexers{}, nil).Informer(),
		}
		err := i.inf.SetWatchErrorHandlerWithContext(func(ctx context.Context, r *cache.Reflector, err error) {
			if apierrors.IsNotFound(err) {
				i.absent.Store(true)
			}
			cache.DefaultWatchErrorHandler(ctx, r, err)
		})
		if err == nil {
			_, err = i.inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
				AddFunc:    func(obj any) { w.handle(res, "add", obj) },
				UpdateFunc: func(_, obj any) { w.handle(res, "update", obj) },
				DeleteFunc: func(obj any) { w.handle(res, "delete", obj) },
			})
		}
		if err != nil {
			cancel()
			return nil, fmt.Errorf("objectives: %w", err)
		}
		wa.informers = append(wa.informers, i)
	}
	for _, i := range wa.informers {
		wa.done.Go(func() { i.inf.RunWithContext(ctx) })
	}
	return wa, nil
}

// handle recomputes the targets in the namespace of an event's object. The
// informer has stored the change before it calls the handler.
func (w *Watcher) handle(res schema.GroupVersionResource, op string, obj any) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	ev := Event{Resource: res, Op: op}
	if m, ok := obj.(metav1.Object); ok {
		ev.Namespace, ev.Name = m.GetNamespace(), m.GetName()
	}
	w.mu.Lock()
	if op == "delete" {
		delete(w.malformed, objectKey{res.Group, ev.Namespace, ev.Name})
	}
	for _, t := range w.targets {
		if t.Spec.GetNamespace() == ev.Namespace {
			w.update(t)
		}
	}
	w.mu.Unlock()
	if w.onDone != nil {
		w.onDone(ev)
	}
}

// update computes t's objectives and hands them over if they changed. w.mu
// is held.
func (w *Watcher) update(t *target) {
	wa := w.watched[t.Spec.GetNamespace()]
	if wa == nil {
		return
	}
	m := map[string]int{}
	for _, i := range wa.informers {
		for _, obj := range i.inf.GetStore().List() {
			u, ok := obj.(*unstructured.Unstructured)
			if !ok {
				continue
			}
			spec, _ := u.Object["spec"].(map[string]any)
			if !refersTo(spec, t.Spec.GetPool()) {
				continue
			}
			m[u.GetName()] = w.priority(i.resource, u, spec)
		}
	}
	if t.pushed && maps.Equal(m, t.last) {
		return
	}
	t.last, t.pushed = m, true
	t.Set(maps.Clone(m)) // the target owns its map; t.last stays ours
	w.log.Info("pool objectives discovered", slog.String("pool", t.Pool), slog.Any("objectives", m))
}

// refersTo reports whether an InferenceObjective's spec targets the
// InferencePool named pool: by spec.poolRef, or by an entry of
// spec.poolRefs (llm-d's v1alpha2 carries both). spec.poolSelector selects
// pools by their labels, which pdx does not read: such objects are not
// matched.
func refersTo(spec map[string]any, pool string) bool {
	if ref, ok := spec["poolRef"].(map[string]any); ok && refIs(ref, pool) {
		return true
	}
	refs, _ := spec["poolRefs"].([]any)
	return slices.ContainsFunc(refs, func(r any) bool {
		ref, ok := r.(map[string]any)
		return ok && refIs(ref, pool)
	})
}

// refIs reports whether a PoolObjectReference names pool; its kind
// defaults to InferencePool, and its group is not compared: llm-d and the
// inference extension default it differently for the same pools.
func refIs(ref map[string]any, pool string) bool {
	name, _ := ref["name"].(string)
	kind, _ := ref["kind"].(string)
	return name == pool && (kind == "" || kind == "InferencePool")
}

// priority is an object's spec.priority: 0 when unset, and when not an
// integer of 32 bits (logged once per bad value). w.mu is held.
func (w *Watcher) priority(res schema.GroupVersionResource, u *unstructured.Unstructured, spec map[string]any) int {
	key := objectKey{res.Group, u.GetNamespace(), u.GetName()}
	v, ok := spec["priority"]
	if !ok || v == nil {
		delete(w.malformed, key)
		return 0
	}
	if p, ok := asInt32(v); ok {
		delete(w.malformed, key)
		return p
	}
	bad := fmt.Sprintf("%v", v)
	if w.malformed[key] != bad {
		w.malformed[key] = bad
		w.log.Warn("InferenceObjective: spec.priority is not an integer, using 0",
			slog.String("resource", res.GroupResource().String()), slog.String("namespace", key.namespace),
			slog.String("name", key.name), slog.String("priority", bad))
	}
	return 0
}

// asInt32 reads a JSON number as an int32: the API's type for priorities.
func asInt32(v any) (int, bool) {
	var n int64
	switch x := v.(type) {
	case int64:
		n = x
	case int32:
		n = int64(x)
	case int:
		n = int64(x)
	case float64: // a client that sent 3.0
		if x != math.Trunc(x) || math.IsInf(x, 0) || x < math.MinInt32 || x > math.MaxInt32 {
			return 0, false
		}
		n = int64(x)
	default:
		return 0, false
	}
	if n < math.MinInt32 || n > math.MaxInt32 {
		return 0, false
	}
	return int(n), true
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
