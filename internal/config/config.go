// Package config loads the pdx configuration file.
//
// The schema is the protobuf message pdx.config.v1.Config
// (api/pdx/config/v1/config.proto), whose comments are the configuration
// reference. Files are YAML (or JSON) written with the proto field names in
// snake_case. Loading is strict: unknown fields, wrong types and invalid values
// are errors that name the offending field path, such as
// "pools[0].decode[1].address", and all problems are reported at once.
//
// What a connector reads of a pool, and what it needs there, its spec in
// package connectors says (connectors.Lookup); what a picking policy reads
// of its leg's picker, its spec in package picker (picker.Lookup). This
// package checks the generic fields and calls the specs for the rest.
package config

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/placement"
	"github.com/pdx-router/pdx/internal/resolver"
)

// Defaults filled in for fields the file leaves unset.
const (
	DefaultGRPCAddress    = "127.0.0.1:9002"
	DefaultAdminAddress   = "127.0.0.1:9003"
	DefaultMaxBodyBytes   = 16 << 20 // 16 MiB
	DefaultPrefillTimeout = 30 * time.Second
	// Envoy's defaults for a listener's request headers (count and KiB).
	DefaultMaxRequestHeaders   = 100
	DefaultMaxRequestHeadersKB = 60
	DefaultRequestBodyTimeout  = time.Minute
	// DefaultXDSCluster is the EDS cluster pdx serves (xds.cluster_name):
	// the decode cluster of pdx's Envoy bootstrap.
	DefaultXDSCluster     = "pdx_decode"
	MaxRequestBodyTimeout = time.Hour
	// MaxDecodeFallbacks bounds a pool's decode_fallbacks: each one is an
	// Envoy retry and an address in a header.
	MaxDecodeFallbacks = 8
)

// Defaults of a pool's failure handling.
const (
	DefaultPrefillAttempts    = 3
	MaxPrefillAttempts        = 10
	DefaultEjectAfterFailures = 3
	DefaultEjectDuration      = 10 * time.Second
	MaxEjectDuration          = time.Hour
)

// Defaults of placement: engine metrics, saturation and prefix hashing.
const (
	DefaultMetricsInterval = 50 * time.Millisecond
	MinMetricsInterval     = 10 * time.Millisecond
	DefaultMetricsPath     = "/metrics"
	DefaultQueueDepth      = 5
	DefaultKVUsage         = 0.8
	DefaultMaxQueueTime    = time.Second
	MaxMaxQueueTime        = time.Minute
)

// Defaults of precise placement: KV events and rendered tokens.
const (
	KVEventsDial   = "dial"
	KVEventsBind   = "bind"
	MaxKVBlockSize = 1024
	// DefaultBindTopic is llm-d's topic prefix, kv@<pod>@<model>.
	DefaultBindTopic          = "kv@"
	DefaultMaxBlocksPerEngine = 1 << 20
	MaxRenderTimeout          = 10 * time.Second
)

// Bounds of dns_refresh_rate, and its default: Envoy's.
const (
	DefaultDNSRefreshRate = resolver.DefaultRefresh
	MinDNSRefreshRate     = time.Millisecond
	MaxDNSRefreshRate     = time.Hour
)

// MaxPrefillTimeout is the largest prefill_timeout accepted.
const MaxPrefillTimeout = 10 * time.Minute

// Defaults of Kubernetes discovery: the labels Kthena's ModelServing puts on
// the pods of a prefill/decode role.
const (
	DefaultRoleLabel   = "modelserving.volcano.sh/role"
	DefaultPrefillRole = "prefill"
	DefaultDecodeRole  = "decode"
)

// Load reads and validates a YAML config file. Problems in the file are
// reported as "<path>:<line>: <field path>: <problem>", one per line, in
// the file's order.
func Load(path string) (*configv1.Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err) // names the file already
	}
	return parse(data, path)
}

// ParseFile is Load for contents already read from the file path (a
// reloader reads the file once, to both hash and parse it).
func ParseFile(data []byte, path string) (*configv1.Config, error) {
	return parse(data, path)
}

// Parse decodes YAML (or JSON) strictly, applies defaults and validates.
// Problems are reported as "config:<line>: <field path>: <problem>", one
// per line.
func Parse(data []byte) (*configv1.Config, error) {
	return parse(data, "config")
}

// parse is Parse with source, the prefix of every error line: the file name
// for Load, so that messages read like a compiler's.
//
// Every problem is reported at once. A value of the wrong type or an unknown
// field is left out and the rest validated, but validation's findings in
// the same part of the file (the same pool, or top-level section), or that
// name the field left out, are dropped: they could be the consequences of
// leaving it out ("prefill: required" for a misspelt "prefil"), and the
// others there come up once it is fixed.
func parse(data []byte, source string) (*configv1.Config, error) {
	cfg, d := decode(data)
	errs := slices.Concat(d.errs, d.choices)
	if d.ok {
		applyDefaults(cfg)
		for _, err := range validate(cfg) {
			if !slices.ContainsFunc(d.errs, func(shape error) bool { return follows(err, pathOf(shape)) }) {
				errs = append(errs, err)
			}
		}
	}
	if len(errs) > 0 {
		return nil, joinErrors(source, errs, d.lines)
	}
	return cfg, nil
}

