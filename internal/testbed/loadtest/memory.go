package loadtest

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

// runMemory parks MemoryConcurrency requests in pdx (their prefill takes
// plan.ParkedPrefill) and reads pdx's live heap while they wait.
func runMemory(ctx context.Context, plan Plan, rep *Report) error {
	r, err := startRig(ctx, rigOptions{
		pdxBin: plan.PdxBin, envoyBin: plan.EnvoyBin,
		engine:  enginesim.Config{PrefillLatency: plan.ParkedPrefill},
		prefill: 2, decode: 2, prefillTimeout: 60 * time.Second,
	})
	if err != nil {
		return err
	}
	defer r.close()
	tg := r.target(PD)
	for _, size := range plan.MemoryBodies {
		idle, err := liveHeap(ctx, r.pdx.pprofAt)
		if err != nil {
			return err
		}
		body := requestBody(tg.model, size, false)
		c := plan.MemoryConcurrency
		client := newClient(c)
		errs := make([]error, c)
		var wg sync.WaitGroup
		for i := range c {
			wg.Go(func() { _, errs[i] = send(ctx, client, tg, body, false, uint64(i)) })
		}
		// Halfway through the prefill every request has reached pdx.
		if err := sleep(ctx, plan.ParkedPrefill/2); err != nil {
			return err
		}
		heap, herr := liveHeap(ctx, r.pdx.pprofAt)
		rss, rerr := rssBytes(r.pdx.pid())
		if plan.SaveProfile != nil && herr == nil {
			herr = fetchProfile(ctx, "http://"+r.pdx.pprofAt+"/debug/pprof/heap?gc=1", func(b []byte) error {
				return plan.SaveProfile(fmt.Sprintf("heap-parked-c%d-%dB", c, size), b)
			})
		}
		wg.Wait()
		client.CloseIdleConnections()
		if herr != nil || rerr != nil {
			return fmt.Errorf("reading pdx memory: %v %v", herr, rerr)
		}
		for _, err := range errs {
			if err != nil {
				return fmt.Errorf("a parked request failed: %w", err)
			}
		}
		m := Memory{
			BodyBytes: size, InFlight: c,
			IdleHeapMiB: float64(idle) / (1 << 20), HeapMiB: float64(heap) / (1 << 20), RSSMiB: float64(rss) / (1 << 20),
			PerRequestBytes: (heap - idle) / int64(c),
			GoalBytes:       2*int64(len(body)) + 16<<10,
		}
		rep.Memory = append(rep.Memory, m)
		if plan.Progress != nil {
			fmt.Fprintf(plan.Progress, "memory    body=%-8d in flight %d: live heap %.1f MiB (idle %.1f), rss %.1f MiB, %d bytes per request (goal <= %d)\n",
				size, c, m.HeapMiB, m.IdleHeapMiB, m.RSSMiB, m.PerRequestBytes, m.GoalBytes)
		}
	}
	return nil
}
