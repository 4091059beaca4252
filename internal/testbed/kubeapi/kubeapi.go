// Package kubeapi runs a real Kubernetes API server on a real etcd, on
// loopback ports, for the tests of the packages that watch a cluster
// (discovery, objectives, reload, the manifests and the chart). `make kube`
// builds both binaries into the tool folder (mk/kube.mk).
//
// It runs no controllers, scheduler or kubelet: pods stay Pending until a
// test writes their status through the status subresource, nothing writes
// EndpointSlices but the tests, and deleted namespaces stay Terminating, so
// each test works in a namespace of its own (Server.Namespace) on the one
// server its package shares (Package).
package kubeapi

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"

	"k8s.io/client-go/rest"

	"github.com/pdx-router/pdx/internal/testbed/logbuf"
	"github.com/pdx-router/pdx/internal/testbed/loopback"
)

// DirEnv names the environment variable that overrides the folder holding
// kube-apiserver and etcd; the Makefile sets it to its KUBE_DIR.
const DirEnv = "KUBE_DIR"

// toolsDir is where `make kube` builds them, relative to the module root.
const toolsDir = ".tools/kube"

// Binaries are the programs Dir must hold.
var Binaries = []string{"kube-apiserver", "etcd"}

// Dir finds the folder holding kube-apiserver and etcd: $KUBE_DIR, else the
// module's .tools/kube (searched from the working directory up). Its error
// says how to get them.
func Dir() (string, error) {
	dir := os.Getenv(DirEnv)
	if dir == "" {
		root, err := moduleRoot()
		if err != nil {
			return "", err
		}
		dir = filepath.Join(root, toolsDir)
	}
	for _, b := range Binaries {
		if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
			return "", fmt.Errorf("no %s in %s: run `make kube` (it builds kube-apiserver and etcd into the tool folder) or set %s: %w",
				b, dir, DirEnv, err)
		}
	}
	return dir, nil
}

func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod above the working directory to find .tools/kube in: set " + DirEnv)
		}
		dir = parent
	}
}

// Server is a running etcd and kube-apiserver.
type Server struct {
	dir             string
	etcd, apiserver *process
	host            string
	token           string
	transport       *http.Transport
}

// process is a child process and its output.
type process struct {
	name    string
	cmd     *exec.Cmd
	log     *logbuf.Buffer
	done    chan struct{}
	waitErr error
}

// Start runs etcd and kube-apiserver from Dir and returns once the API
// server is ready (/readyz, which includes its etcd). Stop ends both.
func Start(ctx context.Context) (*Server, error) {
	bin, err := Dir()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "pdx-kubeapi-")
	if err != nil {
		return nil, err
	}
	s := &Server{dir: dir}
	if err := s.start(ctx, bin); err != nil {
		s.Stop()
		return nil, err
	}
	return s, nil
}

func (s *Server) start(ctx context.Context, bin string) error {
	addrs, err := loopback.FreeAddrs(3)
	if err != nil {
		return err
	}
	etcdURL, peerURL, apiAddr := "http://"+addrs[0], "http://"+addrs[1], addrs[2]

	// The admin's bearer token (system:masters: every right, and the
	// right to impersonate the users tests act as), and the key that signs
	// service account tokens, which the API server requires.
	s.token = randomHex()
	tokens := filepath.Join(s.dir, "tokens.csv")
	if err := os.WriteFile(tokens, []byte(s.token+`,admin,admin,"system:masters"`+"\n"), 0o600); err != nil {
		return err
	}
	saKey := filepath.Join(s.dir, "sa.key")
	if err := writeKey(saKey); err != nil {
		return err
	}

	s.etcd, err = run("etcd", filepath.Join(bin, "etcd"),
		"--name", "default",
		"--data-dir", filepath.Join(s.dir, "etcd"),
		"--listen-client-urls", etcdURL, "--advertise-client-urls", etcdURL,
		"--listen-peer-urls", peerURL, "--initial-advertise-peer-urls", peerURL,
		"--initial-cluster", "default="+peerURL,
		// The data is thrown away with the server.
		"--unsafe-no-fsync",
		"--log-level", "warn",
	)
	if err != nil {
		return err
	}
	host, port, _ := strings.Cut(apiAddr, ":")
	certs := filepath.Join(s.dir, "certs")
	s.apiserver, err = run("kube-apiserver", filepath.Join(bin, "kube-apiserver"),
		"--etcd-servers", etcdURL,
		"--bind-address", host, "--advertise-address", host, "--secure-port", port,
		// A self-signed serving certificate, generated here.
		"--cert-dir", certs,
		"--token-auth-file", tokens,
		"--authorization-mode", "RBAC",
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--service-account-key-file", saKey, "--service-account-signing-key-file", saKey,
		"--service-cluster-ip-range", "10.96.0.0/24",
		// No controller manager creates namespaces' default ServiceAccount.
		"--disable-admission-plugins", "ServiceAccount",
		// A loopback address may not be an Endpoints address.
		"--endpoint-reconciler-type", "none",
	)
	if err != nil {
		return err
	}
	s.host = "https://" + apiAddr
	return s.waitReady(ctx, filepath.Join(certs, "apiserver.crt"))
}

