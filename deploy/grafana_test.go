package deploy_test

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/kvcache"
	"github.com/pdx-router/pdx/internal/kvevents"
	"github.com/pdx-router/pdx/internal/metrics"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/routing"
)

const dashboardFile = "grafana/pdx-dashboard.json"

// dashboard is what the test reads of a Grafana dashboard: every query.
type dashboard struct {
	Panels []struct {
		Title   string `json:"title"`
		Type    string `json:"type"`
		Targets []struct {
			Expr string `json:"expr"`
		} `json:"targets"`
		Datasource *struct {
			UID string `json:"uid"`
		} `json:"datasource"`
	} `json:"panels"`
	Templating struct {
		List []struct {
			Name  string          `json:"name"`
			Type  string          `json:"type"`
			Query json.RawMessage `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

// promqlKeywords are the words of PromQL that are not metric names where a
// metric name could stand.
var promqlKeywords = map[string]bool{
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
	"bool": true, "and": true, "or": true, "unless": true, "offset": true, "atan2": true,
	"sum": true, "min": true, "max": true, "avg": true, "group": true, "stddev": true, "stdvar": true,
	"count": true, "count_values": true, "bottomk": true, "topk": true, "quantile": true, "limitk": true, "limit_ratio": true,
	"inf": true, "nan": true,
}

// grouping keywords take a parenthesized list of label names.
var grouping = map[string]bool{"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true}

// metricNames returns the metric names a PromQL expression selects: the
// identifiers that are neither function calls, keywords, label names (in
// {…} matchers and by/without/on/ignoring lists), durations ([…]),
// strings, numbers nor Grafana variables ($x, ${x}).
func metricNames(expr string) ([]string, error) {
	var out []string
	isIdentStart := func(c byte) bool { return c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }
	isIdent := func(c byte) bool { return isIdentStart(c) || c >= '0' && c <= '9' }
	skipSpace := func(i int) int {
		for i < len(expr) && strings.IndexByte(" \t\r\n", expr[i]) >= 0 {
			i++
		}
		return i
	}
	// skipTo returns the index after the close that matches the opener at
	// i, skipping strings.
	skipTo := func(i int, open, close byte) (int, error) {
		depth := 0
		for ; i < len(expr); i++ {
			switch c := expr[i]; c {
			case '"', '\'', '`':
				j := strings.IndexByte(expr[i+1:], c)
				if j < 0 {
					return 0, fmt.Errorf("unterminated string in %q", expr)
				}
				i += j + 1
			case open:
				depth++
			case close:
				if depth--; depth == 0 {
					return i + 1, nil
				}
			}
		}
		return 0, fmt.Errorf("unbalanced %c in %q", open, expr)
	}
	for i := 0; i < len(expr); {
		c := expr[i]
		switch {
		case c == '"' || c == '\'' || c == '`':
			j := strings.IndexByte(expr[i+1:], c)
			if j < 0 {
				return nil, fmt.Errorf("unterminated string in %q", expr)
			}
			i += j + 2
		case c == '{':
			j, err := skipTo(i, '{', '}')
			if err != nil {
				return nil, err
			}
			i = j
		case c == '[':
			j, err := skipTo(i, '[', ']')
			if err != nil {
				return nil, err
			}
			i = j
		case c == '$':
			i++
			if i < len(expr) && expr[i] == '{' {
				j, err := skipTo(i, '{', '}')
				if err != nil {
					return nil, err
				}
				i = j
				continue
			}
			for i < len(expr) && isIdent(expr[i]) {
				i++
			}
		case c >= '0' && c <= '9' || c == '.':
			// A number, or a duration after offset: digits, letters, dots.
			for i < len(expr) && (isIdent(expr[i]) || expr[i] == '.') {
				i++
			}
		case isIdentStart(c):
			j := i
			for j < len(expr) && isIdent(expr[j]) {
				j++
			}
			word, next := expr[i:j], skipSpace(j)
			i = j
			switch {
			case grouping[strings.ToLower(word)]:
				if next < len(expr) && expr[next] == '(' {
					k, err := skipTo(next, '(', ')')
					if err != nil {
						return nil, err
					}
					i = k
				}
			case promqlKeywords[strings.ToLower(word)]:
			case next < len(expr) && expr[next] == '(':
				// A function call.
			default:
				out = append(out, word)
			}
		default:
			i++
		}
	}
	return out, nil
}

