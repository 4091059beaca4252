package enginemetrics

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// Generous bounds: the machine running these may be small and busy.
const (
	eventually = 10 * time.Second
	poll       = 5 * time.Millisecond
)

// recorder collects what Run reports, per address.
type recorder struct {
	mu      sync.Mutex
	stores  map[string][]Sample
	ats     map[string][]time.Time // when each stored scrape was sent
	fails   map[string][]error
	stopped atomic.Bool // set once Run returned; a report after it is a bug
	late    atomic.Int32
}

func newRecorder() *recorder {
	return &recorder{stores: map[string][]Sample{}, ats: map[string][]time.Time{}, fails: map[string][]error{}}
}

func (r *recorder) store(a string, s Sample, at time.Time) {
	if r.stopped.Load() {
		r.late.Add(1)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.stores[a] = append(r.stores[a], s)
	r.ats[a] = append(r.ats[a], at)
}

func (r *recorder) failed(a string, err error) {
	if r.stopped.Load() {
		r.late.Add(1)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.fails[a] = append(r.fails[a], err)
}

func (r *recorder) counts(a string) (stores, fails int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.stores[a]), len(r.fails[a])
}

func (r *recorder) lastFail(a string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.fails[a]) == 0 {
		return nil
	}
	return r.fails[a][len(r.fails[a])-1]
}

// engine is a metrics endpoint that counts its scrapes and how many overlap.
type engine struct {
	srv         *httptest.Server
	hits        atomic.Int64
	inflight    atomic.Int64
	maxInflight atomic.Int64
	filtered    atomic.Int64 // scrapes that asked for name[]
	plain       atomic.Int64 // and those that did not
}

func newEngine(t *testing.T, h http.HandlerFunc) *engine {
	t.Helper()
	e := &engine{}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.hits.Add(1)
		if r.URL.Query().Has("name[]") {
			e.filtered.Add(1)
		} else {
			e.plain.Add(1)
		}
		n := e.inflight.Add(1)
		defer e.inflight.Add(-1)
		for {
			m := e.maxInflight.Load()
			if n <= m || e.maxInflight.CompareAndSwap(m, n) {
				break
			}
		}
		h(w, r)
	}))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *engine) addr() string { return e.srv.Listener.Addr().String() }

func serveText(text string) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		fmt.Fprint(w, text)
	}
}

// deadAddr is an address where nothing listens: connection refused.
func deadAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	a := l.Addr().String()
	require.NoError(t, l.Close())
	return a
}

// start runs Run in the background; stop cancels it and waits for it.
func start(t *testing.T, rec *recorder, opts Options) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	opts.Store = rec.store
	opts.Failed = rec.failed
	if opts.Log == nil {
		opts.Log = slog.New(slog.DiscardHandler)
	}
	if opts.Interval == 0 {
		opts.Interval = 10 * time.Millisecond
	}
	if opts.Timeout == 0 {
		opts.Timeout = eventually // parsing a full exposition is slow under -race
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		Run(ctx, opts)
		rec.stopped.Store(true)
	}()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case <-done:
			case <-time.After(eventually):
				t.Fatal("Run did not return after its context ended")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

func static(addrs ...string) func() []string {
	return func() []string { return addrs }
}

// clients are the two ways Run scrapes: its own direct connections, and a
// caller's http.Client.
var clients = []struct {
	name   string
	client *http.Client
}{
	{"direct", nil},
	{"http.Client", &http.Client{Transport: &http.Transport{}}},
}

func TestRunHealthyEngineIsStoredRepeatedly(t *testing.T) {
	t.Parallel()
	for _, c := range clients {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := newEngine(t, serveText(readTestdata(t, "vllm.txt")))
			rec := newRecorder()
			start(t, rec, Options{Targets: static(e.addr()), Client: c.client})

			require.Eventually(t, func() bool { n, _ := rec.counts(e.addr()); return n >= 5 }, eventually, poll)
			rec.mu.Lock()
			defer rec.mu.Unlock()
			for _, s := range rec.stores[e.addr()] {
				require.Equal(t, Sample{Waiting: 7, Running: 12, KVUsage: 0.6312, KVTokens: 29127 * 16, KVBlockSize: 16}, s)
			}
			require.Empty(t, rec.fails[e.addr()])
		})
	}
}

