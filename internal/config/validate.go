package config

import (
	"fmt"
	"maps"
	"net"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/placement"
)

var poolNameRE = regexp.MustCompile(`^[a-z0-9-]+$`)

// validate checks a decoded config with defaults applied and returns every
// problem found, each naming its field path.
func validate(cfg *configv1.Config) []error {
	var v validator
	v.listenAddress("grpc_address", cfg.GetGrpcAddress())
	v.listenAddress("admin_address", cfg.GetAdminAddress())

	if t := cfg.GetTls(); t != nil {
		switch {
		case t.GetSelfSigned() && (t.GetCertFile() != "" || t.GetKeyFile() != ""):
			v.fail("tls.self_signed", "exclusive with cert_file and key_file")
		case t.GetSelfSigned():
		default:
			if t.GetCertFile() == "" {
				v.fail("tls.cert_file", "required when tls is set, unless self_signed")
			}
			if t.GetKeyFile() == "" {
				v.fail("tls.key_file", "required when tls is set, unless self_signed")
			}
		}
	}
	switch d := cfg.GetRequestBodyTimeout().AsDuration(); {
	case d <= 0:
		v.fail("request_body_timeout", "%v must be greater than 0", d)
	case d > MaxRequestBodyTimeout:
		v.fail("request_body_timeout", "%v exceeds the maximum of %v", d, MaxRequestBodyTimeout)
	}
	switch d := cfg.GetDnsRefreshRate().AsDuration(); {
	case d < MinDNSRefreshRate:
		v.fail("dns_refresh_rate", "%v is below the minimum of %v", d, MinDNSRefreshRate)
	case d > MaxDNSRefreshRate:
		v.fail("dns_refresh_rate", "%v exceeds the maximum of %v", d, MaxDNSRefreshRate)
	}
	if n := cfg.GetMaxRequestHeaders(); n < 16 {
		// Room for the pseudo-headers and Envoy's own, and pdx's.
		v.fail("max_request_headers", "%d is below 16", n)
	}
	if m := cfg.GetEngineMetrics(); !m.GetDisabled() {
		interval, stale := m.GetInterval().AsDuration(), m.GetStaleAfter().AsDuration()
		if interval < MinMetricsInterval {
			v.fail("engine_metrics.interval", "%v is below the minimum of %v", interval, MinMetricsInterval)
		}
		if stale < interval {
			v.fail("engine_metrics.stale_after", "%v is below interval (%v): every sample would be stale", stale, interval)
		}
		if !strings.HasPrefix(m.GetPath(), "/") {
			v.fail("engine_metrics.path", "%q must start with /", m.GetPath())
		}
	}
	if k := cfg.GetKvEvents(); k != nil {
		v.kvEvents(k)
	}
	if p := cfg.GetPeers(); p != nil {
		if len(p.GetAddresses()) == 0 {
			v.fail("peers.addresses", "at least one replica's admin address is required when peers is set")
		}
		for i, a := range p.GetAddresses() {
			if _, err := endpoint.ParseHostPort(a); err != nil {
				v.fail(fmt.Sprintf("peers.addresses[%d]", i), "%q must be host:port (a replica's admin_address)", a)
			}
		}
		if j := p.GetPickJitter().AsDuration(); j < 0 || j > placement.MaxPickJitter {
			v.fail("peers.pick_jitter", "%v is not in [0s, %v]", j, placement.MaxPickJitter)
		}
	}
	if len(cfg.GetPools()) == 0 {
		v.fail("pools", "at least one pool is required")
	}

	names := map[string]string{}  // pool name -> path of its first use
	models := map[string]string{} // model -> path of its first listing
	defaultPath := ""
	for i, p := range cfg.GetPools() {
		path := fmt.Sprintf("pools[%d]", i)

		switch name := p.GetName(); {
		case name == "":
			v.fail(path+".name", "required")
		case !poolNameRE.MatchString(name):
			v.fail(path+".name", "%q must match [a-z0-9-]+", name)
		case names[name] != "":
			v.fail(path+".name", "duplicate pool name %q (also %s)", name, names[name])
		default:
			names[name] = path + ".name"
		}

		if len(p.GetModels()) == 0 && !p.GetDefault() {
			v.fail(path+".models", "required unless default is true")
		}
		for j, m := range p.GetModels() {
			mp := fmt.Sprintf("%s.models[%d]", path, j)
			switch {
			case m == "":
				v.fail(mp, "empty model name")
			case models[m] != "":
				v.fail(mp, "duplicate model %q (also %s): a model may appear in only one pool", m, models[m])
			default:
				models[m] = mp
			}
		}
		// An adapter routes like a model (to its pool), so it shares
		// models' namespace.
		for j, a := range p.GetLora().GetAdapters() {
			ap := fmt.Sprintf("%s.lora.adapters[%d]", path, j)
			switch {
			case a == "":
				v.fail(ap, "empty adapter name")
			case models[a] != "":
				v.fail(ap, "adapter %q is also %s: a model or adapter may appear only once", a, models[a])
			default:
				models[a] = ap
			}
		}

		if p.GetDefault() {
			if defaultPath != "" {
				v.fail(path+".default", "more than one default pool (also %s)", defaultPath)
			} else {
				defaultPath = path + ".default"
			}
		}

		spec, known := v.connector(path, p)
		traits := connectors.Traits{Prefills: true}
		if known {
			traits = spec.Traits(p)
		}
		switch {
		case p.GetKubernetes() != nil:
			// Discovered and listed endpoints do not mix: which set a
			// request may go to must be plain.
			for _, role := range []struct {
				name string
				eps  []*configv1.Endpoint
			}{{"prefill", p.GetPrefill()}, {"decode", p.GetDecode()}} {
				if len(role.eps) > 0 {
					v.fail(path+"."+role.name, "must be empty when kubernetes discovers the pool's endpoints")
				}
			}
			v.kubernetes(path+".kubernetes", p.GetConnector(), traits, p.GetKubernetes())
		case !traits.Prefills:
			// Aggregated engines: pdx picks a decode endpoint and calls no prefill.
			if len(p.GetPrefill()) > 0 {
				v.fail(path+".prefill", "must be empty with connector %q, whose engines serve whole requests", p.GetConnector())
			}
			v.endpoints(path+".decode", p.GetDecode())
		default:
			v.endpoints(path+".prefill", p.GetPrefill())
			v.endpoints(path+".decode", p.GetDecode())
		}
		v.connectorFields(path, p, spec, known)
		v.kvEventPorts(path, p, cfg.GetKvEvents())
		v.pickers(path, p, traits)
		v.placement(path, p, traits)
		v.failureHandling(path, p)
		v.decodeFallbacks(path, p, traits)
		v.passThrough(path, p.GetPassThrough())
		v.sessionAffinity(path, p.GetSessionAffinity())

		switch d := p.GetPrefillTimeout().AsDuration(); {
		case d <= 0:
			v.fail(path+".prefill_timeout", "%v must be greater than 0", d)
		case d > MaxPrefillTimeout:
			v.fail(path+".prefill_timeout", "%v exceeds the maximum of %v", d, MaxPrefillTimeout)
		}
	}
	return v.errs
}

