package picker

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// trueService is an engine's real service: overhead seconds a call, rate
// tokens a second for one prompt, slots prompts at once each at rate (a
// simulator's slots); shared: its prompts share the rate instead (an
// accelerator), the call done when the work ahead and its own is.
type trueService struct {
	overhead, rate float64
	slots          int
	shared         bool
}

func (e trueService) time(q queue, own int) float64 {
	if e.shared {
		return e.overhead + float64(q.ahead+own)/e.rate
	}
	return e.overhead + float64(q.waiting+own)/e.rate
}

// queueFor is the queue pdx counts on e (fifo) of n requests just sent,
// of ahead tokens together.
func (e trueService) queueFor(ahead, n int) queue {
	var f fifo
	for range n {
		f.add(ahead/n, 0, e.slots)
	}
	return f.queue(0, e.slots, 0, 0, 0)
}

// randomQueue is the queue pdx counts on e of up to five requests of 200
// to 1,200 tokens, sent up to a second ago (those in slots computed at a
// token a millisecond since, the rest waiting whole).
func (e trueService) randomQueue(rng *rand.Rand) queue {
	var f fifo
	for range rng.IntN(6) {
		f.add(200+rng.IntN(1000), -rng.Int64N(int64(time.Second)), e.slots)
	}
	return f.queue(0, e.slots, 1/float64(time.Millisecond), 0, 0)
}

// samplesToConverge feeds m total samples of e (queues and own tokens
// drawn at random, 5% noise and, when outliers, one call in twenty 10×
// slower) and returns after how many its forecasts were within tol of
// e's at an idle engine and four queues drawn alike, and stayed so to the
// end; -1 if they never did.
func samplesToConverge(m *service, e trueService, rng *rand.Rand, outliers bool, tol float64, total int) int {
	m.load(e.slots, 1) // the engine's metrics have shown its slots
	points := []queue{{}}
	for at := rand.New(rand.NewPCG(9, 9)); len(points) < 5; {
		if q := e.randomQueue(at); q.ahead > 0 {
			points = append(points, q)
		}
	}
	since := -1
	for n := 1; n <= total; n++ {
		q := e.randomQueue(rng)
		own := 100 + rng.IntN(2000)
		t := e.time(q, own) * (1 + 0.05*rng.NormFloat64())
		if outliers && rng.IntN(20) == 0 {
			t *= 10
		}
		m.learn(t, q, own)
		ok := true
		for _, p := range points {
			want := e.time(p, 1000)
			if math.Abs(m.forecast(p, 1000, 1, nil)-want) > tol*want {
				ok = false
			}
		}
		switch {
		case !ok:
			since = -1
		case since < 0:
			since = n
		}
	}
	return since
}

// The model learns an engine's overhead, its rate and how many prompts it
// computes at once from pdx's own timed prefills, whatever the seed, and
// outliers do not drag it: over twenty draws of an engine's calls each,
// its forecasts are within 10% of the engine's for good after a median
// of at most 50 prefills (150 with one call in twenty 10× slower), each
// within 500, and its prompt rate within 10%.
func TestServiceConverges(t *testing.T) {
	for _, tc := range []struct {
		name     string
		engine   trueService
		outliers bool
	}{
		{name: "one slot, near the seed", engine: trueService{overhead: 0.005, rate: 12000, slots: 1}},
		{name: "two slots, slow", engine: trueService{overhead: 0.03, rate: 1000, slots: 2}},
		{name: "four slots, fast", engine: trueService{overhead: 0.002, rate: 40000, slots: 4}},
		{name: "shared accelerator", engine: trueService{overhead: 0.008, rate: 20000, slots: 64, shared: true}},
		{name: "one slot, outliers", engine: trueService{overhead: 0.005, rate: 12000, slots: 1}, outliers: true},
		{name: "two slots, outliers", engine: trueService{overhead: 0.03, rate: 1000, slots: 2}, outliers: true},
		{name: "four slots, outliers", engine: trueService{overhead: 0.002, rate: 40000, slots: 4}, outliers: true},
		{name: "shared accelerator, outliers", engine: trueService{overhead: 0.008, rate: 20000, slots: 64, shared: true}, outliers: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var took []int
			for draw := range uint64(20) {
				m := new(service)
				n := samplesToConverge(m, tc.engine, rand.New(rand.NewPCG(draw, 2)), tc.outliers, 0.10, 1000)
				_, _, _, p, _ := m.coefficients()
				require.Positive(t, n, "draw %d: not within 10%% at the end of 1,000 prefills", draw)
				require.LessOrEqual(t, n, 500, "draw %d", draw)
				require.InDelta(t, tc.engine.rate, p, 0.1*tc.engine.rate, "draw %d", draw)
				took = append(took, n)
			}
			slices.Sort(took)
			t.Logf("within 10%% for good after %v prefills", took)
			median := 50
			if tc.outliers {
				median = 150
			}
			require.LessOrEqual(t, took[len(took)/2], median)
		})
	}
}

