package enginesim

import (
	"bytes"
	"net/http"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/require"
)

// scrape GETs path on s and parses it as the Prometheus text format, with
// the classic metric name rules every scraper accepts.
func scrape(t *testing.T, s *Server, path string) map[string]*dto.MetricFamily {
	t.Helper()
	r := get(t, s, path)
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	require.Contains(t, r.header.Get("Content-Type"), "text/plain")
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(r.body))
	require.NoError(t, err, "body: %s", r.body)
	return fams
}

// wantMetric is a metric an engine family exposes.
type wantMetric struct {
	name string
	typ  dto.MetricType
}

var (
	vllmMetrics = []wantMetric{
		{"vllm:num_requests_running", dto.MetricType_GAUGE},
		{"vllm:num_requests_waiting", dto.MetricType_GAUGE},
		{"vllm:kv_cache_usage_perc", dto.MetricType_GAUGE},
		{"vllm:prefix_cache_queries_total", dto.MetricType_COUNTER},
		{"vllm:prefix_cache_hits_total", dto.MetricType_COUNTER},
		{"vllm:num_preemptions_total", dto.MetricType_COUNTER},
	}
	vllmLabels   = map[string]string{"model_name": ModelName, "engine": "0"}
	sglangLabels = map[string]string{"model_name": ModelName}
	trtllmLabels = map[string]string{"model_name": "undefined", "engine_type": "undefined"}
)

func TestMetricsExposition(t *testing.T) {
	sglangMetrics := []wantMetric{
		{"sglang:num_running_reqs", dto.MetricType_GAUGE},
		{"sglang:num_queue_reqs", dto.MetricType_GAUGE},
		{"sglang:token_usage", dto.MetricType_GAUGE},
		{"sglang:cache_hit_rate", dto.MetricType_GAUGE},
	}
	trtllmMetrics := []wantMetric{
		{"trtllm_num_requests_running", dto.MetricType_GAUGE},
		{"trtllm_num_requests_waiting", dto.MetricType_GAUGE},
		{"trtllm_kv_cache_utilization", dto.MetricType_GAUGE},
		{"trtllm_kv_cache_hit_rate", dto.MetricType_GAUGE},
		{"trtllm_kv_cache_reused_blocks_total", dto.MetricType_COUNTER},
		{"trtllm_kv_cache_missed_blocks_total", dto.MetricType_COUNTER},
	}
	tests := []struct {
		name    string
		cfg     Config
		paths   []string
		metrics []wantMetric
		labels  map[string]string
		// moved is a counter a plain request moves under Capacity ("" for
		// none); P2P NCCL serves disaggregated requests only, so none is sent.
		moved string
	}{
		{"nixl", Config{}, []string{"/metrics"}, vllmMetrics, vllmLabels, "vllm:prefix_cache_queries_total"},
		{"lmcache", Config{Connector: ConnectorLMCache}, []string{"/metrics"}, vllmMetrics, vllmLabels, "vllm:prefix_cache_queries_total"},
		{"mooncake", Config{Connector: ConnectorMooncake}, []string{"/metrics"}, vllmMetrics, vllmLabels, "vllm:prefix_cache_queries_total"},
		{"mooncake vllm", Config{Connector: ConnectorMooncake, MooncakeProtocol: MooncakeVLLM}, []string{"/metrics"}, vllmMetrics, vllmLabels, "vllm:prefix_cache_queries_total"},
		{"p2p-nccl", Config{Connector: ConnectorP2PNCCL}, []string{"/metrics"}, vllmMetrics, vllmLabels, ""},
		{"sglang", Config{Connector: ConnectorSGLang}, []string{"/metrics"}, sglangMetrics, sglangLabels, ""},
		{"trtllm", Config{Connector: ConnectorTRTLLM}, []string{"/metrics", "/prometheus/metrics"}, trtllmMetrics, trtllmLabels, "trtllm_kv_cache_missed_blocks_total"},
	}
	for _, tt := range tests {
		for _, withCapacity := range []bool{false, true} {
			name := tt.name
			if withCapacity {
				name += " with capacity"
			}
			t.Run(name, func(t *testing.T) {
				cfg := tt.cfg
				if cfg.Connector == ConnectorLMCache {
					cfg.StoreAddr = startStore(t).Addr()
				}
				if withCapacity {
					cfg.Capacity = testCapacity(nil)
				}
				s := startSim(t, cfg)
				if cfg.Connector != ConnectorP2PNCCL {
					timed(t, s, "req-1", plain(tokensText('a', 40), 2))
				}
				// vLLM says its KV's size, as pdx reads it: the capacity
				// model's blocks of its tokens.
				cacheInfo := withCapacity && tt.labels["engine"] != ""
				for _, path := range tt.paths {
					fams := scrape(t, s, path)
					if cacheInfo {
						f, ok := fams["vllm:cache_config_info"]
						require.True(t, ok, "vllm:cache_config_info missing from %s", path)
						require.Equal(t, dto.MetricType_GAUGE, f.GetType())
						require.Len(t, f.GetMetric(), 1)
						require.Equal(t, 1.0, f.GetMetric()[0].GetGauge().GetValue())
						labels := map[string]string{}
						for _, l := range f.GetMetric()[0].GetLabel() {
							labels[l.GetName()] = l.GetValue()
						}
						require.Equal(t, map[string]string{"engine": "0", "enable_prefix_caching": "True", "block_size": "4", "num_gpu_blocks": "10000"}, labels)
						delete(fams, "vllm:cache_config_info")
					}
					// SGLang says it as its KV token pool.
					if withCapacity && cfg.Connector == ConnectorSGLang {
						f, ok := fams["sglang:max_total_num_tokens"]
						require.True(t, ok, "sglang:max_total_num_tokens missing from %s", path)
						require.Equal(t, dto.MetricType_GAUGE, f.GetType())
						require.Len(t, f.GetMetric(), 1)
						require.Equal(t, 10000*4.0, f.GetMetric()[0].GetGauge().GetValue())
						delete(fams, "sglang:max_total_num_tokens")
					}
					require.Len(t, fams, len(tt.metrics), "no other metrics: %v", keys(fams))
					for _, w := range tt.metrics {
						f, ok := fams[w.name]
						require.True(t, ok, "%s missing from %s", w.name, path)
						require.Equal(t, w.typ, f.GetType(), w.name)
						require.NotEmpty(t, f.GetHelp(), w.name)
						require.Len(t, f.GetMetric(), 1, w.name)
						labels := map[string]string{}
						for _, l := range f.GetMetric()[0].GetLabel() {
							labels[l.GetName()] = l.GetValue()
						}
						require.Equal(t, tt.labels, labels, w.name)
					}
					if tt.moved != "" && withCapacity {
						require.Positive(t, metricValue(t, s, tt.moved), "the request was looked up")
					}
				}
			})
		}
	}
}

