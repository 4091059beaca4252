// Package enginemetrics reads the load an inference engine reports on its
// Prometheus endpoint (queue, running batch, KV cache usage) and keeps it
// fresh by scraping every engine off the request path.
package enginemetrics

import (
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Sample is what one scrape tells of an engine's load.
type Sample struct {
	Waiting int     // requests queued in the engine
	Running int     // requests in its running batch
	KVUsage float64 // KV cache usage, 0–1; -1 when the engine does not say
	// LoRA is what the engine says of its LoRA adapters; MaxLoRA is 0
	// when it says nothing (no vllm:lora_requests_info: LoRA not enabled).
	LoRA LoRA
}

// LoRA is vLLM's vllm:lora_requests_info gauge (vllm/v1/metrics/loggers.py):
// the adapters of the running batch and of the waiting queue, and
// max_lora, how many distinct adapters one batch may use (--max-loras).
type LoRA struct {
	Running, Waiting []string
	MaxLoRA          int
}

// loraFamily is vLLM's adapter gauge. Its value is the time it was last
// set; every label set it ever had stays a series, so the latest one is
// the engine's state (as the Gateway API Inference Extension reads it).
const loraFamily = "vllm:lora_requests_info"

// What a family tells of the load.
type signal int

const (
	waiting signal = iota
	running
	kvUsage
)

// families maps the metric names engines export to what they mean. All are
// gauges; the KV ones are fractions 0–1.
var families = map[string]signal{
	// vLLM (vllm/v1/metrics/loggers.py). gpu_cache_usage_perc is the name
	// before v0.10, kept as a deprecated alias for a while after.
	"vllm:num_requests_waiting": waiting,
	"vllm:num_requests_running": running,
	"vllm:kv_cache_usage_perc":  kvUsage,
	"vllm:gpu_cache_usage_perc": kvUsage,
	// SGLang (python/sglang/srt/metrics/collector.py): token_usage is the
	// share of the KV token pool in use.
	"sglang:num_queue_reqs":   waiting,
	"sglang:num_running_reqs": running,
	"sglang:token_usage":      kvUsage,
	// TensorRT-LLM serve (tensorrt_llm/metrics/collector.py), on
	// /prometheus/metrics, not /metrics (which is JSON there), and only with
	// return_perf_metrics and iteration stats enabled.
	"trtllm_num_requests_waiting": waiting,
	"trtllm_num_requests_running": running,
	"trtllm_kv_cache_utilization": kvUsage,
}

// ErrNoLoad is returned when an exposition parses but carries none of the
// families Parse knows: not an engine, or one that has not started serving.
var ErrNoLoad = errors.New("enginemetrics: no known load metric in exposition")

// Parse reads a Prometheus text exposition and returns the load it reports,
// recognising vLLM, SGLang and TensorRT-LLM serve. A family with several
// series (one per model, data-parallel rank, ...) is summed; KV usage takes
// the fullest. It fails when the text does not parse or has no known family.
func Parse(r io.Reader) (Sample, error) {
	p := newParser()
	return p.parse(r)
}

// parser wraps expfmt's parser so a scrape loop can reuse its buffers.
type parser struct{ text expfmt.TextParser }

// newParser accepts UTF-8 metric names: an engine that exports one anywhere
// in its exposition must not make the whole scrape fail.
func newParser() *parser {
	return &parser{text: expfmt.NewTextParser(model.UTF8Validation)}
}

func (p *parser) parse(r io.Reader) (Sample, error) {
	mfs, err := p.text.TextToMetricFamilies(r)
	if err != nil {
		return Sample{}, fmt.Errorf("enginemetrics: %w", err)
	}
	s := Sample{KVUsage: -1}
	found := false
	for name, sig := range families {
		mf, ok := mfs[name]
		if !ok {
			continue
		}
		found = true
		for _, m := range mf.GetMetric() {
			v, ok := value(m)
			if !ok {
				continue
			}
			switch sig {
			case waiting:
				s.Waiting += count(v)
			case running:
				s.Running += count(v)
			case kvUsage:
				s.KVUsage = max(s.KVUsage, min(max(v, 0), 1))
			}
		}
	}
	if !found {
		return Sample{}, ErrNoLoad
	}
	if mf, ok := mfs[loraFamily]; ok {
		s.LoRA = parseLoRA(mf)
	}
	return s, nil
}

// parseLoRA reads the latest series of vllm:lora_requests_info. A series
// whose max_lora is not a positive number says nothing.
func parseLoRA(mf *dto.MetricFamily) LoRA {
	var best *dto.Metric
	at := math.Inf(-1)
	for _, m := range mf.GetMetric() {
		if v, ok := value(m); ok && v > at {
			best, at = m, v
		}
	}
	if best == nil {
		return LoRA{}
	}
	var l LoRA
	for _, lp := range best.GetLabel() {
		switch lp.GetName() {
		case "max_lora":
			if n, err := strconv.Atoi(strings.TrimSpace(lp.GetValue())); err == nil && n > 0 {
				l.MaxLoRA = n
			}
		case "running_lora_adapters":
			l.Running = adapterList(lp.GetValue())
		case "waiting_lora_adapters":
			l.Waiting = adapterList(lp.GetValue())
		}
	}
	if l.MaxLoRA == 0 {
		return LoRA{}
	}
	return l
}

// adapterList splits vLLM's comma-joined adapter names, nil for none.
// Spaces around a name are dropped (the endpoint-picker protocol's
// example writes "adapter1, adapter2").
func adapterList(s string) []string {
	var out []string
	for name := range strings.SplitSeq(s, ",") {
		if name = strings.TrimSpace(name); name != "" {
			out = append(out, name)
		}
	}
	return out
}

// value is a series' number whatever TYPE the family declared (an engine
// that leaves TYPE out gets untyped); NaN and ±Inf say nothing.
func value(m *dto.Metric) (float64, bool) {
	var v float64
	switch {
	case m.Gauge != nil:
		v = m.Gauge.GetValue()
	case m.Untyped != nil:
		v = m.Untyped.GetValue()
	case m.Counter != nil:
		v = m.Counter.GetValue()
	default:
		return 0, false
	}
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return 0, false
	}
	return v, true
}

// count turns a gauge of requests (exported as a float) into a count.
func count(v float64) int {
	return int(math.Round(max(v, 0)))
}
