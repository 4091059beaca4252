package enginesim

import (
	"context"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestSharedGPUModel drives the shared-GPU model on a clock of its own: a
// prompt computed chunk by chunk while sequences step, each on its own
// clock, as the prefill server's and the sequences' goroutines would with
// perfect timers. A decode step carrying a chunk takes its compute longer,
// the prompt takes a decode step longer a chunk, and a sequence decoding
// throughout pays the prompt's compute once.
func TestSharedGPUModel(t *testing.T) {
	const rate = 10000 // tokens a second: 100 tokens take 10 ms
	const step, perSeq = 5 * time.Millisecond, time.Millisecond
	tests := []struct {
		name          string
		budget        int // Capacity.MaxBatchedTokens
		overhead      time.Duration
		seqs, prompt  int           // sequences decoding, the prompt's uncached tokens
		wantSpan      time.Duration // the prompt's time
		wantChunks    int           // decode steps of each sequence that carry a chunk
		wantChunkCost time.Duration // each one's extra time (0: not checked)
	}{
		{
			// 100 tokens a chunk: 10 chunks of 10 ms, each riding a 5 ms step.
			name: "a long prompt beside one sequence", budget: 101, overhead: 2 * time.Millisecond,
			seqs: 1, prompt: 1000, wantSpan: 100*time.Millisecond + 10*step, wantChunks: 10, wantChunkCost: 10 * time.Millisecond,
		},
		{
			// The budget leaves 100 tokens a step to 4 sequences, whose
			// steps take 5 + 3 × 1 ms.
			name: "a long prompt beside four sequences", budget: 104,
			seqs: 4, prompt: 1000, wantSpan: 100*time.Millisecond + 10*(step+3*perSeq), wantChunks: 10, wantChunkCost: 10 * time.Millisecond,
		},
		{
			// The last chunk is a fifth of the budget's: a fifth of a step.
			name: "a partial last chunk rides part of a step", budget: 101,
			seqs: 1, prompt: 220, wantSpan: 22*time.Millisecond + step + step + step/5, wantChunks: 3,
		},
		{
			// One chunk of a tenth of the budget would ride half a
			// millisecond: the prompt takes at least its overhead more.
			name: "a short prompt takes at least its overhead", budget: 1001, overhead: 2 * time.Millisecond,
			seqs: 1, prompt: 100, wantSpan: 10*time.Millisecond + 2*time.Millisecond, wantChunks: 1, wantChunkCost: 10 * time.Millisecond,
		},
		{
			name: "nothing decoding", budget: 101, overhead: 2 * time.Millisecond,
			prompt: 1000, wantSpan: 2*time.Millisecond + 100*time.Millisecond,
		},
		{
			name: "no step budget", overhead: 2 * time.Millisecond,
			seqs: 3, prompt: 1000, wantSpan: 2*time.Millisecond + 100*time.Millisecond,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := newEngineLoad(&Capacity{MaxRunning: 64, BlockTokens: 4, KVBlocks: 100, PrefillTokensPerSec: rate,
				PrefillOverhead: tt.overhead, DecodeStep: step, DecodeStepPerSeq: perSeq, MaxBatchedTokens: tt.budget}, nil)
			base := m.capa.DecodeStep + time.Duration(max(tt.seqs-1, 0))*perSeq
			t0 := time.Unix(1000, 0)
			// The sequences step from before the prompt, at phases spread
			// over a step.
			m.decoding = tt.seqs
			type sequence struct {
				seat  *seat
				next  time.Time
				extra []time.Duration // beyond base, of each step
			}
			seqs := make([]*sequence, tt.seqs)
			for i := range seqs {
				seqs[i] = &sequence{seat: &seat{m: m}, next: t0.Add(-base + time.Duration(i)*base/time.Duration(tt.seqs))}
			}
			var end time.Time // the prompt's
			for started, horizon := false, t0.Add(tt.wantSpan+5*(base+tt.wantChunkCost)); ; {
				var s *sequence // the next to step
				if len(seqs) > 0 {
					s = slices.MinFunc(seqs, func(a, b *sequence) int { return a.next.Compare(b.next) })
				}
				if !started && (s == nil || !s.next.Before(t0)) {
					m.startRun(tt.prompt, t0)
					started = true
					continue
				}
				if m.run.running && (s == nil || !s.next.Before(m.run.end)) {
					if at := m.run.end; !m.nextChunk() {
						end = at
						m.endRun()
					}
					continue
				}
				if s == nil || s.next.After(horizon) {
					break
				}
				d := s.seat.stepAt(s.next)
				s.extra = append(s.extra, d-base)
				s.next = s.next.Add(d)
			}
			require.Equal(t, tt.wantSpan, end.Sub(t0), "the prompt's time")
			require.Equal(t, tt.wantSpan-tt.overhead-100*time.Millisecond*time.Duration(tt.prompt)/1000, m.usage.PrefillSharedDelay)

			compute := time.Duration(tt.prompt) * time.Second / rate
			var steps int64
			for i, s := range seqs {
				t.Logf("sequence %d: %v", i, s.extra)
				var total time.Duration
				carried := 0
				for _, x := range s.extra {
					require.GreaterOrEqual(t, x, time.Duration(0))
					if x > 0 {
						carried++
						if tt.wantChunkCost > 0 {
							require.InDelta(t, tt.wantChunkCost, x, float64(time.Microsecond), "sequence %d: a step carrying a chunk takes its compute longer", i)
						}
					}
					total += x
				}
				steps += int64(carried)
				require.Equal(t, tt.wantChunks, carried, "sequence %d: steps carrying a chunk", i)
				if tt.wantChunks > 0 {
					require.InDelta(t, compute, total, float64(time.Microsecond), "sequence %d pays the prompt's compute", i)
				} else {
					require.Zero(t, total)
				}
			}
			require.Equal(t, steps, m.usage.DecodeSharedSteps)
			if tt.wantChunks > 0 {
				require.InDelta(t, time.Duration(tt.seqs)*compute, m.usage.DecodeSharedDelay, float64(tt.seqs)*float64(time.Microsecond))
			} else {
				require.Zero(t, m.usage.DecodeSharedDelay)
			}
		})
	}
}

