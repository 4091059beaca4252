package enginemetrics

import (
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func readTestdata(t testing.TB, name string) string {
	t.Helper()
	b, err := os.ReadFile("testdata/" + name)
	require.NoError(t, err)
	return string(b)
}

func TestParse(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		text string
		want Sample
	}{
		{
			name: "vLLM exposition with histograms and process metrics",
			text: readTestdata(t, "vllm.txt"),
			want: Sample{Waiting: 7, Running: 12, KVUsage: 0.6312, KVTokens: 29127 * 16, KVBlockSize: 16},
		},
		{
			name: "SGLang exposition",
			text: readTestdata(t, "sglang.txt"),
			want: Sample{Waiting: 4, Running: 31, KVUsage: 0.87, KVTokens: 462199},
		},
		{
			name: "SGLang's KV pools: the least of its ranks'",
			text: `sglang:num_running_reqs{dp_rank="0"} 1
sglang:max_total_num_tokens{dp_rank="0"} 1000
sglang:max_total_num_tokens{dp_rank="1"} 900.5
sglang:max_total_num_tokens{dp_rank="2"} 0
sglang:max_total_num_tokens{dp_rank="3"} NaN
`,
			want: Sample{Running: 1, KVUsage: -1, KVTokens: 900},
		},
		{
			name: "TensorRT-LLM serve exposition",
			text: readTestdata(t, "trtllm.txt"),
			want: Sample{Waiting: 9, Running: 64, KVUsage: 0.4421},
		},
		{
			name: "vLLM before v0.10 names KV usage gpu_cache_usage_perc",
			text: `# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
vllm:num_requests_waiting{model_name="m"} 1
`,
			want: Sample{Waiting: 1, Running: 0, KVUsage: 0.25},
		},
		{
			name: "data-parallel engines: counts summed, KV usage the fullest",
			text: `# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3
vllm:num_requests_running{engine="1",model_name="m"} 5
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2
vllm:num_requests_waiting{engine="1",model_name="m"} 0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.3
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.9
`,
			want: Sample{Waiting: 2, Running: 8, KVUsage: 0.9},
		},
		{
			name: "no KV family: KVUsage is -1",
			text: "sglang:num_queue_reqs 2\nsglang:num_running_reqs 6\n",
			want: Sample{Waiting: 2, Running: 6, KVUsage: -1},
		},
		{
			name: "NaN is ignored, out-of-range KV clamped",
			text: "vllm:num_requests_waiting NaN\nvllm:num_requests_running 4\nvllm:kv_cache_usage_perc 1.2\n",
			want: Sample{Waiting: 0, Running: 4, KVUsage: 1},
		},
		{
			name: "UTF-8 metric names elsewhere do not fail the scrape",
			text: "{\"some.dotted.metric\"} 1\nvllm:num_requests_running 2\n",
			want: Sample{Running: 2, KVUsage: -1},
		},
		{
			name: "names quoted, or inside the label set, with quoted label names",
			text: "\"vllm:num_requests_running\"{\"model.name\"=\"m\"} 2\n" +
				"{\"vllm:num_requests_waiting\", model_name=\"m\"} 3\n" +
				"{model_name=\"m\", \"vllm:kv_cache_usage_perc\"} 0.5\n" +
				"{trtllm_num_requests_running} 4\n",
			want: Sample{Waiting: 3, Running: 6, KVUsage: 0.5},
		},
		{
			name: "escapes in label values, timestamps, blanks and tabs",
			text: "  vllm:num_requests_running {a=\"x\\\"}\\\\\\n\" , b = \"\"} 2 1700000000000\n" +
				"vllm:num_requests_waiting\t+3\t-5\n\n   \n",
			want: Sample{Waiting: 3, Running: 2, KVUsage: -1},
		},
		{
			name: "a family declared but without series is absent",
			text: "# HELP vllm:kv_cache_usage_perc KV-cache usage.\n# TYPE vllm:kv_cache_usage_perc gauge\n" +
				"vllm:num_requests_running 2\n",
			want: Sample{Running: 2, KVUsage: -1},
		},
		{
			name: "counters count; a family typed summary or histogram says nothing",
			text: "# TYPE vllm:num_requests_running counter\nvllm:num_requests_running 2\n" +
				"# TYPE vllm:num_requests_waiting summary\nvllm:num_requests_waiting{quantile=\"0.5\"} 9\nvllm:num_requests_waiting_count 9\n" +
				"# TYPE vllm:kv_cache_usage_perc histogram\nvllm:kv_cache_usage_perc_bucket{le=\"1\"} 9\n",
			want: Sample{Running: 2, KVUsage: -1},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := Parse(strings.NewReader(tt.text))
			require.NoError(t, err)
			require.Equal(t, tt.want.Waiting, got.Waiting)
			require.Equal(t, tt.want.Running, got.Running)
			require.InDelta(t, tt.want.KVUsage, got.KVUsage, 1e-9)
		})
	}
}