func applyDefaults(cfg *configv1.Config) {
	if cfg.GrpcAddress == "" {
		cfg.GrpcAddress = DefaultGRPCAddress
	}
	if cfg.AdminAddress == "" {
		cfg.AdminAddress = DefaultAdminAddress
	}
	if cfg.MaxBodyBytes == 0 {
		cfg.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if cfg.MaxRequestHeaders == 0 {
		cfg.MaxRequestHeaders = DefaultMaxRequestHeaders
	}
	if cfg.MaxRequestHeadersKb == 0 {
		cfg.MaxRequestHeadersKb = DefaultMaxRequestHeadersKB
	}
	if cfg.RequestBodyTimeout == nil {
		cfg.RequestBodyTimeout = durationpb.New(DefaultRequestBodyTimeout)
	}
	if cfg.EngineMetrics == nil {
		cfg.EngineMetrics = &configv1.EngineMetrics{}
	}
	if cfg.DnsRefreshRate == nil {
		cfg.DnsRefreshRate = durationpb.New(DefaultDNSRefreshRate)
	}
	if p := cfg.Peers; p != nil && p.PickJitter == nil {
		p.PickJitter = durationpb.New(placement.DefaultPickJitter)
	}
	if x := cfg.Xds; x != nil && x.ClusterName == "" {
		x.ClusterName = DefaultXDSCluster
	}
	if m := cfg.EngineMetrics; !m.Disabled {
		if m.Interval == nil {
			m.Interval = durationpb.New(DefaultMetricsInterval)
		}
		if m.StaleAfter == nil {
			m.StaleAfter = durationpb.New(picker.DefaultStaleAfter)
		}
		if m.Path == "" {
			m.Path = DefaultMetricsPath
		}
	}
	if k := cfg.KvEvents; k != nil {
		if k.Mode == "" {
			k.Mode = KVEventsDial
		}
		if k.Mode == KVEventsBind && k.Topic == "" {
			k.Topic = DefaultBindTopic
		}
		if k.BlockSize == 0 {
			k.BlockSize = placement.DefaultKVBlockSize
		}
		if k.MaxBlocksPerEngine == 0 {
			k.MaxBlocksPerEngine = DefaultMaxBlocksPerEngine
		}
	}
	for _, p := range cfg.Pools {
		if p.Saturation == nil {
			p.Saturation = &configv1.Saturation{}
		}
		if s := p.Saturation; !s.Disabled {
			if s.QueueDepth == 0 {
				s.QueueDepth = DefaultQueueDepth
			}
			if s.KvUsage == 0 {
				s.KvUsage = DefaultKVUsage
			}
			if s.Action == configv1.SaturationAction_SATURATION_ACTION_UNSPECIFIED {
				s.Action = configv1.SaturationAction_SATURATION_ACTION_QUEUE
			}
			if s.MaxQueueTime == nil {
				s.MaxQueueTime = durationpb.New(DefaultMaxQueueTime)
			}
		}
		// A message field has presence, so an explicit "0s" stays and is
		// rejected by validation rather than silently replaced.
		if p.PrefillTimeout == nil {
			p.PrefillTimeout = durationpb.New(DefaultPrefillTimeout)
		}
		spec, err := connectors.Lookup(p.Connector)
		if err == nil && spec.Defaults != nil {
			spec.Defaults(p) // the connector's own fields
		}
		if p.PrefillAttempts == 0 {
			p.PrefillAttempts = DefaultPrefillAttempts
		}
		if p.PrefillAttemptTimeout == nil {
			p.PrefillAttemptTimeout = durationpb.New(p.PrefillTimeout.AsDuration())
		}
		if p.OnPrefillFailure == configv1.PrefillFailure_PREFILL_FAILURE_UNSPECIFIED {
			p.OnPrefillFailure = configv1.PrefillFailure_PREFILL_FAILURE_FAIL
		}
		if p.EjectAfterFailures == 0 {
			p.EjectAfterFailures = DefaultEjectAfterFailures
		}
		if p.EjectDuration == nil {
			p.EjectDuration = durationpb.New(DefaultEjectDuration)
		}
		prefills := err != nil || spec.Traits(p).Prefills
		placement.Defaults(p, cfg.KvEvents != nil, prefills)
		// Roles mean nothing to a connector without a prefill leg, whose
		// pods are all decode engines; validation rejects them there.
		if k := p.GetKubernetes(); k != nil && prefills {
			if k.RoleLabel == "" {
				k.RoleLabel = DefaultRoleLabel
			}
			if k.PrefillRole == "" {
				k.PrefillRole = DefaultPrefillRole
			}
			if k.DecodeRole == "" {
				k.DecodeRole = DefaultDecodeRole
			}
		}
	}
}

// joinErrors prefixes each error with source and its line, if it has one,
// and joins them, one per line, in the file's order.
func joinErrors(source string, errs []error, l lines) error {
	type located struct {
		line int
		err  error
	}
	all := make([]located, len(errs))
	for i, err := range errs {
		all[i] = located{l.lineOf(err), err}
	}
	slices.SortStableFunc(all, func(a, b located) int { return a.line - b.line })
	wrapped := make([]error, len(all))
	for i, e := range all {
		if e.line > 0 {
			wrapped[i] = fmt.Errorf("%s:%d: %w", source, e.line, e.err)
		} else {
			wrapped[i] = fmt.Errorf("%s: %w", source, e.err)
		}
	}
	return errors.Join(wrapped...)
}