// pdxMetrics returns pdx's metrics as a server registers them: metrics.New
// and every Collect* method, the KV event ones with a subscriber and an
// index that hold an engine, so that every family has a sample.
func pdxMetrics(t *testing.T) *metrics.Metrics {
	t.Helper()
	table, err := routing.New(&configv1.Config{Pools: []*configv1.Pool{{
		Name: "p", Models: []string{"m"}, Connector: "nixl",
		Prefill:        []*configv1.Endpoint{{Address: "127.0.0.1:8100"}},
		Decode:         []*configv1.Endpoint{{Address: "127.0.0.1:8200"}},
		PrefillTimeout: durationpb.New(time.Second),
		Saturation:     &configv1.Saturation{QueueDepth: 5, KvUsage: 0.8, MaxQueueTime: durationpb.New(time.Second)},
	}}})
	require.NoError(t, err)
	index := kvcache.New(kvcache.Config{})
	index.Apply("127.0.0.1:8200", &kvevents.Batch{Events: []kvevents.Event{{
		Kind: kvevents.BlockStored, Hashes: []kvevents.Hash{{Lo: 1}}, TokenIDs: make([]uint32, 16), BlockSize: 16,
	}}})
	index.Reset("127.0.0.1:8100", -1, "gap")
	sub, err := kvevents.Start(t.Context(), kvevents.Options{Sink: index, Log: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, sub.Close()) })

	m := metrics.New()
	// A new Collect* method registers metrics this test would not see:
	// call it above and list it here.
	collects := map[string]bool{"CollectEndpoints": true, "CollectKVEvents": true}
	typ := reflect.TypeFor[*metrics.Metrics]()
	for i := range typ.NumMethod() {
		if name := typ.Method(i).Name; strings.HasPrefix(name, "Collect") {
			require.True(t, collects[name], "metrics.Metrics.%s registers metrics: call it in pdxMetrics", name)
			delete(collects, name)
		}
	}
	require.Empty(t, collects, "methods pdxMetrics calls that metrics.Metrics no longer has")
	// The prefill engine says its KV's size.
	table.Observe("127.0.0.1:8100", picker.Load{KVTokens: 29127 * 16, At: time.Now()})
	m.CollectEndpoints(func() *routing.Table { return table })
	m.CollectKVEvents(sub, index)

	m.StreamStarted()
	pool := m.Pool(table.Pools()[0])
	pool.Request(metrics.OutcomeRouted, time.Millisecond)
	pool.Request("overloaded", time.Millisecond)
	pool.Prefill(metrics.ResultOK, time.Millisecond)
	pool.Attempt("127.0.0.1:8100", metrics.ResultOK)
	pool.Decision("disaggregated")
	pool.DecodeRepick(true)
	pool.DecodeHeaders(time.Millisecond)
	pool.DecodeDone(time.Millisecond)
	pool.DecodeServed("127.0.0.1:8200", false)
	pool.FirstByte(time.Millisecond, time.Millisecond)
	pool.Tokens(3, 2, 1)
	pool.Tokenized("render")
	pool.RenderFailed("forbidden")
	pool.Checked("127.0.0.1:8100", "match", true, 64, 64)
	pool.Waited("decode", 0, "admitted", time.Millisecond)
	pool.LoRAPick("decode", picker.LoRALoaded)
	pool.Session(picker.RoleDecode, picker.SessionKept)
	m.ScrapeFailed("127.0.0.1:8200")
	return m
}

// fqName reads a descriptor's metric name: prometheus.Desc has no getter,
// its String is Desc{fqName: "name", ...}.
var fqName = regexp.MustCompile(`^Desc\{fqName: "([a-zA-Z_:][a-zA-Z0-9_:]*)"`)

// described returns the names of the pdx_ metrics m registers, from the
// registry's descriptors: every metric, whether or not it has a sample.
func described(t *testing.T, m *metrics.Metrics) []string {
	t.Helper()
	ch := make(chan *prometheus.Desc)
	go func() {
		m.Registry().Describe(ch)
		close(ch)
	}()
	var names []string
	for d := range ch {
		sub := fqName.FindStringSubmatch(d.String())
		require.NotNil(t, sub, "cannot read the name of %s", d)
		if strings.HasPrefix(sub[1], "pdx_") && !slices.Contains(names, sub[1]) {
			names = append(names, sub[1])
		}
	}
	slices.Sort(names)
	return names
}

