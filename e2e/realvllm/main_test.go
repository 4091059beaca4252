// Package realvllm is pdx's real-engine tier: real vLLM engines (the CPU
// build `make vllm` installs, serving the tiny model it makes) behind the
// real Envoy and pdx. What the simulator-based tiers take from vLLM's
// source, these tests take from vLLM itself.
//
// Engines take one to several minutes to start on a small machine, so the
// package starts them once, on first use, and its tests share them: three
// NIXL engines (two prefill, one decode) for most tests, then two engines
// of vLLM's ExampleConnector (shared storage) for the `http` connector;
// never more than three at once. Tests run one after another (none is
// parallel): they read the engines' counters before and after what they
// send.
package realvllm

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/loopback"
	"github.com/pdx-router/pdx/internal/testbed/realvllm"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

var engines fleet

func TestMain(m *testing.M) {
	code := m.Run()
	engines.stop()
	os.Exit(code)
}

// fleet is the engines the tests share, started on first use. Starting one
// set stops the other, so that at most three engines run at once.
type fleet struct {
	mu        sync.Mutex
	installMu sync.Mutex
	in        realvllm.Install
	nixl      *nixlSet
	storage   *storageSet
	// nixlErr and storageErr are a set's start error, kept so that every
	// later test fails at once with it rather than starting the set again.
	nixlErr, storageErr error
}

// nixlSet: prefill-0 and prefill-1 are NIXL producers, decode-0 a NIXL
// consumer; each binds a KV event publisher and a replay socket (pdx's
// kv_events mode dial) and serves the development routes (POST
// /reset_prefix_cache). The prefill engines serve the render API
// (--enable-scale-out) and LoRA adapters (one at a time); decode-0 does
// neither: `vllm serve` renders nothing by default, and on vLLM 0.32's CPU
// build a NIXL consumer started with --enable-lora loses its worker
// process at its first KV pull (it dies after "Transfer plan", no
// traceback), so the LoRA tests use the prefill engines as aggregated
// engines (connector none).
type nixlSet struct {
	prefill []*realvllm.Engine
	decode  *realvllm.Engine
	// stack is Envoy and pdx over all three (options("")).
	stack *stack.Stack
}

// storageSet: two engines of vLLM's ExampleConnector sharing a directory,
// each dialing pdx's KV event socket (kv_events mode bind).
type storageSet struct {
	prefill, decode *realvllm.Engine
	dir             string
	kvBind          string
}

// startTimeout bounds the start of an engine set: 60–170 s on a quiet
// 2-core machine, much more while other work shares it.
const startTimeout = 20 * time.Minute

func (f *fleet) install(t *testing.T) realvllm.Install {
	t.Helper()
	f.installMu.Lock()
	defer f.installMu.Unlock()
	if f.in.Python == "" {
		in, err := realvllm.Find()
		require.NoError(t, err)
		f.in = in
	}
	return f.in
}

// nixlEngines returns the NIXL set, starting it if needed.
func (f *fleet) nixlEngines(t *testing.T) *nixlSet {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	require.NoError(t, f.nixlErr, "the NIXL engines failed to start in an earlier test")
	if f.nixl != nil {
		return f.nixl
	}
	in := f.install(t)
	f.stopStorage()
	cfg := func(name, role string, prefill bool) realvllm.Config {
		return realvllm.Config{Name: name, Model: stack.Model, Connector: realvllm.ConnectorNixl, Role: role,
			KVEvents: &realvllm.KVEvents{Replay: true}, ScaleOut: prefill, LoRA: prefill, DevMode: true,
			StartTimeout: startTimeout}
	}
	start := time.Now()
	es, err := realvllm.StartAll(context.Background(), in,
		cfg("prefill-0", realvllm.RoleProducer, true),
		cfg("prefill-1", realvllm.RoleProducer, true),
		cfg("decode-0", realvllm.RoleConsumer, false))
	if err != nil {
		f.nixlErr = err
		require.NoError(t, err)
	}
	t.Logf("3 NIXL engines started in %v", time.Since(start).Round(time.Second))
	s := &nixlSet{prefill: es[:2], decode: es[2]}
	f.nixl = s
	st, err := stack.Start(context.Background(), s.options(""))
	if err != nil {
		f.nixlErr = err
		require.NoError(t, err)
	}
	s.stack = st
	return s
}