// A model learned at low load, where nothing ever queues, keeps the seed's
// queue rate rather than a wild one.
func TestServiceUnqueued(t *testing.T) {
	m := new(service)
	e := trueService{overhead: 0.01, rate: 5000, slots: 1}
	rng := rand.New(rand.NewPCG(3, 4))
	for range 200 {
		own := 100 + rng.IntN(2000)
		m.learn(e.time(queue{}, own), queue{}, own)
	}
	o, a, w, p, n := m.coefficients()
	require.EqualValues(t, 200, n)
	require.InDelta(t, e.overhead, o, 0.002)
	require.InDelta(t, e.rate, p, 0.05*e.rate)
	require.True(t, math.IsInf(a, 1), "the seed's: the queue costs its wait, nothing taught otherwise")
	require.InDelta(t, p, w, 0.01*p, "a token waited for costs one of the prompt's own, nothing taught otherwise")
}

// Learning from a finished prefill allocates nothing, and nonsense times
// teach nothing.
func TestServiceLearn(t *testing.T) {
	m := new(service)
	q := queue{ahead: 100, waiting: 50}
	require.Zero(t, testing.AllocsPerRun(100, func() { m.learn(0.1, q, 1000) }))
	n := m.samples.Load()
	for _, bad := range []float64{0, -1, math.NaN(), math.Inf(1)} {
		m.learn(bad, q, 1000)
	}
	require.Equal(t, n, m.samples.Load())
}

// A prefill lease teaches its endpoint's model when it answers: the time
// from the pick, the tokens queued before it, and its uncached tokens, as
// the engine reported them when it did (Observe).
func TestLeaseTeachesService(t *testing.T) {
	eps := endpoints(2)
	clk := newFakeClock()
	set := NewSet(eps, Options{Now: clk.Now})
	l := newLeg(set, Forecast{}, RolePrefill)
	e := trueService{overhead: 0.02, rate: 10000, slots: 1}
	for i := range 60 {
		tokens := 1000 + 100*(i%20)
		lease, ok := l.Pick(Request{Subset: []string{eps[0].Address}, Tokens: tokens})
		require.True(t, ok)
		lease.Observe(tokens, tokens/2) // the engine had half cached
		clk.Advance(time.Duration(e.time(queue{}, tokens/2) * float64(time.Second)))
		lease.End(Succeeded)
	}
	m := set.view.Load().states[0].service
	overhead, _, _, rate, n := m.coefficients()
	require.EqualValues(t, 60, n)
	require.InDelta(t, e.overhead, overhead, 0.002)
	require.InDelta(t, e.rate, rate, 0.05*e.rate, "from the tokens the engine computed, half the prompt")
	require.Zero(t, set.view.Load().states[1].service.samples.Load())

	lease, ok := l.Pick(Request{Subset: []string{eps[0].Address}, Tokens: 1000})
	require.True(t, ok)
	lease.End(Failed)
	require.EqualValues(t, 60, m.samples.Load(), "a failure teaches nothing")
}

