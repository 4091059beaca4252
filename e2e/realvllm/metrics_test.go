package realvllm

import (
	"context"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/enginemetrics"
	"github.com/pdx-router/pdx/internal/testbed/realvllm"
)

// sample is what pdx's own scraper reads of the engine's /metrics.
func sample(t *testing.T, e *realvllm.Engine) enginemetrics.Sample {
	t.Helper()
	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, e.URL()+"/metrics", nil)
	require.NoError(t, err)
	resp, err := hc.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	s, err := enginemetrics.Parse(resp.Body)
	require.NoError(t, err, "%s: pdx's scraper reads vLLM %s's exposition", e.Name(), realvllm.Version)
	return s
}

// TestEngineMetrics reads every vLLM metric pdx uses, by its real name and
// shape on vLLM 0.32, with pdx's own parser: the queue, the running batch
// and KV usage move with a request the engine is running; the LoRA gauge
// is there (--enable-lora) with max_lora; cache_config_info's block size
// is the 128 the tier configures pdx with, and its blocks times that are
// the KV size pdx reads; and pdx's scrapes of the engines never failed.
func TestEngineMetrics(t *testing.T) {
	s, st := sharedStack(t)
	for _, e := range s.all() {
		fams := engineMetrics(t, e)
		lora := e != s.decode // the engines started with --enable-lora
		names := []string{"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:cache_config_info"}
		if lora {
			names = append(names, "vllm:lora_requests_info")
		} else {
			require.NotContains(t, fams, "vllm:lora_requests_info", "%s: no LoRA gauge without --enable-lora", e.Name())
		}
		for _, name := range names {
			require.Contains(t, fams, name, "%s exports %s", e.Name(), name)
			require.Equal(t, "GAUGE", fams[name].GetType().String(), "%s: %s is a gauge", e.Name(), name)
		}
		info := matching(fams, "vllm:cache_config_info", nil)
		require.Len(t, info, 1)
		require.Equal(t, "128", labelOf(info[0], "block_size"), "%s: the CPU backend's block size", e.Name())
		require.Equal(t, "True", labelOf(info[0], "enable_prefix_caching"))
		require.Equal(t, 1.0, info[0].GetGauge().GetValue())
		blocks, err := strconv.Atoi(labelOf(info[0], "num_gpu_blocks"))
		require.NoError(t, err, "%s: num_gpu_blocks is a number once the engine serves", e.Name())
		require.Positive(t, blocks)
		got := sample(t, e)
		require.Equal(t, blocks*realvllm.BlockSize, got.KVTokens, "%s: pdx's parser reads the engine's KV size", e.Name())
		if !lora {
			require.Zero(t, got.LoRA.MaxLoRA, e.Name())
		} else {
			series := matching(fams, "vllm:lora_requests_info", nil)
			require.NotEmpty(t, series)
			require.Equal(t, "1", labelOf(series[0], "max_lora"))
			var labels []string
			for _, lp := range series[0].GetLabel() {
				labels = append(labels, lp.GetName())
			}
			require.Subset(t, labels, []string{"max_lora", "running_lora_adapters", "waiting_lora_adapters"})
			require.Greater(t, series[0].GetGauge().GetValue(), 1e9, "its value is a Unix time, when vLLM set it")
			require.Equal(t, 1, got.LoRA.MaxLoRA, e.Name())
		}
		require.GreaterOrEqual(t, got.KVUsage, 0.0, e.Name())
		require.LessOrEqual(t, got.KVUsage, 1.0, e.Name())
	}

	// A long generation on decode-0, sent to it directly: pdx's parser sees
	// it running and holding KV, then finished.
	d := s.decode
	hc := httpClient(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		body, _ := json.Marshal(completion(prompt("a long generation"), 1500).with("ignore_eos", true).body)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, d.URL()+completionsPath, strings.NewReader(string(body)))
		req.Header.Set("Content-Type", "application/json")
		if resp, err := hc.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	var running enginemetrics.Sample
	require.Eventually(t, func() bool {
		running = sample(t, d)
		return running.Running == 1
	}, time.Minute, 20*time.Millisecond, "pdx's parser sees the request running")
	require.Positive(t, running.KVUsage, "a running request holds KV")
	require.Zero(t, running.Waiting)
	cancel()
	<-done
	require.Eventually(t, func() bool {
		s := sample(t, d)
		return s.Running == 0 && s.Waiting == 0
	}, time.Minute, 50*time.Millisecond, "the aborted request left the batch")

	require.Zero(t, value(pdxMetrics(t, st), "pdx_engine_metrics_failures_total", nil), "pdx's scrapes of the engines never failed")
}
