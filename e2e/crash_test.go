package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

// TestGenerationsSurvivePdxCrash (issue 21): two pdx replicas behind one
// Envoy, and one of them SIGKILLed while 100 streamed generations are under
// way, about half of them routed by it. A generation streams from its
// decode engine through Envoy alone, so with pdx's default config every one
// must run to its [DONE], and new requests must succeed through the
// survivor.
func TestGenerationsSurvivePdxCrash(t *testing.T) {
	const (
		inFlight, later = 100, 20
		// Each generation streams for about tokens × DecodePerToken: long
		// enough for all inFlight to be streaming at the kill.
		tokens         = 40
		requestBound   = 30 * time.Second
		streamingBound = 15 * time.Second
	)
	ps := startProcStack(t, procOptions{
		prefill: 2, decode: 2, replicas: 2,
		// At debug pdx logs the request id of each request it routes: which
		// replica routed which generation.
		pdxArgs: []string{"--log-level", "debug"},
		engine:  enginesim.Config{DecodeLatency: 20 * time.Millisecond, DecodePerToken: 50 * time.Millisecond},
	})
	survivor, victim := ps.replicas[0], ps.replicas[1]
	hc := newHTTPClient(t)
	target := ps.envoy.URL() + "/v1/completions"

	var (
		gens            = make([]generation, inFlight)
		streaming, over atomic.Int64
		wg              sync.WaitGroup
	)
	t.Cleanup(wg.Wait)
	for i := range gens {
		wg.Go(func() {
			gens[i] = streamGeneration(t.Context(), hc, target, fmt.Sprintf("crash-%d", i), tokens, requestBound, func() { streaming.Add(1) })
			over.Add(1)
		})
	}
	// Every generation is streaming, and each replica routed some of them.
	routedBy := func() [2]map[string]bool {
		return [2]map[string]bool{routedIDs(survivor.log.String()), routedIDs(victim.log.String())}
	}
	if !assert.Eventually(t, func() bool {
		r := routedBy()
		return streaming.Load() == inFlight && len(r[0]) > 0 && len(r[1]) > 0
	}, streamingBound, 5*time.Millisecond) {
		wg.Wait()
		routed := routedBy()
		t.Fatalf("after %v, %d of %d generations streaming, %d over (first failure: %s); routed by the replicas: %d and %d",
			streamingBound, streaming.Load(), inFlight, over.Load(), firstFailure(gens), len(routed[0]), len(routed[1]))
	}
	require.Zero(t, over.Load(), "a generation ended before the kill: the test needs longer ones")

	killAt := time.Now()
	victim.proc.kill()
	wg.Wait()
	routed := routedBy()

	var cut []generation
	var cutBy [2]int
	for _, g := range gens {
		if g.complete() {
			require.True(t, strings.HasPrefix(g.text, wantPrefix(g.id)), "generation %s streamed another prompt's answer: %q", g.id, g.text)
			continue
		}
		cut = append(cut, g)
		for r := range routed {
			if routed[r][g.id] {
				cutBy[r]++
			}
		}
	}
	lastEnd := time.Duration(0)
	for _, g := range gens {
		lastEnd = max(lastEnd, g.end.Sub(killAt))
	}
	require.Zero(t, len(cut), "the SIGKILL of one pdx replica cut %d of %d generations: %d of the %d the killed replica (%s) routed, %d of the %d the survivor (%s) routed; the first cut: %s",
		len(cut), inFlight, cutBy[1], len(routed[1]), victim.grpcAddr, cutBy[0], len(routed[0]), survivor.grpcAddr, firstFailure(cut))
	t.Logf("%d generations streaming at the kill (%d routed by the killed replica, %d by the survivor): all ended with [DONE], the last %v after the kill",
		inFlight, len(routed[1]), len(routed[0]), lastEnd.Round(time.Millisecond))

	// New requests succeed through the survivor once Envoy's health check
	// has found the dead replica (until then, those it places there fail
	// closed with a 503 router_unavailable).
	var healthy int
	require.Eventually(t, func() bool {
		healthy, _ = envoyStat(ps.envoy.AdminAddr(), "cluster.pdx.membership_healthy")
		return healthy == 1
	}, 20*time.Second, 50*time.Millisecond, "Envoy still counts the dead replica healthy")
	ejected := time.Since(killAt)
	const laterTokens = 4
	after := make([]generation, later)
	var sent sync.WaitGroup
	for i := range after {
		sent.Go(func() {
			after[i] = streamGeneration(t.Context(), hc, target, fmt.Sprintf("after-crash-%d", i), laterTokens, requestBound, nil)
		})
	}
	sent.Wait()
	for _, g := range after {
		require.True(t, g.complete(), "a request after the kill failed: %s", g)
		require.True(t, strings.HasPrefix(g.text, wantPrefix(g.id)), "request %s got another prompt's answer: %q", g.id, g.text)
	}
	select {
	case <-survivor.proc.exited:
		t.Fatalf("the surviving replica exited: %v", survivor.proc.err)
	default:
	}
	t.Logf("Envoy's health check found the dead replica %v after the kill; then %d new requests all succeeded through the survivor",
		ejected.Round(time.Millisecond), later)
}