// connector looks up the spec of the pool's connector.
func (v *validator) connector(path string, p *configv1.Pool) (connectors.Spec, bool) {
	if p.GetConnector() == "" {
		v.fail(path+".connector", "required")
		return connectors.Spec{}, false
	}
	spec, err := connectors.Lookup(p.GetConnector())
	if err != nil {
		v.fail(path+".connector", "%v", err)
		return connectors.Spec{}, false
	}
	return spec, true
}

// pickers checks the legs' picking policies: known, their own fields set
// only on the legs of policies that read them, and then as the policy's
// own validation says.
func (v *validator) pickers(path string, p *configv1.Pool, traits connectors.Traits) {
	if p.GetPrefillPicker() != nil && !traits.Prefills {
		v.fail(path+".prefill_picker", "not valid with connector %q, which has no prefill leg", p.GetConnector())
	}
	for _, leg := range []struct {
		field string
		p     *configv1.Picker
	}{{"prefill_picker", p.GetPrefillPicker()}, {"decode_picker", p.GetDecodePicker()}} {
		if leg.p == nil {
			continue
		}
		lp := path + "." + leg.field
		spec, err := picker.Lookup(leg.p.GetPolicy())
		if err != nil {
			v.fail(lp+".policy", "%v", err)
			continue
		}
		m := leg.p.ProtoReflect()
		fields := m.Descriptor().Fields()
		for i := range fields.Len() {
			name := string(fields.Get(i).Name())
			if name == "policy" || !m.Has(fields.Get(i)) || slices.Contains(spec.Fields, name) {
				continue
			}
			switch names := quoted(picker.Claimants(name)); len(names) {
			case 0:
				v.fail(lp+"."+name, "read by no picking policy")
			case 1:
				v.fail(lp+"."+name, "only for policy %s", names[0])
			default:
				v.fail(lp+"."+name, "only for policies %s", strings.Join(names, ", "))
			}
		}
		if spec.Validate != nil {
			v.errs = append(v.errs, spec.Validate(leg.p, lp)...)
		}
	}
}