func TestRunSlowEngineFailsWithoutPileUp(t *testing.T) {
	t.Parallel()
	for _, c := range clients {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			// Answers only when the scraper gives up (or after a long time).
			e := newEngine(t, func(_ http.ResponseWriter, r *http.Request) {
				select {
				case <-r.Context().Done():
				case <-time.After(eventually):
				}
			})
			rec := newRecorder()
			start(t, rec, Options{
				Interval: 5 * time.Millisecond, // far shorter than the engine takes
				Timeout:  20 * time.Millisecond,
				Targets:  static(e.addr()),
				Client:   c.client,
			})

			require.Eventually(t, func() bool { _, n := rec.counts(e.addr()); return n >= 3 }, eventually, poll)
			require.ErrorIs(t, rec.lastFail(e.addr()), context.DeadlineExceeded)
			require.EqualValues(t, 1, e.maxInflight.Load(), "scrapes of one engine overlapped")
			stores, _ := rec.counts(e.addr())
			require.Zero(t, stores)
		})
	}
}

func TestRunEngineClosingConnectionsIsNoFailure(t *testing.T) {
	t.Parallel()
	// Answers keep-alive, then closes the connection: what an engine's
	// idle timeout or a proxy does between scrapes.
	e := newEngine(t, func(w http.ResponseWriter, _ *http.Request) {
		conn, buf, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		body := "vllm:num_requests_running 3\n"
		fmt.Fprintf(buf, "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		_ = buf.Flush()
	})
	rec := newRecorder()
	start(t, rec, Options{Targets: static(e.addr())})
	require.Eventually(t, func() bool { n, _ := rec.counts(e.addr()); return n >= 5 }, eventually, poll)
	_, fails := rec.counts(e.addr())
	require.Zero(t, fails, "a closed idle connection is redialled, not reported")
}

func TestRunDeadEngineDoesNotAffectOthers(t *testing.T) {
	t.Parallel()
	dead := deadAddr(t)
	ok := newEngine(t, serveText(readTestdata(t, "sglang.txt")))
	rec := newRecorder()
	start(t, rec, Options{Targets: static(dead, ok.addr())})

	require.Eventually(t, func() bool {
		_, deadFails := rec.counts(dead)
		okStores, _ := rec.counts(ok.addr())
		return deadFails >= 2 && okStores >= 10
	}, eventually, poll)
	var opErr *net.OpError
	require.ErrorAs(t, rec.lastFail(dead), &opErr)
	_, okFails := rec.counts(ok.addr())
	require.Zero(t, okFails)
}

func TestRunBadAnswersFail(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		handler http.HandlerFunc
		check   func(t *testing.T, err error)
	}{
		{
			name:    "malformed exposition",
			handler: serveText("vllm:num_requests_waiting{model_name=\"m\" 3\n"),
			check:   func(t *testing.T, err error) { require.ErrorContains(t, err, "enginemetrics: line 1: ") },
		},
		{
			name:    "no known family",
			handler: serveText("process_open_fds 87\n"),
			check:   func(t *testing.T, err error) { require.ErrorIs(t, err, ErrNoLoad) },
		},
		{
			name: "server error",
			handler: func(w http.ResponseWriter, _ *http.Request) {
				http.Error(w, "engine dead", http.StatusInternalServerError)
			},
			check: func(t *testing.T, err error) { require.ErrorIs(t, err, errStatus) },
		},
		{
			name: "connection cut mid-answer",
			handler: func(w http.ResponseWriter, _ *http.Request) {
				w.Header().Set("Content-Length", "100000")
				fmt.Fprint(w, "vllm:num_requests_waiting 3\nvllm:num_req")
			},
			check: func(t *testing.T, err error) { require.Error(t, err) },
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e := newEngine(t, tt.handler)
			rec := newRecorder()
			start(t, rec, Options{Targets: static(e.addr())})
			require.Eventually(t, func() bool { _, n := rec.counts(e.addr()); return n >= 2 }, eventually, poll)
			tt.check(t, rec.lastFail(e.addr()))
			stores, _ := rec.counts(e.addr())
			require.Zero(t, stores)
		})
	}
}