// generation is what a client got for one streamed completion.
type generation struct {
	id     string // the prompt and the X-Request-Id
	status int
	chunks int
	done   bool   // it ended with data: [DONE]
	text   string // the chunks' choices[0].text, joined
	err    error
	body   string // a non-200's answer
	end    time.Time
}

func (g generation) complete() bool { return g.err == nil && g.status == http.StatusOK && g.done }

func (g generation) String() string {
	return fmt.Sprintf("%s: status %d, %d chunks, [DONE] %v, error %v %s", g.id, g.status, g.chunks, g.done, g.err, g.body)
}

// streamGeneration posts a streamed completion of tokens tokens for id and
// reads it to its end, giving up after bound. first is called at its first
// chunk.
func streamGeneration(ctx context.Context, hc *http.Client, url, id string, tokens int, bound time.Duration, first func()) (g generation) {
	g.id = id
	defer func() { g.end = time.Now() }()
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url,
		strings.NewReader(fmt.Sprintf(`{"model":"demo-model","prompt":%q,"max_tokens":%d,"stream":true}`, id, tokens)))
	if err != nil {
		g.err = err
		return g
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", id)
	resp, err := hc.Do(req)
	if err != nil {
		g.err = err
		return g
	}
	defer resp.Body.Close()
	if g.status = resp.StatusCode; g.status != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		g.body = string(b)
		return g
	}
	sc := bufio.NewScanner(resp.Body)
	var text strings.Builder
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		switch {
		case !ok:
		case data == "[DONE]":
			g.done = true
		default:
			if g.chunks++; g.chunks == 1 && first != nil {
				first()
			}
			var c struct {
				Choices []struct {
					Text string `json:"text"`
				} `json:"choices"`
			}
			if err := json.Unmarshal([]byte(data), &c); err == nil && len(c.Choices) > 0 {
				text.WriteString(c.Choices[0].Text)
			}
		}
	}
	g.text, g.err = text.String(), sc.Err()
	return g
}

// firstFailure describes the first generation that failed, if any.
func firstFailure(gens []generation) string {
	for _, g := range gens {
		if g.id != "" && !g.complete() {
			return g.String()
		}
	}
	return "none"
}

// routedIDs are the request ids that a pdx log (JSON, at debug) says were
// routed.
func routedIDs(log string) map[string]bool {
	ids := map[string]bool{}
	for line := range strings.Lines(log) {
		var l struct {
			Msg       string `json:"msg"`
			RequestID string `json:"request_id"`
		}
		if json.Unmarshal([]byte(line), &l) == nil && l.Msg == "routed" {
			ids[l.RequestID] = true
		}
	}
	return ids
}