func TestParseFails(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		text    string
		noLoad  bool // ErrNoLoad rather than a parse error
		errText string
	}{
		{name: "empty", text: "", noLoad: true},
		{
			name:   "only unrelated families",
			text:   "# TYPE process_open_fds gauge\nprocess_open_fds 87\n",
			noLoad: true,
		},
		{
			name:   "known family declared but without series",
			text:   "# HELP vllm:num_requests_waiting Waiting.\n# TYPE vllm:num_requests_waiting gauge\n",
			noLoad: true,
		},
		{name: "value is not a number", text: "vllm:num_requests_waiting seven\n", errText: "float"},
		{name: "unterminated label set", text: "vllm:num_requests_waiting{model_name=\"m\" 3\n"},
		{name: "HTML error page", text: "<html><body>502 Bad Gateway</body></html>\n"},
		{name: "JSON (trtllm-serve's /metrics)", text: `[{"numActiveRequests": 3, "numQueuedRequests": 1}]`},
		{
			name: "malformed line after a good known family",
			text: readTestdata(t, "vllm.txt") + "vllm:num_requests_running{engine=\"0\"} 1 2 3 4\n",
		},
		{name: "conflicting TYPE", text: "# TYPE vllm:num_requests_running gauge\n# TYPE vllm:num_requests_running counter\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := Parse(strings.NewReader(tt.text))
			require.Error(t, err)
			if tt.noLoad {
				require.ErrorIs(t, err, ErrNoLoad)
			} else {
				require.NotErrorIs(t, err, ErrNoLoad)
			}
			if tt.errText != "" {
				require.ErrorContains(t, err, tt.errText)
			}
		})
	}
}

func TestParserKeptFromScrapeToScrape(t *testing.T) {
	t.Parallel()
	p := newParser()
	texts := []struct {
		text string
		want Sample
	}{
		{loraSeed, Sample{Running: 1, KVUsage: -1, LoRA: LoRA{Running: []string{`a\b`}, MaxLoRA: 2}}},
		// The same HELP and TYPE lines again, and no LoRA gauge.
		{loraSeed[:strings.Index(loraSeed, "vllm:lora")], Sample{Running: 1, KVUsage: -1}},
		{strings.Repeat("# "+strings.Repeat("x", 1000)+"\n", 2000) + "sglang:num_queue_reqs 3\n", Sample{Waiting: 3, KVUsage: -1}},
		{readTestdata(t, "vllm.txt"), Sample{Waiting: 7, Running: 12, KVUsage: 0.6312, KVTokens: 29127 * 16, KVBlockSize: 16}},
	}
	for _, tt := range texts {
		got, err := p.parse(strings.NewReader(tt.text))
		require.NoError(t, err)
		require.Equal(t, tt.want, got)
	}
	require.LessOrEqual(t, p.body.Cap(), keepBytes, "a 2 MB body is not kept")
}

