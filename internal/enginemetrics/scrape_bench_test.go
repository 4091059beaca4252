//go:build unix

package enginemetrics

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// helperEnv makes TestHelperServe serve engines: "<count> <mode>".
const helperEnv = "PDX_ENGINEMETRICS_HELPER"

// TestHelperServe is not a test. BenchmarkScrape64Engines runs the test
// binary again with only it selected and helperEnv set, so that the engines'
// CPU is spent in another process than the scraper it measures. It serves
// testdata/vllm.txt on <count> loopback listeners, prints their addresses
// one a line, and stops when its stdin closes. Mode "filtered" answers
// name[] as prometheus_client does; "full" ignores it (what a multi-process
// registry amounts to, once the scraper has dropped the filter).
func TestHelperServe(t *testing.T) {
	spec := os.Getenv(helperEnv)
	if spec == "" {
		return // an ordinary test run: nothing to serve
	}
	var count int
	var mode string
	if _, err := fmt.Sscan(spec, &count, &mode); err != nil {
		t.Fatalf("%s=%q: %v", helperEnv, spec, err)
	}
	text := readTestdata(t, "vllm.txt")
	handler := serveText(text)
	if mode == "filtered" {
		handler = promClient(text, false)
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: time.Minute}
	for range count {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		go func() { _ = srv.Serve(l) }()
		if _, err := os.Stdout.WriteString(l.Addr().String() + "\n"); err != nil {
			t.Fatal(err)
		}
	}
	_, _ = io.Copy(io.Discard, os.Stdin)
	_ = srv.Close()
}

// startEngines runs TestHelperServe in a child process.
func startEngines(b *testing.B, count int, mode string) []string {
	b.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperServe$", "-test.bench=^$", "-test.count=1")
	cmd.Env = append(os.Environ(), helperEnv+"="+strconv.Itoa(count)+" "+mode)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		_ = stdin.Close()
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	lines := bufio.NewScanner(stdout)
	addrs := make([]string, 0, count)
	for len(addrs) < count && lines.Scan() {
		addrs = append(addrs, lines.Text())
	}
	if len(addrs) < count {
		b.Fatalf("helper served %d engines of %d: %v", len(addrs), count, lines.Err())
	}
	go func() { _, _ = io.Copy(io.Discard, stdout) }() // the child's test output
	return addrs
}

// cpuTime is the CPU (user+system) this process has used.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkScrape64Engines measures the goal "scraping 64 engines every
// 50 ms costs at most 5% of one core" (issue 23). The engines run in a
// child process; this process runs only Run, and its own CPU time
// (getrusage, user+sys) is measured. Every iteration is one 3 s window of
// scraping, after a 1 s warm-up in which connections are dialled;
// -benchtime=Nx runs N windows. %core is CPU time over wall time, in
// percent of one core; allocs/scrape counts the whole process's heap
// allocations. "filtered": the engines honour name[] (vLLM, one API
// server); "full": they send the whole 40 KB exposition (SGLang,
// TensorRT-LLM, vLLM with several API servers). A scrape that times out
// because the scraper cannot keep up is counted in failed/s, not an
// error: it is part of the measurement.
func BenchmarkScrape64Engines(b *testing.B) {
	for _, mode := range []string{"filtered", "full"} {
		b.Run(mode, func(b *testing.B) { benchScrape(b, 64, mode) })
	}
}

func benchScrape(b *testing.B, engines int, mode string) {
	const (
		interval = 50 * time.Millisecond
		warmUp   = time.Second
		window   = 3 * time.Second
	)
	addrs := startEngines(b, engines, mode)
	var stores, fails atomic.Int64
	ctx, cancel := context.WithCancel(b.Context())
	done := make(chan struct{})
	go func() {
		defer close(done)
		Run(ctx, Options{
			Interval: interval,
			Targets:  func() []string { return addrs },
			Store:    func(string, Sample, time.Time) { stores.Add(1) },
			Failed:   func(string, error) { fails.Add(1) },
			Log:      slog.New(slog.DiscardHandler),
		})
	}()
	defer func() { cancel(); <-done }()
	time.Sleep(warmUp)
	f0 := fails.Load()

	var cpu, wall time.Duration
	var scrapes int64
	var allocs uint64
	var mem runtime.MemStats
	for b.Loop() {
		runtime.ReadMemStats(&mem)
		c0, t0, s0, a0 := cpuTime(b), time.Now(), stores.Load(), mem.Mallocs
		time.Sleep(window)
		cpu += cpuTime(b) - c0
		wall += time.Since(t0)
		scrapes += stores.Load() - s0
		runtime.ReadMemStats(&mem)
		allocs += mem.Mallocs - a0
	}
	b.ReportMetric(float64(fails.Load()-f0)/wall.Seconds(), "failed/s")
	b.ReportMetric(100*cpu.Seconds()/wall.Seconds(), "%core")
	b.ReportMetric(float64(scrapes)/wall.Seconds(), "scrapes/s")
	b.ReportMetric(float64(cpu.Microseconds())/float64(max(scrapes, 1)), "µs-cpu/scrape")
	b.ReportMetric(float64(allocs)/float64(max(scrapes, 1)), "allocs/scrape")
}
