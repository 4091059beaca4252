package replay

import (
	"fmt"
	"strings"
)

// Profile is a placement policy as pdx's config states it: lines added to
// the stack's pool and to the top level of the config. A peer profile is
// another router instead, over the same engines.
type Profile struct {
	Name string
	// PoolYAML goes into the pool (stack.Options.PoolYAML), ConfigYAML at
	// the top level (stack.Options.ConfigYAML).
	PoolYAML, ConfigYAML string
	// Peer, when set, is a vllm-router --policy: the profile runs vLLM's
	// own router (package vllmrouter) in front of the engines instead of
	// Envoy and pdx, and has no pdx config.
	Peer string
	// KVEvents makes the engines publish vLLM's KV events: pdx subscribes
	// to every engine's (kv_events in mode dial, the prompts rendered by
	// the engines) for precise placement, a peer to the prefill engines'
	// (vllm-router --pd-kv-events) for its kv_aware policy. The engines are
	// the same as for the other profiles otherwise (for the peer their
	// served model is renamed the stack's, which kv_aware checks requests
	// against).
	KVEvents bool
	// Oracle makes the profile the replay's yardstick instead of a router
	// one can deploy: an in-process P/D router (oracle.go) that reads the
	// simulators' true state and picks, per request, the least time to
	// first token. Like a peer it has no pdx config and no Envoy.
	Oracle bool
	// OracleDecode is a variant of the oracle's decode pick
	// (OracleDecodeRoomPrefix and the rest), "" for its own.
	OracleDecode string
	// DecodeAlone lets the oracle also serve a request on a decode engine
	// alone (decode-side reuse) when that gives the first token sooner:
	// the TTFT limit, which weighs no TPOT.
	DecodeAlone bool
	// Peers makes pdx's replicas exchange their prefills (config peers);
	// PeersYAML are more fields of peers (e.g. "pick_jitter: 0s").
	Peers     bool
	PeersYAML string
	// Direct runs the oracle's in-process router placing round robin
	// instead: pdx's round robin without Envoy and pdx in front, so that
	// the two rows' difference is what the path costs, apart from
	// placement. Not a yardstick: runs are not compared with it.
	Direct bool
}

// pdx reports whether p runs Envoy and pdx.
func (p Profile) pdx() bool { return p.Peer == "" && !p.Oracle && !p.Direct }

// Config is what the report lists of p: its pdx YAML, or the peer's
// policy.
func (p Profile) Config() string {
	if p.Oracle {
		pd := "prefill on the least forecast TTFT " +
			"(work queued ahead, then the uncached tokens over the prefill rate, plus the overhead), " +
			"decode on the least KV pull + 2 decode steps at the batch it joins; NIXL P/D legs sent by itself"
		if p.DecodeAlone {
			return "in-process oracle over the simulators' true state (no Envoy), on the path of the least forecast TTFT: " + pd +
				", or a plain request to the decode engine whose own prefill of the prompt is soonest; greedy on TTFT, TPOT not weighed"
		}
		if p.OracleDecode != "" {
			return "in-process oracle over the simulators' true state (no Envoy): " + pd + "; but the decode pick: " + oracleDecodePicks[p.OracleDecode]
		}
		return "in-process oracle over the simulators' true state (no Envoy): " + pd
	}
	if p.Direct {
		return "in-process router (the oracle's, no Envoy), prefill and decode round robin; NIXL P/D legs sent by itself"
	}
	if p.Peer != "" && p.KVEvents {
		return "vllm-router in NIXL P/D mode, --policy " + p.Peer + ", --pd-kv-events from every prefill engine"
	}
	if p.Peer != "" {
		return "vllm-router in NIXL P/D mode, --policy " + p.Peer
	}
	peers := ""
	if p.Peers {
		more := ""
		if p.PeersYAML != "" {
			more = ", " + p.PeersYAML
		}
		peers = "peers: {addresses: [every replica's admin address]" + more + "}\n"
	}
	if p.KVEvents {
		return "kv_events: {mode: dial} (every engine publishes; prompts rendered by the engines)\n" + peers + p.PoolYAML + p.ConfigYAML
	}
	return peers + p.PoolYAML + p.ConfigYAML
}

// PreciseProfile names pdx's precise placement profile.
const PreciseProfile = "precise"

// PrecisePeersProfile names precise placement with the replicas'
// prefills exchanged.
const PrecisePeersProfile = "precise-peers"

