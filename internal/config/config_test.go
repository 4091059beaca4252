package config

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/placement"
)

// pool renders a valid pool list item. Each override is a "key: value" line
// that replaces the line for key, or is added if the pool has no such key.
func pool(overrides ...string) string {
	fields := []string{
		"name: p",
		"models: [m]",
		"connector: nixl",
		`prefill: [{address: "10.0.0.1:8000"}]`,
		`decode: [{address: "10.0.0.2:8000"}]`,
	}
	for _, o := range overrides {
		key, _, _ := strings.Cut(o, ":")
		i := slices.IndexFunc(fields, func(f string) bool { return strings.HasPrefix(f, key+":") })
		if i < 0 {
			fields = append(fields, o)
		} else {
			fields[i] = o
		}
	}
	return "  - " + strings.Join(fields, "\n    ") + "\n"
}

func pools(items ...string) string { return "pools:\n" + strings.Join(items, "") }

// minimal is the smallest valid config.
var minimal = pools(pool())

// withoutLines is err's message without the YAML lines Parse names
// ("config:7: x: problem" reads "config: x: problem"): the tables say
// what is wrong, TestErrorLines where.
func withoutLines(err error) string {
	if err == nil {
		return ""
	}
	return regexp.MustCompile(`(?m)^config:[0-9]+: `).ReplaceAllString(err.Error(), "config: ")
}

func requireProtoEqual(t *testing.T, want, got proto.Message) {
	t.Helper()
	require.True(t, proto.Equal(want, got), "want:\n%s\ngot:\n%s",
		prototext.Format(want), prototext.Format(got))
}

func TestParseAppliesDefaults(t *testing.T) {
	cfg, err := Parse([]byte(minimal))
	require.NoError(t, err)
	requireProtoEqual(t, &configv1.Config{
		GrpcAddress:         "127.0.0.1:9002",
		AdminAddress:        "127.0.0.1:9003",
		MaxBodyBytes:        16 << 20,
		MaxRequestHeaders:   100,
		MaxRequestHeadersKb: 60,
		RequestBodyTimeout:  durationpb.New(time.Minute),
		EngineMetrics:       defaultEngineMetrics(),
		DnsRefreshRate:      durationpb.New(5 * time.Second),
		Pools: []*configv1.Pool{{
			Name:           "p",
			Models:         []string{"m"},
			Connector:      "nixl",
			Prefill:        []*configv1.Endpoint{{Address: "10.0.0.1:8000"}},
			Decode:         []*configv1.Endpoint{{Address: "10.0.0.2:8000"}},
			PrefillTimeout: durationpb.New(30 * time.Second),

			PrefillAttempts:       3,
			PrefillAttemptTimeout: durationpb.New(30 * time.Second),
			OnPrefillFailure:      configv1.PrefillFailure_PREFILL_FAILURE_FAIL,
			EjectAfterFailures:    3,
			EjectDuration:         durationpb.New(10 * time.Second),
			PrefillPicker:         &configv1.Picker{Policy: "forecast"},
			DecodePicker:          &configv1.Picker{Policy: "forecast"},
			Saturation:            defaultSaturation(),
		}},
	}, cfg)
}

// With peers, pick_jitter is placement's default when unset and stays
// as given otherwise, none included.
func TestPeersPickJitter(t *testing.T) {
	for _, tc := range []struct {
		peers string
		want  time.Duration
	}{
		{peers: `peers: {addresses: ["10.0.0.9:9003"]}`, want: placement.DefaultPickJitter},
		{peers: `peers: {addresses: ["10.0.0.9:9003"], pick_jitter: 0s}`, want: 0},
		{peers: `peers: {addresses: ["10.0.0.9:9003"], pick_jitter: 10ms}`, want: 10 * time.Millisecond},
	} {
		t.Run(tc.peers, func(t *testing.T) {
			cfg, err := Parse([]byte(minimal + tc.peers + "\n"))
			require.NoError(t, err)
			require.NotNil(t, cfg.GetPeers().GetPickJitter())
			require.Equal(t, tc.want, cfg.GetPeers().GetPickJitter().AsDuration())
		})
	}
	cfg, err := Parse([]byte(minimal))
	require.NoError(t, err)
	require.Nil(t, cfg.GetPeers(), "no peers, no jitter")
}

func defaultEngineMetrics() *configv1.EngineMetrics {
	return &configv1.EngineMetrics{Interval: durationpb.New(50 * time.Millisecond), StaleAfter: durationpb.New(2 * time.Second), Path: "/metrics"}
}

func defaultSaturation() *configv1.Saturation {
	return &configv1.Saturation{QueueDepth: 5, KvUsage: 0.8, Action: configv1.SaturationAction_SATURATION_ACTION_QUEUE, MaxQueueTime: durationpb.New(time.Second)}
}

func TestParseAllFields(t *testing.T) {
	// JSON is accepted too; durations use Go syntax.
	cfg, err := Parse([]byte(`{
		"grpc_address": ":7000", "admin_address": "localhost:7001", "max_body_bytes": 1024,
		"max_request_headers": 200, "max_request_headers_kb": 96, "request_body_timeout": "5s",
		"pools": [
			{"name": "a-1", "models": ["x", "y"], "connector": "nixl", "prefill_timeout": "1m30s",
			 "prefill": [{"address": "[::1]:1"}], "decode": [{"address": "192.168.0.1:65535"}]},
			{"name": "b", "default": true, "connector": "nixl", "prefill_timeout": "250ms",
			 "prefill": [{"address": "10.0.0.1:1"}], "decode": [{"address": "10.0.0.1:2"}],
			 "prefill_attempts": 2, "prefill_attempt_timeout": "100ms", "on_prefill_failure": "fallback",
			 "eject_after_failures": 5, "eject_duration": "1m",
			 "prefill_picker": {"policy": "round_robin"}, "decode_picker": {"policy": "load_aware", "weights": {"queue": 1}},
			 "disaggregation": {"min_uncached_tokens": 16, "when_prefill_saturated": true},
			 "saturation": {"queue_depth": 8, "kv_usage": 0.9, "max_in_flight": 20, "action": "reject", "max_queue_time": "2s"},
			 "prefix_block_tokens": 16}
		],
		"engine_metrics": {"interval": "100ms", "stale_after": "1s", "path": "/prom"}, "dns_refresh_rate": "250ms"}`))
	require.NoError(t, err)
	requireProtoEqual(t, &configv1.Config{
		GrpcAddress:         ":7000",
		AdminAddress:        "localhost:7001",
		MaxBodyBytes:        1024,
		MaxRequestHeaders:   200,
		MaxRequestHeadersKb: 96,
		RequestBodyTimeout:  durationpb.New(5 * time.Second),
		EngineMetrics:       &configv1.EngineMetrics{Interval: durationpb.New(100 * time.Millisecond), StaleAfter: durationpb.New(time.Second), Path: "/prom"},
		DnsRefreshRate:      durationpb.New(250 * time.Millisecond),
		Pools: []*configv1.Pool{{
			Name:           "a-1",
			Models:         []string{"x", "y"},
			Connector:      "nixl",
			Prefill:        []*configv1.Endpoint{{Address: "[::1]:1"}},
			Decode:         []*configv1.Endpoint{{Address: "192.168.0.1:65535"}},
			PrefillTimeout: durationpb.New(90 * time.Second),

			PrefillAttempts:       3,
			PrefillAttemptTimeout: durationpb.New(90 * time.Second),
			OnPrefillFailure:      configv1.PrefillFailure_PREFILL_FAILURE_FAIL,
			EjectAfterFailures:    3,
			EjectDuration:         durationpb.New(10 * time.Second),
			PrefillPicker:         &configv1.Picker{Policy: "forecast"},
			DecodePicker:          &configv1.Picker{Policy: "forecast"},
			Saturation:            defaultSaturation(),
		}, {
			Name:           "b",
			Default:        true,
			Connector:      "nixl",
			Prefill:        []*configv1.Endpoint{{Address: "10.0.0.1:1"}},
			Decode:         []*configv1.Endpoint{{Address: "10.0.0.1:2"}},
			PrefillTimeout: durationpb.New(250 * time.Millisecond),

			PrefillAttempts:       2,
			PrefillAttemptTimeout: durationpb.New(100 * time.Millisecond),
			OnPrefillFailure:      configv1.PrefillFailure_PREFILL_FAILURE_FALLBACK,
			EjectAfterFailures:    5,
			EjectDuration:         durationpb.New(time.Minute),
			PrefillPicker:         &configv1.Picker{Policy: "round_robin"},
			DecodePicker:          &configv1.Picker{Policy: "load_aware", Weights: &configv1.Weights{Queue: 1}},
			Disaggregation:        &configv1.Disaggregation{MinUncachedTokens: 16, WhenPrefillSaturated: true},
			Saturation:            &configv1.Saturation{QueueDepth: 8, KvUsage: 0.9, MaxInFlight: 20, Action: configv1.SaturationAction_SATURATION_ACTION_REJECT, MaxQueueTime: durationpb.New(2 * time.Second)},
			PrefixBlockTokens:     16,
		}},
	}, cfg)
}