// teachSlotted has m learn e exactly from 300 prefills behind queues of fewer
// than requests requests, its metrics having shown e's slots.
func teachSlotted(m *service, e trueService, rng *rand.Rand, requests int) {
	m.load(e.slots, 1)
	for range 300 {
		n := rng.IntN(requests)
		q := e.queueFor(n*(100+rng.IntN(1000)), n)
		own := 100 + rng.IntN(2000)
		m.learn(e.time(q, own), q, own)
	}
}

// Forecast waits behind a queue for a prompt's cache where the engine
// takes the prompt as soon as one of its slots frees, and least_work does
// not.
func TestForecastWeighsTheQueue(t *testing.T) {
	eps := endpoints(2)
	set := NewSet(eps, Options{})
	holder, other := set.view.Load().states[0], set.view.Load().states[1]
	// Both engines compute four prompts at once, each at 1,000 tokens a
	// second.
	e := trueService{overhead: 0.01, rate: 1000, slots: 4}
	rng := rand.New(rand.NewPCG(5, 6))
	for _, h := range []*health{holder, other} {
		teachSlotted(h.service, e, rng, 8)
	}
	prompt := blocksOf(1, 2, 3, 4, 5, 6, 7, 8)
	hold(t, set, eps[0], prompt, 0)
	// 2,000 tokens in two prefills on the holder, which holds 8 × 64 = 512
	// of the prompt's 1,000 and has two slots free: its forecast is
	// 488/1000 s against 1000/1000 s on the idle one.
	startPrefill(t, set, eps[0], 1000)
	startPrefill(t, set, eps[0], 1000)
	req := Request{Blocks: prompt, BlockTokens: 64, Tokens: 1000}
	pick := func(p Policy) string {
		leg := newLeg(set, p, RolePrefill)
		lease, ok := leg.Pick(req)
		require.True(t, ok)
		defer lease.End(Released)
		return lease.Endpoint().Address
	}
	require.Equal(t, eps[0].Address, pick(Forecast{}))
	require.Equal(t, eps[1].Address, pick(LeastWork{}), "2,000 queued + 488 against 1,000")
}

// On a busy pool a prompt's own uncached tokens weigh more: the same
// queue ahead of the engine holding half of it sends it to an idle engine
// while the rest of the pool is idle, and keeps it with its cache once
// the pool's slots are mostly taken.
func TestForecastWeighsThePool(t *testing.T) {
	for _, tc := range []struct {
		name string
		busy int // prefills on the third engine
		want int
	}{
		{"pool idle", 0, 1},
		{"pool busy", 4, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			eps := endpoints(3)
			set := NewSet(eps, Options{})
			// Every engine computes two prompts at once, each at 1,000
			// tokens a second.
			e := trueService{overhead: 0.01, rate: 1000, slots: 2}
			rng := rand.New(rand.NewPCG(7, 8))
			for _, h := range set.view.Load().states {
				teachSlotted(h.service, e, rng, 6)
			}
			prompt := blocksOf(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)
			hold(t, set, eps[0], prompt, 0).End(Released)
			// The holder has 768 of the prompt's 1,000 tokens and four
			// prefills of 1,000: the prompt waits 2 s for a slot (the
			// two it queues behind), then takes 0.232 s; on the idle
			// engine it takes 1 s. The slots taken, of six: the holder's
			// two and the third engine's.
			for range 4 {
				startPrefill(t, set, eps[0], 1000)
			}
			for range tc.busy {
				startPrefill(t, set, eps[2], 1000)
			}
			leg := newLeg(set, Forecast{}, RolePrefill)
			for range 3 { // whichever candidate the round starts from
				lease, ok := leg.Pick(Request{Blocks: prompt, BlockTokens: 64, Tokens: 1000})
				require.True(t, ok)
				lease.End(Released)
				require.Equal(t, eps[tc.want], lease.Endpoint())
			}
		})
	}
}

