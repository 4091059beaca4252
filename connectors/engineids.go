package connectors

import (
	"context"
	"slices"
	"sync"
	"time"
)

// DefaultEngineIDMaxAge is how long EngineIDs trusts an id it has read. An
// engine that restarts has a new id; one that restarts between two requests
// without failing either is caught when the id expires.
const DefaultEngineIDMaxAge = 10 * time.Second

// EngineIDs remembers the engine ids that Mooncake bootstrap servers report,
// by bootstrap address, so that a request does not wait for a GET /query
// first (upstream's proxy asks once, at start). An id is asked for again
// after its max age, and once a prefill on that engine failed: it may have
// restarted with a new id. Concurrent misses for one address share one
// query. It holds what pdx learned about engines, nothing of a request, and
// is safe for concurrent use; a nil *EngineIDs asks every time.
type EngineIDs struct {
	maxAge time.Duration
	now    func() time.Time

	mu  sync.Mutex
	ids map[string]*engineID
}

// engineID is one address's id, or the query for it in flight (ready open).
type engineID struct {
	ready chan struct{}
	id    []byte // JSON string; nil if the query failed
	at    time.Time
}

// NewEngineIDs returns an empty cache whose ids live for maxAge (0 means
// DefaultEngineIDMaxAge).
func NewEngineIDs(maxAge time.Duration) *EngineIDs {
	if maxAge <= 0 {
		maxAge = DefaultEngineIDMaxAge
	}
	return &EngineIDs{maxAge: maxAge, now: time.Now, ids: map[string]*engineID{}}
}

// get returns the id of the engine behind the bootstrap server at addr,
// calling query when it knows none (or an expired one).
func (c *EngineIDs) get(ctx context.Context, addr string, query func(context.Context) ([]byte, error)) ([]byte, error) {
	if c == nil {
		return query(ctx)
	}
	for {
		c.mu.Lock()
		e, ok := c.ids[addr]
		if ok && e.id != nil && c.now().Sub(e.at) > c.maxAge {
			delete(c.ids, addr)
			ok = false
		}
		if !ok {
			e = &engineID{ready: make(chan struct{})}
			c.ids[addr] = e
			c.mu.Unlock()
			return c.fill(ctx, addr, e, query)
		}
		c.mu.Unlock()
		select {
		case <-e.ready:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		if e.id != nil {
			return e.id, nil
		}
		// The query that another request made failed (perhaps because
		// that request went away): ask again.
	}
}

// fill runs the query for e, which this caller added to the map.
func (c *EngineIDs) fill(ctx context.Context, addr string, e *engineID, query func(context.Context) ([]byte, error)) ([]byte, error) {
	id, err := query(ctx)
	c.mu.Lock()
	if err != nil {
		delete(c.ids, addr)
	} else {
		e.id, e.at = id, c.now()
	}
	c.mu.Unlock()
	close(e.ready)
	return id, err
}

// forget drops the id of addr, if it is still id: a prefill on that engine
// failed, and the next request should ask again.
func (c *EngineIDs) forget(addr string, id []byte) {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.ids[addr]; ok && slices.Equal(e.id, id) {
		delete(c.ids, addr)
	}
}
