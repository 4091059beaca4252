package replay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
	"github.com/pdx-router/pdx/internal/testbed/vllmrouter"
)

// Rig is the deployment every run starts afresh (fresh engines, fresh
// caches): N prefill and M decode NIXL simulators behind pdx and Envoy, or
// behind a peer router for a peer profile.
type Rig struct {
	// Name is a named rig's (CacheBoundRig); "" for the reference rig.
	Name            string
	Prefill, Decode int
	Scale           Scale
	TimeScale       float64
	// Capacity, when set, is every engine's capacity instead of
	// enginesim.ReferenceCapacity(Scale.TokenScale, TimeScale).
	Capacity *enginesim.Capacity
	// DecodeCapacity, when set, is the decode engines' capacity instead of
	// Capacity's.
	DecodeCapacity *enginesim.Capacity
	EnvoyBin       string
	// PromptTokensDetails: the engines report the prompt tokens they found
	// cached in each answer (vLLM's --enable-prompt-tokens-details). pdx
	// then learns each prefill's service from what the engine computed,
	// and its self-check's prediction is recorded against the engines'
	// word (RunResult.SelfCheck).
	PromptTokensDetails bool
}

// run is one replay: a policy, a schedule, a replica count.
type run struct {
	trace    string
	profile  Profile
	replicas int
	rate     float64
	reqs     []Request
	at       []time.Duration
}

// RunResult is one run's measurements.
type RunResult struct {
	Trace    string  `json:"trace"`
	Policy   string  `json:"policy"`
	Replicas int     `json:"pdx_replicas"`
	Rate     float64 `json:"rate_rps"`
	// Repeats is how many fresh replays were pooled into the result.
	Repeats int `json:"repeats"`
	// TargetLoad is the load point's intended round-robin busy share;
	// RRBusyShare what round robin measured at it (the point's load).
	TargetLoad  float64 `json:"target_load"`
	RRBusyShare float64 `json:"rr_busy_share"`
	// BusyShare is this run's own prefill busy share.
	BusyShare float64 `json:"busy_share"`
	Requests  int     `json:"requests"`
	// Errors counts failed requests: Shed of them were refused with 429
	// (pdx's saturation, or a peer's own queue), Broken got a 5xx, no
	// answer or a stream cut short.
	Errors int `json:"errors"`
	Shed   int `json:"shed_429"`
	Broken int `json:"broken"`
	MixUps int `json:"mix_ups"`
	// ErrorSamples are the first few errors, for a failing run.
	ErrorSamples []string    `json:"error_samples,omitempty"`
	TTFT         Percentiles `json:"ttft"`
	E2E          Percentiles `json:"e2e"`
	TPOT         Percentiles `json:"tpot"`
	Goodput      float64     `json:"goodput"`
	// PrefixHitRate is hit over query tokens of the prefill engines;
	// PrefixHitRateAll of every engine.
	PrefixHitRate    float64     `json:"prefix_hit_rate"`
	PrefixHitRateAll float64     `json:"prefix_hit_rate_all"`
	Engines          EngineStats `json:"engines"`
	PrefillCV        float64     `json:"prefill_cv"`
	DecodeCV         float64     `json:"decode_cv"`
	// DurationSec is the runs' time from first send to last answer.
	DurationSec float64 `json:"duration_s"`
	// PrefillWindowSec is the part of the run in which prefills could be
	// running: from the first send to the last first token.
	PrefillWindowSec float64 `json:"prefill_window_s"`
	CPU              CPUUse  `json:"cpu"`
	// VLLMRouter is the version of the vllm-router that served a peer
	// profile's run; empty when Envoy and pdx did.
	VLLMRouter string `json:"vllm_router,omitempty"`
	// PeerKVLookups and PeerKVHits are, for a peer reading the engines' KV
	// events (Profile.KVEvents), its prefill placements that looked the
	// prompt's blocks up in the events' index, and those that found some
	// (vllm_router_kv_placement_lookups_total): the evidence that it
	// placed by the events.
	PeerKVLookups int `json:"peer_kv_lookups,omitempty"`
	PeerKVHits    int `json:"peer_kv_hits,omitempty"`
	// Oracle marks the oracle's run (Profile.Oracle); VsOracle is every
	// other run's distance from the oracle's at its point, when the
	// oracle ran there.
	Oracle   bool      `json:"oracle,omitempty"`
	VsOracle *VsOracle `json:"vs_oracle,omitempty"`
	// PerRepeat is each pooled replay's own figures, when there were
	// several.
	PerRepeat []RepeatResult `json:"per_repeat,omitempty"`
	// Service is the prefill engines' service rate, true and delivered.
	Service Service `json:"prefill_service"`
	// Learned is what pdx's service model learned of the prefill engines
	// (the forecast policy's), averaged over them and the replays; nil for
	// the peer and the oracle.
	Learned *Learned `json:"learned_service,omitempty"`
	// Placement judges the prefill placements against the engines' true
	// state (see Regret), the replays pooled; nil when none was judged.
	Placement *Regret `json:"placement_regret,omitempty"`
	// SelfCheck is placement's prediction of the prompt tokens the prefill
	// engines would find cached against what they reported, the replays
	// and replicas summed; nil unless pdx placed and the engines report
	// (Rig.PromptTokensDetails).
	SelfCheck *SelfCheck `json:"self_check,omitempty"`
}