// The pool's weight on a prompt's own tokens is at the pool's rate, not
// each engine's: between engines that learned their rates a little apart
// (noise, on alike engines) it adds the same time to every forecast, and
// does not multiply that noise by the weight, which sent every long prompt
// to the engine whose rate was learned highest (the replay's conversation
// trace: 147 to 333 prefills an engine).
func TestForecastWeighsAtThePoolRate(t *testing.T) {
	var fast, slow service
	rng := rand.New(rand.NewPCG(9, 10))
	teachSlotted(&fast, trueService{overhead: 0.01, rate: 1100, slots: 1}, rng, 4)
	teachSlotted(&slow, trueService{overhead: 0.01, rate: 1000, slots: 1}, rng, 4)
	var peers peerModel
	peers.add(&fast)
	peers.add(&slow)
	peers.mean()
	_, _, _, fastRate, _ := fast.coefficients()
	_, _, _, slowRate, _ := slow.coefficients()
	require.Greater(t, fastRate, 1.05*slowRate, "the two learned rates apart")
	q, own := queue{ahead: 2000, waiting: 2000}, 1500
	extra := func(m *service) float64 { return m.forecast(q, own, 5, &peers) - m.forecast(q, own, 1, &peers) }
	require.InDelta(t, extra(&slow), extra(&fast), 1e-9)
	require.InDelta(t, 4*float64(own)*peers.coef[3]/1000, extra(&fast), 1e-9, "four times the prompt at the pool's rate")
}

// An engine new to pdx is forecast as its peers until it has answered.
func TestForecastNewEngineAsPeers(t *testing.T) {
	eps := endpoints(3)
	set := NewSet(eps, Options{})
	// Two engines have shown a 0.1 ms overhead and a million tokens a
	// second, far from the seed's 10 ms; the third is new.
	for i := range 2 {
		m := set.view.Load().states[i].service
		for k := range 50 {
			m.learn(0.0001+float64(100*k)/1e6, queue{}, 100*k)
		}
	}
	prompt := blocksOf(1, 2, 3, 4)
	hold(t, set, eps[2], prompt, 0)
	leg := newLeg(set, Forecast{}, RolePrefill)
	req := Request{Blocks: prompt, BlockTokens: 64, Tokens: 256}
	lease, ok := leg.Pick(req)
	require.True(t, ok)
	lease.End(Released)
	require.Equal(t, eps[2], lease.Endpoint(), "the new engine holds the whole prompt: forecast as its peers, it is the quickest")
	require.Zero(t, testing.AllocsPerRun(100, func() {
		l, _ := leg.Pick(req)
		l.End(Released)
	}))
}

// An engine's metrics show how many prompts it computes at once: running
// while others wait.
func TestServiceSlots(t *testing.T) {
	m := new(service)
	require.Equal(t, 1, m.slotsSeen())
	m.load(3, 0)
	require.Equal(t, 1, m.slotsSeen(), "nothing waited: not all its slots")
	m.load(2, 4)
	require.Equal(t, 2, m.slotsSeen())
	m.load(1, 4)
	require.Equal(t, 2, m.slotsSeen(), "the most seen")
}

// However the samples fall, a token a call waits for costs it at least
// one of its own: an engine never looks as if it drained its queue for
// free, or faster than a slot computes.
func TestServiceQueueFloor(t *testing.T) {
	m := new(service)
	m.load(2, 1)
	e := trueService{slots: 2}
	// A burst's samples: long queues, answered as fast as idle calls.
	for i := range 200 {
		q := e.queueFor(1000*(i%5), i%5)
		m.learn(0.01+0.5, q, 500)
	}
	_, a, w, p, _ := m.coefficients()
	require.GreaterOrEqual(t, 1/a+1/w, 0.9999/p, "a token waited for costs at least one of the prompt's own")
}

// teachIdle has each of set's first engines learn 100 idle prefills at its
// rate (tokens a second), every call 10 ms plus its prompt, jitter
// seconds off.
func teachIdle(set *Set, jitter float64, rates ...float64) {
	for i, rate := range rates {
		m := set.view.Load().states[i].service
		for k := range 100 {
			own := 100 * (k%10 + 1)
			off := jitter
			if k/10%2 == 0 {
				off = -off
			}
			m.learn(0.010+float64(own)/rate+off, queue{}, own)
		}
	}
}

