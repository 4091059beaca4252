package picker

import (
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdx-router/pdx/internal/endpoint"
)

// service is a prefill endpoint's learned service model: how long pdx's
// call to it takes to answer, from the call to the answer, as
//
//	T = overhead + perAhead × ahead + perWaiting × waiting + perOwn × own
//
// where ahead are the uncached prompt tokens in the engine before the
// call's (what remains of pdx's prefills there, and the others' the
// engine's metrics count), waiting those the slot free first computes
// before the engine takes the call (fifo: none while a slot is free), and
// own the call's uncached tokens. perOwn is the time the engine takes a
// token of one prompt. An engine whose prompts share one accelerator
// (vLLM's batched prefill chunks) computes the queue and the call
// together; its metrics show it as one slot, so waiting is ahead and
// perAhead + perWaiting is near perOwn. One that computes several prompts
// at once each at full speed (a simulator's slots) starts the call as
// soon as a slot frees: perWaiting near perOwn, perAhead near 0. A router
// that weighs every queued token as one of the prompt's own (least_work)
// moves a prompt away from its cache too readily on the second kind.
//
// It is learned from every prefill pdx calls there and that answers
// (learn): a weighted least-squares fit of the coefficients to the calls'
// durations, each sample's weight decaying by 1/serviceMemory per later
// one, a residual far beyond the fit's usual error counting less (Huber
// weights: a stalled call or a GC pause does not drag the fit), and a
// prior (seed) that holds the coefficients the samples do not tell apart:
// at low load nothing is queued, and perAhead and perWaiting stay the
// seed's until the engine is busy. Picks read the coefficients without
// locking (forecast); learn holds mu.
type service struct {
	mu sync.Mutex
	// coef are the fitted overhead (s), perAhead, perWaiting and perOwn
	// (s per thousand tokens), as float64 bits, published for picks.
	coef [features]atomic.Uint64
	// samples counts the prefills learned from.
	samples atomic.Int64
	// slots is how many prompts the engine has been seen computing at
	// once while others waited (its metrics: running, with some
	// waiting), at least 1.
	slots atomic.Int32
	// noise is scale, as float64 bits, published for picks once
	// huberMin samples have set it.
	noise atomic.Uint64
	// Under mu: the weighted sums of x xᵀ and x y over the samples
	// (x = (1, ahead, waiting, own) in thousands of tokens, y = T in
	// seconds), and scale, the decayed mean absolute residual.
	xx    [features][features]float64
	xy    [features]float64
	scale float64
	// rate is the prompt rate of coef in tokens a nanosecond, as float64
	// bits, for the queue to count what each prefill has computed without
	// a division: 0 until a fit gives a prompt token a cost (a fit that
	// gives it none, bounded at 0, leaves the last).
	rate atomic.Uint64
	// queue is pdx's prefills in flight on the engine (fifo).
	queue fifo
}

// perNs is the engine's rate for one prompt in tokens a nanosecond, for
// the queue: the model's prompt rate, or the seed's before it learned.
func (m *service) perNs() float64 {
	if r := math.Float64frombits(m.rate.Load()); r > 0 {
		return r
	}
	return DefaultPrefillTokensPerSec / 1e9
}

// queueNow is the engine's queue before a prompt sent at now (fifo.queue),
// with extra requests of mean tokens pdx did not send.
func (m *service) queueNow(now int64, extra, mean int) queue {
	return m.queue.queue(now, m.slotsSeen(), m.perNs(), extra, mean)
}

// features is the model's number of coefficients.
const features = 4

// Units and the model's memory and prior.
const (
	// serviceMemory is how many recent prefills the fit remembers: a
	// sample's weight decays by 1 − 1/serviceMemory with each later one.
	serviceMemory = 128
	// priorWeight is how many samples the seed weighs: enough to hold
	// an unidentified coefficient, little against serviceMemory.
	priorWeight = 0.25
	// scaleMemory is the mean absolute residual's memory, in samples.
	scaleMemory = 16
	// huberK: residuals beyond huberK × the mean absolute residual
	// count as that far (Huber's loss).
	huberK = 2
	// huberMin is how many samples the scale needs before it weighs
	// residuals, or picks read it: the seed's first residuals set it.
	huberMin = 8
	// DefaultPrefillTokensPerSec seeds an engine's rate before pdx has
	// timed its prefills: the order of an 8B model on one H100 (10–20k
	// tokens a second). The fit replaces it within tens of prefills.
	DefaultPrefillTokensPerSec = 15000
	// defaultOverhead seeds the fixed cost of a prefill call: the HTTP
	// round trip and the engine's step around it.
	defaultOverhead = 0.010
)

