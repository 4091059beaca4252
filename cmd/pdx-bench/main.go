// Command pdx-bench is pdx's load harness: it starts a real Envoy, pdx (the
// binary given), vLLM's own router as the peer and simulated engines, drives
// closed-loop load through them with Envoy alone as the floor, and writes
// results.json, summary.md and charts. See `make bench`.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/pdx-router/pdx/internal/testbed/envoyproc"
	"github.com/pdx-router/pdx/internal/testbed/loadtest"
	"github.com/pdx-router/pdx/internal/testbed/vllmrouter"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "pdx-bench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("pdx-bench", flag.ContinueOnError)
	var (
		plan     loadtest.Plan
		out      = fs.String("out", "bench", "directory for results.json, summary.md, the charts and profiles/")
		profiles = fs.String("profiles", "zero,realistic", "engine latency profiles: zero, realistic")
		conc     = fs.String("concurrency", "1,64,512,2048", "concurrent clients of the concurrency sweep")
		bodies   = fs.String("bodies", "1024,32768,524288,2097152", "request body sizes of the size sweep")
		streams  = fs.String("stream", "false,true", "streamed answers: false, true or both")
		memBody  = fs.String("memory-bodies", "32768,524288,2097152", "body sizes of the parked-memory measurement (empty skips it)")
		cpuProf  = fs.Bool("cpu-profiles", true, "save pdx CPU profiles and their top functions under out/profiles")
		selfProf = fs.String("cpuprofile", "", "write the harness's own CPU profile (its load generator and engines) to this file")
	)
	fs.StringVar(&plan.PdxBin, "pdx-bin", "", "the pdx binary to measure (required)")
	fs.BoolVar(&plan.Observer, "observer", false, "add the observability pass to Envoy's config")
	fs.BoolVar(&plan.VLLMRouter, "vllm-router", true, "measure vllm-router (round_robin and cache_aware) as the peer (make vllm-router installs it; "+vllmrouter.DirEnv+" overrides)")
	fs.StringVar(&plan.EnvoyBin, "envoy-bin", "", "Envoy binary (default: $ENVOY_BIN or the one `make envoy` installs)")
	fs.IntVar(&plan.SweepBody, "sweep-body", 32768, "body size of the concurrency sweep")
	fs.IntVar(&plan.SizeConcurrency, "size-concurrency", 64, "concurrency of the size sweep")
	fs.DurationVar(&plan.Warmup, "warmup", time.Second, "unmeasured load before each point's window")
	fs.DurationVar(&plan.Window, "window", 4*time.Second, "measured time of each point")
	fs.IntVar(&plan.MemoryConcurrency, "memory-concurrency", 256, "requests parked in pdx for the memory measurement")
	fs.IntVar(&plan.OpenStreams, "open-streams", 10000, "concurrent ext_proc streams given to one pdx (0 skips it)")
	fs.IntVar(&plan.GoalRounds, "goal-rounds", 3, "rounds of the floor and pdx side by side at issue 23's goal points, with the zero-latency engines (0 skips them)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if plan.PdxBin == "" {
		return errors.New("--pdx-bin is required (make bench builds it)")
	}
	if plan.EnvoyBin == "" {
		bin, err := envoyproc.Binary()
		if err != nil {
			return err
		}
		plan.EnvoyBin = bin
	}
	if plan.VLLMRouter {
		// Before Run, whose failure would still write its empty report.
		if _, err := vllmrouter.Dir(); err != nil {
			return fmt.Errorf("%w (--vllm-router=false leaves the peer out)", err)
		}
	}
	var err error
	for name := range strings.SplitSeq(*profiles, ",") {
		switch name {
		case "":
		case loadtest.ZeroLatency.Name:
			plan.Profiles = append(plan.Profiles, loadtest.ZeroLatency)
		case loadtest.Realistic.Name:
			plan.Profiles = append(plan.Profiles, loadtest.Realistic)
		default:
			return fmt.Errorf("--profiles: unknown profile %q", name)
		}
	}
	if plan.Concurrency, err = ints("concurrency", *conc); err != nil {
		return err
	}
	if plan.Bodies, err = ints("bodies", *bodies); err != nil {
		return err
	}
	if plan.MemoryBodies, err = ints("memory-bodies", *memBody); err != nil {
		return err
	}
	for s := range strings.SplitSeq(*streams, ",") {
		if s == "" {
			continue
		}
		b, err := strconv.ParseBool(s)
		if err != nil {
			return fmt.Errorf("--stream: %w", err)
		}
		plan.Streams = append(plan.Streams, b)
	}
	profDir := filepath.Join(*out, "profiles")
	if *cpuProf {
		plan.SaveProfile = func(name string, profile []byte) error {
			return saveProfile(plan.PdxBin, profDir, name, profile)
		}
	}
	plan.Progress = os.Stdout
	if *selfProf != "" {
		f, err := os.Create(*selfProf)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}

	rep, err := loadtest.Run(ctx, plan)
	if rep != nil {
		rep.Machine = fmt.Sprintf("%s/%s, %d CPUs, %s", runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), runtime.Version())
		if werr := rep.Write(*out); werr != nil {
			return errors.Join(err, werr)
		}
		var wrote []string
		for _, f := range []string{"results.json", "summary.md", "latency-vs-concurrency.png", "overhead-vs-size.png"} {
			if _, err := os.Stat(filepath.Join(*out, f)); err == nil {
				wrote = append(wrote, filepath.Join(*out, f))
			}
		}
		fmt.Printf("wrote %s\n", strings.Join(wrote, ", "))
	}
	return err
}

// saveProfile keeps a raw CPU profile and its top functions as text, the
// summary worth reading in review.
func saveProfile(bin, dir, name string, profile []byte) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	raw := filepath.Join(dir, name+".pprof")
	if err := os.WriteFile(raw, profile, 0o644); err != nil {
		return err
	}
	top, err := exec.Command("go", "tool", "pprof", "-top", "-nodecount=35", bin, raw).CombinedOutput()
	if err != nil {
		return fmt.Errorf("go tool pprof: %w: %s", err, top)
	}
	return os.WriteFile(filepath.Join(dir, name+".top.txt"), top, 0o644)
}

func ints(flagName, list string) ([]int, error) {
	var out []int
	for s := range strings.SplitSeq(list, ",") {
		if s == "" {
			continue
		}
		n, err := strconv.Atoi(s)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("--%s: %q is not a positive number", flagName, s)
		}
		out = append(out, n)
	}
	return out, nil
}
