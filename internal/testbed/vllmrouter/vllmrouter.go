// Package vllmrouter runs vLLM's own router (vllm-router, from the Python
// package index) in P/D mode over simulated engines, as the peer pdx's
// benchmarks measure against. The Makefile installs the pinned version into
// .tools/vllm-router; the router is a Rust library in one Python process, so
// that process's CPU is the router's.
package vllmrouter

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/logbuf"
	"github.com/pdx-router/pdx/internal/testbed/loopback"
)

// Version is the vllm-router the Makefile installs (VLLM_ROUTER_VERSION).
const Version = "0.1.17"

// DirEnv names the directory holding the vllm_router package (a pip
// --target install); the default is the repository's .tools/vllm-router.
const DirEnv = "VLLM_ROUTER_DIR"

// toolsDir is the default install, relative to the repository root.
const toolsDir = ".tools/vllm-router"

// ErrNotInstalled is returned when no vllm-router install is found.
var ErrNotInstalled = errors.New("vllm-router not found: run `make vllm-router` (installs vllm-router==" + Version + " into .tools/vllm-router) or set " + DirEnv)

// Dir finds the install: $VLLM_ROUTER_DIR, else .tools/vllm-router of the
// repository around the working directory.
func Dir() (string, error) {
	if dir := os.Getenv(DirEnv); dir != "" {
		if _, err := os.Stat(filepath.Join(dir, "vllm_router")); err != nil {
			return "", fmt.Errorf("%s=%s holds no vllm_router: %w", DirEnv, dir, ErrNotInstalled)
		}
		return dir, nil
	}
	wd, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for dir := wd; ; dir = filepath.Dir(dir) {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			d := filepath.Join(dir, toolsDir)
			if _, err := os.Stat(filepath.Join(d, "vllm_router")); err == nil {
				return d, nil
			}
			return "", ErrNotInstalled
		}
		if filepath.Dir(dir) == dir {
			return "", ErrNotInstalled
		}
	}
}

var versionLine = regexp.MustCompile(`__version__\s*=\s*["']([^"']+)["']`)

// InstalledVersion reads the version of the install in dir.
func InstalledVersion(dir string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dir, "vllm_router", "version.py"))
	if err != nil {
		return "", err
	}
	m := versionLine.FindSubmatch(b)
	if m == nil {
		return "", fmt.Errorf("no __version__ in %s", filepath.Join(dir, "vllm_router", "version.py"))
	}
	return string(m[1]), nil
}

// Options is one router: its engines (http://host:port) and policy.
type Options struct {
	// Dir is the install (default: Dir()).
	Dir string
	// Python runs the launcher (default python3).
	Python          string
	Prefill, Decode []string
	// Policy is vllm-router's --policy for both legs: round_robin,
	// cache_aware, power_of_two, ...
	Policy string
	// KVEvents maps a prefill engine's URL to the ZMQ endpoint it
	// publishes vLLM's KV events on (--pd-kv-events URL=ENDPOINT), for the
	// kv_aware policy: its prefill choice then scores each engine by the
	// request's prompt blocks that engine's events say it caches. It gets
	// the prompt's token ids from the engine's /v1/*/render routes, and
	// trusts an engine's events only for requests naming the model the
	// engine serves (GET /v1/models; other models route by load,
	// fallback "unverified_model"). vllm-router reads these sources with a
	// block size of 16.
	KVEvents map[string]string
	// Args are more flags, after the ones Start sets.
	Args []string
}

// EngineURLs are the simulators' base URLs, as Options.Prefill and Decode
// take them.
func EngineURLs(ss []*enginesim.Server) []string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = "http://" + s.Addr()
	}
	return out
}

// Process is a running vllm-router.
type Process struct {
	cmd     *exec.Cmd
	log     *logbuf.Buffer
	done    chan struct{}
	addr    string
	metrics string // host:port of its Prometheus endpoint
	version string
}

// Start runs vllm-router in NIXL P/D mode on a free loopback port and
// returns once it answers /readiness (all engines healthy).
func Start(ctx context.Context, o Options) (*Process, error) {
	if len(o.Prefill) == 0 || len(o.Decode) == 0 {
		return nil, errors.New("vllmrouter: at least one prefill and one decode engine")
	}
	if o.Dir == "" {
		var err error
		if o.Dir, err = Dir(); err != nil {
			return nil, err
		}
	}
	if o.Python == "" {
		o.Python = "python3"
	}
	if o.Policy == "" {
		o.Policy = "cache_aware" // vllm-router's default
	}
	version, err := InstalledVersion(o.Dir)
	if err != nil {
		return nil, err
	}
	// A port found free can be taken (by another test's connection) before
	// the router binds it; it then exits, and another pair of ports is
	// tried.
	for attempt := 1; ; attempt++ {
		p, err := start(ctx, o, version)
		if err == nil || !errors.Is(err, errPortTaken) || attempt == 3 {
			return p, err
		}
	}
}