// TestSharedGPUCutPrompt: a prompt given up mid-chunk still counts that
// chunk's compute, which sequences may have paid in advance, and nothing
// is left shared.
func TestSharedGPUCutPrompt(t *testing.T) {
	m := newEngineLoad(&Capacity{MaxRunning: 4, BlockTokens: 4, KVBlocks: 100, PrefillTokensPerSec: 10000,
		DecodeStep: 5 * time.Millisecond, MaxBatchedTokens: 101}, nil)
	m.decoding = 1
	t0 := time.Unix(1000, 0)
	s := &seat{m: m}
	m.startRun(1000, t0)
	require.Equal(t, 5*time.Millisecond+10*time.Millisecond, s.stepAt(t0), "the step carries the first chunk")
	m.endRun()
	require.Equal(t, 10*time.Millisecond, m.sharedAt(t0.Add(time.Millisecond)))
	require.Equal(t, 5*time.Millisecond, s.stepAt(t0.Add(15*time.Millisecond)), "paid for; nothing more")
	require.Zero(t, m.chunkCompute(1))
}

// sharedTestCapacity computes 100 prompt tokens in 10 ms, in chunks of 100
// beside one sequence, whose steps take 30 ms.
func sharedTestCapacity(budget int) *Capacity {
	return testCapacity(func(c *Capacity) {
		c.PrefillTokensPerSec = 10000
		c.DecodeStep = 30 * time.Millisecond
		c.MaxBatchedTokens = budget
	})
}