// Forecasts closer than the models' usual error are not told apart: the
// engine holding more of the prompt wins there, and only there.
func TestForecastNoiseBand(t *testing.T) {
	for _, tc := range []struct {
		name   string
		jitter float64 // each call's error
		want   int
	}{
		{"within the noise", 0.010, 0},
		{"beyond it", 0.001, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			eps := endpoints(2)
			set := NewSet(eps, Options{})
			// The holder computes 20k tokens a second, the other 100k.
			teachIdle(set, tc.jitter, 20_000, 100_000)
			require.InDelta(t, tc.jitter, set.view.Load().states[0].service.noiseSeen(), tc.jitter/4)
			// The holder holds half of the prompt's 512 tokens: 256 to
			// compute at 20k a second (13 ms), against 512 at 100k (5 ms).
			prompt := blocksOf(1, 2, 3, 4, 5, 6, 7, 8)
			hold(t, set, eps[0], prompt[:4], 0).End(Released) // sent, done
			leg := newLeg(set, Forecast{}, RolePrefill)
			for range 4 { // whichever candidate the round starts from
				lease, ok := leg.Pick(Request{Blocks: prompt, BlockTokens: 64, Tokens: 512})
				require.True(t, ok)
				lease.End(Released)
				require.Equal(t, eps[tc.want], lease.Endpoint())
			}
		})
	}
}

// An engine's overhead learned high (a few slow calls) does not keep a
// prompt from its cache: a forecast reads the candidates' mean overhead.
func TestForecastPoolsOverhead(t *testing.T) {
	eps := endpoints(2)
	set := NewSet(eps, Options{})
	teachIdle(set, 0, 20_000, 20_000)
	// The holder's calls then took 200 ms more, long enough for its
	// model to forget the rest.
	m := set.view.Load().states[0].service
	for k := range 2 * serviceMemory {
		own := 100 * (k%10 + 1)
		m.learn(0.210+float64(own)/20_000, queue{}, own)
	}
	overhead, _, _, _, _ := m.coefficients()
	require.Greater(t, overhead, 0.1)
	prompt := blocksOf(1, 2, 3, 4)
	hold(t, set, eps[0], prompt, 0).End(Released)
	leg := newLeg(set, Forecast{}, RolePrefill)
	for range 4 {
		lease, ok := leg.Pick(Request{Blocks: prompt, BlockTokens: 64, Tokens: 256})
		require.True(t, ok)
		lease.End(Released)
		require.Equal(t, eps[0], lease.Endpoint())
	}
}

// pdx counts an engine's queue with error (what each prompt ahead finds
// cached, how far each running one got), and a fit to a regressor
// counted with error learns its cost too low: here, waits counted off by
// half of themselves either way, the fit alone learned a waited token at
// about half of a prompt token's cost. It still costs at least one, and
// the prompt's own tokens, counted exactly, teach the engine's rate.
func TestServiceQueueCountedWithError(t *testing.T) {
	e := trueService{overhead: 0.005, rate: 2500, slots: 2}
	for draw := range uint64(10) {
		m := new(service)
		m.load(e.slots, 1)
		rng := rand.New(rand.NewPCG(draw, 7))
		for range 1000 {
			q := e.randomQueue(rng)
			own := 100 + rng.IntN(1000)
			took := e.time(q, own) * (1 + 0.05*rng.NormFloat64())
			counted := q
			counted.waiting = max(int(float64(q.waiting)*(1+0.5*rng.NormFloat64())), 0)
			m.learn(took, counted, own)
		}
		_, a, w, p, _ := m.coefficients()
		require.InDelta(t, e.rate, p, 0.05*e.rate, "draw %d", draw)
		require.GreaterOrEqual(t, 1/a+1/w, 0.9999/p, "draw %d: a waited token costs at least one of the prompt's own", draw)
	}
}
