package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"runtime"
	"runtime/pprof"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// soakDuration is how long TestSoak drives traffic: briefly in CI, for
// minutes when PDX_SOAK is set (e.g. PDX_SOAK=5m).
func soakDuration(t *testing.T) time.Duration {
	if v := os.Getenv("PDX_SOAK"); v != "" {
		d, err := time.ParseDuration(v)
		require.NoError(t, err, "PDX_SOAK")
		return d
	}
	return 5 * time.Second
}

// TestSoak drives mixed traffic through Envoy and pdx: good requests of
// every shape, bad ones, clients that give up mid-prefill, and a prefill
// engine that fails every call. Every request must end the way its kind
// says, and nothing may be left behind: goroutines and heap are compared
// before and after.
func TestSoak(t *testing.T) {
	st := startStack(t, stack.Options{
		Prefill: 3, Decode: 2,
		Engine: enginesim.Config{PrefillLatency: 5 * time.Millisecond, DecodePerToken: time.Millisecond},
		Tune: func(role enginesim.Role, i int, c *enginesim.Config) {
			if role == enginesim.RolePrefill && i == 2 {
				c.FailStatus = 500 // a sick engine: retried, then ejected, then retried again
			}
		},
		PoolYAML: "eject_duration: 2s",
	})
	_, hc := newClient(t, st)
	var mu sync.Mutex
	outcomes := map[string]int{}
	var unexpected []string
	drive := func(d time.Duration) {
		ctx, cancel := context.WithTimeout(t.Context(), d)
		defer cancel()
		var wg sync.WaitGroup
		for w := range 32 {
			wg.Go(func() {
				for i := 0; ctx.Err() == nil; i++ {
					kind, got, ok := soakRequest(t.Context(), hc, st.URL(), w, i)
					mu.Lock()
					outcomes[kind+" → "+got]++
					if !ok && len(unexpected) < 20 {
						unexpected = append(unexpected, kind+": "+got)
					}
					mu.Unlock()
				}
			})
		}
		wg.Wait()
	}
	// A warm-up fills the connection pools between Envoy, pdx and the
	// engines, whose idle connections hold goroutines of their own; what
	// the soak adds after that is what it left behind.
	drive(time.Second)
	goroutinesBefore, heapBefore := settle(st, hc)
	duration := soakDuration(t)
	drive(duration)
	goroutinesAfter, heapAfter := settle(st, hc)
	if path := os.Getenv("PDX_SOAK_HEAP"); path != "" {
		// What holds the live heap after the soak (go tool pprof -sample_index=inuse_space).
		f, err := os.Create(path)
		require.NoError(t, err)
		require.NoError(t, pprof.WriteHeapProfile(f))
		require.NoError(t, f.Close())
	}

	total := 0
	lines := make([]string, 0, len(outcomes))
	for k, n := range outcomes {
		total += n
		lines = append(lines, fmt.Sprintf("%7d  %s", n, k))
	}
	sort.Strings(lines)
	t.Logf("soak: %d requests in %s over 32 clients (and a 1s warm-up)\n%s\ngoroutines %d → %d, live heap %.1f MiB → %.1f MiB",
		total, duration, strings.Join(lines, "\n"), goroutinesBefore, goroutinesAfter,
		float64(heapBefore)/(1<<20), float64(heapAfter)/(1<<20))
	require.Empty(t, unexpected, "requests that did not end as their kind should")
	// Idle keep-alive connections (Envoy's, pdx's to the engines) hold
	// goroutines and vary with the traffic; a request's own goroutines run
	// pdx's code. None may be left once the traffic stopped.
	require.Empty(t, pdxGoroutines(), "goroutines of pdx's requests left behind")
	require.Less(t, goroutinesAfter, goroutinesBefore+1000, "goroutines grow with the requests")
}

// soakRequest sends request i of worker w and says what kind it was, how it
// ended and whether that is how that kind must end.
func soakRequest(ctx context.Context, hc *http.Client, base string, w, i int) (kind, got string, ok bool) {
	text := fmt.Sprintf("soak %d-%d", w, i)
	chat := fmt.Sprintf(`{"model":"demo-model","messages":[{"role":"user","content":%q}],"max_tokens":3,"stream":%v}`, text, i%2 == 0)
	switch i % 8 {
	case 0, 1, 2, 3: // good chat, streaming or not
		return expect(ctx, hc, "good chat", base+"/v1/chat/completions", chat, 200, wantPrefix(chatPrompt(text)))
	case 4: // good completion
		return expect(ctx, hc, "good completion", base+"/v1/completions",
			fmt.Sprintf(`{"model":"demo-model","prompt":%q,"max_tokens":2}`, text), 200, wantPrefix(text))
	case 5: // bad input, in turn
		bad := []string{`{"model":"demo-model",`, `{"messages":[]}`, `{"model":"demo-model","messages":[{}],"n":2}`, `{"model":"demo-model","messages":"x"}`}
		return expect(ctx, hc, "bad input", base+"/v1/chat/completions", bad[i/8%len(bad)], 400, `"error"`)
	case 6: // a client that gives up during the prefill
		cctx, cancel := context.WithTimeout(ctx, time.Millisecond)
		defer cancel()
		kind, got, _ = expect(cctx, hc, "client gives up", base+"/v1/chat/completions", chat, 200, "")
		return kind, got, true // any end is fine, as long as it ends
	default: // prompt finished by the prefill (EOS): the decode recomputes
		return expect(ctx, hc, "prefill EOS", base+"/v1/completions",
			fmt.Sprintf(`{"model":"demo-model","prompt":"%s [sim:eos]","max_tokens":2}`, text), 200, wantPrefix(text+" [sim:eos]"))
	}
}

func expect(ctx context.Context, hc *http.Client, kind, url, body string, status int, contains string) (string, string, bool) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return kind, err.Error(), false
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := hc.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return kind, "client gave up", false
		}
		return kind, "transport error: " + err.Error(), false
	}
	defer resp.Body.Close()
	var b strings.Builder
	_, err = copyBody(&b, resp)
	got := fmt.Sprintf("%d", resp.StatusCode)
	switch {
	case err != nil:
		return kind, got + " cut: " + err.Error(), false
	case resp.StatusCode != status:
		return kind, got + " " + b.String(), false
	case !strings.Contains(b.String(), contains):
		return kind, got + " with a wrong answer: " + b.String(), false
	}
	return kind, got, true
}

func copyBody(b *strings.Builder, resp *http.Response) (int64, error) {
	buf := make([]byte, 4096)
	var n int64
	for {
		k, err := resp.Body.Read(buf)
		b.Write(buf[:k])
		n += int64(k)
		if err != nil {
			if err.Error() == "EOF" {
				return n, nil
			}
			return n, err
		}
	}
}

// pdxGoroutines returns the stacks of goroutines running pdx's processor or
// connectors code.
func pdxGoroutines() []string {
	buf := make([]byte, 16<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		if strings.Contains(g, "pdx-router/pdx/processor.") || strings.Contains(g, "pdx-router/pdx/connectors.") {
			out = append(out, g)
		}
	}
	return out
}

// settle drops the engines' records (the simulators keep every body they
// got), closes idle client connections, lets goroutines end and collects
// garbage, then reports the goroutine count and live heap.
func settle(st *stack.Stack, hc *http.Client) (int, uint64) {
	for _, e := range st.Engines() {
		e.Reset()
	}
	hc.CloseIdleConnections()
	time.Sleep(500 * time.Millisecond)
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return runtime.NumGoroutine(), ms.HeapAlloc
}