func TestParseErrors(t *testing.T) {
	tests := []struct {
		name string
		yaml string
		want []string // each must appear in the error
	}{
		{"request_body_timeout zero", minimal + "request_body_timeout: 0s\n", []string{
			`config: request_body_timeout: 0s must be greater than 0`}},
		{"request_body_timeout too long", minimal + "request_body_timeout: 2h\n", []string{
			`config: request_body_timeout: 2h0m0s exceeds the maximum of 1h0m0s`}},
		{"max_request_headers too low", minimal + "max_request_headers: 8\n", []string{
			`config: max_request_headers: 8 is below 16`}},
		{"engine_metrics", minimal + "engine_metrics: {interval: 1ms, stale_after: 0.5ms, path: metrics}\n", []string{
			`config: engine_metrics.interval: 1ms is below the minimum of 10ms`,
			`config: engine_metrics.stale_after: 500µs is below interval (1ms): every sample would be stale`,
			`config: engine_metrics.path: "metrics" must start with /`}},
		{"saturation", pools(pool(`saturation: {kv_usage: 1.5, action: shed, max_queue_time: 2m}`)), []string{
			`config: pools[0].saturation.kv_usage: 1.5 is not in (0, 1]`,
			`config: pools[0].saturation.action: "shed" is not "queue" or "reject"`,
			`config: pools[0].saturation.max_queue_time: 2m0s exceeds the maximum of 1m0s`}},
		{"flow_control", pools(pool(`flow_control: {fairness: vtc, ordering: lifo, objectives: [{name: a, priority: 1}, {priority: 2}, {name: a}], bands: [{priority: 1, max_queue_time: 2m}, {priority: 1, max_queue_time: -1s}]}`),
			pool("name: q", "models: [q]", "saturation: {disabled: true}", "flow_control: {}")), []string{
			`config: pools[0].flow_control.fairness: "vtc" is not round_robin or token_usage`,
			`config: pools[0].flow_control.ordering: "lifo" is not fcfs or edf`,
			`config: pools[0].flow_control.objectives[1].name: is required`,
			`config: pools[0].flow_control.objectives[2].name: "a" is listed twice`,
			`config: pools[0].flow_control.bands[0].max_queue_time: 2m0s exceeds the maximum of 1m0s`,
			`config: pools[0].flow_control.bands[1].priority: 1 is listed twice`,
			`config: pools[0].flow_control.bands[1].max_queue_time: -1s must not be negative`,
			`config: pools[1].flow_control: needs saturation, which is disabled: nothing would ever wait`}},
		{"flow_control.kubernetes_objectives", pools(pool(`flow_control: {kubernetes_objectives: {}}`),
			pool("name: q", "models: [q]", `flow_control: {kubernetes_objectives: {namespace: Team_A, pool: "pool/x"}}`)), []string{
			`config: pools[0].flow_control.kubernetes_objectives.namespace: required`,
			`config: pools[0].flow_control.kubernetes_objectives.pool: required: the InferencePool the objects' spec.poolRef names`,
			`config: pools[1].flow_control.kubernetes_objectives.namespace: "Team_A" is not valid`,
			`config: pools[1].flow_control.kubernetes_objectives.pool: "pool/x" is not valid`}},
		{"disaggregation without a prefill leg", pools(pool("connector: none", "prefill: []", "disaggregation: {min_uncached_tokens: 16}")), []string{
			`config: pools[0].disaggregation: not valid with connector "none", which has no prefill leg`}},
		{"prefill_saturated_min_priority without when_prefill_saturated", pools(pool("disaggregation: {prefill_saturated_min_priority: 1}")), []string{
			`config: pools[0].disaggregation.prefill_saturated_min_priority: has no effect without when_prefill_saturated`}},
		{"prefill_max_in_flight without a prefill leg", pools(pool("connector: none", "prefill: []", "saturation: {prefill_max_in_flight: 2}")), []string{
			`config: pools[0].saturation.prefill_max_in_flight: not valid with connector "none", which has no prefill leg`}},
		{"decode_fallbacks with connectors that cannot", pools(pool("connector: sglang", "decode_fallbacks: 1"), pool("name: q", "models: [q]", "connector: p2p-nccl", "decode_fallbacks: 1"),
			pool("name: r", "models: [r]", "connector: trtllm", "decode_fallbacks: 1"), pool("name: s", "models: [s]", "connector: mooncake", "mooncake_protocol: vllm", "decode_fallbacks: 1"),
			pool("name: t", "models: [t]", "decode_fallbacks: 9")), []string{
			`config: pools[0].decode_fallbacks: not valid with connector "sglang": its prefill hands the KV to the one decode engine it was told of, so no other can take the request`,
			`config: pools[1].decode_fallbacks: not valid with connector "p2p-nccl"`,
			`config: pools[2].decode_fallbacks: not valid with connector "trtllm"`,
			`config: pools[3].decode_fallbacks: not valid with connector "mooncake"`,
			`config: pools[4].decode_fallbacks: 9 exceeds the maximum of 8`}},
		{"kv_events dial", minimal + "kv_events: {port: 70000, replay_port: 70001, bind_address: tcp://0.0.0.0:1, block_size: 2048}\n", []string{
			`config: kv_events.port: 70000 is not a port`,
			`config: kv_events.replay_port: 70001 is not a port`,
			`config: kv_events.bind_address: only valid in mode "bind"`,
			`config: kv_events.block_size: 2048 exceeds the maximum of 1024`}},
		{"kv_events dial without a port", pools(pool(`prefill: [{address: "10.0.0.1:8000", kv_events_port: 5557}]`)) + "kv_events: {}\n", []string{
			`config: pools[0].decode[0].kv_events_port: required when kv_events.port is unset`}},
		{"kv_events bind", minimal + "kv_events: {mode: bind, bind_address: 0.0.0.0:5557, port: 5557}\n", []string{
			`config: kv_events.bind_address: "0.0.0.0:5557" must be tcp://host:port (e.g. tcp://0.0.0.0:5557)`,
			`config: kv_events.port: only valid in mode "dial"`}},
		{"endpoints' kv_events ports without kv_events", pools(pool(`prefill: [{address: "10.0.0.1:8000", kv_events_port: 5557}]`)), []string{
			`config: pools[0].prefill[0].kv_events_port: only valid with kv_events in mode "dial"`}},
		{"endpoints' kv_events ports", pools(pool(`decode: [{address: "10.0.0.2:8000", kv_events_port: 70000, kv_events_replay_port: 70001}]`)) + "kv_events: {port: 5557}\n", []string{
			`config: pools[0].decode[0].kv_events_port: 70000 is not a port`,
			`config: pools[0].decode[0].kv_events_replay_port: 70001 is not a port`}},
		{"peers without addresses", minimal + "peers: {}\n", []string{
			`config: peers.addresses: at least one replica's admin address is required when peers is set`}},
		{"peers' addresses", minimal + `peers: {addresses: ["pdx-peers.ns.svc:9090", "pdx-peers", ":9090"]}` + "\n", []string{
			`config: peers.addresses[1]: "pdx-peers" must be host:port (a replica's admin_address)`,
			`config: peers.addresses[2]: ":9090" must be host:port (a replica's admin_address)`}},
		{"peers' pick_jitter", minimal + `peers: {addresses: ["10.0.0.9:9003"], pick_jitter: 1s}` + "\n", []string{
			`config: peers.pick_jitter: 1s is not in [0s, 100ms]`}},
		{"peers' negative pick_jitter", minimal + `peers: {addresses: ["10.0.0.9:9003"], pick_jitter: -1ms}` + "\n", []string{
			`config: peers.pick_jitter: -1ms is not in [0s, 100ms]`}},
		{"kv_events mode", minimal + "kv_events: {mode: central}\n", []string{
			`config: kv_events.mode: unknown mode "central" (want "dial" or "bind")`}},
		{"render", pools(pool("render: {timeout: 0s, address: engine}"), pool("name: q", "models: [q]", "render: {timeout: 1m}")), []string{
			`config: pools[0].render.timeout: 0s must be greater than 0`,
			`config: pools[0].render.address: "engine" is not host:port`,
			`config: pools[1].render.timeout: 1m0s exceeds the maximum of 10s`}},
		{"prefix_block_tokens", pools(pool("prefix_block_tokens: 5000")), []string{
			`config: pools[0].prefix_block_tokens: 5000 exceeds the maximum of 4096`}},
		{"pass_through paths", pools(pool(`pass_through: [v1/x, "/v1/y?z=1", /v1/completions, /v1/e, /v1/e]`)), []string{
			`config: pools[0].pass_through[0]: "v1/x" is not a path`,
			`config: pools[0].pass_through[1]: "/v1/y?z=1" is not a path`,
			`config: pools[0].pass_through[2]: "/v1/completions" is routed by pdx itself`,
			`config: pools[0].pass_through[4]: duplicate path "/v1/e"`}},
		{"session_affinity", pools(pool("session_affinity: {}"), pool("name: q", "models: [q]", "session_affinity: {header: X-Session}"),
			pool("name: r", "models: [r]", `session_affinity: {header: "x session"}`), pool("name: s", "models: [s]", "session_affinity: {header: x-gateway-destination-endpoint}"),
			pool("name: t", "models: [t]", "session_affinity: {header: x-request-id}")), []string{
			`config: pools[0].session_affinity.header: required`,
			`config: pools[1].session_affinity.header: "X-Session" is not a lower-case HTTP header name`,
			`config: pools[2].session_affinity.header: "x session" is not a lower-case HTTP header name`,
			`config: pools[3].session_affinity.header: "x-gateway-destination-endpoint" is a header pdx sets or routes by itself`,
			`config: pools[4].session_affinity.header: "x-request-id" is a header pdx sets or routes by itself`}},
		// Decoding: unknown fields, named by full path.
		{"unknown top-level field", minimal + "grpc_adress: x\n", []string{
			`config: grpc_adress: unknown field, did you mean "grpc_address"? (known fields of Config: grpc_address, admin_address, max_body_bytes, pools, tls, max_request_headers, max_request_headers_kb, request_body_timeout, engine_metrics, end_streams_at_routing, xds, kv_events, dns_refresh_rate, peers)`}},
		{"unknown pool field", pools(pool(`prefil: [{address: "10.0.0.1:8000"}]`)), []string{
			`config: pools[0].prefil: unknown field, did you mean "prefill"? (known fields of Pool: name, models, default, connector, prefill, decode, prefill_timeout, mooncake_protocol, prefill_attempts, prefill_attempt_timeout, on_prefill_failure, eject_after_failures, eject_duration, kubernetes, pass_through, allowed_kv_hosts, trtllm_protocol, prefill_picker, decode_picker, disaggregation, saturation, prefix_block_tokens, decode_fallbacks, render, flow_control, session_affinity, lora)`}},
		{"dp_size too big", pools(pool(`prefill: [{address: "10.0.0.1:8000", dp_size: 2000}]`, `decode: [{address: "10.0.0.2:8000", dp_size: 1}, {address: "10.0.0.3:8000", dp_size: 1025}]`)), []string{
			`config: pools[0].prefill[0].dp_size: 2000 is over the maximum of 1024 data-parallel ranks`,
			`config: pools[0].decode[1].dp_size: 1025 is over the maximum of 1024 data-parallel ranks`}},
		{"dp_size differing among decode fallbacks", pools(pool("decode_fallbacks: 1", `decode: [{address: "10.0.0.2:8000", dp_size: 4}, {address: "10.0.0.3:8000", dp_size: 4}, {address: "10.0.0.4:8000"}]`)), []string{
			`config: pools[0].decode[2].dp_size: 0 differs from decode[0]'s 4: with decode_fallbacks every decode endpoint needs one dp_size`}},
		{"dp_size with trtllm", pools(pool("connector: trtllm", `decode: [{address: "10.0.0.2:8000", dp_size: 2}]`)), []string{
			`config: pools[0].decode[0].dp_size: only valid with connectors "nixl", "http", "mooncake", "sglang", "none", not "trtllm"`}},
		{"unknown endpoint field", pools(pool(`decode: [{address: "10.0.0.2:8000"}, {addr: "10.0.0.3:1"}]`)), []string{
			`config: pools[0].decode[1].addr: unknown field (known fields of Endpoint: address, bootstrap_port, kv_address, dp_size, kv_events_port, kv_events_replay_port)`}},
		{"lowerCamel JSON name rejected", minimal + "grpcAddress: x\n", []string{`config: grpcAddress: unknown field, did you mean "grpc_address"?`}},
		{"all unknown fields reported", minimal + "b: 1\na: 2\n", []string{`config: a: unknown field`, `config: b: unknown field`}},

		// Decoding: wrong types.
		{"string for bool", pools(pool(`default: "yes"`)), []string{
			`config: pools[0].default: expected true or false, got string "yes"`}},
		{"number for string", pools(pool("name: 12")), []string{
			`config: pools[0].name: expected a string, got number 12`}},
		{"negative number", minimal + "max_body_bytes: -1\n", []string{
			`config: max_body_bytes: expected a whole number from 0 to 4294967295, got number -1`}},
		{"number too large", minimal + "max_body_bytes: 4294967296\n", []string{`max_body_bytes: expected a whole number`}},
		{"fraction", minimal + "max_body_bytes: 1.5\n", []string{`max_body_bytes: expected a whole number`}},
		{"mapping for list", "pools: {name: p}\n", []string{`config: pools: expected a list, got a mapping`}},
		{"scalar for message", "pools: [p]\n", []string{`config: pools[0]: expected a mapping (Pool), got string "p"`}},
		{"null list element", "pools: [null]\n", []string{`config: pools[0]: expected a mapping (Pool), got null`}},
		{"not a mapping at top level", "- a\n", []string{`config: expected a mapping (Config), got a list`}},
		{"invalid duration", pools(pool("prefill_timeout: 3 seconds")), []string{
			`config: pools[0].prefill_timeout: expected a duration such as "30s", "1m30s" or "250ms", got string "3 seconds"`}},
		{"number for duration", pools(pool("prefill_timeout: 30")), []string{
			`config: pools[0].prefill_timeout: expected a duration such as "30s", "1m30s" or "250ms", got number 30 (a number needs a unit: s, ms, m, h)`}},
		{"duplicate YAML key", minimal + "grpc_address: a:1\ngrpc_address: b:1\n", []string{`"grpc_address" already set`}},
		{"duplicate YAML key in pool", pools(pool()) + "    name: q\n", []string{`"name" already set`}},
		// YAML 1.1 reads a bare n as false; the type check catches it.
		{"YAML 1.1 boolean", pools(pool("models: [n]")), []string{`config: pools[0].models[0]: expected a string, got false`}},
		{"malformed YAML", "pools: [\n", []string{"config: invalid YAML: did not find expected node content"}},

		// Validation.
		{"empty", "", []string{`config: pools: at least one pool is required`}},
		{"bad grpc address", minimal + "grpc_address: \"9002\"\n", []string{`config: grpc_address: "9002" is not host:port`}},
		{"bad admin address", minimal + "admin_address: x\n", []string{`config: admin_address: "x" is not host:port`}},
		{"missing name", pools(pool(`name: ""`)), []string{`config: pools[0].name: required`}},
		{"bad name", pools(pool("name: Pool_A")), []string{`config: pools[0].name: "Pool_A" must match [a-z0-9-]+`}},
		{"duplicate name", pools(pool(), pool("models: [other]")), []string{
			`config: pools[1].name: duplicate pool name "p" (also pools[0].name)`}},
		{"no models and not default", pools(pool("models: []")), []string{
			`config: pools[0].models: required unless default is true`}},
		{"empty model name", pools(pool(`models: [m, ""]`)), []string{`config: pools[0].models[1]: empty model name`}},
		{"duplicate model in pool", pools(pool("models: [m, m]")), []string{
			`config: pools[0].models[1]: duplicate model "m" (also pools[0].models[0])`}},
		{"duplicate model across pools", pools(pool(), pool("name: q", "models: [x, m]")), []string{
			`config: pools[1].models[1]: duplicate model "m" (also pools[0].models[0]): a model may appear in only one pool`}},
		{"empty adapter name", pools(pool(`lora: {adapters: [sql, ""]}`)), []string{
			`config: pools[0].lora.adapters[1]: empty adapter name`}},
		{"duplicate adapter", pools(pool("lora: {adapters: [sql, sql]}")), []string{
			`config: pools[0].lora.adapters[1]: adapter "sql" is also pools[0].lora.adapters[0]`}},
		{"adapter named as the pool's model", pools(pool("lora: {adapters: [m]}")), []string{
			`config: pools[0].lora.adapters[0]: adapter "m" is also pools[0].models[0]`}},
		{"adapter of another pool's model", pools(pool(), pool("name: q", "models: [x]", "lora: {adapters: [m]}")), []string{
			`config: pools[1].lora.adapters[0]: adapter "m" is also pools[0].models[0]`}},
		{"model of another pool's adapter", pools(pool("lora: {adapters: [sql]}"), pool("name: q", "models: [sql]")), []string{
			`config: pools[1].models[0]: duplicate model "sql" (also pools[0].lora.adapters[0])`}},
		{"two default pools", pools(pool("default: true"), pool("name: q", "models: [x]", "default: true")), []string{
			`config: pools[1].default: more than one default pool (also pools[0].default)`}},
		{"missing connector", pools(pool(`connector: ""`)), []string{`config: pools[0].connector: required`}},
		{"no prefill", pools(pool("prefill: []")), []string{`config: pools[0].prefill: at least one endpoint is required`}},
		{"prefill with connector none", pools(pool("connector: none")), []string{
			`config: pools[0].prefill: must be empty with connector "none", whose engines serve whole requests`}},
		{"no decode", pools(pool("decode:")), []string{`config: pools[0].decode: at least one endpoint is required`}},
		{"endpoint without port", pools(pool(`prefill: [{address: "10.0.0.1"}]`)), []string{
			`config: pools[0].prefill[0].address: "10.0.0.1" is not host:port (e.g. 10.0.0.5:8000 or vllm-decode-0:8000)`}},
		{"unbracketed IPv6", pools(pool(`prefill: [{address: "::1:80"}]`)), []string{
			`config: pools[0].prefill[0].address: "::1:80" is not host:port: write an IPv6 address in brackets, e.g. [fd00::1]:8000`}},
		{"port 0", pools(pool(`prefill: [{address: "10.0.0.1:0"}]`)), []string{
			`config: pools[0].prefill[0].address: "10.0.0.1:0" has port "0", want 1-65535`}},
		{"port too large", pools(pool(`prefill: [{address: "[::1]:65536"}]`)), []string{
			`config: pools[0].prefill[0].address: "[::1]:65536" has port "65536", want 1-65535`}},
		{"unspecified IP", pools(pool(`prefill: [{address: "0.0.0.0:80"}]`)), []string{
			`config: pools[0].prefill[0].address: "0.0.0.0:80" has an unspecified IP`}},
		{"duplicate endpoint", pools(pool(`decode: [{address: "10.0.0.2:8000"}, {address: "10.0.0.2:8000"}]`)), []string{
			`config: pools[0].decode[1].address: duplicate endpoint "10.0.0.2:8000" (also pools[0].decode[0].address)`}},
		{"zero timeout", pools(pool("prefill_timeout: 0s")), []string{`config: pools[0].prefill_timeout: 0s must be greater than 0`}},
		{"negative timeout", pools(pool("prefill_timeout: -1s")), []string{`config: pools[0].prefill_timeout: -1s must be greater than 0`}},
		{"timeout too long", pools(pool("prefill_timeout: 10m1s")), []string{
			`config: pools[0].prefill_timeout: 10m1s exceeds the maximum of 10m0s`}},
		{"all problems reported", pools(pool("name: X", `connector: ""`), pool("name: q", "models: [m]")), []string{
			`config: pools[0].name: "X" must match`, `config: pools[0].connector: required`,
			`config: pools[1].models[0]: duplicate model "m"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := Parse([]byte(tt.yaml))
			require.Error(t, err, "input:\n%s", tt.yaml)
			require.Nil(t, cfg)
			for _, want := range tt.want {
				require.Contains(t, withoutLines(err), want, "input:\n%s", tt.yaml)
			}
		})
	}
}

func TestParseLimits(t *testing.T) {
	for _, in := range []string{
		pools(pool("prefill_timeout: 10m")),
		pools(pool("prefill_timeout: 1ns")),
		minimal + "max_body_bytes: 4294967295\n",
		minimal + "max_body_bytes: 0\n", // means the default
	} {
		_, err := Parse([]byte(in))
		require.NoError(t, err, "input:\n%s", in)
	}
}

// Decode fallbacks are for the connectors whose KV any decode engine can
// take; the xDS server's cluster defaults to the bootstrap's decode cluster.
func TestDecodeFallbacksAndXDS(t *testing.T) {
	for _, tc := range []struct {
		name, yaml string
		want       uint32
	}{
		{"nixl", pools(pool("decode_fallbacks: 1")), 1},
		{"http", pools(pool("connector: http", "decode_fallbacks: 8")), 8},
		{"lmcache", pools(pool("connector: lmcache", "decode_fallbacks: 2")), 2},
		{"mooncake nixl protocol", pools(pool("connector: mooncake", "decode_fallbacks: 1")), 1},
		{"none", pools(pool("connector: none", "prefill: []", "decode_fallbacks: 3")), 3},
		{"sglang without", pools(pool("connector: sglang")), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := Parse([]byte(tc.yaml + "xds: {enabled: true}\n"))
			require.NoError(t, err)
			require.Equal(t, tc.want, cfg.GetPools()[0].GetDecodeFallbacks())
			require.Equal(t, DefaultXDSCluster, cfg.GetXds().GetClusterName())
		})
	}
	cfg, err := Parse([]byte(minimal))
	require.NoError(t, err)
	require.Nil(t, cfg.GetXds(), "xDS is off unless asked for")
}

// A connector pdx does not have is refused where the config is read.
func TestUnknownConnector(t *testing.T) {
	_, err := Parse([]byte(pools(pool(), pool("name: q", "models: [x]", "connector: nixel"))))
	require.EqualError(t, err,
		`config:9: pools[1].connector: unknown connector "nixel" (known: `+knownConnectors+`)`)
}

func TestLoad(t *testing.T) {
	dir := t.TempDir()

	missing := filepath.Join(dir, "missing.yaml")
	_, err := Load(missing)
	require.ErrorContains(t, err, missing)
	require.ErrorIs(t, err, os.ErrNotExist)

	// Problems in a file are prefixed with its name, like compiler errors.
	bad := filepath.Join(dir, "bad.yaml")
	require.NoError(t, os.WriteFile(bad, []byte(minimal+"grpc_adress: x\n"), 0o600))
	_, err = Load(bad)
	require.ErrorContains(t, err, bad+`:7: grpc_adress: unknown field, did you mean "grpc_address"?`)

	good := filepath.Join(dir, "good.yaml")
	require.NoError(t, os.WriteFile(good, []byte(minimal), 0o600))
	cfg, err := Load(good)
	require.NoError(t, err)
	require.Equal(t, "p", cfg.GetPools()[0].GetName())
}

func TestExampleConfig(t *testing.T) {
	cfg, err := Load("../../deploy/pdx.yaml")
	require.NoError(t, err)

	require.Len(t, cfg.GetPools(), 1)
	p := cfg.GetPools()[0]
	require.Equal(t, []string{"demo-model"}, p.GetModels())
	require.True(t, p.GetDefault())
	require.Equal(t, "nixl", p.GetConnector())
	addrs := func(eps []*configv1.Endpoint) (out []string) {
		for _, ep := range eps {
			out = append(out, ep.GetAddress())
		}
		return out
	}
	require.Equal(t, []string{"127.0.0.1:8100", "127.0.0.1:8101"}, addrs(p.GetPrefill()))
	require.Equal(t, []string{"127.0.0.1:8102", "127.0.0.1:8103"}, addrs(p.GetDecode()))
}

func TestConnectorOptions(t *testing.T) {
	const base = `
pools:
- name: p
  default: true
  connector: %s%s
  prefill: [{address: 127.0.0.1:1%s}]
  decode: [{address: 127.0.0.1:2%s}]
`
	tests := []struct {
		name, connector, poolExtra, prefillExtra, decodeExtra string
		wantErr                                               string
		check                                                 func(t *testing.T, p *configv1.Pool)
	}{
		{name: "bootstrap port kept", connector: "sglang", prefillExtra: ", bootstrap_port: 9100", check: func(t *testing.T, p *configv1.Pool) {
			require.EqualValues(t, 9100, p.GetPrefill()[0].GetBootstrapPort())
		}},
		{name: "bootstrap port too big", connector: "sglang", prefillExtra: ", bootstrap_port: 70000", wantErr: "pools[0].prefill[0].bootstrap_port: 70000 is not a port"},
		{name: "mooncake defaults to nixl", connector: "mooncake", check: func(t *testing.T, p *configv1.Pool) {
			require.Equal(t, "nixl", p.GetMooncakeProtocol())
		}},
		{name: "mooncake vllm", connector: "mooncake", poolExtra: "\n  mooncake_protocol: vllm", check: func(t *testing.T, p *configv1.Pool) {
			require.Equal(t, "vllm", p.GetMooncakeProtocol())
		}},
		{name: "mooncake protocol unknown", connector: "mooncake", poolExtra: "\n  mooncake_protocol: rdma", wantErr: `pools[0].mooncake_protocol: "rdma" is not "nixl" or "vllm"`},
		{name: "mooncake protocol on another connector", connector: "nixl", poolExtra: "\n  mooncake_protocol: vllm", wantErr: `pools[0].mooncake_protocol: only valid with connector "mooncake"`},
		{name: "p2p needs kv_address", connector: "p2p-nccl", prefillExtra: ", kv_address: 127.0.0.1:21001", wantErr: `pools[0].decode[0].kv_address: required with connector "p2p-nccl"`},
		{name: "p2p kv_address on a host the address does not name", connector: "p2p-nccl", prefillExtra: ", kv_address: host:1", decodeExtra: ", kv_address: 127.0.0.1:22001", wantErr: `pools[0].prefill[0].kv_address: "host:1" names host "host", not the host name of address "127.0.0.1:1": write an IP, or address's host name`},
		{name: "p2p ok", connector: "p2p-nccl", prefillExtra: ", kv_address: 127.0.0.1:21001", decodeExtra: ", kv_address: 127.0.0.1:22001", check: func(t *testing.T, p *configv1.Pool) {
			require.Equal(t, "127.0.0.1:22001", p.GetDecode()[0].GetKvAddress())
		}},
		{name: "kv_address elsewhere", connector: "http", decodeExtra: ", kv_address: 127.0.0.1:22001", wantErr: `pools[0].decode[0].kv_address: only valid with connectors "nixl", "mooncake", "p2p-nccl", not "http"`},
		{name: "kv_address of a NIXL side channel", connector: "nixl", prefillExtra: ", kv_address: 127.0.0.1:5600", check: func(t *testing.T, p *configv1.Pool) {
			require.Equal(t, "127.0.0.1:5600", p.GetPrefill()[0].GetKvAddress())
		}},
		{name: "allowed_kv_hosts", connector: "nixl", poolExtra: "\n  allowed_kv_hosts: [10.1.0.0/16, 192.168.0.7, kv.example]", check: func(t *testing.T, p *configv1.Pool) {
			require.Equal(t, []string{"10.1.0.0/16", "192.168.0.7", "kv.example"}, p.GetAllowedKvHosts())
		}},
		{name: "bad allowed_kv_hosts", connector: "nixl", poolExtra: "\n  allowed_kv_hosts: [10.1.0.0/40]", wantErr: `pools[0].allowed_kv_hosts[0]: "10.1.0.0/40" is not a CIDR prefix`},
		{name: "trtllm_protocol defaults to current", connector: "trtllm", check: func(t *testing.T, p *configv1.Pool) {
			require.Equal(t, "current", p.GetTrtllmProtocol())
		}},
		{name: "trtllm_protocol legacy", connector: "trtllm", poolExtra: "\n  trtllm_protocol: legacy", check: func(t *testing.T, p *configv1.Pool) {
			require.Equal(t, "legacy", p.GetTrtllmProtocol())
		}},
		{name: "unknown trtllm_protocol", connector: "trtllm", poolExtra: "\n  trtllm_protocol: v2", wantErr: `pools[0].trtllm_protocol: "v2" is not "current" or "legacy"`},
		{name: "trtllm_protocol elsewhere", connector: "nixl", poolExtra: "\n  trtllm_protocol: legacy", wantErr: `pools[0].trtllm_protocol: only valid with connector "trtllm"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := Parse(fmt.Appendf(nil, base, tc.connector, tc.poolExtra, tc.prefillExtra, tc.decodeExtra))
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			tc.check(t, cfg.GetPools()[0])
		})
	}
}

func TestPickers(t *testing.T) {
	const disagg = "connector: nixl\n  prefill: [{address: 127.0.0.1:1}]\n  decode: [{address: 127.0.0.1:2}]"
	const aggregated = "connector: none\n  decode: [{address: 127.0.0.1:2}]"
	for _, tc := range []struct {
		name, pool string
		wantErr    string
		want       [2]string // prefill, decode policy; "" for no picker
	}{
		{name: "defaults", pool: disagg, want: [2]string{"forecast", "forecast"}},
		{name: "explicit", pool: disagg + "\n  prefill_picker: {policy: round_robin}\n  decode_picker: {policy: round_robin}", want: [2]string{"round_robin", "round_robin"}},
		{name: "empty policy is the default", pool: disagg + "\n  decode_picker: {}", want: [2]string{"forecast", "forecast"}},
		{name: "decode weights without a policy: load_aware, the default they were written for",
			pool: disagg + "\n  decode_picker: {weights: {kv_usage: 3}}", want: [2]string{"forecast", "load_aware"}},
		{name: "every policy", pool: disagg + "\n  prefill_picker: {policy: least_request}\n  decode_picker: {policy: prefix_affinity, load_factor: 2}", want: [2]string{"least_request", "prefix_affinity"}},
		{name: "no prefill picker without a prefill leg", pool: aggregated, want: [2]string{"", "forecast"}},
		{name: "unknown prefill policy", pool: disagg + "\n  prefill_picker: {policy: least_loaded}",
			wantErr: `pools[0].prefill_picker.policy: unknown picking policy "least_loaded" (known: ` + knownPolicies + `)`},
		{name: "unknown decode policy", pool: disagg + "\n  decode_picker: {policy: random}",
			wantErr: `pools[0].decode_picker.policy: unknown picking policy "random" (known: ` + knownPolicies + `)`},
		{name: "weights of another policy", pool: disagg + "\n  decode_picker: {policy: round_robin, weights: {queue: 1}}",
			wantErr: `pools[0].decode_picker.weights: only for policy "load_aware"`},
		{name: "negative weight", pool: disagg + "\n  decode_picker: {policy: load_aware, weights: {queue: -1}}",
			wantErr: `pools[0].decode_picker.weights.queue: -1 is not in [0, 100]`},
		{name: "load factor of another policy", pool: disagg + "\n  decode_picker: {policy: least_request, load_factor: 2}",
			wantErr: `pools[0].decode_picker.load_factor: only for policy "prefix_affinity"`},
		{name: "load factor too small", pool: disagg + "\n  prefill_picker: {policy: prefix_affinity, load_factor: 0.5}",
			wantErr: `pools[0].prefill_picker.load_factor: 0.5 is not in (1, 100]`},
		{name: "prefill picker without a prefill leg", pool: aggregated + "\n  prefill_picker: {policy: round_robin}",
			wantErr: `pools[0].prefill_picker: not valid with connector "none", which has no prefill leg`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := Parse(fmt.Appendf(nil, "pools:\n- name: p\n  default: true\n  %s\n", tc.pool))
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			p := cfg.GetPools()[0]
			require.Equal(t, tc.want, [2]string{p.GetPrefillPicker().GetPolicy(), p.GetDecodePicker().GetPolicy()})
		})
	}
}

func TestFailureHandling(t *testing.T) {
	const base = `
pools:
- name: p
  default: true
  connector: nixl
  prefill_timeout: 10s
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:2}]
`
	tests := []struct{ name, extra, wantErr string }{
		{name: "attempts too many", extra: "  prefill_attempts: 11\n", wantErr: "pools[0].prefill_attempts: 11 exceeds the maximum of 10"},
		{name: "attempt timeout above the budget", extra: "  prefill_attempt_timeout: 11s\n", wantErr: "pools[0].prefill_attempt_timeout: 11s exceeds prefill_timeout (10s)"},
		{name: "attempt timeout zero", extra: "  prefill_attempt_timeout: 0s\n", wantErr: "pools[0].prefill_attempt_timeout: 0s must be greater than 0"},
		{name: "unknown policy", extra: "  on_prefill_failure: retry\n", wantErr: `pools[0].on_prefill_failure: "retry" is not "fail" or "fallback"`},
		{name: "eject duration too long", extra: "  eject_duration: 2h\n", wantErr: "pools[0].eject_duration: 2h0m0s exceeds the maximum of 1h0m0s"},
		{name: "a choice that is no string", extra: "  on_prefill_failure: 2\n", wantErr: `pools[0].on_prefill_failure: expected "fail" or "fallback", got number 2`},
		{name: "the unspecified value is no choice", extra: "  on_prefill_failure: unspecified\n", wantErr: `"unspecified" is not "fail" or "fallback"`},
		{name: "all fine", extra: "  prefill_attempts: 10\n  prefill_attempt_timeout: 10s\n  on_prefill_failure: fallback\n"},
		// protojson's spelling of a choice, as a config written from the
		// proto reads.
		{name: "full enum names", extra: "  on_prefill_failure: PREFILL_FAILURE_FALLBACK\n  saturation: {action: SATURATION_ACTION_REJECT}\n"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(base + tc.extra))
			if tc.wantErr == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tc.wantErr)
		})
	}
}

func TestTLSConfig(t *testing.T) {
	const pools = `
pools:
- name: p
  default: true
  connector: nixl
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:2}]
`
	_, err := Parse([]byte("tls: {client_ca_file: ca.pem}" + pools))
	require.ErrorContains(t, err, "tls.cert_file: required when tls is set")
	require.ErrorContains(t, err, "tls.key_file: required when tls is set")
	cfg, err := Parse([]byte("tls: {cert_file: c.pem, key_file: k.pem, client_ca_file: ca.pem}" + pools))
	require.NoError(t, err)
	require.Equal(t, "ca.pem", cfg.GetTls().GetClientCaFile())

	cfg, err = Parse([]byte("tls: {self_signed: true}" + pools))
	require.NoError(t, err)
	require.True(t, cfg.GetTls().GetSelfSigned())
	_, err = Parse([]byte("tls: {self_signed: true, cert_file: c.pem, key_file: k.pem}" + pools))
	require.ErrorContains(t, err, "tls.self_signed: exclusive with cert_file and key_file")
}

func TestConnectorNoneHasNoPrefill(t *testing.T) {
	cfg, err := Parse([]byte("pools:\n" + pool("connector: none", "prefill: []")))
	require.NoError(t, err)
	require.Empty(t, cfg.GetPools()[0].GetPrefill())
}

func TestKubernetesDiscovery(t *testing.T) {
	// kpool is a pool discovering its endpoints, with extra lines appended to
	// its kubernetes section and the given connector.
	kpool := func(connector string, extra ...string) string {
		lines := append([]string{"namespace: llm", "service: engines", "port: 8000"}, extra...)
		return "pools:\n- name: p\n  default: true\n  connector: " + connector +
			"\n  kubernetes:\n    " + strings.Join(lines, "\n    ") + "\n"
	}
	tests := []struct {
		name    string
		yaml    string
		wantErr []string // each must appear; none: valid
		check   func(t *testing.T, k *configv1.KubernetesDiscovery)
	}{
		{name: "defaults follow Kthena", yaml: kpool("nixl"), check: func(t *testing.T, k *configv1.KubernetesDiscovery) {
			requireProtoEqual(t, &configv1.KubernetesDiscovery{
				Namespace: "llm", Service: "engines", Port: 8000,
				RoleLabel: "modelserving.volcano.sh/role", PrefillRole: "prefill", DecodeRole: "decode",
			}, k)
		}},
		{name: "all fields", yaml: kpool("sglang", `match_labels: {modelserving.volcano.sh/name: m, app: x}`,
			"role_label: pdx.io/role", "prefill_role: P", "decode_role: D",
			"group_label: modelserving.volcano.sh/group-name", "bootstrap_port: 9000"),
			check: func(t *testing.T, k *configv1.KubernetesDiscovery) {
				requireProtoEqual(t, &configv1.KubernetesDiscovery{
					Namespace: "llm", Service: "engines", Port: 8000,
					MatchLabels: map[string]string{"modelserving.volcano.sh/name": "m", "app": "x"},
					RoleLabel:   "pdx.io/role", PrefillRole: "P", DecodeRole: "D",
					GroupLabel: "modelserving.volcano.sh/group-name", BootstrapPort: 9000,
				}, k)
			}},
		{name: "pods alone, port by name", yaml: strings.Replace(kpool("nixl", "match_labels: {app: x}", "port_name: http"), "service: engines\n    port: 8000\n    ", "", 1),
			check: func(t *testing.T, k *configv1.KubernetesDiscovery) {
				require.Empty(t, k.GetService())
				require.Equal(t, "http", k.GetPortName())
			}},
		{name: "connector none has no roles", yaml: kpool("none"), check: func(t *testing.T, k *configv1.KubernetesDiscovery) {
			require.Empty(t, k.GetRoleLabel())
			require.Empty(t, k.GetPrefillRole())
		}},
		{name: "p2p kv_port", yaml: kpool("p2p-nccl", "kv_port: 21001"), check: func(t *testing.T, k *configv1.KubernetesDiscovery) {
			require.EqualValues(t, 21001, k.GetKvPort())
		}},
		{name: "dp sizes", yaml: kpool("sglang", "dp_size: 8", "decode_dp_size: 16"), check: func(t *testing.T, k *configv1.KubernetesDiscovery) {
			require.EqualValues(t, 8, k.GetDpSize())
			require.EqualValues(t, 16, k.GetDecodeDpSize())
		}},

		{name: "static lists too", yaml: kpool("nixl") + "  prefill: [{address: 10.0.0.1:1}]\n  decode: [{address: 10.0.0.1:2}]\n", wantErr: []string{
			`config: pools[0].prefill: must be empty when kubernetes discovers the pool's endpoints`,
			`config: pools[0].decode: must be empty when kubernetes discovers the pool's endpoints`}},
		{name: "unknown field", yaml: kpool("nixl", "selector: {app: x}"), wantErr: []string{
			`config: pools[0].kubernetes.selector: unknown field (known fields of KubernetesDiscovery: namespace, service, match_labels, role_label, prefill_role, decode_role, group_label, port, port_name, bootstrap_port, kv_port, dp_size, decode_dp_size)`}},
		{name: "label value not a string", yaml: kpool("nixl", "match_labels: {app: 1}"), wantErr: []string{
			`config: pools[0].kubernetes.match_labels["app"]: expected a string, got number 1`}},
		{name: "labels not a mapping", yaml: kpool("nixl", "match_labels: [app]"), wantErr: []string{
			`config: pools[0].kubernetes.match_labels: expected a mapping, got a list`}},
		{name: "null label value", yaml: kpool("nixl", "match_labels: {app: null}"), wantErr: []string{
			`config: pools[0].kubernetes.match_labels["app"]: expected a value, got null`}},
		{name: "bad label key and value", yaml: kpool("nixl", `match_labels: {"a b": "x y"}`), wantErr: []string{
			`config: pools[0].kubernetes.match_labels["a b"]: "a b" is not valid: name part must consist of alphanumeric characters`,
			`config: pools[0].kubernetes.match_labels["a b"]: "x y" is not valid: a valid label must be`}},
		{name: "no namespace", yaml: strings.Replace(kpool("nixl"), "namespace: llm", `namespace: ""`, 1), wantErr: []string{
			`config: pools[0].kubernetes.namespace: required`}},
		{name: "bad namespace", yaml: strings.Replace(kpool("nixl"), "namespace: llm", "namespace: LLM", 1), wantErr: []string{
			`config: pools[0].kubernetes.namespace: "LLM" is not valid: a lowercase RFC 1123 label must consist of`}},
		{name: "bad service", yaml: strings.Replace(kpool("nixl"), "service: engines", "service: 1engines", 1), wantErr: []string{
			`config: pools[0].kubernetes.service: "1engines" is not valid`}},
		{name: "neither service nor labels", yaml: strings.Replace(kpool("nixl"), "service: engines", `service: ""`, 1), wantErr: []string{
			`config: pools[0].kubernetes: service or match_labels is required`}},
		{name: "no port", yaml: strings.Replace(kpool("nixl"), "port: 8000", "port: 0", 1), wantErr: []string{
			`config: pools[0].kubernetes.port: port or port_name is required`}},
		{name: "port and port name", yaml: kpool("nixl", "port_name: http"), wantErr: []string{
			`config: pools[0].kubernetes.port_name: set either port or port_name, not both`}},
		{name: "port too big", yaml: strings.Replace(kpool("nixl"), "port: 8000", "port: 65536", 1), wantErr: []string{
			`config: pools[0].kubernetes.port: 65536 is not a port (1-65535)`}},
		{name: "bad port name", yaml: strings.Replace(kpool("nixl", "port_name: HTTP_port"), "port: 8000", "port: 0", 1), wantErr: []string{
			`config: pools[0].kubernetes.port_name: "HTTP_port" is not valid`}},
		{name: "bootstrap port too big", yaml: kpool("sglang", "bootstrap_port: 70000"), wantErr: []string{
			`config: pools[0].kubernetes.bootstrap_port: 70000 is not a port (1-65535)`}},
		{name: "dp size too big", yaml: kpool("nixl", "dp_size: 1025", "decode_dp_size: 4096"), wantErr: []string{
			`config: pools[0].kubernetes.dp_size: 1025 is over the maximum of 1024 data-parallel ranks`,
			`config: pools[0].kubernetes.decode_dp_size: 4096 is over the maximum of 1024 data-parallel ranks`}},
		{name: "dp size with trtllm", yaml: kpool("trtllm", "dp_size: 2"), wantErr: []string{
			`config: pools[0].kubernetes.dp_size: only valid with connectors "nixl", "http", "mooncake", "sglang", "none", not "trtllm"`}},
		{name: "p2p needs kv_port", yaml: kpool("p2p-nccl"), wantErr: []string{
			`config: pools[0].kubernetes.kv_port: required with connector "p2p-nccl"`}},
		{name: "kv_port elsewhere", yaml: kpool("sglang", "kv_port: 21001"), wantErr: []string{
			`config: pools[0].kubernetes.kv_port: only valid with connectors "nixl", "mooncake", "p2p-nccl", not "sglang"`}},
		{name: "same roles", yaml: kpool("nixl", "prefill_role: both", "decode_role: both"), wantErr: []string{
			`config: pools[0].kubernetes.decode_role: "both" is also prefill_role`}},
		{name: "bad role label", yaml: kpool("nixl", "role_label: -role"), wantErr: []string{
			`config: pools[0].kubernetes.role_label: "-role" is not valid`}},
		{name: "group label is the role label", yaml: kpool("nixl", "group_label: modelserving.volcano.sh/role"), wantErr: []string{
			`config: pools[0].kubernetes.group_label: "modelserving.volcano.sh/role" is also role_label`}},
		{name: "roles with connector none", yaml: kpool("none", "role_label: x", "group_label: g"), wantErr: []string{
			`config: pools[0].kubernetes.role_label: not valid with connector "none": every pod is a decode engine`,
			`config: pools[0].kubernetes.group_label: not valid with connector "none"`}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := Parse([]byte(tc.yaml))
			if len(tc.wantErr) > 0 {
				require.Error(t, err, "input:\n%s", tc.yaml)
				for _, want := range tc.wantErr {
					require.Contains(t, withoutLines(err), want, "input:\n%s", tc.yaml)
				}
				return
			}
			require.NoError(t, err, "input:\n%s", tc.yaml)
			require.Empty(t, cfg.GetPools()[0].GetPrefill())
			tc.check(t, cfg.GetPools()[0].GetKubernetes())
		})
	}
}

