package enginesim

import (
	"net/http"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// GET /metrics serves the engine's load in the Prometheus text format, under
// the names and labels of the engine family of Config.Connector, so that a
// router's scraper reads the simulator as it would read the real engine.
// Counters carry the _total suffix on the wire, as the engines' Python
// prometheus_client adds it to every counter; client_golang does not, so the
// names below include it.
//
// vLLM (connectors nixl, http/lmcache, mooncake, p2p-nccl):
// vllm/v1/metrics/loggers.py, PrometheusStatLogger: labels model_name (the
// served model name) and engine (the engine core's index, "0" for one).
//
// SGLang: python/sglang/srt/metrics/collector.py, SchedulerMetricsCollector:
// gauges with label model_name (docs/references/production_metrics.md shows
// only it).
//
// TensorRT-LLM: tensorrt_llm/metrics/collector.py, MetricsCollector, which
// trtllm-serve serves on /prometheus/metrics (examples/serve/
// prometheus_metrics.py) when return_perf_metrics is on. Its labels are the
// ones tensorrt_llm/serve/openai_server.py passes: model_name and
// engine_type, both literally "undefined". The simulator serves them on
// /prometheus/metrics and on /metrics (where trtllm-serve answers JSON
// iteration stats instead).
//
// The hit-rate gauges (sglang:cache_hit_rate, trtllm_kv_cache_hit_rate) are
// cumulative here: prefix-cache hit tokens over queried tokens since start
// (the engines compute them over recent batches).

// metricsModel is the model_name label value of vLLM and SGLang, their
// served model name.
const metricsModel = ModelName

// trtllmUndefined is the value of trtllm-serve's labels.
const trtllmUndefined = "undefined"

// engineMetric is one metric of an engine family.
type engineMetric struct {
	desc  *prometheus.Desc
	kind  prometheus.ValueType
	value func(loadSnapshot) float64
}

// loadSnapshot is what one scrape reports, read at once.
type loadSnapshot struct {
	running, waiting       int
	kvUsage                float64
	queries, hits          int64
	queryBlocks, hitBlocks int64
}

func (l loadSnapshot) hitRate() float64 {
	if l.queries == 0 {
		return 0
	}
	return float64(l.hits) / float64(l.queries)
}

// snapshot reads the load for a scrape.
func (s *Server) snapshot() loadSnapshot {
	queued := s.queuedDecodes()
	m := s.load
	m.mu.Lock()
	defer m.mu.Unlock()
	return loadSnapshot{
		running: m.running(), waiting: m.waitingLocked() + queued, kvUsage: m.kvUsage(),
		queries: m.usage.PrefixQueryTokens, hits: m.usage.PrefixHitTokens,
		queryBlocks: m.queryBlocks, hitBlocks: m.hitBlocks,
	}
}

// engineMetrics is the metric set of the engine family of connector; capa
// is the engine's capacity model (nil: none), its KV blocks of scale
// tokens a block token.
func engineMetrics(connector string, capa *Capacity, scale int) []engineMetric {
	gauge, counter := prometheus.GaugeValue, prometheus.CounterValue
	def := func(labels prometheus.Labels) func(string, string, prometheus.ValueType, func(loadSnapshot) float64) engineMetric {
		return func(name, help string, kind prometheus.ValueType, v func(loadSnapshot) float64) engineMetric {
			return engineMetric{desc: prometheus.NewDesc(name, help, nil, labels), kind: kind, value: v}
		}
	}
	running := func(l loadSnapshot) float64 { return float64(l.running) }
	waiting := func(l loadSnapshot) float64 { return float64(l.waiting) }
	kv := func(l loadSnapshot) float64 { return l.kvUsage }
	hitRate := loadSnapshot.hitRate
	switch connector {
	case ConnectorSGLang:
		m := def(prometheus.Labels{"model_name": metricsModel})
		out := []engineMetric{
			m("sglang:num_running_reqs", "The number of running requests.", gauge, running),
			m("sglang:num_queue_reqs", "The number of requests in the waiting queue.", gauge, waiting),
			m("sglang:token_usage", "The token usage.", gauge, kv),
			m("sglang:cache_hit_rate", "The prefix cache hit rate.", gauge, hitRate),
		}
		if capa != nil {
			// SGLang's KV token pool, in its tokens: what pdx reads as
			// the KV's size.
			pool := float64(capa.KVBlocks * capa.BlockTokens * scale)
			out = append(out, m("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", gauge,
				func(loadSnapshot) float64 { return pool }))
		}
		return out
	case ConnectorTRTLLM:
		m := def(prometheus.Labels{"model_name": trtllmUndefined, "engine_type": trtllmUndefined})
		return []engineMetric{
			m("trtllm_num_requests_running", "Number of active requests.", gauge, running),
			m("trtllm_num_requests_waiting", "Number of queued requests.", gauge, waiting),
			m("trtllm_kv_cache_utilization", "KV cache utilization.", gauge, kv),
			m("trtllm_kv_cache_hit_rate", "KV cache hit rate.", gauge, hitRate),
			m("trtllm_kv_cache_reused_blocks_total", "Cumulative number of KV cache blocks reused (cache hits).", counter,
				func(l loadSnapshot) float64 { return float64(l.hitBlocks) }),
			m("trtllm_kv_cache_missed_blocks_total", "Cumulative number of KV cache blocks missed (cache misses).", counter,
				func(l loadSnapshot) float64 { return float64(l.queryBlocks - l.hitBlocks) }),
		}
	}
	m := def(prometheus.Labels{"model_name": metricsModel, "engine": "0"})
	var cache []engineMetric
	if capa != nil {
		// vLLM's CacheConfig as labels, value 1; the fields a router
		// reads (the KV's size), without the rest of vLLM's.
		cache = append(cache, def(prometheus.Labels{"engine": "0", "enable_prefix_caching": "True",
			"block_size": strconv.Itoa(capa.BlockTokens * scale), "num_gpu_blocks": strconv.Itoa(capa.KVBlocks)})(
			"vllm:cache_config_info", "Information of the LLMEngine CacheConfig", gauge, func(loadSnapshot) float64 { return 1 }))
	}
	return append(cache,
		m("vllm:num_requests_running", "Number of requests in model execution batches.", gauge, running),
		m("vllm:num_requests_waiting", "Number of requests waiting to be processed.", gauge, waiting),
		m("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", gauge, kv),
		m("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.", counter,
			func(l loadSnapshot) float64 { return float64(l.queries) }),
		m("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", counter,
			func(l loadSnapshot) float64 { return float64(l.hits) }),
		// The model never preempts (a sequence reserves its KV on
		// admission), so this stays 0, as on an engine with room to spare.
		m("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.", counter,
			func(loadSnapshot) float64 { return 0 }),
	)
}

// loadCollector exposes an engine's load, read once per scrape so that the
// values of one scrape agree with each other.
type loadCollector struct {
	s       *Server
	metrics []engineMetric
}

func (c loadCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, m := range c.metrics {
		ch <- m.desc
	}
}

func (c loadCollector) Collect(ch chan<- prometheus.Metric) {
	snap := c.s.snapshot()
	for _, m := range c.metrics {
		ch <- prometheus.MustNewConstMetric(m.desc, m.kind, m.value(snap))
	}
}

// metricsHandler serves the engine's metrics from a registry of its own, so
// that engines in one process do not share (or collide on) the global one.
func (s *Server) metricsHandler() http.Handler {
	reg := prometheus.NewRegistry()
	reg.MustRegister(loadCollector{s: s, metrics: engineMetrics(s.cfg.Connector, s.load.capa, s.tokenScale())})
	if s.load.lora.on() && s.cfg.Connector != ConnectorSGLang && s.cfg.Connector != ConnectorTRTLLM {
		reg.MustRegister(loraCollector{m: s.load})
	}
	return promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
}

// metricsRoutes adds the metrics routes to mux and returns their paths.
func (s *Server) metricsRoutes(mux *http.ServeMux) []string {
	paths := []string{"/metrics"}
	if s.cfg.Connector == ConnectorTRTLLM {
		paths = append(paths, "/prometheus/metrics") // trtllm-serve's path
	}
	for _, p := range paths {
		mux.Handle("GET "+p, s.metrics)
	}
	return paths
}
