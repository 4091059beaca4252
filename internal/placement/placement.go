// Package placement places a request on its pool's engines: it reads the
// prompt (the engines' rendered tokens, else the byte estimate), picks the
// decode endpoint and the ones Envoy may retry it on, decides whether the
// prefill leg pays, and picks the prefill endpoint, attempt by attempt.
//
// A Pool is what placing needs of one pool, shared by every stream; the
// legs' policies and passive health are package picker's, the engines'
// reported caches package kvcache's. A Placement is one request's: Pool.Place
// creates it, and the request's stream owns it to its end.
package placement

import (
	"fmt"
	"math"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/kvcache"
	"github.com/pdx-router/pdx/internal/picker"
)

// Defaults of a pool's placement fields (Defaults fills them in).
const (
	// DefaultPrefixBlockTokens is the size of the blocks a prompt's bytes
	// are hashed in (picker.Blocks), in estimated tokens, while the
	// engines have not said theirs (Pool.BlockTokens).
	DefaultPrefixBlockTokens = 64
	// DefaultKVBlockSize is vLLM's --block-size on GPUs: the blocks the
	// engines' KV events name.
	DefaultKVBlockSize = 16
	// DefaultRenderTimeout bounds a render on a request's path.
	DefaultRenderTimeout = 100 * time.Millisecond
	// DefaultPickJitter is peers.pick_jitter's default: a few times the
	// time a lease takes to reach the peers (on loopback, quiet, about
	// 60 µs at the median and 1.1 ms at the 99th percentile:
	// BenchmarkPeerLeaseDelay), so that fewer of a burst's picks fall
	// closer together than that; on the cache-bound rig's bursts it
	// misplaced fewer prefills (docs/placement.md). It costs a prefill
	// half of it on average, which is why it is not wider.
	DefaultPickJitter = 4 * time.Millisecond
	// MaxPickJitter bounds peers.pick_jitter.
	MaxPickJitter = 100 * time.Millisecond
)

// Pool is what placing a request needs of its pool. It is built once per
// routing table (New) and read by every stream at once; only the legs'
// endpoint sets change under it (discovery), and its render's pause.
type Pool struct {
	// Name is the pool's, for messages.
	Name string
	// Prefill and Decode are the pool's two legs. Prefills: the pool's
	// connector takes a prefill leg.
	Prefill, Decode picker.Leg
	Prefills        bool
	// Decider says which requests skip the prefill leg.
	Decider Decider
	// DecodeFallbacks is how many more decode endpoints a request names
	// for Envoy to retry its decode on.
	DecodeFallbacks int
	// Render, when not nil, is where the pool's prompts are tokenized;
	// Cache is what the engines report holding (nil without kv_events),
	// matched in blocks of KVBlockSize tokens.
	Render      *Render
	Cache       *kvcache.Index
	KVBlockSize int
	// PickJitter is the most a request waits, at random, before its first
	// prefill pick (peers.pick_jitter; 0: none).
	PickJitter time.Duration
	// LateDecode: the decode is picked again once the prefill has answered
	// (Placement.Settle), the first pick being tentative.
	LateDecode bool
	// check is how the engines' word (rendered tokens, KV events) fared
	// against what the prefill engines said they computed (selfcheck.go).
	check selfCheck
}

// Options are what a pool's placement takes from outside its own config.
type Options struct {
	// StaleAfter: engine samples older than this do not count.
	StaleAfter time.Duration
	// Cache is the engines' reported caches (kv_events), nil without;
	// KVBlockSize their blocks' size (kv_events.block_size).
	Cache       *kvcache.Index
	KVBlockSize int
	// Prefills: the pool's connector takes a prefill leg.
	Prefills bool
	// Journal hears the prefill leg's leases, for the replica's peers;
	// nil without peers. PickJitter and LateDecode are Pool's.
	Journal    *picker.Journal
	PickJitter time.Duration
	LateDecode bool
}

// Defaults fills in the placement fields pc leaves unset: the one place
// they are defaulted, for config.Parse and for New. kvEvents: the config
// reads the engines' KV events; prefills: the pool's connector takes a
// prefill leg (without one it has no prefill picker).
func Defaults(pc *configv1.Pool, kvEvents, prefills bool) {
	// Precise placement needs the engines' tokens: with KV events a pool
	// renders unless told not to.
	if pc.Render == nil && kvEvents {
		pc.Render = &configv1.Render{}
	}
	if r := pc.Render; r != nil && !r.Disabled && r.Timeout == nil {
		r.Timeout = durationpb.New(DefaultRenderTimeout)
	}
	if prefills {
		pc.PrefillPicker = picker.WithDefaults(pc.PrefillPicker, picker.RolePrefill)
	}
	pc.DecodePicker = picker.WithDefaults(pc.DecodePicker, picker.RoleDecode)
}

