package replay

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
)

// TenantsTrace is the name that selects the generated tenants workload
// (TenantsFor) among the traces.
const TenantsTrace = "tenants"

// Tenants is a cache-bound multi-tenant workload, modelled on llm-d's
// precise-prefix benchmark ("KV-Cache Wins You Can See": 150 tenants, each
// with a shared ~6k-token context): every request is its tenant's context
// followed by a question of its own. The contexts together exceed any
// one prefill engine's KV several times, so where a tenant's requests
// land decides whether its context is cached. It is generated as a trace (Trace) in the
// Mooncake form: the context's hash_ids blocks, then fresh blocks.
type Tenants struct {
	Tenants int `json:"tenants"`
	// ContextBlocks is each tenant's context, in 512-token trace blocks.
	ContextBlocks int `json:"context_blocks"`
	// QuestionTokens and OutputTokens are each request's own question
	// (after the context, in blocks no other request has) and answer, in
	// real tokens.
	QuestionTokens int `json:"question_tokens"`
	OutputTokens   int `json:"output_tokens"`
	// Rate is the Poisson arrival rate of the generated timeline (req/s);
	// only its shape matters, as a load point compresses it to its rate.
	Rate float64 `json:"native_rate_rps"`
	// Seed makes the arrivals and the tenants' order: equal seeds, equal
	// traces.
	Seed uint64 `json:"seed"`
	// KVRatio is what TenantsFor sized the contexts for: all of them over
	// the prefill engines' KV (informational).
	KVRatio float64 `json:"contexts_over_prefill_kv,omitempty"`
}

// The tenants workload's figures. Tenants are chosen uniformly, as in
// llm-d's benchmark, whose every tenant has as many users: every context
// is then in the working set, which is what makes it exceed the KV (a
// Zipf choice would let any policy's LRU keep the few hot tenants and
// hide where the rest land).
const (
	// tenantCount is llm-d's. pdx-replay's 2,000-request window visits
	// each 13 times: a tenant's first visit, a miss for every policy, is
	// 7.5% of requests (at 500 requests it was 30%, which set every
	// policy's TTFT p90 at an uncached prompt's).
	tenantCount = 150
	// tenantQuestionTokens and tenantOutputTokens are a short question
	// and a short answer.
	tenantQuestionTokens = 1200
	tenantOutputTokens   = 256
	tenantSeed           = 20
)

// TenantKVRatio sizes the tenants workload's contexts by default:
// together 0.8 of the prefill engines' KV, 3.2 times one engine's (at 4
// prefill engines). That is llm-d's regime: its 150 × 6k tokens are about
// 0.4 of its 8 pods' KV and 3.3 times one pod's (Qwen-32B on 2 H100s a
// pod: some 70 GB of KV at 256 KiB a token, an estimate), so that a
// placement that keeps each tenant on one engine can cache nearly every
// context and one that spreads tenants over the engines cannot. With 4
// engines both figures cannot be had; 0.8 keeps the split fitting with
// room to spare. Above 1 no placement caches every context, and beyond
// 2 a tenant's requests miss more often than not under any policy.
const TenantKVRatio = 0.8

// TenantsFor sizes the tenants workload for a rig: tenantCount tenants
// whose contexts together are kvRatio (TenantKVRatio when 0) times the
// prefill engines' KV (enginesim.ReferenceCapacity at the rig's scales),
// rounded to whole trace blocks.
func TenantsFor(rig Rig, kvRatio float64) Tenants {
	if kvRatio <= 0 {
		kvRatio = TenantKVRatio
	}
	_, c := rig.engineConfig()
	kvTokens := float64(rig.Prefill) * float64(c.KVBlocks*c.BlockTokens*rig.Scale.TokenScale)
	blocks := max(1, int(math.Round(kvRatio*kvTokens/(tenantCount*TraceBlockTokens))))
	return Tenants{
		Tenants: tenantCount, ContextBlocks: blocks,
		QuestionTokens: tenantQuestionTokens, OutputTokens: tenantOutputTokens,
		Rate: 1, Seed: tenantSeed, KVRatio: kvRatio,
	}
}

// ContextTokens is a tenant's context in real tokens.
func (w Tenants) ContextTokens() int { return w.ContextBlocks * TraceBlockTokens }

// Trace generates the first n requests: Poisson arrivals, each of a tenant
// chosen uniformly. Tenant t's context is the blocks t×ContextBlocks
// onwards; each request's question takes fresh ids after every context's.
func (w Tenants) Trace(n int) ([]TraceRequest, error) {
	switch {
	case n < 1:
		return nil, fmt.Errorf("tenants: %d requests asked", n)
	case w.Tenants < 1 || w.ContextBlocks < 1:
		return nil, fmt.Errorf("tenants: %d tenants of %d blocks", w.Tenants, w.ContextBlocks)
	case w.QuestionTokens < 1 || w.OutputTokens < 0:
		return nil, fmt.Errorf("tenants: question of %d tokens, answer of %d", w.QuestionTokens, w.OutputTokens)
	case !(w.Rate > 0) || math.IsInf(w.Rate, 0):
		return nil, errors.New("tenants: the arrival rate must be positive and finite")
	}
	rng := rand.New(rand.NewPCG(w.Seed, 0x5eed))
	questionBlocks := (w.QuestionTokens + TraceBlockTokens - 1) / TraceBlockTokens
	next := int64(w.Tenants * w.ContextBlocks) // the first question block
	out := make([]TraceRequest, n)
	var at float64 // ms
	for i := range out {
		if i > 0 {
			at += rng.ExpFloat64() / w.Rate * 1000
		}
		tenant := int64(rng.IntN(w.Tenants))
		ids := make([]int64, 0, w.ContextBlocks+questionBlocks)
		for b := range int64(w.ContextBlocks) {
			ids = append(ids, tenant*int64(w.ContextBlocks)+b)
		}
		for range questionBlocks {
			ids = append(ids, next)
			next++
		}
		out[i] = TraceRequest{
			Timestamp:    int64(at),
			InputLength:  w.ContextTokens() + w.QuestionTokens,
			OutputLength: w.OutputTokens,
			HashIDs:      ids,
		}
	}
	return out, nil
}

// TenantOf is the tenant of a request of the workload (its first block
// names it).
func (w Tenants) TenantOf(r TraceRequest) int { return int(r.HashIDs[0]) / w.ContextBlocks }

// String describes the workload in a line.
func (w Tenants) String() string {
	return fmt.Sprintf("generated: %d tenants chosen uniformly, each a %d-token context (%d blocks), then a %d-token question; %d-token answers; Poisson arrivals (seed %d)",
		w.Tenants, w.ContextTokens(), w.ContextBlocks, w.QuestionTokens, w.OutputTokens, w.Seed)
}