func TestRunFollowsTargets(t *testing.T) {
	t.Parallel()
	a := newEngine(t, serveText(readTestdata(t, "vllm.txt")))
	b := newEngine(t, serveText(readTestdata(t, "trtllm.txt")))
	var mu sync.Mutex
	targets := []string{a.addr()}
	set := func(ts ...string) { mu.Lock(); defer mu.Unlock(); targets = ts }
	rec := newRecorder()
	start(t, rec, Options{Targets: func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), targets...)
	}})

	require.Eventually(t, func() bool { return a.hits.Load() >= 3 }, eventually, poll)
	require.Zero(t, b.hits.Load())

	set(a.addr(), b.addr(), b.addr()) // added (a duplicate is one target)
	require.Eventually(t, func() bool { n, _ := rec.counts(b.addr()); return n >= 3 }, eventually, poll)

	set(b.addr()) // a removed
	// Once b has been scraped a few more times, Run has seen the change.
	waitMoreStores := func() {
		n, _ := rec.counts(b.addr())
		require.Eventually(t, func() bool { m, _ := rec.counts(b.addr()); return m >= n+5 }, eventually, poll)
	}
	waitMoreStores()
	aHits := a.hits.Load()
	waitMoreStores()
	require.Equal(t, aHits, a.hits.Load(), "a removed engine is still scraped")
	require.EqualValues(t, 1, b.maxInflight.Load())
}

func TestRunStopsEverythingWhenContextEnds(t *testing.T) {
	// Not parallel: it counts goroutines.
	e := newEngine(t, serveText(readTestdata(t, "sglang.txt")))
	slow := newEngine(t, func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
	ignore := goleak.IgnoreCurrent()
	rec := newRecorder()
	stop := start(t, rec, Options{
		Timeout: time.Minute, // the slow scrape is in flight when Run stops
		Targets: static(e.addr(), slow.addr(), deadAddr(t)),
	})
	require.Eventually(t, func() bool {
		n, _ := rec.counts(e.addr())
		return n >= 3 && slow.inflight.Load() == 1
	}, eventually, poll)

	stop() // returns only once Run has
	require.NoError(t, goleak.Find(ignore), "Run left goroutines behind")
	require.Zero(t, rec.late.Load(), "Store or Failed called after Run returned")
	_, slowFails := rec.counts(slow.addr())
	require.Zero(t, slowFails, "a scrape cut short by stopping is not the engine's failure")
}

// logCounter counts log records by level.
type logCounter struct {
	mu     sync.Mutex
	levels map[slog.Level]int
}

func (c *logCounter) Enabled(context.Context, slog.Level) bool { return true }
func (c *logCounter) Handle(_ context.Context, r slog.Record) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.levels[r.Level]++
	return nil
}
func (c *logCounter) WithAttrs([]slog.Attr) slog.Handler { return c }
func (c *logCounter) WithGroup(string) slog.Handler      { return c }

func (c *logCounter) count(l slog.Level) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.levels[l]
}

func TestRunLogsStateChangesOnly(t *testing.T) {
	t.Parallel()
	var healthy atomic.Bool
	e := newEngine(t, func(w http.ResponseWriter, r *http.Request) {
		if !healthy.Load() {
			http.Error(w, "starting", http.StatusServiceUnavailable)
			return
		}
		serveText("vllm:num_requests_waiting 1\n")(w, r)
	})
	logs := &logCounter{levels: map[slog.Level]int{}}
	rec := newRecorder()
	start(t, rec, Options{
		Interval: time.Millisecond, // backoff caps failures at a few a second
		Targets:  static(e.addr()),
		Log:      slog.New(logs),
	})
	require.Eventually(t, func() bool { _, n := rec.counts(e.addr()); return n >= 3 }, eventually, poll)
	healthy.Store(true)
	require.Eventually(t, func() bool { n, _ := rec.counts(e.addr()); return n >= 3 }, eventually, poll)

	require.Equal(t, 1, logs.count(slog.LevelWarn))
	require.Equal(t, 1, logs.count(slog.LevelInfo))
}