// SelfCheck is pdx_placement_cached_tokens_total's two sources: the
// prompt tokens placement predicted its prefills would find cached, and
// those the engines reported cached. Ratio is the first over the second:
// below 1, placement thought prompts less cached than they were.
type SelfCheck struct {
	PredictedCachedTokens int64   `json:"predicted_cached_tokens"`
	ReportedCachedTokens  int64   `json:"reported_cached_tokens"`
	Ratio                 float64 `json:"ratio"`
}

// Learned is what pdx's service model learned of the prefill engines from
// its timed prefills (picker.Service), the mean over them: their overhead,
// the rate one prompt computes at, what a queued token a new call waits
// for costs it and what one of the engine's whole queue does (tokens a
// second; 0: the fit found it costs nothing), the slots seen, how many
// prefills taught it, and how many of pdx's tokens the engines counted as
// one of theirs (picker.Set.TokenScale).
type Learned struct {
	OverheadMs        float64 `json:"overhead_ms"`
	PromptTokensPerS  float64 `json:"prompt_tokens_per_s"`
	WaitingTokensPerS float64 `json:"waiting_tokens_per_s"`
	AheadTokensPerS   float64 `json:"ahead_tokens_per_s"`
	TokenScale        float64 `json:"token_scale"`
	Slots             float64 `json:"slots"`
	Samples           float64 `json:"samples"`
}

// RepeatResult is what one replay of a run measured alone.
type RepeatResult struct {
	Goodput       float64     `json:"goodput"`
	PrefixHitRate float64     `json:"prefix_hit_rate"`
	TTFT          Percentiles `json:"ttft"`
	BusyShare     float64     `json:"busy_share"`
}

// Service is the prefill engines' true service: a prompt takes Overhead
// plus its uncached tokens over TokensPerSec, Slots prompts at once (the
// simulators' capacity), and what they delivered: Prefills prompts of
// UncachedTokens, at DeliveredTokensPerSec, those tokens over the slots'
// busy time less the overheads (below the true rate by the simulators'
// timers waking late on a busy machine). A placement's learned rate is
// measured against these.
type Service struct {
	Slots                 int     `json:"slots"`
	TokensPerSec          float64 `json:"tokens_per_s"`
	OverheadMs            float64 `json:"overhead_ms"`
	Prefills              int64   `json:"prefills"`
	UncachedTokens        int64   `json:"uncached_tokens"`
	DeliveredTokensPerSec float64 `json:"delivered_tokens_per_s"`
}

// service is s's true figures and what the engines of es delivered.
func service(c enginesim.Capacity, es EngineStats) Service {
	s := Service{
		Slots: max(c.PrefillSlots, 1), TokensPerSec: c.PrefillTokensPerSec, OverheadMs: ms(c.PrefillOverhead),
		Prefills: es.Prefills, UncachedTokens: es.PrefillTokens,
	}
	compute := es.PrefillBusy*time.Duration(s.Slots) - time.Duration(es.Prefills)*c.PrefillOverhead
	if compute > 0 {
		s.DeliveredTokensPerSec = float64(es.PrefillTokens) / compute.Seconds()
	}
	return s
}

