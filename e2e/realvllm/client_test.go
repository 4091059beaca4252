package realvllm

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/realvllm"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// requestTimeout bounds one request: a prompt of a few hundred tokens takes
// tens of milliseconds on a quiet machine, seconds on a busy one.
const requestTimeout = 3 * time.Minute

// httpClient is a client of its own per test, its idle connections closed
// when the test ends.
func httpClient(t *testing.T) *http.Client {
	hc := &http.Client{Timeout: requestTimeout}
	t.Cleanup(hc.CloseIdleConnections)
	return hc
}

const (
	completionsPath = "/v1/completions"
	chatPath        = "/v1/chat/completions"
)

// call is an OpenAI request: its path and JSON body.
type call struct {
	path string
	body map[string]any
}

// completion is a plain completions request for prompt, temperature 0.
func completion(prompt string, maxTokens int) call {
	return call{completionsPath, map[string]any{"model": stack.Model, "prompt": prompt, "max_tokens": maxTokens, "temperature": 0}}
}

// chat is a one-message chat request, temperature 0.
func chat(content string, maxTokens int) call {
	return call{chatPath, map[string]any{"model": stack.Model, "max_tokens": maxTokens, "temperature": 0,
		"messages": []map[string]string{{"role": "user", "content": content}}}}
}

// with returns c with more body fields.
func (c call) with(kv ...any) call {
	b := maps.Clone(c.body)
	for i := 0; i+1 < len(kv); i += 2 {
		b[kv[i].(string)] = kv[i+1]
	}
	return call{c.path, b}
}

// streamed is c streamed with usage.
func (c call) streamed() call {
	return c.with("stream", true, "stream_options", map[string]any{"include_usage": true})
}

func (c call) stream() bool { s, _ := c.body["stream"].(bool); return s }

// result is what an answer said.
type result struct {
	status int
	raw    string
	text   string
	// finish is the first choice's finish_reason.
	finish string
	// usage: whether the answer carried it, and its counts.
	usage                          bool
	promptTokens, completionTokens int
	cachedTokens                   int
	// kvParams is a non-streamed answer's top-level kv_transfer_params.
	kvParams json.RawMessage
}

type answerJSON struct {
	Choices []struct {
		Text    string `json:"text"`
		Message struct {
			Content string `json:"content"`
		} `json:"message"`
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		PromptTokensDetails *struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
	KVTransferParams json.RawMessage `json:"kv_transfer_params"`
}

func (r *result) add(a answerJSON) {
	for _, c := range a.Choices {
		r.text += c.Text + c.Message.Content + c.Delta.Content
		if c.FinishReason != nil && r.finish == "" {
			r.finish = *c.FinishReason
		}
	}
	if u := a.Usage; u != nil {
		r.usage, r.promptTokens, r.completionTokens = true, u.PromptTokens, u.CompletionTokens
		if u.PromptTokensDetails != nil {
			r.cachedTokens = u.PromptTokensDetails.CachedTokens
		}
	}
	if len(a.KVTransferParams) > 0 && string(a.KVTransferParams) != "null" {
		r.kvParams = a.KVTransferParams
	}
}

// send posts c to base (Envoy, or an engine) and reads its answer, JSON
// or server-sent events.
func send(t *testing.T, hc *http.Client, base string, c call, headers ...string) result {
	t.Helper()
	r, err := trySend(t, hc, base, c, headers...)
	require.NoError(t, err)
	return r
}

func trySend(t *testing.T, hc *http.Client, base string, c call, headers ...string) (result, error) {
	payload, err := json.Marshal(c.body)
	require.NoError(t, err)
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, base+c.path, bytes.NewReader(payload))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := hc.Do(req)
	if err != nil {
		return result{}, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return result{}, err
	}
	r := result{status: resp.StatusCode, raw: string(raw)}
	if resp.StatusCode != http.StatusOK {
		return r, nil
	}
	if !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		var a answerJSON
		if err := json.Unmarshal(raw, &a); err != nil {
			return r, fmt.Errorf("answer %q: %w", raw, err)
		}
		r.add(a)
		return r, nil
	}
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(make([]byte, 0, 64<<10), 4<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var a answerJSON
		if err := json.Unmarshal([]byte(data), &a); err != nil {
			return r, fmt.Errorf("event %q: %w", data, err)
		}
		r.add(a)
	}
	return r, sc.Err()
}