// lockedBuffer is a log's output, written by the workers and read by the
// test.
type lockedBuffer struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) lines() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return strings.Split(strings.TrimSuffix(b.buf.String(), "\n"), "\n")
}

// maxLogLine bounds a state change's line: the time, level, message, the
// address and why, as pdx's JSON log writes them.
const maxLogLine = 250

// An engine going down and coming back is one short line each way, however
// many scrapes fail in between, with either client; the filter's long query
// is not in it.
func TestRunLogsOneShortLinePerStateChange(t *testing.T) {
	t.Parallel()
	for _, c := range clients {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			var healthy atomic.Bool
			e := newEngine(t, func(w http.ResponseWriter, r *http.Request) {
				if !healthy.Load() {
					http.Error(w, "starting", http.StatusServiceUnavailable)
					return
				}
				serveText("vllm:num_requests_waiting 1\n")(w, r)
			})
			dead := deadAddr(t)
			var out lockedBuffer
			rec := newRecorder()
			start(t, rec, Options{
				Interval: time.Millisecond,
				Targets:  static(e.addr(), dead),
				Client:   c.client,
				Log:      slog.New(slog.NewJSONHandler(&out, nil)),
			})
			// Down, up, down, up: at least three scrapes each time. It stays
			// up after: a third down, while the dead address's count is
			// awaited, would log a fifth line.
			for i := range 2 {
				_, fails := rec.counts(e.addr())
				require.Eventually(t, func() bool { _, n := rec.counts(e.addr()); return n >= fails+3 }, eventually, poll)
				healthy.Store(true)
				stores, _ := rec.counts(e.addr())
				require.Eventually(t, func() bool { n, _ := rec.counts(e.addr()); return n >= stores+3 }, eventually, poll)
				if i == 0 {
					healthy.Store(false)
				}
			}
			require.Eventually(t, func() bool { _, n := rec.counts(dead); return n >= 4 }, eventually, poll)

			var engine, refused []string
			for _, line := range out.lines() {
				require.Less(t, len(line), maxLogLine, line)
				require.NotContains(t, line, "name%5B", "the filter's query")
				switch {
				case strings.Contains(line, `"address":"`+e.addr()+`"`):
					engine = append(engine, line)
				case strings.Contains(line, `"address":"`+dead+`"`):
					refused = append(refused, line)
				default:
					t.Fatalf("a line about no engine: %s", line)
				}
			}
			require.Len(t, engine, 4, "down, up, down, up: %q", engine)
			for i, want := range []string{
				`"level":"WARN","msg":"engine metrics: scrape failing"`, `"level":"INFO","msg":"engine metrics: scrape ok again"`,
				`"level":"WARN","msg":"engine metrics: scrape failing"`, `"level":"INFO","msg":"engine metrics: scrape ok again"`,
			} {
				require.Contains(t, engine[i], want)
			}
			require.Contains(t, engine[0], `"error":"enginemetrics: unexpected status 503 Service Unavailable for GET /metrics"`)
			require.Len(t, refused, 1, "one line however many scrapes failed: %q", refused)
			require.Contains(t, refused[0], `"error":"GET /metrics: dial tcp `+dead+`: connect: connection refused"`)
		})
	}
}

// promClient answers like prometheus_client: with name[] it keeps only the
// families asked for, or, as a multi-process registry does, none at all.
func promClient(text string, multiProcess bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		names := r.URL.Query()["name[]"]
		if len(names) == 0 {
			serveText(text)(w, r)
			return
		}
		var out strings.Builder
		if !multiProcess {
			for line := range strings.Lines(text) {
				for _, n := range names {
					if strings.HasPrefix(strings.TrimPrefix(strings.TrimPrefix(line, "# HELP "), "# TYPE "), n+" ") ||
						strings.HasPrefix(line, n+"{") {
						out.WriteString(line)
					}
				}
			}
		}
		serveText(out.String())(w, r)
	}
}