// learned reads what the first pdx replica of st learned of its prefill
// engines, the mean over them; nil when it has none. Its rates are in
// simulated tokens: pdx's engines publish and render those (only
// vllm-router's are given a KVEvents.TokenScale).
func learned(st *stack.Stack) *Learned {
	var sum learnedSum
	for _, p := range st.Pdx.Table().Pools() {
		scale := p.Prefill.Set.TokenScale()
		for _, ep := range p.Prefill.Set.Endpoints() {
			sv, ok := p.Prefill.Set.Service(ep)
			if !ok {
				continue
			}
			// +Inf: the fit found no cost, counted as 0 (JSON has no Inf).
			sum.add(Learned{
				OverheadMs:        float64(sv.Overhead) / float64(time.Millisecond),
				PromptTokensPerS:  finite(sv.PromptRate),
				WaitingTokensPerS: finite(sv.WaitingRate),
				AheadTokensPerS:   finite(sv.AheadRate),
				TokenScale:        scale,
				Slots:             float64(sv.Slots),
				Samples:           float64(sv.Samples),
			})
		}
	}
	return sum.mean()
}

// learnedSum adds up Learned figures for their mean.
type learnedSum struct {
	l Learned
	n int
}

// add counts l.
func (s *learnedSum) add(l Learned) {
	s.n++
	s.l.OverheadMs += l.OverheadMs
	s.l.PromptTokensPerS += l.PromptTokensPerS
	s.l.WaitingTokensPerS += l.WaitingTokensPerS
	s.l.AheadTokensPerS += l.AheadTokensPerS
	s.l.TokenScale += l.TokenScale
	s.l.Slots += l.Slots
	s.l.Samples += l.Samples
}

// mean is the mean of what was added; nil when nothing was.
func (s *learnedSum) mean() *Learned {
	if s.n == 0 {
		return nil
	}
	f, l := float64(s.n), s.l
	l.OverheadMs, l.PromptTokensPerS, l.WaitingTokensPerS, l.AheadTokensPerS = l.OverheadMs/f, l.PromptTokensPerS/f, l.WaitingTokensPerS/f, l.AheadTokensPerS/f
	l.TokenScale, l.Slots, l.Samples = l.TokenScale/f, l.Slots/f, l.Samples/f
	return &l
}

// finite is x, or 0 for an infinity.
func finite(x float64) float64 {
	if math.IsInf(x, 0) {
		return 0
	}
	return x
}

// meanLearned is the mean of the samples' learned services; nil when
// none has one.
func meanLearned(samples []sample) *Learned {
	var sum learnedSum
	for _, s := range samples {
		if s.learned != nil {
			sum.add(*s.learned)
		}
	}
	return sum.mean()
}

// VsOracle is how far a run is from the oracle's at the same point:
// ratios of latencies (1: as good as the oracle) and differences of
// shares in points (0: as good).
type VsOracle struct {
	TTFTP50 float64 `json:"ttft_p50_ratio"`
	TTFTP90 float64 `json:"ttft_p90_ratio"`
	// GoodputPoints and PrefixHitPoints are the run's goodput and prefill
	// prefix hit rate minus the oracle's, in percentage points.
	GoodputPoints   float64 `json:"goodput_points"`
	PrefixHitPoints float64 `json:"prefix_hit_points"`
}

// compareToOracle fills in VsOracle of a load point's runs, if the oracle
// is among them: the P/D oracle's, else oracle-reuse's.
func compareToOracle(point []RunResult) {
	i := slices.IndexFunc(point, func(r RunResult) bool { return r.Oracle && r.Policy == OracleProfile })
	if i < 0 {
		i = slices.IndexFunc(point, func(r RunResult) bool { return r.Oracle })
	}
	if i < 0 {
		return
	}
	for j := range point {
		if j != i {
			point[j].VsOracle = vsOracle(point[j], point[i])
		}
	}
}

// vsOracle is r's distance from o, the oracle's run at its point.
func vsOracle(r, o RunResult) *VsOracle {
	return &VsOracle{
		TTFTP50:         ratio(r.TTFT.P50, o.TTFT.P50),
		TTFTP90:         ratio(r.TTFT.P90, o.TTFT.P90),
		GoodputPoints:   100 * (r.Goodput - o.Goodput),
		PrefixHitPoints: 100 * (r.PrefixHitRate - o.PrefixHitRate),
	}
}

// perRequestTimeout bounds one request, far above any SLO.
const perRequestTimeout = 2 * time.Minute

// sample is what one replay of a run measured.
type sample struct {
	outs    []Outcome
	engines EngineStats
	elapsed time.Duration
	cpu     CPUUse
	// vllmRouter is the peer's version; "" for pdx.
	vllmRouter string
	// kvLookups and kvHits are the peer's KV-event placement lookups
	// (Profile.KVEvents).
	kvLookups, kvHits int
	// learned is what the first pdx replica learned; nil without pdx.
	learned *Learned
	// judged is the replay's prefill placements judged (see Regret).
	judged judged
	// check is what pdx's replicas predicted and the engines reported
	// cached; nil unless the engines report it.
	check *SelfCheck
}