// seed is the model before any sample: a token waited for and one of the
// prompt's own each at rate, the rest of the queue costing nothing (on an
// engine of one slot, all of it is waited for), defaultOverhead a call.
func seed(rate float64) [features]float64 {
	per := 1000 / rate
	return [features]float64{defaultOverhead, 0, per, per}
}

// queue is what is in an engine before a call: ahead, the uncached
// tokens of its requests, and waiting, those the call waits for before a
// slot frees.
type queue struct{ ahead, waiting int }

// load takes what the engine's metrics said: a sample with requests
// waiting shows how many it computes at once.
func (m *service) load(running, waiting int) {
	if waiting <= 0 || running <= 0 {
		return
	}
	for {
		old := m.slots.Load()
		if int32(running) <= old || m.slots.CompareAndSwap(old, int32(min(running, 1<<20))) {
			return
		}
	}
}

// slotsSeen is how many prompts the engine computes at once, as far as
// its metrics have shown (1 before they have).
func (m *service) slotsSeen() int { return max(int(m.slots.Load()), 1) }

// noiseSeen is how far, in seconds, the model's forecasts usually miss:
// the decayed mean absolute residual of its fit, 0 before huberMin
// samples.
func (m *service) noiseSeen() float64 { return math.Float64frombits(m.noise.Load()) }

// forecast is the model's time for a call of own uncached tokens behind
// q, in seconds: its rates with its peers' overhead, and weight − 1 more
// times the own tokens' time at the peers' prompt rate (1: the time
// alone). The weight is what computing the tokens costs the pool (see
// Forecast), at the pool's rate: at each engine's own, the weight would
// multiply the small differences between alike engines' learned rates,
// and send every long prompt to the one learned fastest. Before the first
// sample it is wholly its peers' (see peerModel), or without them the
// seed's.
func (m *service) forecast(q queue, own int, weight float64, peers *peerModel) float64 {
	var c [features]float64
	switch {
	case m.samples.Load() > 0:
		for i := range c {
			c[i] = math.Float64frombits(m.coef[i].Load())
		}
		if peers != nil && peers.n > 0 {
			c[0] = peers.coef[0]
		}
	case peers != nil && peers.n > 0:
		c = peers.coef
	default:
		c = seed(DefaultPrefillTokensPerSec)
	}
	pool := c[3]
	if peers != nil && peers.n > 0 {
		pool = peers.coef[3]
	}
	return c[0] + (c[1]*float64(q.ahead)+c[2]*float64(q.waiting)+(c[3]+(weight-1)*pool)*float64(own))/1000
}

// peerModel is the mean model of a pick's candidates that have learned
// theirs. Its overhead is every engine's in a forecast (see Forecast);
// the whole of it is what an engine new to pdx (one discovery just added)
// is taken to be until it has answered, rather than the seed, which can
// be far from what its peers have shown and would draw requests to it,
// or keep them away, for no reason of its own.
type peerModel struct {
	coef [features]float64
	n    int
}

// add counts m in the sums, if it has learned; mean makes them the mean
// once every candidate is added (a division a coefficient, not a
// candidate).
func (p *peerModel) add(m *service) {
	if m.samples.Load() == 0 {
		return
	}
	p.n++
	for i := range p.coef {
		p.coef[i] += math.Float64frombits(m.coef[i].Load())
	}
}

// mean turns the sums add made into their mean.
func (p *peerModel) mean() {
	if p.n > 1 {
		for i := range p.coef {
			p.coef[i] /= float64(p.n)
		}
	}
}

// coefficients returns the fitted overhead (s) and rates (tokens a
// second: of the engine's whole queue while it computes the call, of the
// part the call waits for, and of one prompt), and how many samples
// taught them. A rate the fit found no time for is +Inf.
func (m *service) coefficients() (overhead, aheadRate, waitingRate, ownRate float64, samples int64) {
	c := seed(DefaultPrefillTokensPerSec)
	n := m.samples.Load()
	if n > 0 {
		for i := range c {
			c[i] = math.Float64frombits(m.coef[i].Load())
		}
	}
	return c[0], 1000 / c[1], 1000 / c[2], 1000 / c[3], n
}