// placement checks the disaggregation decider, saturation and prefix
// hashing.
func (v *validator) placement(path string, p *configv1.Pool, traits connectors.Traits) {
	if p.GetDisaggregation() != nil && !traits.Prefills {
		v.fail(path+".disaggregation", "not valid with connector %q, which has no prefill leg", p.GetConnector())
	}
	if d := p.GetDisaggregation(); d != nil && d.PrefillSaturatedMinPriority != nil && !d.GetWhenPrefillSaturated() {
		v.fail(path+".disaggregation.prefill_saturated_min_priority", "has no effect without when_prefill_saturated")
	}
	if s := p.GetSaturation(); !s.GetDisabled() {
		if s.GetPrefillMaxInFlight() > 0 && !traits.Prefills {
			v.fail(path+".saturation.prefill_max_in_flight", "not valid with connector %q, which has no prefill leg", p.GetConnector())
		}
		if u := s.GetKvUsage(); u <= 0 || u > 1 {
			v.fail(path+".saturation.kv_usage", "%v is not in (0, 1]", u)
		}
		switch d := s.GetMaxQueueTime().AsDuration(); {
		case d <= 0:
			v.fail(path+".saturation.max_queue_time", "%v must be greater than 0", d)
		case d > MaxMaxQueueTime:
			v.fail(path+".saturation.max_queue_time", "%v exceeds the maximum of %v", d, MaxMaxQueueTime)
		}
	}
	if fc := p.GetFlowControl(); fc != nil {
		v.flowControl(path+".flow_control", fc, p.GetSaturation())
	}
	if n := p.GetPrefixBlockTokens(); n > 4096 {
		v.fail(path+".prefix_block_tokens", "%d exceeds the maximum of 4096", n)
	}
	if r := p.GetRender(); r != nil && !r.GetDisabled() {
		switch d := r.GetTimeout().AsDuration(); {
		case d <= 0:
			v.fail(path+".render.timeout", "%v must be greater than 0", d)
		case d > MaxRenderTimeout:
			v.fail(path+".render.timeout", "%v exceeds the maximum of %v", d, MaxRenderTimeout)
		}
		if a := r.GetAddress(); a != "" {
			if _, err := endpoint.ParseAddress(a); err != nil {
				v.fail(path+".render.address", "%v", err)
			}
		}
	}
}

// flowControl checks a pool's flow control, which orders the requests
// that saturation makes wait.
func (v *validator) flowControl(path string, fc *configv1.FlowControl, s *configv1.Saturation) {
	if s.GetDisabled() {
		v.fail(path, "needs saturation, which is disabled: nothing would ever wait")
	}
	switch fc.GetFairness() {
	case "", "round_robin", "token_usage":
	default:
		v.fail(path+".fairness", "%q is not round_robin or token_usage", fc.GetFairness())
	}
	switch fc.GetOrdering() {
	case "", "fcfs", "edf":
	default:
		v.fail(path+".ordering", "%q is not fcfs or edf", fc.GetOrdering())
	}
	names := map[string]bool{}
	for i, o := range fc.GetObjectives() {
		at := fmt.Sprintf("%s.objectives[%d]", path, i)
		switch {
		case o.GetName() == "":
			v.fail(at+".name", "is required")
		case names[o.GetName()]:
			v.fail(at+".name", "%q is listed twice", o.GetName())
		}
		names[o.GetName()] = true
	}
	bands := map[int32]bool{}
	for i, b := range fc.GetBands() {
		at := fmt.Sprintf("%s.bands[%d]", path, i)
		if bands[b.GetPriority()] {
			v.fail(at+".priority", "%d is listed twice", b.GetPriority())
		}
		bands[b.GetPriority()] = true
		switch d := b.GetMaxQueueTime().AsDuration(); {
		case d < 0:
			v.fail(at+".max_queue_time", "%v must not be negative", d)
		case d > MaxMaxQueueTime:
			v.fail(at+".max_queue_time", "%v exceeds the maximum of %v", d, MaxMaxQueueTime)
		}
	}
	if k := fc.GetKubernetesObjectives(); k != nil {
		at := path + ".kubernetes_objectives"
		if ns := k.GetNamespace(); ns == "" {
			v.fail(at+".namespace", "required")
		} else {
			v.k8sName(at+".namespace", ns, validation.IsDNS1123Label(ns))
		}
		// An InferencePool's name is an object name: a DNS subdomain.
		if p := k.GetPool(); p == "" {
			v.fail(at+".pool", "required: the InferencePool the objects' spec.poolRef names")
		} else {
			v.k8sName(at+".pool", p, validation.IsDNS1123Subdomain(p))
		}
	}
}