// registered gathers the families pdx's metrics export once every one has
// a sample, with their types.
func registered(t *testing.T) map[string]dto.MetricType {
	t.Helper()
	m := pdxMetrics(t)
	families, err := m.Registry().Gather()
	require.NoError(t, err)
	out := map[string]dto.MetricType{}
	for _, f := range families {
		out[f.GetName()] = f.GetType()
	}
	// Every pdx family has a sample: one without would go unchecked.
	for _, name := range described(t, m) {
		require.Contains(t, out, name, "pdxMetrics gives %s no sample", name)
	}
	return out
}

// unknownMetric checks a name a query selects against the families:
// histograms only as _bucket, _sum or _count series, summaries as
// themselves (quantiles), _sum or _count, others as themselves.
func unknownMetric(name string, families map[string]dto.MetricType) error {
	if typ, ok := families[name]; ok {
		if typ == dto.MetricType_HISTOGRAM {
			return fmt.Errorf("%s is a histogram: select its _bucket, _sum or _count", name)
		}
		return nil
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		base, ok := strings.CutSuffix(name, suffix)
		if !ok {
			continue
		}
		switch typ, known := families[base]; {
		case known && typ == dto.MetricType_HISTOGRAM:
			return nil
		case known && typ == dto.MetricType_SUMMARY && suffix != "_bucket":
			return nil
		case known:
			return fmt.Errorf("%s: %s is a %s, which has no %s series", name, base, typ, suffix)
		}
	}
	return fmt.Errorf("%s is not a metric pdx exports", name)
}

// labelValues reads a template variable's label_values(metric, label).
var labelValues = regexp.MustCompile(`^label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*[a-zA-Z_][a-zA-Z0-9_]*\s*\)$`)

// queries returns every query of d: its panels' targets and its query
// variables' metrics, each with where it is.
func queries(t *testing.T, d dashboard) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			names, err := metricNames(tg.Expr)
			require.NoError(t, err, "panel %q", p.Title)
			require.NotEmpty(t, names, "panel %q: %s selects no metric", p.Title, tg.Expr)
			out["panel "+p.Title] = append(out["panel "+p.Title], names...)
		}
	}
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		var q struct {
			Query string `json:"query"`
		}
		require.NoError(t, json.Unmarshal(v.Query, &q), "variable %s", v.Name)
		m := labelValues.FindStringSubmatch(q.Query)
		require.NotNil(t, m, "variable %s: %q is not label_values(metric, label)", v.Name, q.Query)
		out["variable "+v.Name] = append(out["variable "+v.Name], m[1])
	}
	return out
}

// TestDashboardUsesPdxMetrics: every metric the dashboard's panels and
// variables query is one pdx registers, with the series its type has.
func TestDashboardUsesPdxMetrics(t *testing.T) {
	raw, err := os.ReadFile(dashboardFile)
	require.NoError(t, err)
	var d dashboard
	require.NoError(t, json.Unmarshal(raw, &d))
	families := registered(t)

	// The datasource is the dashboard's variable, so the JSON imports into
	// any Grafana.
	var vars []string
	for _, v := range d.Templating.List {
		vars = append(vars, v.Type+":"+v.Name)
	}
	require.Contains(t, vars, "datasource:datasource")
	for _, p := range d.Panels {
		if p.Type == "row" {
			continue
		}
		require.NotNil(t, p.Datasource, "panel %q", p.Title)
		require.Equal(t, "${datasource}", p.Datasource.UID, "panel %q", p.Title)
	}
	for where, names := range queries(t, d) {
		for _, name := range names {
			require.NoError(t, unknownMetric(name, families), where)
		}
	}
}

// observabilityDoc is the metric reference.
const observabilityDoc = "../docs/observability.md"

// metricRow matches a row of the metric reference's table: its first cell
// is the metric's name.
var metricRow = regexp.MustCompile("(?m)^\\| `(pdx_[a-z0-9_]+)` \\|")