// TestParseMalformed lists malformed lines of the families Parse reads:
// each must fail the parse, as it fails expfmt's, naming its line.
func TestParseMalformed(t *testing.T) {
	t.Parallel()
	const before = "# HELP process_open_fds Open fds.\nprocess_open_fds 87\n" // the line tested is line 3
	tests := []struct {
		name, line, errText string
	}{
		{"label set not terminated", `vllm:num_requests_running{model_name="m" 3`, "expected ',' or '}'"},
		{"label set cut short", `vllm:num_requests_running{model_name="m"`, "label set not terminated"},
		{"label value not terminated", `vllm:num_requests_running{a="b} 3`, "label value not terminated"},
		{"label value not quoted", `vllm:num_requests_running{a=b} 3`, "not quoted"},
		{"unknown escape in a label value", `vllm:num_requests_running{a="\x"} 3`, "escape"},
		{"label without a value", `vllm:num_requests_running{a} 3`, "expected '='"},
		{"empty label name", `vllm:num_requests_running{""="x"} 3`, "invalid label name"},
		{"label name not UTF-8", "vllm:num_requests_running{\"\xff\"=\"x\"} 3", "UTF-8"},
		{"label value not UTF-8", "vllm:num_requests_running{a=\"\xff\"} 3", "UTF-8"},
		{"duplicate label", `vllm:num_requests_running{a="1",a="2"} 3`, "duplicate"},
		{"__name__ label", `vllm:num_requests_running{__name__="x"} 3`, "reserved"},
		{"two names in the label set", `{"vllm:num_requests_running","x"} 3`, "second metric name"},
		{"label set without a name", `{model_name="vllm:num_requests_running"} 3`, "no metric name"},
		{"quoted name not terminated", `"vllm:num_requests_running 3`, "not terminated"},
		{"no value", "vllm:num_requests_running", "not a float"},
		{"value not a number", "vllm:num_requests_running seven", "not a float"},
		{"hex value", "vllm:num_requests_running 0x1p3", "not a float"},
		{"value with underscores", "vllm:num_requests_running 1_000", "not a float"},
		{"value out of range", "vllm:num_requests_running 1e999", "not a float"},
		{"value and junk", `vllm:num_requests_running{a="b"} 3}`, "not a float"},
		{"carriage return", "vllm:num_requests_running 3\r", "not a float"},
		{"blank after the value", "vllm:num_requests_running 3 ", "timestamp"},
		{"timestamp not an integer", "vllm:num_requests_running 3 1.5", "timestamp"},
		{"text after the timestamp", "vllm:num_requests_running 3 1 2", "after timestamp"},
		{"unknown type", "# TYPE vllm:num_requests_running bogus", "unknown metric type"},
		{"TYPE after samples", "vllm:num_requests_running 3\n# TYPE vllm:num_requests_running gauge", "TYPE"},
		{"second HELP", "# HELP vllm:num_requests_running a\n# HELP vllm:num_requests_running b", "second HELP"},
		{"unknown escape in HELP", `# HELP vllm:num_requests_running a \x b`, "escape"},
		{"name in a comment ends badly", "# TYPE vllm:num_requests_running{} gauge", "invalid metric name"},
		{"negative histogram count", "# TYPE vllm:kv_cache_usage_perc histogram\nvllm:kv_cache_usage_perc_count -1", "negative"},
		{"negative bucket", "# TYPE vllm:kv_cache_usage_perc histogram\nvllm:kv_cache_usage_perc_bucket{le=\"1\"} -1", "negative"},
		{"le not a number", "# TYPE vllm:kv_cache_usage_perc histogram\nvllm:kv_cache_usage_perc_bucket{le=\"x\"} 1", "not a float"},
		{"quantile not a number", "# TYPE vllm:num_requests_running summary\nvllm:num_requests_running{quantile=\"x\"} 1", "not a float"},
		{"LoRA gauge label set not terminated", `vllm:lora_requests_info{max_lora="2" 1`, "expected ',' or '}'"},
		{"no newline at the end", "vllm:num_requests_running 3", "unexpected end of input"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			text := before + tt.line
			if tt.name != "no newline at the end" {
				text += "\n"
			}
			_, err := referenceParse(strings.NewReader(text))
			require.Error(t, err, "expfmt accepts it")
			require.NotErrorIs(t, err, ErrNoLoad, "expfmt accepts it")

			_, err = Parse(strings.NewReader(text))
			require.Error(t, err)
			require.NotErrorIs(t, err, ErrNoLoad)
			line := 3 + strings.Count(tt.line, "\n")
			require.ErrorContains(t, err, "enginemetrics: line "+strconv.Itoa(line)+": ")
			require.ErrorContains(t, err, tt.errText)
		})
	}
}