func TestMetricsFollowTheCache(t *testing.T) {
	tests := []struct {
		connector      string
		usage, hitRate string
		// the prefix-cache counters, in tokens (vLLM) or blocks (TensorRT-LLM)
		queries, hits string
		wantQ, wantH  float64
	}{
		{ConnectorNIXL, "vllm:kv_cache_usage_perc", "", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", 80, 36},
		{ConnectorSGLang, "sglang:token_usage", "sglang:cache_hit_rate", "", "", 0, 0},
		{ConnectorTRTLLM, "trtllm_kv_cache_utilization", "trtllm_kv_cache_hit_rate", "trtllm_kv_cache_missed_blocks_total", "trtllm_kv_cache_reused_blocks_total", 11, 9},
	}
	for _, tt := range tests {
		t.Run(tt.connector, func(t *testing.T) {
			s := startSim(t, Config{Connector: tt.connector, Capacity: testCapacity(func(c *Capacity) { c.KVBlocks = 100 })})
			require.Zero(t, metricValue(t, s, tt.usage))
			prompt := tokensText('a', 40) // 10 blocks
			timed(t, s, "req-1", plain(prompt, 2))
			timed(t, s, "req-2", plain(prompt, 2))
			// 10 prompt blocks cached, of 100, but held by no request: free,
			// as in vLLM's block pool. The second lookup reused 9 (36
			// tokens: never the last token).
			require.Zero(t, metricValue(t, s, tt.usage))
			if tt.hitRate != "" {
				require.InDelta(t, 36.0/80, metricValue(t, s, tt.hitRate), 1e-9)
			}
			if tt.queries != "" {
				require.Equal(t, tt.wantQ, metricValue(t, s, tt.queries))
				require.Equal(t, tt.wantH, metricValue(t, s, tt.hits))
			}
		})
	}
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}
