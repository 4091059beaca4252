package connectors

import (
	"fmt"
	"slices"
	"strings"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
)

// Spec is everything pdx knows of a connector outside this package. Every
// connector file has one, and specs lists it: nothing else in pdx switches
// on a connector's name.
type Spec struct {
	// Names are the values of a pool's connector field that select the
	// connector; the first is its name, the others aliases.
	Names []string
	// Fields are the connector-specific pool fields (Field*) that the
	// connector reads; config refuses them on the pools of other
	// connectors.
	Fields []string
	// Defaults, when set, fills in the connector's own fields a pool
	// leaves unset.
	Defaults func(p *configv1.Pool)
	// Validate, when set, checks the values of the connector's own fields;
	// path is the pool's field path, e.g. "pools[0]". The generic fields
	// are config's to check.
	Validate func(p *configv1.Pool, path string) []error
	// ClientKeys are the body members through which the protocol's
	// engines take KV transfer instructions or pdx's choices (a DP rank).
	// A client must never set them: a kv_transfer_params or bootstrap_*
	// of its choosing would make an engine pull (or push) another
	// request's KV blocks. Every connector removes every connector's
	// ClientKeys from both legs, then writes its own.
	ClientKeys []string
	// Traits are the protocol's properties for a pool that passed
	// Validate.
	Traits func(p *configv1.Pool) Traits
	// New builds the connector of a pool that passed Validate.
	New func(p *configv1.Pool) (Connector, error)
}

// Traits are what routing, the processor and config need to know of a
// connector's protocol.
type Traits struct {
	// Prefills reports a prefill leg. Without one (aggregated engines) a
	// pool lists no prefill endpoints and its pods have no roles.
	Prefills bool
	// Concurrent reports that the prefill still runs when Prepare returns
	// (Handoff.Prefill is set): the processor holds the decode's response
	// headers until it is done. Routing needs it before a body arrives,
	// to ask Envoy for those headers.
	Concurrent bool
	// MultipleChoices reports that requests may ask for n > 1: the decode
	// recomputes or shares the prefix rather than taking the KV of one
	// sequence.
	MultipleChoices bool
	// DecodeFallback reports that a decode engine other than the one
	// picked can still take the request with the same decode body, so
	// Envoy may retry the decode on another (the pool's decode_fallbacks).
	DecodeFallback bool
	// NotDisaggregated are the generation APIs whose requests the
	// protocol's engines cannot take a hand-off on (their servers do not
	// read the protocol's fields there): pdx answers them with the API's
	// own error. None by default.
	NotDisaggregated API
}

// The connector-specific pool fields, as Spec.Fields names them.
const (
	FieldMooncakeProtocol = "mooncake_protocol"
	FieldTRTLLMProtocol   = "trtllm_protocol"
	// FieldKVAddress covers the endpoints' kv_address and
	// kubernetes.kv_port.
	FieldKVAddress = "kv_address"
	// FieldDPSize covers the endpoints' dp_size and kubernetes.dp_size
	// and decode_dp_size: the connector names DP ranks to its engines.
	FieldDPSize = "dp_size"
)

// specs lists every connector. Adding one is a file with its spec and a
// line here.
func specs() []Spec {
	return []Spec{
		nixlSpec(),
		httpSpec(),
		mooncakeSpec(),
		sglangSpec(),
		p2pNCCLSpec(),
		trtllmSpec(),
		noneSpec(),
	}
}

// Lookup returns the spec of the connector a pool names.
func Lookup(name string) (Spec, error) {
	for _, s := range specs() {
		if slices.Contains(s.Names, name) {
			return s, nil
		}
	}
	return Spec{}, fmt.Errorf("unknown connector %q (known: %s)", name, strings.Join(Names(), ", "))
}

// Names lists the names and aliases of every connector, sorted.
func Names() []string {
	var names []string
	for _, s := range specs() {
		names = append(names, s.Names...)
	}
	slices.Sort(names)
	return names
}

// Claimants lists the names of the connectors that read field, for
// messages.
func Claimants(field string) []string {
	var names []string
	for _, s := range specs() {
		if slices.Contains(s.Fields, field) {
			names = append(names, s.Names[0])
		}
	}
	return names
}

// New returns the connector of a pool that config validated, and its
// traits.
func New(p *configv1.Pool) (Connector, Traits, error) {
	s, err := Lookup(p.GetConnector())
	if err != nil {
		return nil, Traits{}, err
	}
	c, err := s.New(p)
	if err != nil {
		return nil, Traits{}, err
	}
	return c, s.Traits(p), nil
}

// fixed returns the Traits and New of a connector whose traits and value do
// not depend on the pool.
func fixed(c Connector, t Traits) (func(*configv1.Pool) Traits, func(*configv1.Pool) (Connector, error)) {
	return func(*configv1.Pool) Traits { return t },
		func(*configv1.Pool) (Connector, error) { return c, nil }
}

// fieldError is a problem with a pool field, named by its path.
func fieldError(path, format string, args ...any) error {
	return fmt.Errorf("%s: %s", path, fmt.Sprintf(format, args...))
}

// kvAddresses returns the field paths and values of a pool's endpoints'
// kv_address, the prefill endpoints' first.
func kvAddresses(p *configv1.Pool, path string) (paths, values []string) {
	for _, role := range []struct {
		name string
		eps  []*configv1.Endpoint
	}{{"prefill", p.GetPrefill()}, {"decode", p.GetDecode()}} {
		for i, ep := range role.eps {
			paths = append(paths, fmt.Sprintf("%s.%s[%d].kv_address", path, role.name, i))
			values = append(values, ep.GetKvAddress())
		}
	}
	return paths, values
}