// New builds the placement of the pool pc with endpoints prefill and
// decode; prev, when not nil, is its predecessor in the table being
// replaced, whose endpoints' passive health it keeps. Errors name the
// field at fault.
func New(pc *configv1.Pool, prefill, decode []endpoint.Endpoint, prev *Pool, opts Options) (*Pool, error) {
	pc = proto.CloneOf(pc)
	Defaults(pc, opts.Cache != nil, opts.Prefills)
	health := picker.Options{
		FailureThreshold: int(pc.GetEjectAfterFailures()),
		CoolDown:         pc.GetEjectDuration().AsDuration(),
		StaleAfter:       opts.StaleAfter,
		Adapters:         pc.GetLora().GetAdapters(),
		BlockTokens:      int(pc.GetPrefixBlockTokens()),
	}
	var render *Render
	if r := pc.GetRender(); r != nil && !r.GetDisabled() {
		render = &Render{Address: r.GetAddress(), Timeout: r.GetTimeout().AsDuration()}
		if a, err := endpoint.ParseAddress(render.Address); err == nil && render.Address != "" {
			render.Address = a.String() // a URL's host:port
		}
	}
	if opts.Cache != nil && render != nil {
		// Only rendered prompts match the engines' blocks.
		health.Cache = opts.Cache
	}
	if health.BlockTokens == 0 {
		// Unset, the blocks are the engines' (Pool.BlockTokens), but
		// where the pool reads their KV events (it renders): there what
		// pdx sent only stands in for what the events have not told
		// yet, and blocks of the default size count less of it than
		// finer ones, so that the engines' word decides (on the
		// cache-bound rig the engines' blocks raised precise
		// placement's TTFT p90 at 55% and 85%).
		health.BlockTokens, health.EngineBlocks = DefaultPrefixBlockTokens, health.Cache == nil
	}
	if s := pc.GetSaturation(); s != nil && !s.GetDisabled() {
		health.Saturation = picker.Saturation{
			QueueDepth: int(s.GetQueueDepth()), KVUsage: s.GetKvUsage(), MaxInFlight: int(s.GetMaxInFlight()),
		}
	}
	prefillHealth, decodeHealth := health, health
	if n := pc.GetSaturation().GetPrefillMaxInFlight(); n > 0 && !pc.GetSaturation().GetDisabled() {
		prefillHealth.Saturation.MaxInFlight = int(n)
	}
	if prev != nil {
		prefillHealth.Inherit, decodeHealth.Inherit = prev.Prefill.Set, prev.Decode.Set
	}
	prefillHealth.Journal, prefillHealth.Pool = opts.Journal, pc.GetName()
	p := &Pool{
		Name:            pc.GetName(),
		Prefills:        opts.Prefills,
		Decider:         decider(pc.GetDisaggregation()),
		DecodeFallbacks: int(pc.GetDecodeFallbacks()),
		Render:          render,
		Cache:           opts.Cache,
		KVBlockSize:     opts.KVBlockSize,
		PickJitter:      opts.PickJitter,
		LateDecode:      opts.LateDecode && opts.Prefills,
	}
	if p.KVBlockSize <= 0 {
		p.KVBlockSize = DefaultKVBlockSize
	}
	var err error
	if p.Prefill, err = picker.NewLeg(picker.NewSet(prefill, prefillHealth), pc.GetPrefillPicker(), picker.RolePrefill); err != nil {
		return nil, fmt.Errorf("prefill_picker.policy: %w", err)
	}
	if p.Decode, err = picker.NewLeg(picker.NewSet(decode, decodeHealth), pc.GetDecodePicker(), picker.RoleDecode); err != nil {
		return nil, fmt.Errorf("decode_picker.policy: %w", err)
	}
	return p, nil
}

// Decider decides per request whether the prefill leg pays (the config's
// Disaggregation).
type Decider struct {
	// MinUncachedTokens: a prompt whose uncached part on its decode engine
	// is shorter goes to the decode engine alone. 0: off.
	MinUncachedTokens int
	// WhenPrefillSaturated sends a request to its decode engine alone when
	// every prefill endpoint is saturated, if its priority is at least
	// SaturatedMinPriority.
	WhenPrefillSaturated bool
	SaturatedMinPriority int
}

// decider is d's Decider.
func decider(d *configv1.Disaggregation) Decider {
	out := Decider{
		MinUncachedTokens:    int(d.GetMinUncachedTokens()),
		WhenPrefillSaturated: d.GetWhenPrefillSaturated(),
		SaturatedMinPriority: math.MinInt,
	}
	if d != nil && d.PrefillSaturatedMinPriority != nil {
		out.SaturatedMinPriority = int(d.GetPrefillSaturatedMinPriority())
	}
	return out
}