// TestEveryMetricShownAndDocumented: every metric pdx registers (read from
// its registry's descriptors, so whether or not it has a sample) is queried
// by a panel of the dashboard and has a row of its own in
// docs/observability.md's metric table; the table has no row for a metric
// pdx does not register.
func TestEveryMetricShownAndDocumented(t *testing.T) {
	names := described(t, pdxMetrics(t))
	require.Contains(t, names, "pdx_requests_total")
	require.Contains(t, names, "pdx_kv_cache_blocks", "the collectors' metrics are read too")

	raw, err := os.ReadFile(dashboardFile)
	require.NoError(t, err)
	var d dashboard
	require.NoError(t, json.Unmarshal(raw, &d))
	shown := map[string]bool{}
	for where, selected := range queries(t, d) {
		if !strings.HasPrefix(where, "panel ") {
			continue // a variable shows nothing
		}
		for _, name := range selected {
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				if base, ok := strings.CutSuffix(name, suffix); ok && slices.Contains(names, base) {
					name = base
				}
			}
			shown[name] = true
		}
	}
	doc, err := os.ReadFile(observabilityDoc)
	require.NoError(t, err)
	rows := map[string]bool{}
	for _, m := range metricRow.FindAllStringSubmatch(string(doc), -1) {
		require.False(t, rows[m[1]], "%s has two rows for %s", observabilityDoc, m[1])
		rows[m[1]] = true
	}

	var problems []string
	for _, name := range names {
		if !shown[name] {
			problems = append(problems, fmt.Sprintf("%s: no panel of %s queries it", name, dashboardFile))
		}
		if !rows[name] {
			problems = append(problems, fmt.Sprintf("%s: no row in the metric table of %s", name, observabilityDoc))
		}
		delete(rows, name)
	}
	for _, name := range slices.Sorted(maps.Keys(rows)) {
		problems = append(problems, fmt.Sprintf("%s: a row of %s's metric table, but pdx registers no such metric", name, observabilityDoc))
	}
	require.Empty(t, problems, "the metrics pdx registers, its dashboard and its metric reference differ:\n%s", strings.Join(problems, "\n"))
}

// TestDashboardCheck is the check's own table: what it reads from PromQL,
// and what it refuses.
func TestDashboardCheck(t *testing.T) {
	families := registered(t)
	for _, tc := range []struct {
		expr    string
		want    []string
		wantErr string // of the first name unknownMetric refuses
	}{
		{`sum by (pool) (rate(pdx_tokens_total{kind="cached", pool=~"$pool"}[$__rate_interval]))`, []string{"pdx_tokens_total"}, ""},
		{`histogram_quantile(0.99, sum by (le) (rate(pdx_ttft_seconds_bucket{pool=~"${pool}"}[5m])))`, []string{"pdx_ttft_seconds_bucket"}, ""},
		{`sum(rate(pdx_request_duration_seconds_sum[1m])) / on(pool) group_left(connector) sum(rate(pdx_request_duration_seconds_count[1m]))`,
			[]string{"pdx_request_duration_seconds_sum", "pdx_request_duration_seconds_count"}, ""},
		{`pdx_streams_in_flight offset 5m > bool 3`, []string{"pdx_streams_in_flight"}, ""},
		{`sum without (endpoint) (pdx_endpoint_in_flight{endpoint!="pdx_fake_total"})`, []string{"pdx_endpoint_in_flight"}, ""},
		{`max(go_goroutines) + 1e3`, []string{"go_goroutines"}, ""},
		{`rate(pdx_nope_total[5m])`, []string{"pdx_nope_total"}, "pdx_nope_total is not a metric pdx exports"},
		{`rate(pdx_requests_total_bucket[5m])`, []string{"pdx_requests_total_bucket"}, "pdx_requests_total is a COUNTER"},
		{`pdx_handoff_duration_seconds`, []string{"pdx_handoff_duration_seconds"}, "is a histogram"},
		{`sum(rate(pdx_tokens{kind="prompt"}[5m]))`, []string{"pdx_tokens"}, "pdx_tokens is not a metric"},
	} {
		t.Run(tc.expr, func(t *testing.T) {
			names, err := metricNames(tc.expr)
			require.NoError(t, err)
			require.Equal(t, tc.want, names)
			var errs []string
			for _, n := range names {
				if err := unknownMetric(n, families); err != nil {
					errs = append(errs, err.Error())
				}
			}
			if tc.wantErr == "" {
				require.Empty(t, errs)
				return
			}
			require.True(t, slices.ContainsFunc(errs, func(e string) bool { return strings.Contains(e, tc.wantErr) }), "errors %v", errs)
		})
	}
	_, err := metricNames(`rate(pdx_requests_total{pool="x}[5m])`)
	require.Error(t, err, "an unterminated string")
}
