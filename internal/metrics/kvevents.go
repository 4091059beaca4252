package metrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdx-router/pdx/internal/kvcache"
	"github.com/pdx-router/pdx/internal/kvevents"
)

// CollectKVEvents exports the KV event subscriptions' counts and what the
// index built from them holds, read at each scrape.
func (m *Metrics) CollectKVEvents(sub *kvevents.Subscriber, index *kvcache.Index) {
	m.reg.MustRegister(&kvCollector{sub: sub, index: index})
}

var (
	kvMessagesDesc = prometheus.NewDesc("pdx_kv_events_total",
		"The engines' KV event messages and events by what became of them: batches and events applied; unknown_events (types pdx does not know, skipped), decode_errors, malformed, unknown_topics (bind mode: a topic that names no engine); gaps, replays (gaps the replay socket filled), catch_ups (subscriptions that began with what the publisher held before pdx subscribed), replay_failures, restarts (a publisher's sequence went back), overflows (pdx fell behind), dropped (batches lost to overflows).",
		[]string{"kind"}, nil)
	kvResetsDesc = prometheus.NewDesc("pdx_kv_cache_resets_total",
		"Times pdx forgot an engine's blocks to relearn them, by reason: gap, restart, reconnect (a gap across a dropped connection), overflow, decode, removed.",
		[]string{"reason"}, nil)
	kvIgnoredDesc = prometheus.NewDesc("pdx_kv_cache_ignored_total",
		"Stored or removed blocks the index could not use, by why: orphans (stored under a parent block pdx never saw: kept apart, matched once they join their chain), orphans_dropped (orphans beyond an engine's bound, not kept), unknown_removals, ignored_groups (not full attention), ignored_media, block_size (not a multiple of kv_events.block_size), conflicts, malformed, no_slot, overflows.",
		[]string{"kind"}, nil)
	kvJoinedDesc = prometheus.NewDesc("pdx_kv_cache_orphans_joined_total",
		"Orphan blocks that joined their chain when the engine stored the block they waited for under a prefix pdx knows: matched from then on.",
		nil, nil)
	kvBlocksDesc = prometheus.NewDesc("pdx_kv_cache_blocks",
		"Blocks of kv_events.block_size tokens each engine reports holding, by tier (gpu, cpu): what precise placement matches prompts against.",
		[]string{"endpoint", "tier"}, nil)
)

type kvCollector struct {
	sub   *kvevents.Subscriber
	index *kvcache.Index
}

func (c *kvCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- kvMessagesDesc
	ch <- kvResetsDesc
	ch <- kvIgnoredDesc
	ch <- kvJoinedDesc
	ch <- kvBlocksDesc
}

func (c *kvCollector) Collect(ch chan<- prometheus.Metric) {
	counter := func(d *prometheus.Desc, v uint64, label string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), label)
	}
	s := c.sub.Stats()
	for _, k := range []struct {
		kind string
		v    uint64
	}{{"batches", s.Batches}, {"events", s.Events}, {"unknown_events", s.UnknownEvents}, {"decode_errors", s.DecodeErrors},
		{"malformed", s.Malformed}, {"unknown_topics", s.UnknownTopics}, {"gaps", s.Gaps}, {"replays", s.Replays}, {"catch_ups", s.CatchUps},
		{"replay_failures", s.ReplayFailures}, {"restarts", s.Restarts}, {"overflows", s.Overflows}, {"dropped", s.Dropped}} {
		counter(kvMessagesDesc, k.v, k.kind)
	}
	x := c.index.Stats()
	for reason, n := range x.Resets {
		counter(kvResetsDesc, n, reason)
	}
	for _, k := range []struct {
		kind string
		v    uint64
	}{{"orphans", x.Orphans}, {"orphans_dropped", x.OrphansDropped}, {"unknown_removals", x.UnknownRemovals}, {"ignored_groups", x.IgnoredGroups},
		{"ignored_media", x.IgnoredMedia}, {"block_size", x.BlockSizeMismatches}, {"conflicts", x.Conflicts},
		{"malformed", x.Malformed}, {"no_slot", x.NoSlot}, {"overflows", x.Overflows}} {
		counter(kvIgnoredDesc, k.v, k.kind)
	}
	ch <- prometheus.MustNewConstMetric(kvJoinedDesc, prometheus.CounterValue, float64(x.Joined))
	for _, e := range x.Engines {
		ch <- prometheus.MustNewConstMetric(kvBlocksDesc, prometheus.GaugeValue, float64(e.GPUBlocks), e.Address, "gpu")
		ch <- prometheus.MustNewConstMetric(kvBlocksDesc, prometheus.GaugeValue, float64(e.CPUBlocks), e.Address, "cpu")
	}
}