// waitReady waits for the serving certificate, builds the clients'
// transport on it, and waits until /readyz answers ok.
func (s *Server) waitReady(ctx context.Context, certFile string) error {
	ctx, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	var last error
	for {
		select {
		case <-s.etcd.done:
			return fmt.Errorf("etcd exited: %v\n%s", s.etcd.waitErr, s.Log())
		case <-s.apiserver.done:
			return fmt.Errorf("kube-apiserver exited: %v\n%s", s.apiserver.waitErr, s.Log())
		case <-ctx.Done():
			return fmt.Errorf("kube-apiserver not ready (%v): %w\n%s", last, context.Cause(ctx), s.Log())
		case <-tick.C:
		}
		if s.transport == nil {
			pemCerts, err := os.ReadFile(certFile)
			if err != nil {
				last = err
				continue
			}
			roots := x509.NewCertPool()
			if !roots.AppendCertsFromPEM(pemCerts) {
				last = fmt.Errorf("%s: no certificate yet", certFile)
				continue
			}
			s.transport = &http.Transport{
				TLSClientConfig:   &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12},
				ForceAttemptHTTP2: true,
				// Watches stream for as long as a test runs.
				IdleConnTimeout: 90 * time.Second,
			}
		}
		if last = s.ready(ctx); last == nil {
			return nil
		}
	}
}

func (s *Server) ready(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.host+"/readyz", nil)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+s.token)
	resp, err := s.transport.RoundTrip(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("/readyz: %s: %s", resp.Status, body)
	}
	return nil
}

// Config is a client config of the cluster's admin. Each call returns a
// new copy, which the caller may change.
func (s *Server) Config() *rest.Config {
	return &rest.Config{
		Host:        s.host,
		BearerToken: s.token,
		Transport:   s.transport,
		UserAgent:   "pdx-test",
		// A test's bursts are not throttled on the client side.
		QPS: 1000, Burst: 1000,
	}
}

// ConfigAs is a client config that acts as user in groups (impersonated by
// the admin): what the user may do is what RBAC grants them, as for pdx's
// ServiceAccount in a cluster.
func (s *Server) ConfigAs(user string, groups ...string) *rest.Config {
	cfg := s.Config()
	cfg.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: groups}
	return cfg
}

// Pids are the process ids of kube-apiserver and etcd.
func (s *Server) Pids() []int {
	return []int{s.apiserver.cmd.Process.Pid, s.etcd.cmd.Process.Pid}
}

// Log returns what etcd and kube-apiserver have printed.
func (s *Server) Log() string {
	var b strings.Builder
	for _, p := range []*process{s.etcd, s.apiserver} {
		if p != nil {
			fmt.Fprintf(&b, "--- %s:\n%s", p.name, tail(p.log.String(), 40))
		}
	}
	return b.String()
}

// Stop ends the API server, then etcd, and removes their files. The
// clients' connections are closed.
func (s *Server) Stop() {
	if s.transport != nil {
		s.transport.CloseIdleConnections()
	}
	for _, p := range []*process{s.apiserver, s.etcd} {
		if p != nil {
			p.stop()
		}
	}
	os.RemoveAll(s.dir)
}

func run(name, path string, args ...string) (*process, error) {
	p := &process{name: name, cmd: exec.Command(path, args...), log: &logbuf.Buffer{}, done: make(chan struct{})}
	p.cmd.Stdout, p.cmd.Stderr = p.log, p.log
	p.cmd.SysProcAttr = procAttr()
	started := make(chan error)
	go func() {
		// Linux kills the child (Pdeathsig) when the thread that started
		// it ends, not the process: keep the thread until the child exits.
		runtime.LockOSThread()
		if err := p.cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		p.waitErr = p.cmd.Wait()
		close(p.done)
	}()
	if err := <-started; err != nil {
		return nil, fmt.Errorf("starting %s: %w", path, err)
	}
	return p, nil
}

func (p *process) stop() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(15 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

func randomHex() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// writeKey writes a new RSA private key, PEM-encoded, to path.
func writeKey(path string) error {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600)
}

func tail(s string, lines int) string {
	parts := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(parts) > lines {
		parts = parts[len(parts)-lines:]
	}
	return strings.Join(parts, "\n") + "\n"
}
