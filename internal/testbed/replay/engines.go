package replay

import (
	"time"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// EngineStats is what the engines themselves counted over a run.
type EngineStats struct {
	// PrefillRequests and DecodeRequests are requests served per engine
	// (a decode engine's plain requests, served without a prefill leg,
	// included), from the engines' Tally.
	PrefillRequests []int `json:"prefill_requests"`
	DecodeRequests  []int `json:"decode_requests"`
	// Rejected counts requests and KV transfers the engines refused: a KV
	// hand-off gone wrong shows up here.
	Rejected int `json:"kv_rejected"`
	// PrefillBusy is the prefill engines' busy time, summed.
	PrefillBusy time.Duration `json:"prefill_busy_ns"`
	// Prefills and PrefillTokens are the prompts the prefill engines
	// computed and their uncached tokens.
	Prefills, PrefillTokens int64
	// Prefix cache counters (tokens) of the prefill engines, and of all.
	PrefillQueryTokens, PrefillHitTokens int64
	AllQueryTokens, AllHitTokens         int64
	PulledBlocks                         int64
}

// engineStats reads the counters of every engine of st.
func engineStats(st *stack.Stack) EngineStats {
	var es EngineStats
	for _, e := range st.Prefill {
		t, u := e.Tally(), usageOf(e)
		es.PrefillRequests = append(es.PrefillRequests, t.Prefill+t.Plain)
		es.Rejected += t.Rejected
		es.PrefillBusy += u.PrefillBusy
		es.Prefills += u.Prefills
		es.PrefillTokens += u.PrefillTokens
		es.PrefillQueryTokens += u.PrefixQueryTokens
		es.PrefillHitTokens += u.PrefixHitTokens
		es.add(u)
	}
	for _, e := range st.Decode {
		t, u := e.Tally(), usageOf(e)
		es.DecodeRequests = append(es.DecodeRequests, t.Decode+t.Plain)
		es.Rejected += t.Rejected
		es.add(u)
	}
	return es
}

// merge adds o's counts to es, engine by engine.
func (es *EngineStats) merge(o EngineStats) {
	es.PrefillRequests = addInts(es.PrefillRequests, o.PrefillRequests)
	es.DecodeRequests = addInts(es.DecodeRequests, o.DecodeRequests)
	es.Rejected += o.Rejected
	es.PrefillBusy += o.PrefillBusy
	es.Prefills += o.Prefills
	es.PrefillTokens += o.PrefillTokens
	es.PrefillQueryTokens += o.PrefillQueryTokens
	es.PrefillHitTokens += o.PrefillHitTokens
	es.AllQueryTokens += o.AllQueryTokens
	es.AllHitTokens += o.AllHitTokens
	es.PulledBlocks += o.PulledBlocks
}

// addInts is a + b elementwise; the shorter is padded with zeros.
func addInts(a, b []int) []int {
	out := make([]int, max(len(a), len(b)))
	for i := range out {
		if i < len(a) {
			out[i] += a[i]
		}
		if i < len(b) {
			out[i] += b[i]
		}
	}
	return out
}

// usageOf reads an engine's busy time and cache counters.
func usageOf(e *enginesim.Server) enginesim.Usage { return e.Usage() }

func (es *EngineStats) add(u enginesim.Usage) {
	es.AllQueryTokens += u.PrefixQueryTokens
	es.AllHitTokens += u.PrefixHitTokens
	es.PulledBlocks += u.PulledBlocks
}

// engineConfig is every simulator's config: the rig's capacity (by
// default the reference capacity at the run's scales, fixed before any
// policy was tuned), and counts instead of records; with
// PromptTokensDetails, answers that say what was found cached.
func (rig Rig) engineConfig() (enginesim.Config, enginesim.Capacity) {
	c := enginesim.ReferenceCapacity(float64(rig.Scale.TokenScale), rig.TimeScale)
	if rig.Capacity != nil {
		c = *rig.Capacity
	}
	return enginesim.Config{Capacity: &c, TallyOnly: true, PromptTokensDetails: rig.PromptTokensDetails}, c
}
