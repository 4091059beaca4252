package enginesim

import (
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// LoRA adapters, as vLLM serves them (--enable-lora, --max-loras,
// --lora-modules name=path), modelled from its source:
//
//   - A request names its adapter by its "model" field when that is one of
//     the engine's LoRA modules (Config.LoRAModules); else it is the base
//     model's.
//   - The scheduler (vllm/v1/core/sched/scheduler.py, Scheduler.schedule)
//     seeds scheduled_loras with the adapters of the running batch; a
//     waiting request whose adapter is not among them is skipped (it stays
//     waiting, those behind it may go) when they already number max_loras.
//   - The worker (vllm/lora/worker_manager.py, LRUCacheWorkerLoRAManager)
//     keeps max_loras adapters on the GPU, loading the one a batch needs
//     and evicting the least recently used: a load costs the engine's time
//     (Capacity.LoRALoad) before the request's prompt computes. The
//     scheduler's rule means an adapter in use is never the one evicted.
//   - vllm/v1/metrics/loggers.py sets the gauge vllm:lora_requests_info
//     with labels max_lora, waiting_lora_adapters and
//     running_lora_adapters (the adapters' names joined by ",") to the
//     current time at every step; each label set ever seen stays a series,
//     so a reader takes the one with the latest value.

// adapterOf is the adapter a request names, "" for the base model.
func (s *Server) adapterOf(req *inferenceRequest) string {
	if slices.Contains(s.cfg.LoRAModules, req.model) {
		return req.model
	}
	return ""
}

// loraSlots is an engine's adapters: those on its GPU, those its running
// and waiting requests use, and the series of vllm:lora_requests_info.
// Its methods are called with engineLoad.mu held.
type loraSlots struct {
	max  int           // Capacity.MaxLoRA; 0: no LoRA modelling
	load time.Duration // Capacity.LoRALoad
	// resident are the adapters on the GPU, most recently used first.
	resident []string
	// running and waiting count the requests of each adapter in the batch
	// (prefilling or decoding) and in the queues.
	running, waiting map[string]int
	// order is the adapters in the order they started running or waiting
	// (Python dicts keep insertion order, and vLLM joins their keys).
	order []string
	// loads counts adapters loaded onto the GPU.
	loads int64
	// series are the gauge's label sets seen, with the time each was last
	// set.
	series map[loraSeries]time.Time
}

type loraSeries struct{ running, waiting string }

func newLoRASlots(c *Capacity) loraSlots {
	if c == nil || c.MaxLoRA <= 0 {
		return loraSlots{}
	}
	return loraSlots{max: c.MaxLoRA, load: c.LoRALoad, running: map[string]int{}, waiting: map[string]int{}, series: map[loraSeries]time.Time{}}
}

func (l *loraSlots) on() bool { return l.max > 0 }

// admits reports whether a request of adapter may join the batch now:
// the base model always, an adapter when it runs already or the batch's
// distinct adapters are fewer than max_loras.
func (l *loraSlots) admits(adapter string) bool {
	if !l.on() || adapter == "" || l.running[adapter] > 0 {
		return true
	}
	return len(l.running) < l.max
}

// queue counts a request of adapter as waiting.
func (l *loraSlots) queue(adapter string) {
	if l.on() && adapter != "" {
		l.add(l.waiting, adapter, 1)
	}
}

// unqueue takes it off the waiting ones.
func (l *loraSlots) unqueue(adapter string) {
	if l.on() && adapter != "" {
		l.add(l.waiting, adapter, -1)
	}
}

// start moves a request of adapter from waiting to running and returns
// how long loading the adapter takes: 0 when it is on the GPU already.
func (l *loraSlots) start(adapter string) time.Duration {
	if !l.on() || adapter == "" {
		return 0
	}
	l.add(l.waiting, adapter, -1)
	l.add(l.running, adapter, 1)
	if i := slices.Index(l.resident, adapter); i >= 0 {
		l.resident = slices.Insert(slices.Delete(l.resident, i, i+1), 0, adapter)
		return 0
	}
	if len(l.resident) >= l.max {
		// Evict the least recently used adapter no running request uses;
		// admits leaves one.
		for i := len(l.resident) - 1; i >= 0; i-- {
			if l.running[l.resident[i]] == 0 {
				l.resident = slices.Delete(l.resident, i, i+1)
				break
			}
		}
	}
	l.resident = slices.Insert(l.resident, 0, adapter)
	l.loads++
	return l.load
}

// stop takes a request of adapter off the batch.
func (l *loraSlots) stop(adapter string) {
	if l.on() && adapter != "" {
		l.add(l.running, adapter, -1)
	}
}

// add changes the count of adapter in counts, dropping it at 0, and sets
// the gauge's series for the new state.
func (l *loraSlots) add(counts map[string]int, adapter string, d int) {
	n := counts[adapter] + d
	switch {
	case n <= 0:
		delete(counts, adapter)
	case counts[adapter] == 0:
		counts[adapter] = n
		l.order = append(slices.DeleteFunc(l.order, func(a string) bool { return a == adapter }), adapter)
	default:
		counts[adapter] = n
	}
	l.series[l.current()] = time.Now()
}

// current is the gauge's label set now.
func (l *loraSlots) current() loraSeries {
	join := func(counts map[string]int) string {
		var b strings.Builder
		for _, a := range l.order {
			if counts[a] > 0 {
				if b.Len() > 0 {
					b.WriteByte(',')
				}
				b.WriteString(a)
			}
		}
		return b.String()
	}
	return loraSeries{running: join(l.running), waiting: join(l.waiting)}
}

// loraDesc is vLLM's gauge (PrometheusStatLogger.gauge_lora_info).
var loraDesc = prometheus.NewDesc("vllm:lora_requests_info", "Running stats on lora requests.",
	[]string{"max_lora", "waiting_lora_adapters", "running_lora_adapters"}, nil)

// loraCollector exposes an engine's vllm:lora_requests_info.
type loraCollector struct{ m *engineLoad }

func (c loraCollector) Describe(ch chan<- *prometheus.Desc) { ch <- loraDesc }

func (c loraCollector) Collect(ch chan<- prometheus.Metric) {
	c.m.mu.Lock()
	defer c.m.mu.Unlock()
	l := &c.m.lora
	if len(l.series) == 0 {
		// vLLM sets it at its first step; an idle engine's is empty.
		l.series[loraSeries{}] = time.Now()
	}
	max := strconv.Itoa(l.max)
	for s, at := range l.series {
		ch <- prometheus.MustNewConstMetric(loraDesc, prometheus.GaugeValue, float64(at.UnixNano())/1e9, max, s.waiting, s.running)
	}
}