// replay starts a fresh deployment for r, sends every request at its scheduled
// offset (open loop: late answers never delay later sends), waits for all
// and reads the engines' counters.
func (rig Rig) replay(ctx context.Context, r run) (sample, error) {
	d, err := rig.start(ctx, r.profile, r.replicas)
	if err != nil {
		return sample{}, fmt.Errorf("policy %s: %w", r.profile.Name, err)
	}
	defer d.Close()
	client := newClient()
	defer client.CloseIdleConnections()

	_, capacity := rig.engineConfig()
	regret := watchRegret(d.st.Prefill, prefillTie(capacity, rig.Scale))
	cpu := startCPU(d.routerPid())
	outs, elapsed := sendAll(ctx, client, d.URL(), r.reqs, r.at)
	use := cpu.stop()
	placed := regret.stop()
	if err := ctx.Err(); err != nil {
		return sample{}, err
	}
	s := sample{outs: outs, engines: engineStats(d.st), elapsed: elapsed, cpu: use, judged: placed}
	if d.peer == nil && d.oracle == nil {
		s.learned = learned(d.st)
		if rig.PromptTokensDetails {
			if s.check, err = selfCheck(ctx, d.st); err != nil {
				return sample{}, fmt.Errorf("policy %s: %w", r.profile.Name, err)
			}
		}
	}
	if d.peer != nil {
		s.vllmRouter = d.peer.Version()
	}
	if r.profile.KVEvents && d.peer != nil {
		m, err := d.peer.Metrics()
		if err != nil {
			return sample{}, fmt.Errorf("policy %s: %w", r.profile.Name, err)
		}
		const lookups = "vllm_router_kv_placement_lookups_total"
		s.kvHits = int(m[lookups+`{result="hit"}`])
		s.kvLookups = s.kvHits + int(m[lookups+`{result="miss"}`])
	}
	return s, nil
}

// deployment is a started rig: its engines, and in front of them Envoy
// with pdx (st has them), a peer router, or the oracle.
type deployment struct {
	st     *stack.Stack
	peer   *vllmrouter.Process
	oracle *oracle
}

// URL is where the client sends requests.
func (d *deployment) URL() string {
	switch {
	case d.peer != nil:
		return d.peer.URL()
	case d.oracle != nil:
		return d.oracle.URL()
	}
	return d.st.URL()
}

// routerPid is the process in front of the engines: Envoy (pdx runs in
// this process), or the peer; 0 for the oracle, which runs in this
// process, so that its cores are the harness's and the router's read 0.
func (d *deployment) routerPid() int {
	switch {
	case d.peer != nil:
		return d.peer.Pid()
	case d.oracle != nil:
		return 0
	}
	return d.st.Envoy.Pid()
}

// Close stops the router first, so that no request is cut by an engine
// going away.
func (d *deployment) Close() error {
	var errs []error
	if d.peer != nil {
		errs = append(errs, d.peer.Stop())
	}
	if d.oracle != nil {
		errs = append(errs, d.oracle.Close())
	}
	return errors.Join(append(errs, d.st.Close())...)
}

// start brings up the rig with a profile's config: the whole stack, or for
// a peer the stack's engines alone (the same engines, started by the same
// code) with the peer in front.
func (rig Rig) start(ctx context.Context, p Profile, replicas int) (*deployment, error) {
	opts, capacity := rig.options(p, replicas)
	if p.pdx() {
		st, err := stack.Start(ctx, opts)
		if err != nil {
			return nil, err
		}
		return &deployment{st: st}, nil
	}
	if replicas != 1 {
		return nil, fmt.Errorf("%d pdx replicas asked of a router that is not pdx", replicas)
	}
	st, err := stack.StartEngines(ctx, opts)
	if err != nil {
		return nil, err
	}
	if p.Oracle || p.Direct {
		o, err := startOracle(ctx, st.Prefill, st.Decode, capacity, rig.Scale, p.DecodeAlone, p.Direct, p.OracleDecode)
		if err != nil {
			return nil, errors.Join(err, st.Close())
		}
		return &deployment{st: st, oracle: o}, nil
	}
	po := vllmrouter.Options{Prefill: vllmrouter.EngineURLs(st.Prefill), Decode: vllmrouter.EngineURLs(st.Decode), Policy: p.Peer}
	if p.KVEvents {
		po.KVEvents = map[string]string{}
		for _, s := range st.Prefill {
			po.KVEvents["http://"+s.Addr()] = s.KVEventsEndpoint()
		}
	}
	peer, err := vllmrouter.Start(ctx, po)
	if err != nil {
		return nil, errors.Join(err, st.Close())
	}
	return &deployment{st: st, peer: peer}, nil
}