// learn fits the model to one more prefill: it took t seconds, own
// uncached tokens behind q. It does not allocate.
func (m *service) learn(t float64, q queue, own int) {
	if !(t > 0) || math.IsInf(t, 0) || q.ahead < 0 || q.waiting < 0 || own < 0 {
		return
	}
	x := [features]float64{1, float64(q.ahead) / 1000, float64(q.waiting) / 1000, float64(own) / 1000}
	m.mu.Lock()
	defer m.mu.Unlock()
	n := m.samples.Load()
	cur := seed(DefaultPrefillTokensPerSec)
	if n > 0 {
		for i := range cur {
			cur[i] = math.Float64frombits(m.coef[i].Load())
		}
	}
	predicted := 0.0
	for i := range x {
		predicted += cur[i] * x[i]
	}
	residual := t - predicted
	w := 1.0
	if a := math.Abs(residual); n >= huberMin && a > huberK*m.scale {
		w = huberK * m.scale / a
	}
	if n == 0 {
		m.scale = math.Abs(residual)
	} else {
		// The scale follows faster than the fit, so that the seed's
		// first, large residual soon stops setting it.
		m.scale += (math.Min(math.Abs(residual), huberK*max(m.scale, 1e-6)) - m.scale) / scaleMemory
	}
	const keep = 1 - 1.0/serviceMemory
	for i := range x {
		for j := range x {
			m.xx[i][j] = keep*m.xx[i][j] + w*x[i]*x[j]
		}
		m.xy[i] = keep*m.xy[i] + w*x[i]*t
	}
	next, ok := m.solve()
	if !ok {
		return
	}
	for i := range next {
		m.coef[i].Store(math.Float64bits(next[i]))
	}
	if next[3] > 0 {
		m.rate.Store(math.Float64bits(1e-6 / next[3]))
	}
	if n+1 >= huberMin {
		m.noise.Store(math.Float64bits(m.scale))
	}
	m.samples.Add(1)
}

// solve returns the coefficients that fit the weighted sums best with the
// seed as a prior of priorWeight samples at one thousand tokens, bounded
// to sane values: an overhead from 0 to a minute, rates from one token a
// second up, and a token the call waits for costing at least one of its
// own.
func (m *service) solve() ([features]float64, bool) {
	prior := seed(DefaultPrefillTokensPerSec)
	if m.samples.Load() > 0 {
		// A token waited for costs what one of the prompt's own does (a
		// slot's rate), as far as the samples have not told otherwise:
		// few calls wait on an engine of several slots short of busy.
		prior[2] = math.Float64frombits(m.coef[3].Load())
	}
	var a [features][features + 1]float64
	for i := range features {
		for j := range features {
			a[i][j] = m.xx[i][j]
		}
		a[i][i] += priorWeight
		a[i][features] = m.xy[i] + priorWeight*prior[i]
	}
	// Gauss-Jordan elimination with partial pivoting.
	for col := range features {
		pivot := col
		for r := col + 1; r < features; r++ {
			if math.Abs(a[r][col]) > math.Abs(a[pivot][col]) {
				pivot = r
			}
		}
		if math.Abs(a[pivot][col]) < 1e-12 {
			return [features]float64{}, false
		}
		a[col], a[pivot] = a[pivot], a[col]
		for r := range features {
			if r == col {
				continue
			}
			f := a[r][col] / a[col][col]
			for c := col; c <= features; c++ {
				a[r][c] -= f * a[col][c]
			}
		}
	}
	var out [features]float64
	for i := range out {
		out[i] = a[i][features] / a[i][i]
	}
	out[0] = min(max(out[0], 0), 60)
	for i := 1; i < features; i++ {
		out[i] = min(max(out[i], 0), 1000)
	}
	// A token the call waits for (which is ahead of it too) costs it at
	// least one of its own: the slot free first, or the engine's shared
	// step, computes it at no more than one prompt's rate. The fit alone
	// says less: the queue it is fitted to is pdx's count, off by what
	// each prompt ahead found cached and how far each running one got,
	// and a regressor counted with error draws its coefficient toward 0
	// and the overhead up (on the cache-bound rig at 85%, a waited token
	// learned at 3,350–3,910 tokens a second where the engines compute
	// 2,500, the overhead at 10–21 ms where it is 5). A queue that costs too little
	// keeps prompts behind it for their cache, and one that costs nothing
	// (samples of an idle engine, a burst's) would draw every request.
	if out[1]+out[2] < out[3] {
		out[2] = out[3] - out[1]
	}
	return out, true
}

// Service is what a prefill endpoint's service model has learned, and how
// many of pdx's prefills taught it (0: the seed's). False for an endpoint
// the Set does not have.
type Service struct {
	Overhead time.Duration
	// AheadRate, WaitingRate and PromptRate are in tokens a second (see
	// service): what the engine's whole queue costs a call, what the part
	// it waits for costs, and one prompt's own tokens; +Inf for a term
	// the fit found costs nothing.
	AheadRate, WaitingRate, PromptRate float64
	// Slots is how many prompts the engine was seen computing at once.
	Slots   int
	Samples int64
}

// Service returns what ep's service model has learned.
func (s *Set) Service(ep endpoint.Endpoint) (Service, bool) {
	h := s.view.Load().lookup(ep)
	if h == nil || h.service == nil {
		return Service{}, false
	}
	o, a, w, p, n := h.service.coefficients()
	return Service{Overhead: time.Duration(o * float64(time.Second)), AheadRate: a, WaitingRate: w, PromptRate: p,
		Slots: h.service.slotsSeen(), Samples: n}, true
}