// reference is the engine's own computation of c's prompt: c sent to it
// directly, without streaming or KV transfer.
func reference(t *testing.T, hc *http.Client, e *realvllm.Engine, c call) result {
	t.Helper()
	ref := c.with()
	delete(ref.body, "stream")
	delete(ref.body, "stream_options")
	delete(ref.body, "kv_transfer_params")
	r := send(t, hc, e.URL(), ref)
	require.Equal(t, http.StatusOK, r.status, "%s directly: %s", e.Name(), r.raw)
	return r
}

// prompt is a text of some hundreds of tokens (several of vLLM's 128-token
// CPU blocks) that starts with tag, so that prompts of different tags
// share no block, and ends with made-up words of its own, no punctuation:
// the tiny random model's answer hangs mostly on a prompt's last tokens,
// and prompts that end alike (a period, or a digit apart) often get the
// same answer.
func prompt(tag string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s. ", tag)
	for i := range 12 {
		fmt.Fprintf(&b, "Sentence %d of %s tells of routers, engines and caches. ", i, tag)
	}
	syllables := []string{"ka", "lo", "mi", "ne", "su", "ta", "vo", "ri", "pe", "gu", "zo", "fa", "xi", "bu", "de", "wy"}
	for i, c := range sha256.Sum256([]byte(tag)) {
		if i%3 == 0 {
			b.WriteByte(' ')
		}
		b.WriteString(syllables[c>>4] + syllables[c&15])
	}
	return b.String()
}

// metrics scrapes url's Prometheus text.
func metrics(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, url, nil)
	require.NoError(t, err)
	resp, err := hc.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, url)
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	require.NoError(t, err, url)
	return fams
}

func engineMetrics(t *testing.T, e *realvllm.Engine) map[string]*dto.MetricFamily {
	t.Helper()
	return metrics(t, e.URL()+"/metrics")
}

func pdxMetrics(t *testing.T, st *stack.Stack) map[string]*dto.MetricFamily {
	t.Helper()
	return metrics(t, "http://"+st.Pdx.AdminAddr()+"/metrics")
}

// matching are the series of name whose labels include match.
func matching(fams map[string]*dto.MetricFamily, name string, match map[string]string) []*dto.Metric {
	var out []*dto.Metric
	for _, m := range fams[name].GetMetric() {
		ok := true
		for k, v := range match {
			ok = ok && labelOf(m, k) == v
		}
		if ok {
			out = append(out, m)
		}
	}
	return out
}

func labelOf(m *dto.Metric, name string) string {
	for _, lp := range m.GetLabel() {
		if lp.GetName() == name {
			return lp.GetValue()
		}
	}
	return ""
}

// value sums the counters and gauges of name whose labels include match.
func value(fams map[string]*dto.MetricFamily, name string, match map[string]string) float64 {
	var sum float64
	for _, m := range matching(fams, name, match) {
		sum += m.GetCounter().GetValue() + m.GetGauge().GetValue() + m.GetUntyped().GetValue()
	}
	return sum
}

// promptSources is the decode's vllm:prompt_tokens_by_source_total, by
// source: how the prompt tokens of the requests it served got into its
// cache.
type promptSources struct{ local, cacheHit, external float64 }

func sourcesOf(t *testing.T, e *realvllm.Engine) promptSources {
	t.Helper()
	fams := engineMetrics(t, e)
	const name = "vllm:prompt_tokens_by_source_total"
	require.Contains(t, fams, name, "%s serves vLLM 0.32's prompt token sources", e.Name())
	return promptSources{
		local:    value(fams, name, map[string]string{"source": "local_compute"}),
		cacheHit: value(fams, name, map[string]string{"source": "local_cache_hit"}),
		external: value(fams, name, map[string]string{"source": "external_kv_transfer"}),
	}
}

func (p promptSources) minus(q promptSources) promptSources {
	return promptSources{p.local - q.local, p.cacheHit - q.cacheHit, p.external - q.external}
}

// successes is the engine's vllm:request_success_total, every finish
// reason: the requests it finished.
func successes(t *testing.T, e *realvllm.Engine) float64 {
	t.Helper()
	return value(engineMetrics(t, e), "vllm:request_success_total", nil)
}
