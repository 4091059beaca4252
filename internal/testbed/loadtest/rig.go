package loadtest

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/envoyproc"
	"github.com/pdx-router/pdx/internal/testbed/logbuf"
	"github.com/pdx-router/pdx/internal/testbed/loopback"
	"github.com/pdx-router/pdx/internal/testbed/vllmrouter"
)

// Models of the pdx config the rig runs: one pool per way of serving.
const (
	modelPD  = "bench-pd"  // connector nixl: prefill, then decode
	modelAgg = "bench-agg" // connector none: decode only, no prefill
)

// rig is one deployment under load: simulated engines in this process, pdx,
// three Envoys and the peer routers as processes of their own, so that each
// one's CPU and memory can be read apart.
type rig struct {
	prefill, decode []*enginesim.Server
	pdx             *pdxProcess
	envoy           *envoyproc.Process // with ext_proc, to pdx
	duplex          *envoyproc.Process // the same in FULL_DUPLEX_STREAMED body mode
	floor           *envoyproc.Process // without: the client names the engine
	// peers are the vllm-routers of the peer scenarios, on the same
	// engines; none unless rigOptions.peers.
	peers map[Scenario]*vllmrouter.Process
}

type rigOptions struct {
	pdxBin, envoyBin string
	engine           enginesim.Config // latencies
	prefill, decode  int
	prefillTimeout   time.Duration
	observer         bool
	peers            bool // start the vllm-routers
}

