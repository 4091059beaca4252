package e2e

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// TestMetrics sends traffic through Envoy and scrapes pdx's /metrics over
// HTTP, as Prometheus would: routed requests, an error and a pass-through
// show under their pool and outcome, with prefill and routing latencies and
// every engine's health. With a concurrent connector (sglang) Envoy sends
// the decode's response headers to pdx, so their latency shows too; with a
// sequential one (nixl) pdx never sees them.
func TestMetrics(t *testing.T) {
	for _, tc := range []struct {
		connector string
		sees      bool // the decode's response headers reach pdx
	}{{"nixl", false}, {"sglang", true}} {
		t.Run(tc.connector, func(t *testing.T) {
			st := startStack(t, stack.Options{Connector: tc.connector})
			_, hc := newClient(t, st)
			const n = 4
			for i := range n {
				text := fmt.Sprintf("metrics %s %d", tc.connector, i)
				a := post(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"`+text+`","max_tokens":2}`)
				require.Equal(t, http.StatusOK, a.status, a.body)
			}
			bad := post(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"x","max_tokens":0}`)
			requireAPIError(t, bad, 400, "invalid_value", "max_tokens")
			req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, st.URL()+"/v1/models", nil)
			require.NoError(t, err)
			require.Equal(t, http.StatusOK, do(t, hc, req).status, "pdx answers it from its pools")

			demo := map[string]string{"pool": "demo", "connector": tc.connector}
			// A request is counted when its ext_proc stream ends, which
			// with response headers sent to pdx can follow the client's
			// answer by a moment.
			var fams map[string]*dto.MetricFamily
			require.Eventually(t, func() bool {
				fams = scrape(t, "http://"+st.Pdx.AdminAddr()+"/metrics")
				return value(fams, "pdx_requests_total", with(demo, "outcome", "routed")) == n &&
					value(fams, "pdx_streams_in_flight", nil) == 0
			}, 10*time.Second, 50*time.Millisecond, "routed requests counted, no stream left")

			require.Equal(t, 1.0, value(fams, "pdx_requests_total", with(demo, "outcome", "invalid_value")))
			require.Equal(t, 1.0, value(fams, "pdx_requests_total", map[string]string{"pool": "", "outcome": "answered"}))
			require.Equal(t, 0.0, value(fams, "pdx_requests_total", with(demo, "outcome", "fallback")))
			require.Equal(t, uint64(n), count(fams, "pdx_request_duration_seconds", with(demo, "outcome", "routed")))
			require.Equal(t, uint64(1), count(fams, "pdx_request_duration_seconds", with(demo, "outcome", "error")))
			require.Equal(t, uint64(n), count(fams, "pdx_prefill_duration_seconds", with(demo, "outcome", "ok")))
			require.Equal(t, float64(n), value(fams, "pdx_prefill_attempts_total", map[string]string{"pool": "demo", "result": "ok"}),
				"one successful attempt per request, over all endpoints")
			for _, e := range st.Prefill {
				require.Equal(t, 1.0, value(fams, "pdx_endpoint_healthy", map[string]string{"pool": "demo", "role": "prefill", "endpoint": e.Addr()}))
			}
			for _, e := range st.Decode {
				require.Equal(t, 1.0, value(fams, "pdx_endpoint_healthy", map[string]string{"pool": "demo", "role": "decode", "endpoint": e.Addr()}))
			}
			if tc.sees {
				require.Equal(t, uint64(n), count(fams, "pdx_decode_ttfb_seconds", demo))
			} else {
				require.NotContains(t, fams, "pdx_decode_ttfb_seconds", "not observed without response headers")
			}
		})
	}
}

func with(labels map[string]string, k, v string) map[string]string {
	out := map[string]string{k: v}
	for lk, lv := range labels {
		out[lk] = lv
	}
	return out
}

// scrape fetches and parses a Prometheus text exposition.
func scrape(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	// No keep-alive: no idle connection is left for goleak.
	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, url, nil)
	require.NoError(t, err)
	a := do(t, hc, req)
	require.Equal(t, http.StatusOK, a.status)
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(strings.NewReader(a.body))
	require.NoError(t, err)
	return fams
}

// matching returns the series of name whose labels have the values in
// match (a missing label has the value "").
func matching(fams map[string]*dto.MetricFamily, name string, match map[string]string) []*dto.Metric {
	var out []*dto.Metric
	for _, m := range fams[name].GetMetric() {
		labels := map[string]string{}
		for _, lp := range m.GetLabel() {
			labels[lp.GetName()] = lp.GetValue()
		}
		ok := true
		for k, v := range match {
			ok = ok && labels[k] == v
		}
		if ok {
			out = append(out, m)
		}
	}
	return out
}

// value sums the counter or gauge series of name that match.
func value(fams map[string]*dto.MetricFamily, name string, match map[string]string) float64 {
	var sum float64
	for _, m := range matching(fams, name, match) {
		sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
	}
	return sum
}

// count sums the sample counts of the histogram series of name that match.
func count(fams map[string]*dto.MetricFamily, name string, match map[string]string) uint64 {
	var sum uint64
	for _, m := range matching(fams, name, match) {
		sum += m.GetHistogram().GetSampleCount()
	}
	return sum
}