// storageEngines returns the ExampleConnector set, stopping the NIXL one.
func (f *fleet) storageEngines(t *testing.T) *storageSet {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	require.NoError(t, f.storageErr, "the storage engines failed to start in an earlier test")
	if f.storage != nil {
		return f.storage
	}
	in := f.install(t)
	f.stopNixl()
	dir, err := os.MkdirTemp("", "pdx-vllm-kv-")
	require.NoError(t, err)
	// The engines dial it for the minute they take to start, before pdx
	// listens there.
	addrs, err := loopback.ListenLaterAddrs(1)
	require.NoError(t, err)
	bind := "tcp://" + addrs[0]
	cfg := func(name string) realvllm.Config {
		return realvllm.Config{Name: name, Model: stack.Model, Connector: realvllm.ConnectorExample, SharedStorage: dir,
			KVEvents: &realvllm.KVEvents{Connect: bind, Topic: "kv@"}, ScaleOut: true, StartTimeout: startTimeout}
	}
	start := time.Now()
	es, err := realvllm.StartAll(context.Background(), in, cfg("storage-0"), cfg("storage-1"))
	if err != nil {
		os.RemoveAll(dir)
		f.storageErr = err
		require.NoError(t, err)
	}
	t.Logf("2 ExampleConnector engines started in %v", time.Since(start).Round(time.Second))
	f.storage = &storageSet{prefill: es[0], decode: es[1], dir: dir, kvBind: bind}
	return f.storage
}

func (f *fleet) stopNixl() {
	if s := f.nixl; s != nil {
		if s.stack != nil {
			s.stack.Close()
		}
		for _, e := range s.all() {
			e.Stop()
		}
		f.nixl = nil
	}
}

func (f *fleet) stopStorage() {
	if s := f.storage; s != nil {
		s.prefill.Stop()
		s.decode.Stop()
		os.RemoveAll(s.dir)
		f.storage = nil
	}
}

func (f *fleet) stop() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.stopNixl()
	f.stopStorage()
}

func (s *nixlSet) all() []*realvllm.Engine {
	return append(append([]*realvllm.Engine(nil), s.prefill...), s.decode)
}

// endpoint is what pdx's config says of an engine of the set.
func endpoint(e *realvllm.Engine) stack.Endpoint {
	return stack.Endpoint{Addr: e.Addr(), KVAddr: e.SideChannel(), KVEventsPort: e.KVEventsPort(), KVEventsReplayPort: e.KVEventsReplayPort()}
}

// options are a stack over decode-0 and prefill (default: both prefill
// engines) with pdx's KV events in mode dial, rendering prompts on the
// prefill engines in turn; poolYAML is added to the pool.
func (s *nixlSet) options(poolYAML string, prefill ...*realvllm.Engine) stack.Options {
	if prefill == nil {
		prefill = s.prefill
	}
	decode := endpoint(s.decode)
	decode.KVAddr = "" // a prefill's only
	ext := &stack.External{Decode: []stack.Endpoint{decode}, BlockSize: realvllm.BlockSize}
	for _, p := range prefill {
		ext.Prefill = append(ext.Prefill, endpoint(p))
	}
	if !strings.Contains(poolYAML, "render:") {
		// A render takes a few milliseconds on a quiet machine; pdx's
		// 100 ms default would place by the estimate on a busy one.
		poolYAML = "render: {timeout: 10s}\n" + poolYAML
	}
	return stack.Options{
		Connector: "nixl", External: ext, KVEvents: "dial",
		PrefillTimeout: 2 * time.Minute, LogLevel: slog.LevelDebug,
		// vLLM's /metrics is some 60 KB of text that takes it tens of
		// milliseconds: pdx's default of 20 scrapes a second an engine
		// would take a core of this machine.
		ConfigYAML: "engine_metrics: {interval: 500ms, stale_after: 5s}",
		PoolYAML:   poolYAML,
	}
}

// startStack runs Envoy and pdx over engines for one test; their logs and
// the engines' are printed only if it fails.
func startStack(t *testing.T, opts stack.Options, es ...*realvllm.Engine) *stack.Stack {
	t.Helper()
	st, err := stack.Start(context.Background(), opts)
	require.NoError(t, err)
	t.Cleanup(func() {
		if t.Failed() {
			t.Log(st.Logs())
		}
		assert.NoError(t, st.Close())
	})
	logOnFailure(t, es...)
	return st
}

// logOnFailure prints the tail of each engine's log if t fails, and
// writes the whole log to a file it names (vLLM's tracebacks run long).
func logOnFailure(t *testing.T, es ...*realvllm.Engine) {
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		for _, e := range es {
			path := filepath.Join(os.TempDir(), fmt.Sprintf("pdx-realvllm-%s-%s.log", strings.ReplaceAll(t.Name(), "/", "_"), e.Name()))
			if err := os.WriteFile(path, []byte(e.Log()), 0o644); err != nil {
				path = err.Error()
			}
			t.Logf("----- %s log (tail; all of it in %s) -----\n%s", e.Name(), path, tailLines(e.Log(), 120))
		}
	})
}

// sharedStack is the NIXL set's own stack, its logs printed if t fails.
func sharedStack(t *testing.T) (*nixlSet, *stack.Stack) {
	t.Helper()
	s := engines.nixlEngines(t)
	t.Cleanup(func() {
		if t.Failed() {
			t.Log(s.stack.Logs())
		}
	})
	logOnFailure(t, s.all()...)
	return s, s.stack
}

func tailLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
