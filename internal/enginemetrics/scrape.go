package enginemetrics

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"sync"
	"time"
)

// Options configure Run.
type Options struct {
	// Interval is the time between scrapes of one engine. Default 50ms, what
	// the Gateway API Inference Extension and AIBrix use.
	Interval time.Duration
	// Timeout bounds one scrape. Default 4×Interval (200ms at 50ms): the
	// staleness at which GIE's saturation detector stops trusting a
	// reading. An answer later than that is of no use, while a busy engine
	// (its Python HTTP server shares a core with request handling) often
	// answers a little later than one Interval; failing it then would flap
	// exactly the engines whose load matters most. Scrapes of one engine
	// never overlap whatever Timeout is, and a failed one backs off.
	Timeout time.Duration
	// Path is the exposition's path. Default "/metrics" (vLLM, SGLang);
	// TensorRT-LLM serve exposes Prometheus text on "/prometheus/metrics".
	Path string
	// Client, when set, makes the scrapes (for TLS, a proxy, a test). By
	// default each engine gets one kept-alive HTTP/1.1 connection of its
	// own, without net/http's Transport: see direct.
	Client *http.Client
	// Targets lists the engines' "host:port" addresses. Run calls it every
	// Interval, so the set may change (config reload, discovery).
	Targets func() []string
	// Store (required) receives a successful scrape, at the time it was
	// sent (the reading is no older than that). Calls for one address are
	// sequential; calls for different addresses are concurrent.
	Store func(address string, s Sample, at time.Time)
	// Failed receives a failed scrape (dead, slow, malformed); may be nil.
	// Same concurrency as Store.
	Failed func(address string, err error)
	// Log receives state changes only (ok→failing, failing→ok), never every
	// failure, so a dead engine does not flood it: one short line each,
	// the engine's address and why. Default slog.Default().
	Log *slog.Logger
}

const (
	defaultInterval = 50 * time.Millisecond
	// maxBackoff bounds the wait after repeated failures: a recovered engine
	// is seen again well within the 2s after which GIE calls metrics stale.
	maxBackoff = time.Second
	// maxBodyBytes bounds an exposition. vLLM's is tens of KiB; each LoRA
	// adapter or model adds series, so leave ample room.
	maxBodyBytes = 16 << 20
)

func (o Options) withDefaults() Options {
	if o.Interval <= 0 {
		o.Interval = defaultInterval
	}
	if o.Timeout <= 0 {
		o.Timeout = 4 * o.Interval
	}
	if o.Path == "" {
		o.Path = "/metrics"
	}
	if o.Failed == nil {
		o.Failed = func(string, error) {}
	}
	if o.Log == nil {
		o.Log = slog.Default()
	}
	return o
}