// options are the stack options of a profile; the engine capacity too.
func (rig Rig) options(p Profile, replicas int) (stack.Options, enginesim.Capacity) {
	engine, capacity := rig.engineConfig()
	kvMode := ""
	switch {
	case p.KVEvents && p.pdx():
		// pdx reads the events in the engines' own blocks (the stack
		// sets kv_events.block_size from the capacity), with a replay
		// socket to fill gaps.
		engine.KVEvents = &enginesim.KVEvents{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0"}
		kvMode = "dial"
	case p.KVEvents:
		// Each simulated token is published as TokenScale tokens, so that
		// a block is the 16 real tokens vllm-router assumes
		// (CheckProfiles); kv_aware trusts events only for requests naming
		// the engine's served model.
		engine.KVEvents = &enginesim.KVEvents{Endpoint: "tcp://127.0.0.1:0", TokenScale: rig.Scale.TokenScale}
		engine.ServedModelName = stack.Model
	}
	return stack.Options{
		Prefill:        rig.Prefill,
		Decode:         rig.Decode,
		Engine:         engine,
		DecodeCapacity: rig.DecodeCapacity,
		EnvoyBin:       rig.EnvoyBin,
		LogLevel:       slog.LevelWarn,
		PoolYAML:       p.PoolYAML,
		ConfigYAML:     p.ConfigYAML,
		PdxReplicas:    replicas,
		Peers:          p.Peers,
		PeersYAML:      p.PeersYAML,
		KVEvents:       kvMode,
		// Queued prefills of a saturated point wait long; the prefill
		// must not time out before the client's own bound.
		PrefillTimeout: perRequestTimeout,
	}, capacity
}

// kvEventsBlockTokens is the block size vllm-router 0.1.17 reads
// --pd-kv-events sources with (its --pd-kv-events help: "Block size is
// 16"); batches of another are rejected (BlockSizeMismatch in its log).
const kvEventsBlockTokens = 16

// CheckProfiles parses every profile's pdx config, and finds the peer's
// install for a peer profile, before anything starts, so that a typo or a
// missing vllm-router fails the run at once, naming the policy.
func (rig Rig) CheckProfiles(ps []Profile) error {
	for _, p := range ps {
		if p.Oracle {
			continue // nothing to parse or install
		}
		if p.Peer != "" {
			if _, err := vllmrouter.Dir(); err != nil {
				return fmt.Errorf("policy %s: %w", p.Name, err)
			}
			if _, c := rig.options(p, 1); p.KVEvents && c.BlockTokens*rig.Scale.TokenScale != kvEventsBlockTokens {
				return fmt.Errorf("policy %s: vllm-router reads KV events in blocks of %d tokens; token scale %d makes the engines' %d",
					p.Name, kvEventsBlockTokens, rig.Scale.TokenScale, c.BlockTokens*rig.Scale.TokenScale)
			}
			continue
		}
		opts, _ := rig.options(p, 1)
		if err := stack.CheckConfig(opts); err != nil {
			return fmt.Errorf("policy %s (pool YAML %q, top-level YAML %q): %w", p.Name, p.PoolYAML, p.ConfigYAML, err)
		}
	}
	return nil
}

// sendAll sends reqs[i] at start+at[i], each on its own goroutine, and
// returns the outcomes and the time from the first send to the last
// answer.
func sendAll(ctx context.Context, client *http.Client, url string, reqs []Request, at []time.Duration) ([]Outcome, time.Duration) {
	outs := make([]Outcome, len(reqs))
	var wg sync.WaitGroup
	start := time.Now()
	for i, r := range reqs {
		if d := time.Until(start.Add(at[i])); d > 0 {
			select {
			case <-ctx.Done():
			case <-time.After(d):
			}
		}
		if ctx.Err() != nil {
			break
		}
		wg.Go(func() {
			rctx, cancel := context.WithTimeout(ctx, perRequestTimeout)
			defer cancel()
			sent := time.Since(start)
			outs[i] = send(rctx, client, url, r)
			outs[i].Sent = sent
		})
	}
	wg.Wait()
	return outs, time.Since(start)
}

// maxErrorSamples is how many errors a result keeps verbatim.
const maxErrorSamples = 5

// summarizeRun turns the samples of a run (its repeats) into a result:
// outcomes pooled, engine counters summed, busy share over the summed
// prefill windows, cores averaged over time, the router's CPU per request
// from its core-seconds.
func summarizeRun(r run, samples []sample, slo SLO, c enginesim.Capacity) RunResult {
	var (
		outs            []Outcome
		es              EngineStats
		elapsed, window time.Duration
		cpu             CPUUse
	)
	for _, s := range samples {
		outs = append(outs, s.outs...)
		es.merge(s.engines)
		elapsed += s.elapsed
		window += prefillWindow(s.outs, s.elapsed)
		w := s.elapsed.Seconds()
		cpu.Router, cpu.Harness, cpu.Machine, cpu.Cores = cpu.Router+w*s.cpu.Router, cpu.Harness+w*s.cpu.Harness, cpu.Machine+w*s.cpu.Machine, s.cpu.Cores
	}
	if len(outs) > 0 {
		cpu.RouterMsPerRequest = 1000 * cpu.Router / float64(len(outs))
	}
	if t := elapsed.Seconds(); t > 0 {
		cpu.Router, cpu.Harness, cpu.Machine = cpu.Router/t, cpu.Harness/t, cpu.Machine/t
	}
	res := RunResult{
		Trace: r.trace, Policy: r.profile.Name, Oracle: r.profile.Oracle, Replicas: r.replicas, Rate: r.rate, Repeats: len(samples),
		Requests: len(outs), Engines: es, DurationSec: elapsed.Seconds(), CPU: cpu,
		Goodput:          goodput(outs, slo),
		PrefixHitRate:    ratio(float64(es.PrefillHitTokens), float64(es.PrefillQueryTokens)),
		PrefixHitRateAll: ratio(float64(es.AllHitTokens), float64(es.AllQueryTokens)),
		PrefillCV:        cv(es.PrefillRequests),
		DecodeCV:         cv(es.DecodeRequests),
	}
	if len(samples) > 0 {
		res.VLLMRouter = samples[0].vllmRouter
	}
	for _, s := range samples {
		res.PeerKVLookups += s.kvLookups
		res.PeerKVHits += s.kvHits
	}
	res.PrefillWindowSec = window.Seconds()
	res.BusyShare = busyShare(es.PrefillBusy, window, len(es.PrefillRequests))
	res.Service = service(c, es)
	res.Learned = meanLearned(samples)
	res.Placement = pooledRegret(samples)
	res.SelfCheck = pooledSelfCheck(samples)
	if len(samples) > 1 {
		for i := range samples {
			one := summarizeRun(r, samples[i:i+1], slo, c)
			res.PerRepeat = append(res.PerRepeat, RepeatResult{
				Goodput: one.Goodput, PrefixHitRate: one.PrefixHitRate, TTFT: one.TTFT, BusyShare: one.BusyShare,
			})
		}
	}
	var ttft, e2e, tpot []time.Duration
	for _, o := range outs {
		if o.MixedUp {
			res.MixUps++
		}
		if o.Err != "" {
			res.Errors++
			if o.Status == http.StatusTooManyRequests {
				res.Shed++
			} else {
				res.Broken++
			}
			if len(res.ErrorSamples) < maxErrorSamples {
				res.ErrorSamples = append(res.ErrorSamples, fmt.Sprintf("request %d: %s", o.Index, o.Err))
			}
		}
		if !o.OK() {
			continue
		}
		ttft, e2e = append(ttft, o.TTFT), append(e2e, o.E2E)
		if o.Tokens > 1 {
			tpot = append(tpot, o.TPOT())
		}
	}
	res.TTFT, res.E2E, res.TPOT = percentiles(ttft), percentiles(e2e), percentiles(tpot)
	return res
}

// prefillWindow is the time from the first send to the last first token
// (the last prefill done): the decode tail after it has no prefill work,
// and counting it would cap every busy share below 1.
func prefillWindow(outs []Outcome, elapsed time.Duration) time.Duration {
	var last time.Duration
	for _, o := range outs {
		if o.Tokens > 0 {
			last = max(last, o.Sent+o.TTFT)
		}
	}
	if last == 0 {
		return elapsed
	}
	return last
}

// busyShare is the prefill engines' busy time over their capacity during
// the run: the load measure of a point.
func busyShare(busy, elapsed time.Duration, engines int) float64 {
	return ratio(busy.Seconds(), elapsed.Seconds()*float64(engines))
}