// TestParseSkipsOtherFamilies lists lines that expfmt rejects but Parse
// skips: they are of families it does not read.
func TestParseSkipsOtherFamilies(t *testing.T) {
	t.Parallel()
	tests := []struct{ name, line string }{
		{"malformed labels", `process_open_fds{fd=3 87`},
		{"value not a number", "process_open_fds many"},
		{"unknown type", "# TYPE process_open_fds bogus"},
		{"unknown escape in HELP", `# HELP process_open_fds \x`},
		{"second TYPE", "# TYPE process_open_fds gauge\n# TYPE process_open_fds counter"},
		{"suffixed name of an untyped family is a family of its own", "vllm:num_requests_running_count"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			text := "vllm:num_requests_running 2\n" + tt.line + "\n"
			_, err := referenceParse(strings.NewReader(text))
			require.Error(t, err, "expfmt accepts it")
			got, err := Parse(strings.NewReader(text))
			require.NoError(t, err)
			require.Equal(t, Sample{Running: 2, KVUsage: -1}, got)
		})
	}
}

func TestParseLoRA(t *testing.T) {
	t.Parallel()
	const load = "vllm:num_requests_running 1\n"
	tests := []struct {
		name string
		text string
		want LoRA
	}{
		{name: "no gauge: LoRA not enabled", text: load, want: LoRA{}},
		{
			name: "vLLM's shape: names comma-joined, value the time set",
			text: load + "# TYPE vllm:lora_requests_info gauge\n" +
				`vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",waiting_lora_adapters="code"} 1.7e+09` + "\n",
			want: LoRA{Running: []string{"sql", "chat"}, Waiting: []string{"code"}, MaxLoRA: 4},
		},
		{
			name: "every label set stays a series: the latest one counts",
			text: load +
				`vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 1.70000001e+09` + "\n" +
				`vllm:lora_requests_info{max_lora="2",running_lora_adapters="new",waiting_lora_adapters="w"} 1.70000002e+09` + "\n" +
				`vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.70000000e+09` + "\n",
			want: LoRA{Running: []string{"new"}, Waiting: []string{"w"}, MaxLoRA: 2},
		},
		{
			name: "an idle engine: nothing running or waiting",
			text: load + `vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7e+09` + "\n",
			want: LoRA{MaxLoRA: 2},
		},
		{
			name: "spaces around names, empty entries",
			text: load + `vllm:lora_requests_info{max_lora="3",running_lora_adapters=" a, b ,,",waiting_lora_adapters=""} 1` + "\n",
			want: LoRA{Running: []string{"a", "b"}, MaxLoRA: 3},
		},
		{
			name: "max_lora 0 or not a number says nothing",
			text: load + `vllm:lora_requests_info{max_lora="x",running_lora_adapters="a",waiting_lora_adapters=""} 1` + "\n",
			want: LoRA{},
		},
		{
			name: "a NaN series is ignored",
			text: load +
				`vllm:lora_requests_info{max_lora="2",running_lora_adapters="nan",waiting_lora_adapters=""} NaN` + "\n" +
				`vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",waiting_lora_adapters=""} 5` + "\n",
			want: LoRA{Running: []string{"a"}, MaxLoRA: 2},
		},
		{
			name: "the testdata exposition of vLLM without LoRA (max_lora 0)",
			text: readTestdata(t, "vllm.txt"),
			want: LoRA{},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := Parse(strings.NewReader(tt.text))
			require.NoError(t, err)
			require.Equal(t, tt.want, got.LoRA)
		})
	}
}

func FuzzParseLoRA(f *testing.F) {
	f.Add("4", "sql,chat", "code", "1.7e+09")
	f.Add("", ",,", " ", "NaN")
	f.Add("-1", "a", "", "-5")
	f.Fuzz(func(t *testing.T, maxLoRA, running, waiting, value string) {
		text := "vllm:num_requests_running 1\nvllm:lora_requests_info{max_lora=" + strconv.Quote(maxLoRA) +
			",running_lora_adapters=" + strconv.Quote(running) + ",waiting_lora_adapters=" + strconv.Quote(waiting) + "} " + value + "\n"
		s, err := Parse(strings.NewReader(text))
		if err != nil {
			return // not an exposition: Parse says so, it does not panic
		}
		l := s.LoRA
		require.GreaterOrEqual(t, l.MaxLoRA, 0)
		if l.MaxLoRA == 0 {
			require.Equal(t, LoRA{}, l, "no max_lora, no adapters")
		}
		for _, a := range append(slices.Clone(l.Running), l.Waiting...) {
			require.NotEmpty(t, a)
			require.NotContains(t, a, ",")
			require.Equal(t, strings.TrimSpace(a), a)
		}
	})
}
