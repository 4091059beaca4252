package loadtest

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Scenario is one way a request is served, measured side by side with the
// others under the same load.
type Scenario string

const (
	// Floor is Envoy alone sending the client's body to a decode engine:
	// what any router on Envoy costs at least.
	Floor Scenario = "floor"
	// NoPrefill is Envoy with pdx picking the decode endpoint and rewriting
	// the body (connector "none"): the cost of the ext_proc exchange alone.
	NoPrefill Scenario = "pdx-no-prefill"
	// NoPrefillDuplex is NoPrefill with the body sent in Envoy's
	// FULL_DUPLEX_STREAMED mode: one exchange instead of BUFFERED's two
	// (headers, then body), pdx answering the headers when the body ends.
	NoPrefillDuplex Scenario = "pdx-no-prefill-full-duplex"
	// PD is the whole disaggregated path: pdx calls a prefill engine (NIXL),
	// and the decode engine pulls the KV from it.
	PD Scenario = "pdx"
	// PeerRoundRobin and PeerCacheAware are vLLM's own router, vllm-router,
	// in NIXL P/D mode over the same engines with its round_robin and
	// cache_aware policies: the peer pdx is compared with. It has no Envoy:
	// the client sends to it directly.
	PeerRoundRobin Scenario = "vllm-router-round-robin"
	PeerCacheAware Scenario = "vllm-router-cache-aware"
	// FloorAtPdxRate is the floor again, its clients paced to the
	// throughput pdx's whole path had at the same point: Envoy alone at
	// pdx's load. Envoy's CPU per request falls as it gets busier (more
	// events per wake-up), and the floor runs 2–3 times pdx's throughput,
	// so only this floor's Envoy compares with pdx's at the same load.
	// It runs after the others, as its rate is pdx's.
	FloorAtPdxRate Scenario = "floor-at-pdx-rate"
)

// Scenarios in the order each point runs them (the peers only when the
// plan has them).
var Scenarios = []Scenario{Floor, NoPrefill, NoPrefillDuplex, PD, PeerRoundRobin, PeerCacheAware}

// peerPolicy is the vllm-router --policy of each peer scenario.
var peerPolicy = map[Scenario]string{PeerRoundRobin: "round_robin", PeerCacheAware: "cache_aware"}

// Floor reports whether s is Envoy alone.
func (s Scenario) Floor() bool { return s == Floor || s == FloorAtPdxRate }

// Peer reports whether s is vllm-router's.
func (s Scenario) Peer() bool { return peerPolicy[s] != "" }

// Disaggregated reports whether s calls a prefill engine for every request,
// whose decode must then pull the KV.
func (s Scenario) Disaggregated() bool { return s == PD || s.Peer() }

// target is where and how a scenario's requests are sent.
type target struct {
	url   string
	model string
	// dest, when set, picks the engine for request n (the floor's client
	// names it; pdx would).
	dest func(n uint64) string
}

func (r *rig) target(s Scenario) target {
	switch s {
	case Floor, FloorAtPdxRate:
		return target{url: r.floor.URL(), model: modelAgg, dest: func(n uint64) string {
			return r.decode[n%uint64(len(r.decode))].Addr()
		}}
	case NoPrefill:
		return target{url: r.envoy.URL(), model: modelAgg}
	case NoPrefillDuplex:
		return target{url: r.duplex.URL(), model: modelAgg}
	case PeerRoundRobin, PeerCacheAware:
		// The engines take any model name; the body is pdx's.
		return target{url: r.peers[s].URL(), model: modelPD}
	default:
		return target{url: r.envoy.URL(), model: modelPD}
	}
}

// requestBody is a completion request of about size bytes. The prompt is
// words, so that the engines' token estimate (4 bytes a token) holds.
func requestBody(model string, size int, stream bool) []byte {
	head := fmt.Sprintf(`{"model":%q,"max_tokens":16,"stream":%t,"prompt":"`, model, stream)
	n := max(size-len(head)-2, 1)
	const words = "the quick brown fox jumps over the lazy dog "
	prompt := strings.Repeat(words, n/len(words)+1)[:n]
	return []byte(head + prompt + `"}`)
}

// loadResult is what one closed-loop run measured.
type loadResult struct {
	requests   int // completed within the window, successfully
	answered   int // completed successfully, warm-up and tail included
	errors     int
	firstError string
	window     time.Duration
	warmup     time.Duration // how long it took to warm up
	lat        latencies
	ttfb       latencies // time to the response headers
}