func startRig(ctx context.Context, o rigOptions) (_ *rig, err error) {
	r := &rig{}
	defer func() {
		if err != nil {
			r.close()
		}
	}()
	eng := o.engine
	eng.Connector = "nixl"
	eng.TallyOnly = true
	for range o.prefill {
		c := eng
		c.Role = enginesim.RolePrefill
		s, err := enginesim.Start(ctx, "127.0.0.1:0", c)
		if err != nil {
			return nil, err
		}
		r.prefill = append(r.prefill, s)
	}
	for range o.decode {
		c := eng
		c.Role = enginesim.RoleDecode
		s, err := enginesim.Start(ctx, "127.0.0.1:0", c)
		if err != nil {
			return nil, err
		}
		r.decode = append(r.decode, s)
	}
	// pdx, a child process, listens on ports found free; one can be taken
	// before pdx binds it, and then other ports are tried.
	for attempt := 1; ; attempt++ {
		addrs, err := loopback.FreeAddrs(3)
		if err != nil {
			return nil, err
		}
		r.pdx, err = startPdx(ctx, o.pdxBin, r.pdxConfig(addrs[0], addrs[1], o.prefillTimeout), addrs[2])
		if err == nil {
			break
		}
		if !strings.Contains(err.Error(), "address already in use") || attempt == 3 {
			return nil, err
		}
	}
	ecfg := envoy.Config{
		PdxAddress:       r.pdx.grpcAddr,
		MessageTimeout:   o.prefillTimeout + 5*time.Second,
		BufferLimitBytes: maxBody + envoy.BufferHeadroom/2,
		Observer:         o.observer,
	}
	if r.envoy, err = envoyproc.Start(ctx, o.envoyBin, ecfg, nil); err != nil {
		return nil, fmt.Errorf("envoy: %w", err)
	}
	dcfg := ecfg
	dcfg.RequestBodyMode = envoy.BodyFullDuplexStreamed
	if r.duplex, err = envoyproc.Start(ctx, o.envoyBin, dcfg, nil); err != nil {
		return nil, fmt.Errorf("full-duplex envoy: %w", err)
	}
	ecfg.WithoutExtProc = true
	if r.floor, err = envoyproc.Start(ctx, o.envoyBin, ecfg, nil); err != nil {
		return nil, fmt.Errorf("floor envoy: %w", err)
	}
	if o.peers {
		if err := r.startPeers(ctx); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// startPeers starts a vllm-router per peer scenario.
func (r *rig) startPeers(ctx context.Context) error {
	r.peers = map[Scenario]*vllmrouter.Process{}
	for _, sc := range Scenarios {
		if !sc.Peer() {
			continue
		}
		p, err := vllmrouter.Start(ctx, vllmrouter.Options{Prefill: vllmrouter.EngineURLs(r.prefill), Decode: vllmrouter.EngineURLs(r.decode), Policy: peerPolicy[sc]})
		if err != nil {
			return fmt.Errorf("%s: %w", sc, err)
		}
		r.peers[sc] = p
	}
	return nil
}

// servers are the processes that serve sc's requests (0: none), whose CPU
// and memory are the scenario's.
func (r *rig) servers(sc Scenario) (pdx, envoy, peer int) {
	switch sc {
	case Floor, FloorAtPdxRate:
		return 0, r.floor.Pid(), 0
	case NoPrefillDuplex:
		return r.pdx.pid(), r.duplex.Pid(), 0
	case PeerRoundRobin, PeerCacheAware:
		return 0, 0, r.peers[sc].Pid()
	default:
		return r.pdx.pid(), r.envoy.Pid(), 0
	}
}

// maxBody is pdx's max_body_bytes in the rig: above every body measured.
const maxBody = 16 << 20

func (r *rig) pdxConfig(grpcAddr, adminAddr string, prefillTimeout time.Duration) string {
	var b strings.Builder
	fmt.Fprintf(&b, "grpc_address: %s\nadmin_address: %s\nmax_body_bytes: %d\npools:\n", grpcAddr, adminAddr, maxBody)
	fmt.Fprintf(&b, "- name: pd\n  models: [%s]\n  connector: nixl\n  prefill_timeout: %s\n  prefill_attempt_timeout: %s\n  prefill:\n",
		modelPD, prefillTimeout, prefillTimeout)
	for _, p := range r.prefill {
		fmt.Fprintf(&b, "  - address: %s\n", p.Addr())
	}
	b.WriteString("  decode:\n")
	for _, d := range r.decode {
		fmt.Fprintf(&b, "  - address: %s\n", d.Addr())
	}
	fmt.Fprintf(&b, "- name: agg\n  models: [%s]\n  connector: none\n  decode:\n", modelAgg)
	for _, d := range r.decode {
		fmt.Fprintf(&b, "  - address: %s\n", d.Addr())
	}
	return b.String()
}

// tally sums the engines' counts.
func (r *rig) tally() enginesim.Tally {
	var t enginesim.Tally
	for _, s := range append(append([]*enginesim.Server(nil), r.prefill...), r.decode...) {
		x := s.Tally()
		t.Prefill += x.Prefill
		t.Decode += x.Decode
		t.Plain += x.Plain
		t.KVPull += x.KVPull
		t.KVPush += x.KVPush
		t.Pulled += x.Pulled
		t.Rejected += x.Rejected
		t.LongPrefill += x.LongPrefill
		t.StreamedPrefill += x.StreamedPrefill
	}
	return t
}

func (r *rig) close() error {
	var errs []error
	for _, e := range []*envoyproc.Process{r.envoy, r.duplex, r.floor} {
		if e != nil {
			errs = append(errs, e.Stop())
		}
	}
	for _, p := range r.peers {
		errs = append(errs, p.Stop())
	}
	if r.pdx != nil {
		errs = append(errs, r.pdx.stop())
	}
	for _, s := range append(r.prefill, r.decode...) {
		errs = append(errs, s.Close())
	}
	return errors.Join(errs...)
}

// pdxProcess is `pdx serve` run as a child process.
type pdxProcess struct {
	cmd                          *exec.Cmd
	dir                          string
	log                          *logbuf.Buffer
	grpcAddr, adminAddr, pprofAt string
	done                         chan struct{}
}

func startPdx(ctx context.Context, bin, config, pprofAddr string) (*pdxProcess, error) {
	dir, err := os.MkdirTemp("", "pdx-bench-")
	if err != nil {
		return nil, err
	}
	path := filepath.Join(dir, "pdx.yaml")
	if err := os.WriteFile(path, []byte(config), 0o600); err != nil {
		return nil, err
	}
	p := &pdxProcess{dir: dir, log: &logbuf.Buffer{}, pprofAt: pprofAddr, done: make(chan struct{})}
	for line := range strings.Lines(config) {
		if v, ok := strings.CutPrefix(line, "grpc_address: "); ok {
			p.grpcAddr = strings.TrimSpace(v)
		}
		if v, ok := strings.CutPrefix(line, "admin_address: "); ok {
			p.adminAddr = strings.TrimSpace(v)
		}
	}
	p.cmd = exec.Command(bin, "serve", "--config", path, "--log-level", "warn", "--pprof-address", p.pprofAt, "--drain-timeout", "5s")
	p.cmd.Stdout, p.cmd.Stderr = p.log, p.log
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := p.cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("starting pdx %s: %w", bin, err)
	}
	go func() {
		_ = p.cmd.Wait()
		close(p.done)
	}()
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := debugClient.Get("http://" + p.adminAddr + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return p, nil
			}
		}
		select {
		case <-p.done:
			return nil, fmt.Errorf("pdx exited at start:\n%s", p.log.String())
		case <-ctx.Done():
			p.stop()
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			p.stop()
			return nil, fmt.Errorf("pdx not ready after 20s:\n%s", p.log.String())
		}
	}
}

func (p *pdxProcess) pid() int { return p.cmd.Process.Pid }

func (p *pdxProcess) stop() error {
	defer os.RemoveAll(p.dir)
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
	return nil
}