func TestRunAsksForOnlyTheLoadFamilies(t *testing.T) {
	t.Parallel()
	text := readTestdata(t, "vllm.txt")
	single := newEngine(t, promClient(text, false))
	multi := newEngine(t, promClient(text, true))
	rec := newRecorder()
	start(t, rec, Options{Targets: static(single.addr(), multi.addr())})

	want := Sample{Waiting: 7, Running: 12, KVUsage: 0.6312, KVTokens: 29127 * 16, KVBlockSize: 16}
	require.Eventually(t, func() bool {
		s, _ := rec.counts(single.addr())
		m, _ := rec.counts(multi.addr())
		return s >= 5 && m >= 5
	}, eventually, poll)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, a := range []string{single.addr(), multi.addr()} {
		require.Empty(t, rec.fails[a])
		for _, s := range rec.stores[a] {
			require.Equal(t, want, s)
		}
	}
	require.Zero(t, single.plain.Load(), "every scrape filtered")
	require.EqualValues(t, 1, multi.filtered.Load(), "filter dropped after an empty answer")
}

func TestOptionsDefaults(t *testing.T) {
	t.Parallel()
	o := Options{}.withDefaults()
	require.Equal(t, 50*time.Millisecond, o.Interval)
	require.Equal(t, 200*time.Millisecond, o.Timeout)
	require.Equal(t, "/metrics", o.Path)
	require.Nil(t, o.Client, "nil: direct connections")
	require.NotNil(t, o.Log)
	require.NotPanics(t, func() { o.Failed("x", errors.New("y")) })
}

func TestRunFilterKeepsTheLoRAGauge(t *testing.T) {
	t.Parallel()
	text := "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 2\n" +
		"# TYPE vllm:lora_requests_info gauge\n" +
		`vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters=""} 1.7e+09` + "\n" +
		"# TYPE process_open_fds gauge\nprocess_open_fds 87\n"
	e := newEngine(t, promClient(text, false))
	rec := newRecorder()
	start(t, rec, Options{Targets: static(e.addr())})
	require.Eventually(t, func() bool { n, _ := rec.counts(e.addr()); return n >= 2 }, eventually, poll)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, s := range rec.stores[e.addr()] {
		require.Equal(t, LoRA{Running: []string{"sql"}, MaxLoRA: 2}, s.LoRA, "name[] asks for the LoRA gauge too")
	}
	require.Zero(t, e.plain.Load(), "every scrape filtered")
}

func TestNextTick(t *testing.T) {
	t.Parallel()
	epoch := time.Unix(1000, 0)
	const iv = 50 * time.Millisecond
	tests := []struct {
		name string
		t    time.Duration // after epoch
		want time.Duration // after epoch
	}{
		{"at the epoch: the first tick", 0, iv},
		{"between ticks: the next", 20 * time.Millisecond, iv},
		{"on a tick: the one after", iv, 2 * iv},
		{"just after a tick (a timer fires late)", iv + time.Microsecond, 2 * iv},
		{"well after the epoch", 3*iv + 7*time.Millisecond, 4 * iv},
		{"before the epoch (clock oddity): the first tick", -time.Second, iv},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, epoch.Add(tt.want), nextTick(epoch, epoch.Add(tt.t), iv))
		})
	}
}

func TestWorkerUntilNext(t *testing.T) {
	t.Parallel()
	epoch := time.Unix(1000, 0)
	const iv = 50 * time.Millisecond
	w := &worker{opts: &Options{Interval: iv}, epoch: epoch}
	ms := time.Millisecond
	tests := []struct {
		name       string
		start, now time.Duration // after epoch
		failures   int
		want       time.Duration
	}{
		{"healthy: the next tick", 2 * iv, 2*iv + 3*ms, 0, iv - 3*ms},
		{"healthy, woken late: still the next tick", 2*iv + 4*ms, 2*iv + 9*ms, 0, iv - 9*ms},
		{"healthy, scrape outlasted the tick: at once", 2 * iv, 3*iv + 20*ms, 0, 0},
		{"healthy, outlasted several ticks: at once", 2 * iv, 6 * iv, 0, 0},
		{"one failure: two intervals, on a tick", 2 * iv, 2*iv + 3*ms, 1, 3*iv - 3*ms},
		{"failed late: backoff from now", 2 * iv, 6*iv + 10*ms, 1, 3*iv - 10*ms},
		{"many failures: maxBackoff, on a tick", 2 * iv, 2*iv + 3*ms, 30, maxBackoff + iv - 3*ms},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, tt.want, w.untilNext(epoch.Add(tt.start), epoch.Add(tt.now), tt.failures))
		})
	}
}

