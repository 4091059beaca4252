package server

import (
	"context"
	"log/slog"
	"net"
	"strconv"
	"time"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/kvcache"
	"github.com/pdx-router/pdx/internal/kvevents"
	"github.com/pdx-router/pdx/internal/routing"
)

// engineRefresh is how often the subscriptions follow the routing table's
// engines (reloads, discovery); a SetEngines with the same engines does
// nothing.
const engineRefresh = time.Second

// subscribe starts reading the engines' KV events into the routing table's
// prefix cache, off every request's path. The mode, ports and topic are
// the config's at start; the engines follow the table.
func (s *Server) subscribe(k *configv1.KVEvents) error {
	cache := s.proc.Table().PrefixCache()
	if k == nil || cache == nil {
		return nil
	}
	opts := kvevents.Options{Sink: cache, Topic: k.GetTopic(), CatchUp: true, Log: s.log.With(slog.String("component", "kv_events"))}
	if k.GetMode() == config.KVEventsBind {
		opts.Bind = k.GetBindAddress()
	}
	ctx, cancel := context.WithCancel(context.Background())
	sub, err := kvevents.Start(ctx, opts)
	if err != nil {
		cancel()
		return err
	}
	s.kvEvents, s.stopEvents, s.eventsDone = sub, cancel, make(chan struct{})
	s.metrics.CollectKVEvents(sub, cache)
	f := &engineFollower{k: k, sub: sub, cache: cache, table: s.proc.Table, log: s.log}
	f.follow()
	go func() {
		defer close(s.eventsDone)
		tick := time.NewTicker(engineRefresh)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
				f.follow()
			}
		}
	}()
	return nil
}

// engineFollower keeps the KV event subscriptions, and the engines the
// prefix cache tells apart, in step with the routing table's endpoints.
type engineFollower struct {
	k     *configv1.KVEvents
	sub   *kvevents.Subscriber
	cache *kvcache.Index
	table func() *routing.Table
	log   *slog.Logger
}

// follow subscribes to the table's engines as they are now, and frees the
// cache's slots of those that left (kvcache.Index.MaxEngines slots: pods
// that come and go would use them all up). An engine that left has had
// its subscription stopped, its last batch applied, before its slot is
// freed: none of its events can take a slot again. A pick's view of a
// pool that was built as an engine left and came back at once names its
// freed slot, which holds nothing; the views are refreshed after, and at
// every turn, so that such a view is fixed by the next turn at the latest.
func (f *engineFollower) follow() {
	table := f.table()
	eps := table.Endpoints()
	if err := f.sub.SetEngines(publishers(f.k, eps)); err != nil {
		f.log.Warn("kv events: engines not subscribed", slog.String("error", err.Error()))
	} else {
		addrs := make([]string, len(eps))
		for i, ep := range eps {
			addrs[i] = ep.Address
		}
		if n := f.cache.Retain(addrs); n > 0 {
			f.log.Debug("kv events: engines that left forgotten", slog.Int("engines", n))
		}
	}
	for _, p := range table.Pools() {
		p.Prefill.Set.RefreshSlots()
		p.Decode.Set.RefreshSlots()
	}
}

// publishers are the KV event sources of eps: in mode dial each engine's
// publisher on its host, at its own port or the config's; in mode bind the
// engines themselves, which dial pdx and name themselves in their topics.
func publishers(k *configv1.KVEvents, eps []endpoint.Endpoint) []kvevents.Engine {
	out := make([]kvevents.Engine, 0, len(eps))
	for _, ep := range eps {
		e := kvevents.Engine{Addr: ep.Address, DPSize: ep.DPSize}
		if k.GetMode() != config.KVEventsBind {
			e.Endpoint = zmqEndpoint(ep.Host(), ep.KVEventsPort, int(k.GetPort()))
			e.Replay = zmqEndpoint(ep.Host(), ep.KVEventsReplayPort, int(k.GetReplayPort()))
		}
		out = append(out, e)
	}
	return out
}

// zmqEndpoint is tcp://host:port with the endpoint's own port, else the
// config's; "" when neither is set.
func zmqEndpoint(host string, own, configured int) string {
	port := own
	if port == 0 {
		port = configured
	}
	if port == 0 {
		return ""
	}
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(port))
}

// KVEventsAddr is where pdx listens for engines' KV events (kv_events in
// mode bind), "" otherwise.
func (s *Server) KVEventsAddr() string {
	if s.kvEvents == nil {
		return ""
	}
	return s.kvEvents.Addr()
}

// stopSubscribing ends the subscriptions.
func (s *Server) stopSubscribing() {
	if s.stopEvents == nil {
		return
	}
	s.stopEvents()
	<-s.eventsDone
	_ = s.kvEvents.Close()
}
