// Package routing maps a request's model to its pool: the connector and the
// engines that serve it. A Table is immutable once built; a stream takes one
// snapshot when it starts and keeps it to its end.
package routing

import (
	"fmt"
	"time"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/picker"
)

// Pool is a set of prefill and decode engines serving some models with one
// connector.
type Pool struct {
	Name          string
	ConnectorName string
	Connector     connectors.Connector
	Prefill       *picker.RoundRobin
	Decode        *picker.RoundRobin
	// PrefillTimeout bounds all prefill attempts of a request together;
	// AttemptTimeout bounds each.
	PrefillTimeout time.Duration
	AttemptTimeout time.Duration
	// Attempts is how many prefill endpoints a request may try.
	Attempts int
	// Fallback sends a request whose prefill attempts all failed to a decode
	// endpoint with the plain client body, instead of failing it.
	Fallback bool
}

// Table finds the pool of a model.
type Table struct {
	byModel    map[string]*Pool
	fallback   *Pool
	concurrent bool
	maxBody    int
}

// MaxBodyBytes is the largest request body pdx routes.
func (t *Table) MaxBodyBytes() int { return t.maxBody }

// HasConcurrent reports whether some pool's connector prefills concurrently
// with the decode. Such requests need Envoy to send the response headers to
// pdx, which is decided before the body says which pool a request is for.
func (t *Table) HasConcurrent() bool { return t.concurrent }

// New builds a table from a config that config.Parse accepted. It fails on
// connector names that are not registered.
func New(cfg *configv1.Config) (*Table, error) {
	if err := config.ValidateConnectors(cfg, connectors.Names()); err != nil {
		return nil, err
	}
	t := &Table{byModel: map[string]*Pool{}, maxBody: int(cfg.GetMaxBodyBytes())}
	for i, pc := range cfg.GetPools() {
		conn, err := connectors.New(pc.GetConnector(), connectors.Options{MooncakeProtocol: pc.GetMooncakeProtocol()})
		if err != nil {
			return nil, fmt.Errorf("pools[%d].connector: %w", i, err)
		}
		t.concurrent = t.concurrent || connectors.Concurrent(conn)
		health := picker.Options{
			FailureThreshold: int(pc.GetEjectAfterFailures()),
			CoolDown:         pc.GetEjectDuration().AsDuration(),
		}
		p := &Pool{
			Name:           pc.GetName(),
			ConnectorName:  pc.GetConnector(),
			Connector:      conn,
			Prefill:        picker.NewRoundRobin(endpoints(pc.GetPrefill()), health),
			Decode:         picker.NewRoundRobin(endpoints(pc.GetDecode()), health),
			PrefillTimeout: pc.GetPrefillTimeout().AsDuration(),
			AttemptTimeout: pc.GetPrefillAttemptTimeout().AsDuration(),
			Attempts:       max(1, int(pc.GetPrefillAttempts())),
			Fallback:       pc.GetOnPrefillFailure() == "fallback",
		}
		if p.AttemptTimeout <= 0 { // a config not through config.Parse
			p.AttemptTimeout = p.PrefillTimeout
		}
		for _, m := range pc.GetModels() {
			t.byModel[m] = p
		}
		if pc.GetDefault() {
			t.fallback = p
		}
	}
	return t, nil
}

// Lookup returns the pool serving model: the pool that lists it, else the
// default pool.
func (t *Table) Lookup(model string) (*Pool, bool) {
	if p, ok := t.byModel[model]; ok {
		return p, true
	}
	return t.fallback, t.fallback != nil
}

func endpoints(eps []*configv1.Endpoint) []connectors.Endpoint {
	out := make([]connectors.Endpoint, len(eps))
	for i, e := range eps {
		out[i] = connectors.Endpoint{Address: e.GetAddress(), BootstrapPort: int(e.GetBootstrapPort()), KVAddress: e.GetKvAddress()}
	}
	return out
}

// Fixed returns a table that sends every model to pool.
func Fixed(pool *Pool) *Table {
	return &Table{byModel: map[string]*Pool{}, fallback: pool, concurrent: connectors.Concurrent(pool.Connector)}
}