// PrecisePeersAtOnceProfile and DefaultPeersAtOnceProfile name
// PrecisePeersProfile and DefaultPeersProfile with the replicas picking
// at once (peers.pick_jitter 0s): what the pick jitter is measured
// against.
const (
	PrecisePeersAtOnceProfile = "precise-peers-at-once"
	DefaultPeersAtOnceProfile = "pdx-default-peers-at-once"
	// PrecisePeersJitter16Profile names PrecisePeersProfile with a 16 ms
	// pick jitter.
	PrecisePeersJitter16Profile = "precise-peers-jitter-16"
)

// DefaultPeersProfile names pdx's defaults with the replicas' prefills,
// and the prompt blocks they sent, exchanged.
const DefaultPeersProfile = "pdx-default-peers"

// PreciseReuseProfile names precise placement with decode-side reuse.
const PreciseReuseProfile = "precise-reuse"

// dynamoLocalPrefillTokens is NVIDIA Dynamo's max_local_prefill_length
// default, in real tokens: a prompt with more tokens than this that its
// decode worker's prefix cache lacks is prefilled remotely (ai-dynamo/dynamo,
// examples/llm/components/disagg_router.py, prefill_remote).
const dynamoLocalPrefillTokens = 1000

// PdxDefaultDecider is the disaggregation line of the "pdx-default"
// profile (pool YAML, e.g. "disaggregation: {min_uncached_tokens: 4}");
// empty leaves pdx's own default.
const PdxDefaultDecider = ""

// llmdDeciderTokens is llm-d's sample prefix-based P/D decider threshold,
// in real tokens (nonCachedTokens of deploy/config/pd-epp-config.yaml).
const llmdDeciderTokens = 16

// Profiles is the table of placement policies at a token scale: edit it
// here. The decider thresholds are real token counts scaled like prompts.
// The peers come next to last, the oracles last.
func Profiles(s Scale) []Profile {
	return []Profile{
		{Name: "round-robin", PoolYAML: lines(
			"prefill_picker: {policy: round_robin}",
			"decode_picker: {policy: round_robin}")},
		{Name: "least-request", PoolYAML: lines(
			"prefill_picker: {policy: least_request}",
			"decode_picker: {policy: least_request}")},
		// llm-d's documented P/D profile: prefix-cache scorer weight 2,
		// queue scorer 1, prefill skipped below 16 uncached tokens.
		{Name: "llm-d-default", PoolYAML: lines(
			"prefill_picker: {policy: load_aware, weights: {prefix: 2, queue: 1}}",
			"decode_picker: {policy: load_aware, weights: {prefix: 2, queue: 1}}",
			fmt.Sprintf("disaggregation: {min_uncached_tokens: %d}", s.Tokens(llmdDeciderTokens)))},
		{Name: "pdx-default", PoolYAML: lines(PdxDefaultDecider)},
		// pdx's defaults with the decode's stream held until the response
		// ends, counted exactly but cut if pdx dies (pdx's former
		// default), and ended at routing, the decode uncounted: what
		// pdx-default's detached decodes (end_streams_at_routing unset)
		// are measured against.
		{Name: "pdx-held", ConfigYAML: lines("end_streams_at_routing: false")},
		{Name: "pdx-uncounted", ConfigYAML: lines("end_streams_at_routing: true")},
		// pdx's stateless prefix placement: every replica picks alike.
		{Name: "prefix-affinity", PoolYAML: lines("prefill_picker: {policy: prefix_affinity}")},
		// pdx's defaults placing by what the engines report holding (their
		// KV events) and their tokens (render), not by what pdx sent.
		{Name: PreciseProfile, KVEvents: true},
		// precise, its replicas exchanging their prefills (config peers):
		// each counts them all in the engines' queues.
		{Name: PrecisePeersProfile, KVEvents: true, Peers: true},
		// pdx's defaults without events, the replicas exchanging their prefills (config
		// peers): each counts them all in the engines' queues, and every
		// prompt block sent as sent.
		{Name: DefaultPeersProfile, Peers: true, PoolYAML: lines(PdxDefaultDecider)},
		// Both, the replicas picking a burst's prefills at once.
		{Name: PrecisePeersAtOnceProfile, KVEvents: true, Peers: true, PeersYAML: "pick_jitter: 0s"},
		{Name: DefaultPeersAtOnceProfile, Peers: true, PeersYAML: "pick_jitter: 0s", PoolYAML: lines(PdxDefaultDecider)},
		// precise-peers with four times the default pick jitter.
		{Name: PrecisePeersJitter16Profile, KVEvents: true, Peers: true, PeersYAML: "pick_jitter: 16ms"},
		// precise, and a prompt whose decode engine holds all but fewer
		// than 1,000 of its tokens (the engine's own word) is prefilled
		// there alone: decode-side reuse, by NVIDIA Dynamo's disaggregated
		// router rule and its default max_local_prefill_length.
		{Name: PreciseReuseProfile, KVEvents: true, PoolYAML: lines(
			fmt.Sprintf("disaggregation: {min_uncached_tokens: %d}", s.Tokens(dynamoLocalPrefillTokens)))},
		// pdx's former prefill default, least_work (the default, forecast,
		// is pdx-default and precise): what the forecast is measured
		// against, without and with the engines' events.
		{Name: "least-work", PoolYAML: lines("prefill_picker: {policy: least_work}", PdxDefaultDecider)},
		{Name: "least-work-precise", KVEvents: true, PoolYAML: lines("prefill_picker: {policy: least_work}")},
		// pdx's defaults but the decode leg's policy: what forecast's
		// decode placement is measured against (--decode-kv-blocks);
		// load_aware was the default before it.
		{Name: "pdx-decode-load-aware", PoolYAML: lines("decode_picker: {policy: load_aware}", PdxDefaultDecider)},
		{Name: "pdx-decode-round-robin", PoolYAML: lines("decode_picker: {policy: round_robin}", PdxDefaultDecider)},
		{Name: "pdx-decode-least-request", PoolYAML: lines("decode_picker: {policy: least_request}", PdxDefaultDecider)},
		// vLLM's own router: cache_aware is its default, the one users
		// compare against; round_robin is its plain baseline.
		{Name: "vllm-router-cache-aware", Peer: "cache_aware"},
		// kv_aware places prefills by the KV events the engines publish
		// (what each prefill engine caches) instead of its own guess.
		{Name: "vllm-router-kv-aware", Peer: "kv_aware", KVEvents: true},
		{Name: "vllm-router-round-robin", Peer: "round_robin"},
		// The yardstick's limit: what a router that knew every engine's
		// cache and queue would get, request by request.
		{Name: OracleProfile, Oracle: true},
		// The oracle but its decode pick: what each part of that pick is
		// worth when decodes wait for KV (--decode-kv-blocks).
		{Name: "oracle-decode-early", Oracle: true, OracleDecode: OracleDecodeEarly},
		{Name: "oracle-decode-room-prefix", Oracle: true, OracleDecode: OracleDecodeRoomPrefix},
		{Name: "oracle-decode-room-fewest", Oracle: true, OracleDecode: OracleDecodeRoomFewest},
		{Name: "oracle-decode-fewest", Oracle: true, OracleDecode: OracleDecodeFewest},
		{Name: "oracle-decode-round-robin", Oracle: true, OracleDecode: OracleDecodeRoundRobin},
		// The TTFT limit with decode-side reuse: the oracle that may also
		// serve a request on a decode engine alone.
		{Name: OracleReuseProfile, Oracle: true, DecodeAlone: true},
		// round-robin's placement on the oracle's path: what Envoy and
		// pdx add to a request's TTFT, apart from placement.
		{Name: DirectRoundRobinProfile, Direct: true},
	}
}