// A choice reads the same in the file's spelling and in protojson's.
func TestEnumSpellings(t *testing.T) {
	const pool = `
pools:
- name: p
  default: true
  connector: nixl
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:2}]
`
	for _, extra := range []string{
		"  on_prefill_failure: fallback\n  saturation: {action: reject}\n",
		"  on_prefill_failure: PREFILL_FAILURE_FALLBACK\n  saturation: {action: SATURATION_ACTION_REJECT}\n",
	} {
		cfg, err := Parse([]byte(pool + extra))
		require.NoError(t, err)
		p := cfg.GetPools()[0]
		require.Equal(t, configv1.PrefillFailure_PREFILL_FAILURE_FALLBACK, p.GetOnPrefillFailure(), extra)
		require.Equal(t, configv1.SaturationAction_SATURATION_ACTION_REJECT, p.GetSaturation().GetAction(), extra)
	}
	cfg, err := Parse([]byte(pool))
	require.NoError(t, err)
	require.Equal(t, configv1.PrefillFailure_PREFILL_FAILURE_FAIL, cfg.GetPools()[0].GetOnPrefillFailure(), "the default")
	require.Equal(t, configv1.SaturationAction_SATURATION_ACTION_QUEUE, cfg.GetPools()[0].GetSaturation().GetAction(), "the default")
}