// phase is how far t is from the nearest multiple of interval after ref.
func phase(ref, t time.Time, interval time.Duration) time.Duration {
	d := t.Sub(ref) % interval
	if d < 0 {
		d += interval
	}
	return min(d, interval-d)
}

func TestRunAlignsTheFleetsScrapes(t *testing.T) {
	t.Parallel()
	const interval = 50 * time.Millisecond
	tests := []struct {
		name string
		slow bool // one engine never answers in time
	}{
		{"healthy fleet", false},
		// The slow engine's own scrapes time out and back off; the others
		// keep both their rate and their tick.
		{"with a slow engine", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var addrs []string
			for range 12 {
				addrs = append(addrs, newEngine(t, serveText("vllm:num_requests_running 1\n")).addr())
			}
			var slow *engine
			if tt.slow {
				slow = newEngine(t, func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
				addrs = append(addrs, slow.addr())
			}
			rec := newRecorder()
			start(t, rec, Options{
				Interval: interval,
				Timeout:  2 * interval,
				Targets:  static(addrs...),
			})
			healthy := addrs[:12]
			require.Eventually(t, func() bool {
				for _, a := range healthy {
					if n, _ := rec.counts(a); n < 10 {
						return false
					}
				}
				return true
			}, eventually, poll)

			rec.mu.Lock()
			defer rec.mu.Unlock()
			var ats []time.Time
			for _, a := range healthy {
				require.Empty(t, rec.fails[a])
				ats = append(ats, rec.ats[a]...)
			}
			// The fleet's tick is the phase most scrapes share (one late
			// scrape taken as the reference failed CI). Each engine must
			// be on it most of the time: with a phase of its own per
			// engine, all 12 sharing one is about 12×0.4^11 ≈ 5e-4 likely.
			near := func(ref time.Time) int {
				n := 0
				for _, at := range ats {
					if phase(ref, at, interval) < interval/5 {
						n++
					}
				}
				return n
			}
			tick := ats[0]
			for _, at := range ats[1:] {
				if near(at) > near(tick) {
					tick = at
				}
			}
			for _, a := range healthy {
				var on int
				var phases []time.Duration
				for _, at := range rec.ats[a] {
					d := phase(tick, at, interval)
					phases = append(phases, d)
					if d < interval/5 {
						on++
					}
				}
				// A machine busy with other tests (CI runs packages in
				// parallel, under -race) makes some scrapes late.
				require.Greater(t, 2*on, len(phases), "%s: %d of %d scrapes on the fleet's tick (distances %v)", a, on, len(phases), phases)
			}
			if slow != nil {
				require.Empty(t, rec.stores[slow.addr()])
				require.NotEmpty(t, rec.fails[slow.addr()])
				require.EqualValues(t, 1, slow.maxInflight.Load(), "scrapes of one engine overlapped")
			}
		})
	}
}

func TestRunSlowEngineDoesNotDelayOthers(t *testing.T) {
	t.Parallel()
	// Holds every scrape until the scraper gives up, which with this
	// Timeout is long after the test has ended.
	slow := newEngine(t, func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
	fast := newEngine(t, serveText("vllm:num_requests_running 1\n"))
	rec := newRecorder()
	start(t, rec, Options{
		Interval: 5 * time.Millisecond,
		Timeout:  time.Minute,
		Targets:  static(slow.addr(), fast.addr()),
	})
	require.Eventually(t, func() bool {
		n, _ := rec.counts(fast.addr())
		return n >= 50 && slow.inflight.Load() == 1
	}, eventually, poll)
	require.EqualValues(t, 1, slow.hits.Load(), "one scrape of the slow engine, still in flight")
	_, fails := rec.counts(fast.addr())
	require.Zero(t, fails)
}