// maxWarmup bounds the warm-up of a load level that never settles.
const maxWarmup = 60 * time.Second

// closedLoop runs c clients, each sending its next request when the last one
// is answered. It warms up for at least warmup and until every client has
// had an answer (at thousands of clients the first answers take seconds),
// then measures the requests that complete within the next window: their
// count is the throughput, their durations the latencies. Errors anywhere
// count. windowStarts, if set, is called as the window starts. A rate above
// 0 paces the clients: the k-th request is not sent before k/rate seconds
// from the start, so the throughput is at most rate.
func closedLoop(ctx context.Context, client *http.Client, tg target, body []byte, stream bool, c int, rate float64, warmup, window time.Duration, windowStarts func()) loadResult {
	start := time.Now()
	var paced atomic.Int64
	pace := func() {
		if rate <= 0 {
			return
		}
		at := start.Add(time.Duration(float64(paced.Add(1)-1) / rate * float64(time.Second)))
		if d := time.Until(at); d > 0 {
			sleep(ctx, d)
		}
	}
	type sample struct {
		end       time.Time
		lat, ttfb time.Duration
	}
	var (
		mu       sync.Mutex
		samples  []sample
		errs     atomic.Int64
		firstErr atomic.Value
		n        atomic.Uint64
		warm     sync.WaitGroup // a client's first answer
		wg       sync.WaitGroup
	)
	// until is when clients stop; unknown (far away) until all are warm.
	var until atomic.Int64
	until.Store(start.Add(maxWarmup + window).UnixNano())
	warm.Add(c)
	for range c {
		wg.Go(func() {
			var mine []sample
			first := true
			for time.Now().UnixNano() < until.Load() && ctx.Err() == nil {
				pace()
				t0 := time.Now()
				ttfb, err := send(ctx, client, tg, body, stream, n.Add(1))
				t1 := time.Now()
				if err != nil {
					if errs.Add(1) == 1 {
						firstErr.Store(err.Error())
					}
				} else {
					mine = append(mine, sample{t1, t1.Sub(t0), ttfb})
				}
				if first {
					first = false
					warm.Done()
				}
			}
			if first {
				warm.Done()
			}
			mu.Lock()
			samples = append(samples, mine...)
			mu.Unlock()
		})
	}
	warm.Wait()
	if d := warmup - time.Since(start); d > 0 {
		sleep(ctx, d)
	}
	from := time.Now()
	until.Store(from.Add(window).UnixNano())
	if windowStarts != nil {
		windowStarts()
	}
	wg.Wait()
	to := time.Unix(0, until.Load())

	var lat, ttfb []time.Duration
	for _, s := range samples {
		if !s.end.Before(from) && !s.end.After(to) {
			lat = append(lat, s.lat)
			ttfb = append(ttfb, s.ttfb)
		}
	}
	r := loadResult{requests: len(lat), answered: len(samples), errors: int(errs.Load()), window: window, warmup: from.Sub(start), lat: summarize(lat), ttfb: summarize(ttfb)}
	if e, ok := firstErr.Load().(string); ok {
		r.firstError = e
	}
	return r
}

// send posts one request and reads the whole answer, which must be a 200
// (for a stream: one that ends with [DONE]).
func send(ctx context.Context, client *http.Client, tg target, body []byte, stream bool, n uint64) (time.Duration, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, tg.url+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	if tg.dest != nil {
		req.Header.Set("x-gateway-destination-endpoint", tg.dest(n))
	}
	t0 := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		return 0, err
	}
	ttfb := time.Since(t0)
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, fmt.Errorf("reading the answer: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("status %d: %.200s", resp.StatusCode, got)
	}
	if stream && !bytes.Contains(got, []byte("data: [DONE]")) {
		return 0, fmt.Errorf("stream without [DONE]: %.200s", got)
	}
	return ttfb, nil
}

// newClient is an HTTP/1.1 client keeping a connection per concurrent
// client, as a fleet of API clients would.
func newClient(c int) *http.Client {
	return &http.Client{Transport: &http.Transport{
		MaxIdleConns:        c,
		MaxIdleConnsPerHost: c,
		DisableCompression:  true,
		IdleConnTimeout:     90 * time.Second,
	}}
}