// kvEventPorts checks the endpoints' own publisher ports.
func (v *validator) kvEventPorts(path string, p *configv1.Pool, k *configv1.KVEvents) {
	if p.GetKubernetes() != nil && k.GetMode() == KVEventsDial && k.GetPort() == 0 {
		v.fail("kv_events.port", "required in mode %q with discovered endpoints (pool %s): the port of the engines' KV event publishers", KVEventsDial, p.GetName())
	}
	for _, role := range []struct {
		name string
		eps  []*configv1.Endpoint
	}{{"prefill", p.GetPrefill()}, {"decode", p.GetDecode()}} {
		for i, ep := range role.eps {
			for _, f := range []struct {
				name string
				port uint32
			}{{"kv_events_port", ep.GetKvEventsPort()}, {"kv_events_replay_port", ep.GetKvEventsReplayPort()}} {
				fp := fmt.Sprintf("%s.%s[%d].%s", path, role.name, i, f.name)
				switch {
				case f.port == 0 && f.name == "kv_events_port" && k.GetMode() == KVEventsDial && k.GetPort() == 0:
					v.fail(fp, "required when kv_events.port is unset: the port of the engine's KV event publisher")
				case f.port == 0:
				case k.GetMode() != KVEventsDial:
					v.fail(fp, "only valid with kv_events in mode %q", KVEventsDial)
				case f.port > 65535:
					v.fail(fp, "%d is not a port", f.port)
				}
			}
		}
	}
}

// kvEvents checks how pdx meets the engines' KV event publishers.
func (v *validator) kvEvents(k *configv1.KVEvents) {
	switch k.GetMode() {
	case KVEventsDial:
		if k.GetPort() > 65535 {
			v.fail("kv_events.port", "%d is not a port", k.GetPort())
		}
		if k.GetReplayPort() > 65535 {
			v.fail("kv_events.replay_port", "%d is not a port", k.GetReplayPort())
		}
		if k.GetBindAddress() != "" {
			v.fail("kv_events.bind_address", "only valid in mode %q", KVEventsBind)
		}
	case KVEventsBind:
		a, ok := strings.CutPrefix(k.GetBindAddress(), "tcp://")
		if _, _, err := net.SplitHostPort(a); !ok || err != nil {
			v.fail("kv_events.bind_address", "%q must be tcp://host:port (e.g. tcp://0.0.0.0:5557)", k.GetBindAddress())
		}
		if k.GetPort() != 0 || k.GetReplayPort() != 0 {
			v.fail("kv_events.port", "only valid in mode %q: in mode %q the engines connect to bind_address", KVEventsDial, KVEventsBind)
		}
	default:
		v.fail("kv_events.mode", "unknown mode %q (want %q or %q)", k.GetMode(), KVEventsDial, KVEventsBind)
	}
	if n := k.GetBlockSize(); n > MaxKVBlockSize {
		v.fail("kv_events.block_size", "%d exceeds the maximum of %d", n, MaxKVBlockSize)
	}
}