// TestSharedGPUOnAnEngine: on an engine, a long plain request prefilled
// while a sequence decodes there rides its steps (10 chunks of 10 ms, each
// with a 30 ms step: 400 ms rather than 100) and lengthens them by its
// compute; alone, or without a step budget, it takes what it did before.
func TestSharedGPUOnAnEngine(t *testing.T) {
	const compute = 100 * time.Millisecond // the 1000-token prompt's
	tests := []struct {
		name   string
		budget int
		batch  bool // a sequence decodes meanwhile
		// Usage's PrefillSharedDelay and DecodeSharedDelay
		wantPrefill, wantDecode time.Duration
	}{
		{name: "beside a decoding sequence", budget: 101, batch: true, wantPrefill: 10 * 30 * time.Millisecond, wantDecode: compute},
		{name: "alone", budget: 101},
		{name: "no step budget", batch: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := startSim(t, Config{Capacity: sharedTestCapacity(tt.budget)})
			alone := timed(t, s, "alone", plain(tokensText('q', 1000), 1))
			require.GreaterOrEqual(t, alone, compute)
			before := s.Usage()
			require.Zero(t, before.PrefillSharedDelay)

			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			var decode <-chan asyncReply
			if tt.batch {
				// 30 steps of at least 30 ms: it outlasts the prompt.
				decode = goPostCtx(t, ctx, s, "/v1/completions", "decode", plain(tokensText('d', 4), 31))
				require.Eventually(t, func() bool { return s.Usage().DecodeTokens > before.DecodeTokens }, 10*time.Second, time.Millisecond)
			}
			took := timed(t, s, "prompt", plain(tokensText('p', 1000), 1))
			if tt.batch {
				require.Equal(t, http.StatusOK, await(t, decode).status)
			}
			requireIdle(t, s)

			u := s.Usage()
			require.Equal(t, tt.wantPrefill, u.PrefillSharedDelay, "10 chunks, each riding a step")
			require.InDelta(t, tt.wantDecode, u.DecodeSharedDelay, float64(time.Millisecond), "the sequence paid the prompt's compute")
			require.GreaterOrEqual(t, took, compute+tt.wantPrefill)
			if tt.wantDecode == 0 {
				require.Zero(t, u.DecodeSharedSteps)
				require.Less(t, float64(took)/float64(alone), 2.0, "alone %v, now %v", alone, took)
				return
			}
			require.Greater(t, float64(took)/float64(alone), 2.0, "alone %v, beside a batch %v", alone, took)
			// About one step a chunk, give or take a timer waking late.
			require.GreaterOrEqual(t, u.DecodeSharedSteps, int64(5))
			require.LessOrEqual(t, u.DecodeSharedSteps, int64(20))
			// The steps that carried chunks took about a chunk's compute
			// (10 ms) longer each: the TPOT rise.
			mean := u.DecodeSharedDelay / time.Duration(u.DecodeSharedSteps)
			require.GreaterOrEqual(t, mean, 5*time.Millisecond, "%+v", u)
			require.LessOrEqual(t, mean, 20*time.Millisecond, "%+v", u)
		})
	}
}

// TestSharedGPUForecasts: beside a decoding sequence a prompt's forecast
// compute includes the steps its chunks ride, and while a prompt is
// computed a decode's forecast step includes the chunk it would carry.
func TestSharedGPUForecasts(t *testing.T) {
	const step = 30 * time.Millisecond
	s := startSim(t, Config{Capacity: sharedTestCapacity(101)})
	prompt := tokensText('p', 1000)
	require.InDelta(t, 100*time.Millisecond, s.ForecastPrefill(prompt).Compute, float64(time.Microsecond), "idle: its compute")
	require.Equal(t, step, s.ForecastDecode(tokensText('x', 4), 4).Step)

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	decode := goPostCtx(t, ctx, s, "/v1/completions", "decode", plain(tokensText('d', 4), 100))
	require.Eventually(t, func() bool { return s.Usage().DecodeTokens > 0 }, 10*time.Second, time.Millisecond)
	f := s.ForecastPrefill(prompt)
	require.InDelta(t, 100*time.Millisecond+10*step, f.Compute, float64(time.Microsecond), "beside one sequence: 10 chunks riding a step each")
	require.Zero(t, f.Wait)
	require.Equal(t, step, s.ForecastDecode(tokensText('x', 4), 4).Step, "no prompt computed")

	p := goPostCtx(t, ctx, s, "/v1/completions", "prompt", plain(prompt, 1))
	computing := func() bool {
		s.load.mu.Lock()
		defer s.load.mu.Unlock()
		return s.load.run.running
	}
	require.Eventually(t, computing, 10*time.Second, time.Millisecond)
	f = s.ForecastPrefill(tokensText('z', 100))
	require.Positive(t, f.Wait, "the rest of the prompt computed")
	require.LessOrEqual(t, f.Wait, 100*time.Millisecond+10*step)
	require.InDelta(t, 10*time.Millisecond+step, f.Compute, float64(time.Microsecond), "one chunk riding a step")
	d := s.ForecastDecode(tokensText('x', 4), 4)
	// Two sequences leave 99 tokens of the budget to the prompt: a step
	// carries up to 9.9 ms of its compute.
	if computing() { // and so it was when forecast
		require.Greater(t, d.Step, step, "%+v", d)
		require.LessOrEqual(t, d.Step, step+99*time.Second/10000, "%+v", d)
	}
	require.Equal(t, http.StatusOK, await(t, p).status)
	cancel()
	<-decode
	requireIdle(t, s)
}