// oracleDecodePicks say what the oracle's decode-pick variants do, for
// the report.
var oracleDecodePicks = map[string]string{
	OracleDecodeEarly:      "the oracle's, made when the prefill is placed, before it runs",
	OracleDecodeRoomPrefix: "the engines that admit the sequence at once first, then the most of its prompt cached, then the fewest sequences",
	OracleDecodeRoomFewest: "the engines that admit the sequence at once first, then the fewest sequences",
	OracleDecodeFewest:     "the fewest sequences running and waiting",
	OracleDecodeRoundRobin: "round robin",
}

// OracleProfile is the oracle's profile name, the yardstick every run is
// compared with; OracleReuseProfile the oracle with decode-alone.
const (
	OracleProfile      = "oracle"
	OracleReuseProfile = "oracle-reuse"
	// DirectRoundRobinProfile is round robin on the oracle's path.
	DirectRoundRobinProfile = "direct-round-robin"
)

// SelectProfiles picks profiles by name, in the order given.
func SelectProfiles(all []Profile, names []string) ([]Profile, error) {
	var out []Profile
	for _, n := range names {
		i := -1
		for j, p := range all {
			if p.Name == n {
				i = j
			}
		}
		if i < 0 {
			var known []string
			for _, p := range all {
				known = append(known, p.Name)
			}
			return nil, fmt.Errorf("unknown policy %q (known: %s)", n, strings.Join(known, ", "))
		}
		out = append(out, all[i])
	}
	return out, nil
}

// lines joins YAML lines, the empty ones left out, each ending in a
// newline.
func lines(l ...string) string {
	var b strings.Builder
	for _, s := range l {
		if s = strings.TrimSpace(s); s != "" {
			b.WriteString(s + "\n")
		}
	}
	return b.String()
}