// failureHandling checks retries, the failure policy and passive health.
func (v *validator) failureHandling(path string, p *configv1.Pool) {
	if n := p.GetPrefillAttempts(); n > MaxPrefillAttempts {
		v.fail(path+".prefill_attempts", "%d exceeds the maximum of %d", n, MaxPrefillAttempts)
	}
	switch d, total := p.GetPrefillAttemptTimeout().AsDuration(), p.GetPrefillTimeout().AsDuration(); {
	case d <= 0:
		v.fail(path+".prefill_attempt_timeout", "%v must be greater than 0", d)
	case d > total:
		v.fail(path+".prefill_attempt_timeout", "%v exceeds prefill_timeout (%v), the budget of all attempts", d, total)
	}
	switch d := p.GetEjectDuration().AsDuration(); {
	case d <= 0:
		v.fail(path+".eject_duration", "%v must be greater than 0", d)
	case d > MaxEjectDuration:
		v.fail(path+".eject_duration", "%v exceeds the maximum of %v", d, MaxEjectDuration)
	}
}

// decodeFallbacks checks that a pool naming decode endpoints to fall back
// to has a connector whose KV another decode engine can take.
func (v *validator) decodeFallbacks(path string, p *configv1.Pool, traits connectors.Traits) {
	n := p.GetDecodeFallbacks()
	switch {
	case n == 0:
	case n > MaxDecodeFallbacks:
		v.fail(path+".decode_fallbacks", "%d exceeds the maximum of %d", n, MaxDecodeFallbacks)
	case !traits.DecodeFallback:
		v.fail(path+".decode_fallbacks", "not valid with connector %q: its prefill hands the KV to the one decode engine it was told of, so no other can take the request",
			p.GetConnector())
	default:
		// One rank header goes with the request, whichever decode
		// serves it: a fallback with fewer DP ranks could refuse it.
		for i, ep := range p.GetDecode() {
			if first := max(p.GetDecode()[0].GetDpSize(), 1); max(ep.GetDpSize(), 1) != first {
				v.fail(fmt.Sprintf("%s.decode[%d].dp_size", path, i), "%d differs from decode[0]'s %d: with decode_fallbacks every decode endpoint needs one dp_size, as the decode's DP rank goes to whichever of them serves",
					ep.GetDpSize(), first)
			}
		}
	}
}

// connectorFields checks the connector-specific fields: set only on the
// pools of connectors that read them, well-formed, and then as the
// connector's own validation says.
func (v *validator) connectorFields(path string, p *configv1.Pool, spec connectors.Spec, known bool) {
	claims := func(field string) bool { return !known || slices.Contains(spec.Fields, field) }
	only := func(fieldPath, field string) {
		names := quoted(connectors.Claimants(field))
		noun := "connector"
		if len(names) > 1 {
			noun = "connectors"
		}
		v.fail(fieldPath, "only valid with %s %s, not %q", noun, strings.Join(names, ", "), p.GetConnector())
	}
	if p.GetMooncakeProtocol() != "" && !claims(connectors.FieldMooncakeProtocol) {
		only(path+".mooncake_protocol", connectors.FieldMooncakeProtocol)
	}
	if p.GetTrtllmProtocol() != "" && !claims(connectors.FieldTRTLLMProtocol) {
		only(path+".trtllm_protocol", connectors.FieldTRTLLMProtocol)
	}
	if p.GetKubernetes().GetKvPort() != 0 && !claims(connectors.FieldKVAddress) {
		only(path+".kubernetes.kv_port", connectors.FieldKVAddress)
	}
	if n := p.GetKubernetes().GetDpSize(); n != 0 {
		v.dpSize(path+".kubernetes.dp_size", n, claims, only)
	}
	if n := p.GetKubernetes().GetDecodeDpSize(); n != 0 {
		v.dpSize(path+".kubernetes.decode_dp_size", n, claims, only)
	}
	for i, h := range p.GetAllowedKvHosts() {
		if _, err := endpoint.ParseHostSet([]string{h}); err != nil {
			v.fail(fmt.Sprintf("%s.allowed_kv_hosts[%d]", path, i), "%v", err)
		}
	}
	for _, role := range []struct {
		name string
		eps  []*configv1.Endpoint
	}{{"prefill", p.GetPrefill()}, {"decode", p.GetDecode()}} {
		for i, ep := range role.eps {
			if kv := ep.GetKvAddress(); kv != "" {
				kp := fmt.Sprintf("%s.%s[%d].kv_address", path, role.name, i)
				if claims(connectors.FieldKVAddress) {
					v.kvAddress(kp, kv, ep.GetAddress())
				} else {
					only(kp, connectors.FieldKVAddress)
				}
			}
			if ep.GetBootstrapPort() > 65535 {
				v.fail(fmt.Sprintf("%s.%s[%d].bootstrap_port", path, role.name, i), "%d is not a port (1-65535)", ep.GetBootstrapPort())
			}
			if n := ep.GetDpSize(); n != 0 {
				v.dpSize(fmt.Sprintf("%s.%s[%d].dp_size", path, role.name, i), n, claims, only)
			}
		}
	}
	if known && spec.Validate != nil {
		v.errs = append(v.errs, spec.Validate(p, path)...)
	}
}

