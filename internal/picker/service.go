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
//	T = overhead + perQueued × ahead + perOwn × own
//
// where ahead are the uncached prompt tokens queued before the call's
// (what remains of pdx's prefills there, and the others' the engine's
// metrics count) and own the call's uncached tokens. perOwn is the time
// the engine takes a token of one prompt, perQueued a token of the queue:
// an engine that computes c prompts at once drains its queue c times
// faster than it computes one of them (perQueued ≈ perOwn / c), and a
// router that weighs both alike (least_work) moves a prompt away from its
// cache too readily.
//
// It is learned from every prefill pdx calls there and that answers
// (learn): a weighted least-squares fit of the three coefficients to the
// calls' durations, each sample's weight decaying by decay per sample (the
// last ~serviceMemory prefills count), a residual far beyond the fit's
// usual error counting less (Huber weights: a stalled call or a GC pause
// does not drag the fit), and a prior (seed) that holds the coefficients
// the samples do not tell apart: at low load nothing is ever queued, and
// perQueued stays the seed's until the engine is busy. Picks read the
// coefficients without locking (forecast); learn holds mu.
type service struct {
	mu sync.Mutex
	// coef are the fitted overhead (s), perQueued and perOwn (s per
	// thousand tokens), as float64 bits, published for picks.
	coef [3]atomic.Uint64
	// samples counts the prefills learned from.
	samples atomic.Int64
	// Under mu: the weighted sums of x xᵀ and x y over the samples
	// (x = (1, ahead, own) in thousands of tokens, y = T in seconds), and
	// scale, the decayed mean absolute residual.
	xx    [3][3]float64
	xy    [3]float64
	scale float64
}

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
	huberK = 3
	// DefaultPrefillTokensPerSec seeds an engine's rate before pdx has
	// timed its prefills: the order of an 8B model on one H100 (10–20k
	// tokens a second). The fit replaces it within tens of prefills.
	DefaultPrefillTokensPerSec = 15000
	// defaultOverhead seeds the fixed cost of a prefill call: the HTTP
	// round trip and the engine's step around it.
	defaultOverhead = 0.010
)

// seed is the model before any sample: one prompt at a time at rate,
// defaultOverhead a call.
func seed(rate float64) [3]float64 {
	per := 1000 / rate
	return [3]float64{defaultOverhead, per, per}
}

// forecast is the model's time for a call of own uncached tokens behind
// ahead queued ones, in seconds. Before the first sample it is the seed's.
func (m *service) forecast(ahead, own int) float64 {
	if m.samples.Load() == 0 {
		c := seed(DefaultPrefillTokensPerSec)
		return c[0] + (c[1]*float64(ahead)+c[2]*float64(own))/1000
	}
	o := math.Float64frombits(m.coef[0].Load())
	q := math.Float64frombits(m.coef[1].Load())
	p := math.Float64frombits(m.coef[2].Load())
	return o + (q*float64(ahead)+p*float64(own))/1000
}

// coefficients returns the fitted overhead (s) and rates (tokens a
// second, of the queue and of one prompt), and how many samples taught
// them.
func (m *service) coefficients() (overhead, queueRate, ownRate float64, samples int64) {
	if m.samples.Load() == 0 {
		return defaultOverhead, DefaultPrefillTokensPerSec, DefaultPrefillTokensPerSec, 0
	}
	return math.Float64frombits(m.coef[0].Load()),
		1000 / math.Float64frombits(m.coef[1].Load()),
		1000 / math.Float64frombits(m.coef[2].Load()),
		m.samples.Load()
}

// learn fits the model to one more prefill: it took t seconds, own
// uncached tokens behind ahead queued ones. It does not allocate.
func (m *service) learn(t float64, ahead, own int) {
	if !(t > 0) || math.IsInf(t, 0) || ahead < 0 || own < 0 {
		return
	}
	x := [3]float64{1, float64(ahead) / 1000, float64(own) / 1000}
	m.mu.Lock()
	defer m.mu.Unlock()
	n := m.samples.Load()
	cur := seed(DefaultPrefillTokensPerSec)
	if n > 0 {
		for i := range cur {
			cur[i] = math.Float64frombits(m.coef[i].Load())
		}
	}
	residual := t - (cur[0] + cur[1]*x[1] + cur[2]*x[2])
	w := 1.0
	if a := math.Abs(residual); n >= 8 && a > huberK*m.scale {
		w = huberK * m.scale / a
	}
	const keep = 1 - 1.0/serviceMemory
	if n == 0 {
		m.scale = math.Abs(residual)
	} else {
		// The scale follows faster than the fit, so that the seed's
		// first, large residual soon stops setting it.
		m.scale += (math.Min(math.Abs(residual), huberK*max(m.scale, 1e-6)) - m.scale) / scaleMemory
	}
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
	m.samples.Add(1)
}

// solve returns the coefficients that fit the weighted sums best with the
// seed as a prior of priorWeight samples at one thousand tokens, bounded
// to sane values: a positive overhead under a minute, a rate between one
// token and a billion a second.
func (m *service) solve() ([3]float64, bool) {
	prior := seed(DefaultPrefillTokensPerSec)
	var a [3][4]float64
	for i := range 3 {
		for j := range 3 {
			a[i][j] = m.xx[i][j]
		}
		a[i][i] += priorWeight
		a[i][3] = m.xy[i] + priorWeight*prior[i]
	}
	// Gaussian elimination with partial pivoting on the 3×4 system.
	for col := range 3 {
		pivot := col
		for r := col + 1; r < 3; r++ {
			if math.Abs(a[r][col]) > math.Abs(a[pivot][col]) {
				pivot = r
			}
		}
		if math.Abs(a[pivot][col]) < 1e-12 {
			return [3]float64{}, false
		}
		a[col], a[pivot] = a[pivot], a[col]
		for r := range 3 {
			if r == col {
				continue
			}
			f := a[r][col] / a[col][col]
			for c := col; c < 4; c++ {
				a[r][c] -= f * a[col][c]
			}
		}
	}
	var out [3]float64
	for i := range out {
		out[i] = a[i][3] / a[i][i]
	}
	out[0] = min(max(out[0], 0), 60)
	for i := 1; i < 3; i++ {
		out[i] = min(max(out[i], 1e-6), 1000)
	}
	return out, true
}

// Service is what a prefill endpoint's service model has learned: its
// overhead a call, the rate it drains its queue at and the rate it
// computes one prompt at, and how many of pdx's prefills taught it (0: the
// seed's). False for an endpoint the Set does not have.
type Service struct {
	Overhead              time.Duration
	QueueRate, PromptRate float64 // tokens a second
	Samples               int64
}

// Service returns what ep's service model has learned.
func (s *Set) Service(ep endpoint.Endpoint) (Service, bool) {
	h := s.view.Load().lookup(ep)
	if h == nil || h.service == nil {
		return Service{}, false
	}
	o, q, p, n := h.service.coefficients()
	return Service{Overhead: time.Duration(o * float64(time.Second)), QueueRate: q, PromptRate: p, Samples: n}, true
}