// Run scrapes until ctx ends: one goroutine per target, started and stopped
// as Targets changes. It returns once every goroutine has stopped; Store and
// Failed are not called after that.
func Run(ctx context.Context, opts Options) {
	opts = opts.withDefaults()
	workers := map[string]*worker{}
	// retired holds workers told to stop that may still be finishing a
	// scrape; one re-added meanwhile waits for its predecessor, so an engine
	// never has two scrapes in flight.
	retired := map[string]*worker{}
	var all sync.WaitGroup
	defer all.Wait()
	// Every worker scrapes at the same multiples of Interval from epoch:
	// the runtime then readies the fleet in one timer pass and netpoll
	// returns its answers together, where a phase of its own per engine
	// cost a thread wake-up per scrape (1,280 a second at 64 engines).
	// The engines are separate processes, so answering at once costs them
	// nothing.
	epoch := time.Now()

	tick := time.NewTicker(opts.Interval)
	defer tick.Stop()
	// want is kept from tick to tick: a map of the fleet rebuilt every
	// Interval was 6% of the scraper's CPU at 64 engines.
	want := map[string]bool{}
	for {
		clear(want)
		if opts.Targets != nil {
			for _, a := range opts.Targets() {
				want[a] = true
			}
		}
		for a, w := range retired {
			if w.stopped() {
				delete(retired, a)
			}
		}
		for a, w := range workers {
			if !want[a] {
				w.cancel()
				delete(workers, a)
				retired[a] = w
			}
		}
		for a := range want {
			if _, ok := workers[a]; ok {
				continue
			}
			wctx, cancel := context.WithCancel(ctx)
			w := &worker{opts: &opts, address: a, epoch: epoch, cancel: cancel, done: make(chan struct{})}
			prev := retired[a]
			delete(retired, a)
			workers[a] = w
			all.Go(func() {
				if prev != nil {
					<-prev.done
				}
				w.run(wctx)
			})
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// worker scrapes one engine, one scrape at a time.
type worker struct {
	opts    *Options
	address string
	epoch   time.Time // ticks are epoch + k×Interval
	cancel  context.CancelFunc
	done    chan struct{}
	// filter is whether to ask for only the families Parse reads (at
	// filtered, Path with filterQuery); false once the engine has shown it
	// does not honour it.
	filter   bool
	filtered string
	direct   *direct // when Options.Client is nil
	parser   *parser
	failing  bool
}

// filterQuery asks prometheus_client (which vLLM, SGLang and TensorRT-LLM
// all serve their metrics with) for only the families Parse reads, with its
// name[] parameter. A 40 KB vLLM exposition shrinks to a dozen lines: the
// engine's Python process renders less and pdx parses less; the full text
// costs milliseconds of CPU to parse. Servers that ignore the parameter
// send everything, which Parse reads just as well. A multi-process
// prometheus_client registry (SGLang, TensorRT-LLM, vLLM with several API
// servers) answers it with nothing; the worker then drops the filter.
var filterQuery = func() string {
	q := url.Values{}
	for _, name := range known {
		q.Add("name[]", name)
	}
	return q.Encode()
}()

func (w *worker) stopped() bool {
	select {
	case <-w.done:
		return true
	default:
		return false
	}
}

func (w *worker) run(ctx context.Context) {
	defer close(w.done)
	w.filter = true
	w.filtered = w.opts.Path + "?" + filterQuery
	w.parser = newParser()
	if w.opts.Client == nil {
		w.direct = &direct{address: w.address}
		defer w.direct.close()
	}
	interval := w.opts.Interval
	now := time.Now()
	timer := time.NewTimer(nextTick(w.epoch, now, interval).Sub(now))
	defer timer.Stop()
	failures := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
		start := time.Now()
		s, err := w.scrape(ctx)
		if ctx.Err() != nil {
			return // stopped mid-scrape: not the engine's failure
		}
		if err != nil {
			failures++
			w.opts.Failed(w.address, err)
		} else {
			failures = 0
			w.opts.Store(w.address, s, start)
		}
		w.logChange(err)
		timer.Reset(w.untilNext(start, time.Now(), failures))
	}
}

// untilNext is how long from now to wait before the next scrape, the last
// having started at start and followed failures failed ones. A healthy
// engine is scraped at the tick after start, or at once when its scrape
// outlasted that tick: waiting for the next would leave its reading a whole
// Interval staler (the scrapes of one engine never overlap, and the next
// one is back on the tick). A failing one backs off from now, so that a
// slow engine is not sent a new scrape while it may still be working on the
// one we gave up on, and comes back on a tick too.
func (w *worker) untilNext(start, now time.Time, failures int) time.Duration {
	interval := w.opts.Interval
	if failures == 0 {
		return max(nextTick(w.epoch, start, interval).Sub(now), 0)
	}
	backoff := min(interval<<min(failures, 10), maxBackoff)
	return nextTick(w.epoch, now.Add(backoff), interval).Sub(now)
}

// nextTick is the first epoch + k×interval strictly after t (k ≥ 1), so a
// worker that wakes a little early still moves on to the next tick.
func nextTick(epoch, t time.Time, interval time.Duration) time.Time {
	k := t.Sub(epoch)/interval + 1
	return epoch.Add(max(k, 1) * interval)
}

func (w *worker) logChange(err error) {
	switch {
	case err != nil && !w.failing:
		w.failing = true
		w.opts.Log.Warn("engine metrics: scrape failing", "address", w.address, "error", err)
	case err == nil && w.failing:
		w.failing = false
		w.opts.Log.Info("engine metrics: scrape ok again", "address", w.address)
	}
}

// errStatus is a scrape answered with something other than 200 OK.
var errStatus = errors.New("enginemetrics: unexpected status")

// accept asks for the classic text format, the one Parse reads:
// prometheus_client picks the format it answers in from the Accept header.
const accept = "text/plain;version=0.0.4"

// scrape reads the engine's load once; ctx is the worker's.
func (w *worker) scrape(ctx context.Context) (Sample, error) {
	if !w.filter {
		return w.get(ctx, w.opts.Path)
	}
	s, err := w.get(ctx, w.filtered)
	if errors.Is(err, ErrNoLoad) {
		// Filtered to nothing: a multi-process registry. (An engine that
		// has no series yet loses the filter too; it then costs more
		// CPU, never correctness.)
		w.filter = false
		return w.get(ctx, w.opts.Path)
	}
	return s, err
}

// get scrapes target (path and query) and parses the answer.
func (w *worker) get(ctx context.Context, target string) (Sample, error) {
	if w.direct == nil {
		return w.getClient(ctx, target)
	}
	a, err := w.direct.get(ctx, target, w.opts.Timeout)
	if err != nil {
		return Sample{}, err
	}
	if a.code != http.StatusOK {
		return Sample{}, fmt.Errorf("%w %s for GET %s", errStatus, a.status, w.opts.Path)
	}
	return w.parser.parseBytes(a.body)
}

// getClient is get with Options.Client.
func (w *worker) getClient(ctx context.Context, target string) (s Sample, err error) {
	ctx, cancel := context.WithTimeout(ctx, w.opts.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+w.address+target, nil)
	if err != nil {
		return Sample{}, err
	}
	req.Header.Set("Accept", accept)
	resp, err := w.opts.Client.Do(req)
	if err != nil {
		// As direct's: the path without the query.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return Sample{}, fmt.Errorf("GET %s: %w", w.opts.Path, err)
	}
	defer func() {
		// Drain what is left (bounded) so the connection is reused.
		_, _ = io.CopyN(io.Discard, resp.Body, 64<<10)
		_ = resp.Body.Close()
	}()
	if resp.StatusCode != http.StatusOK {
		return Sample{}, fmt.Errorf("%w %s for GET %s", errStatus, resp.Status, w.opts.Path)
	}
	body := &io.LimitedReader{R: resp.Body, N: maxBodyBytes + 1}
	s, err = w.parser.parse(body)
	if err == nil && body.N == 0 {
		err = fmt.Errorf("enginemetrics: exposition of GET %s exceeds %d bytes", w.opts.Path, maxBodyBytes)
	}
	return s, err
}