func quoted(names []string) []string {
	out := make([]string, len(names))
	for i, n := range names {
		out[i] = strconv.Quote(n)
	}
	return out
}

// passThrough checks a pool's pass_through paths.
func (v *validator) passThrough(path string, paths []string) {
	seen := map[string]bool{}
	for i, p := range paths {
		pp := fmt.Sprintf("%s.pass_through[%d]", path, i)
		switch {
		case !strings.HasPrefix(p, "/") || strings.ContainsAny(p, "?# \t"):
			v.fail(pp, "%q is not a path (it starts with / and has no query)", p)
		case connectors.Routed(p):
			v.fail(pp, "%q is routed by pdx itself, with the pool's connector: remove it from pass_through", p)
		case seen[p]:
			v.fail(pp, "duplicate path %q", p)
		}
		seen[p] = true
	}
}

// headerNameRE is a lower-case HTTP field name (RFC 9110's token): Envoy
// hands pdx header names in lower case.
var headerNameRE = regexp.MustCompile("^[a-z0-9!#$%&'*+.^_`|~-]+$")

// pdxHeaders are the request headers pdx sets or reads for its own
// routing, which cannot name a client's session.
var pdxHeaders = []string{
	"x-gateway-destination-endpoint", "x-gateway-destination-endpoint-served", "x-gateway-destination-endpoint-subset",
	"x-data-parallel-rank", "x-request-id", "content-length", "traceparent", "tracestate",
}

// sessionAffinity checks a pool's session_affinity.
func (v *validator) sessionAffinity(path string, s *configv1.SessionAffinity) {
	if s == nil {
		return
	}
	switch h := s.GetHeader(); {
	case h == "":
		v.fail(path+".session_affinity.header", "required")
	case !headerNameRE.MatchString(h):
		v.fail(path+".session_affinity.header", "%q is not a lower-case HTTP header name", h)
	case slices.Contains(pdxHeaders, h):
		v.fail(path+".session_affinity.header", "%q is a header pdx sets or routes by itself", h)
	}
}

// kubernetes checks a pool's discovery section.
func (v *validator) kubernetes(path, connector string, traits connectors.Traits, k *configv1.KubernetesDiscovery) {
	switch ns := k.GetNamespace(); {
	case ns == "":
		v.fail(path+".namespace", "required")
	default:
		v.k8sName(path+".namespace", ns, validation.IsDNS1123Label(ns))
	}
	if s := k.GetService(); s != "" {
		v.k8sName(path+".service", s, validation.IsDNS1035Label(s))
	}
	if k.GetService() == "" && len(k.GetMatchLabels()) == 0 {
		v.fail(path, "service or match_labels is required: which pods are the pool's engines")
	}
	for _, key := range slices.Sorted(maps.Keys(k.GetMatchLabels())) {
		kp := fmt.Sprintf("%s.match_labels[%q]", path, key)
		v.k8sName(kp, key, validation.IsQualifiedName(key))
		val := k.GetMatchLabels()[key]
		v.k8sName(kp, val, validation.IsValidLabelValue(val))
	}

	if !traits.Prefills {
		for _, f := range []struct{ name, value string }{
			{"role_label", k.GetRoleLabel()}, {"prefill_role", k.GetPrefillRole()},
			{"decode_role", k.GetDecodeRole()}, {"group_label", k.GetGroupLabel()},
		} {
			if f.value != "" {
				v.fail(path+"."+f.name, "not valid with connector %q: every pod is a decode engine", connector)
			}
		}
	} else {
		v.k8sName(path+".role_label", k.GetRoleLabel(), validation.IsQualifiedName(k.GetRoleLabel()))
		v.k8sName(path+".prefill_role", k.GetPrefillRole(), validation.IsValidLabelValue(k.GetPrefillRole()))
		v.k8sName(path+".decode_role", k.GetDecodeRole(), validation.IsValidLabelValue(k.GetDecodeRole()))
		if k.GetPrefillRole() == k.GetDecodeRole() {
			v.fail(path+".decode_role", "%q is also prefill_role", k.GetDecodeRole())
		}
		switch g := k.GetGroupLabel(); {
		case g == "":
		case g == k.GetRoleLabel():
			v.fail(path+".group_label", "%q is also role_label", g)
		default:
			v.k8sName(path+".group_label", g, validation.IsQualifiedName(g))
		}
	}

	switch {
	case k.GetPort() != 0 && k.GetPortName() != "":
		v.fail(path+".port_name", "set either port or port_name, not both")
	case k.GetPort() == 0 && k.GetPortName() == "":
		v.fail(path+".port", "port or port_name is required: the engines' HTTP port")
	case k.GetPort() > 65535:
		v.fail(path+".port", "%d is not a port (1-65535)", k.GetPort())
	case k.GetPortName() != "":
		v.k8sName(path+".port_name", k.GetPortName(), validation.IsValidPortName(k.GetPortName()))
	}
	if k.GetBootstrapPort() > 65535 {
		v.fail(path+".bootstrap_port", "%d is not a port (1-65535)", k.GetBootstrapPort())
	}
	if kp := k.GetKvPort(); kp > 65535 {
		v.fail(path+".kv_port", "%d is not a port (1-65535)", kp)
	}
}