// The registries' names, as the unknown-name messages list them: the
// registries' own tests hold the lists themselves.
var (
	knownConnectors = strings.Join(connectors.Names(), ", ")
	knownPolicies   = strings.Join(picker.Policies(), ", ")
)

func TestKVEventsDefaults(t *testing.T) {
	tests := []struct {
		name, yaml string
		kv         *configv1.KVEvents
		render     []*configv1.Render // per pool
	}{
		{"dial, every pool renders", minimal + "kv_events: {port: 5557}\n",
			&configv1.KVEvents{Mode: "dial", Port: 5557, BlockSize: 16, MaxBlocksPerEngine: 1 << 20},
			[]*configv1.Render{{Timeout: durationpb.New(100 * time.Millisecond)}}},
		{"bind takes llm-d's topic, a pool may opt out", pools(pool("render: {disabled: true}")) + "kv_events: {mode: bind, bind_address: tcp://0.0.0.0:5557, block_size: 64}\n",
			&configv1.KVEvents{Mode: "bind", BindAddress: "tcp://0.0.0.0:5557", Topic: "kv@", BlockSize: 64, MaxBlocksPerEngine: 1 << 20},
			[]*configv1.Render{{Disabled: true}}},
		{"render without events", pools(pool("render: {address: 10.0.0.9:8000}")),
			nil, []*configv1.Render{{Address: "10.0.0.9:8000", Timeout: durationpb.New(100 * time.Millisecond)}}},
		{"neither", minimal, nil, []*configv1.Render{nil}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := Parse([]byte(tt.yaml))
			require.NoError(t, err)
			requireProtoEqual(t, tt.kv, cfg.GetKvEvents())
			require.Len(t, cfg.GetPools(), len(tt.render))
			for i, r := range tt.render {
				requireProtoEqual(t, r, cfg.GetPools()[i].GetRender())
			}
		})
	}
}