var errPortTaken = errors.New("a port it was given was taken")

func start(ctx context.Context, o Options, version string) (*Process, error) {
	addrs, err := loopback.FreeAddrs(2)
	if err != nil {
		return nil, err
	}
	host, port := splitAddr(addrs[0])
	_, promPort := splitAddr(addrs[1])
	args := []string{"-m", "vllm_router.launch_router",
		"--host", host, "--port", port,
		// Its default Prometheus port (29000) is fixed: two routers would
		// collide.
		"--prometheus-host", host, "--prometheus-port", promPort,
		"--vllm-pd-disaggregation", "--kv-connector", "nixl",
		"--policy", o.Policy,
		"--log-level", "warning",
	}
	for _, u := range o.Prefill {
		args = append(args, "--prefill", u)
	}
	for _, u := range o.Decode {
		args = append(args, "--decode", u)
	}
	for _, u := range slices.Sorted(maps.Keys(o.KVEvents)) {
		args = append(args, "--pd-kv-events", u+"="+o.KVEvents[u])
	}
	args = append(args, o.Args...)

	p := &Process{log: &logbuf.Buffer{}, done: make(chan struct{}), addr: addrs[0], metrics: addrs[1], version: version}
	p.cmd = exec.Command(o.Python, args...)
	p.cmd.Env = append(os.Environ(), "PYTHONPATH="+o.Dir, "PYTHONDONTWRITEBYTECODE=1", "NO_COLOR=1")
	p.cmd.Stdout, p.cmd.Stderr = p.log, p.log
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting vllm-router: %w", err)
	}
	go func() {
		_ = p.cmd.Wait()
		close(p.done)
	}()
	if err := p.waitReady(ctx); err != nil {
		_ = p.Stop()
		log := p.log.String()
		if strings.Contains(log, "Address already in use") {
			err = fmt.Errorf("%w: %w", err, errPortTaken)
		}
		return nil, fmt.Errorf("vllm-router: %w\nits log:\n%s", err, tail(log, 40))
	}
	return p, nil
}

func splitAddr(addr string) (host, port string) {
	i := strings.LastIndexByte(addr, ':')
	return addr[:i], addr[i+1:]
}

// waitReady polls /readiness, which answers 200 once the router has
// checked its engines.
func (p *Process) waitReady(ctx context.Context) error {
	client := &http.Client{Timeout: time.Second}
	defer client.CloseIdleConnections()
	deadline := time.Now().Add(60 * time.Second)
	for {
		resp, err := client.Get(p.URL() + "/readiness")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-p.done:
			return errors.New("exited before it was ready")
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return errors.New("not ready after 60s")
		}
	}
}

// URL is where clients send requests.
func (p *Process) URL() string { return "http://" + p.addr }

// MetricsURL is the router's Prometheus endpoint (--prometheus-port).
func (p *Process) MetricsURL() string { return "http://" + p.metrics + "/metrics" }

// Metrics scrapes the router's Prometheus endpoint: each sample's value by
// its name and labels as printed, e.g.
// `vllm_router_kv_placement_lookups_total{result="hit"}`.
func (p *Process) Metrics() (map[string]float64, error) {
	client := &http.Client{Timeout: 5 * time.Second}
	defer client.CloseIdleConnections()
	resp, err := client.Get(p.MetricsURL())
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("vllm-router metrics: status %d", resp.StatusCode)
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	out := map[string]float64{}
	for line := range strings.SplitSeq(string(b), "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			return nil, fmt.Errorf("vllm-router metrics: not a sample: %q", line)
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			return nil, fmt.Errorf("vllm-router metrics: %q: %w", line, err)
		}
		out[line[:i]] = v
	}
	return out, nil
}

// Pid is the router's process: its CPU is the router's.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Version is the running vllm-router's version.
func (p *Process) Version() string { return p.version }

// Log is what the router printed.
func (p *Process) Log() string { return p.log.String() }

// Stop ends the router: SIGTERM, then SIGKILL after 5 s.
func (p *Process) Stop() error {
	select {
	case <-p.done:
		return nil
	default:
	}
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.done
	}
	return nil
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