// MaxDPSize bounds a dp_size: more DP ranks behind one address than the
// largest expert-parallel deployments run is a typo.
const MaxDPSize = 1024

// dpSize checks a dp_size n at path: a connector that names DP ranks to
// its engines, and at most MaxDPSize.
func (v *validator) dpSize(path string, n uint32, claims func(string) bool, only func(string, string)) {
	switch {
	case !claims(connectors.FieldDPSize):
		only(path, connectors.FieldDPSize)
	case n > MaxDPSize:
		v.fail(path, "%d is over the maximum of %d data-parallel ranks", n, MaxDPSize)
	}
}

// k8sName fails path with the problems a Kubernetes validation function
// found in value.
func (v *validator) k8sName(path, value string, problems []string) {
	if len(problems) > 0 {
		v.fail(path, "%q is not valid: %s", value, strings.Join(problems, "; "))
	}
}

type validator struct {
	errs []error
}

func (v *validator) fail(path, format string, args ...any) {
	v.errs = append(v.errs, &fieldError{path: path, msg: fmt.Sprintf(format, args...)})
}

// listenAddress checks a host:port to listen on; the host may be a name or
// empty (all interfaces).
func (v *validator) listenAddress(path, addr string) {
	if _, _, err := net.SplitHostPort(addr); err != nil {
		v.fail(path, "%q is not host:port", addr)
	}
}

// endpoints checks a pool's prefill or decode list.
func (v *validator) endpoints(path string, eps []*configv1.Endpoint) {
	if len(eps) == 0 {
		v.fail(path, "at least one endpoint is required")
	}
	seen := map[string]string{}
	for i, ep := range eps {
		ap := fmt.Sprintf("%s[%d].address", path, i)
		if ep.GetAddress() == "" {
			v.fail(ap, "required: the engine's host:port, e.g. 10.0.0.5:8000 or vllm-decode-0:8000")
			continue
		}
		addr, err := endpoint.ParseAddress(ep.GetAddress())
		if err != nil {
			v.fail(ap, "%v", err)
			continue
		}
		// A repeated endpoint would silently get twice the traffic.
		if prev, dup := seen[addr.String()]; dup {
			v.fail(ap, "duplicate endpoint %q (also %s)", ep.GetAddress(), prev)
			continue
		}
		seen[addr.String()] = ap
	}
}

// kvAddress checks an endpoint's kv_address: "ip:port", or "host:port" on
// the host name of the endpoint's address, whose every address then has
// its KV on that port.
func (v *validator) kvAddress(path, kv, address string) {
	a, err := endpoint.ParseHostPort(kv)
	if err != nil {
		v.fail(path, "%v", err)
		return
	}
	own, err := endpoint.ParseAddress(address)
	if !a.IsName() || err != nil || own.Name == a.Name {
		return // address's own error is reported there
	}
	v.fail(path, "%q names host %q, not the host name of address %q: write an IP, or address's host name (the KV is then on each of its addresses)", kv, a.Name, address)
}
