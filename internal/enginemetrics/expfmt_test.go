package enginemetrics

import (
	"errors"
	"fmt"
	"io"
	"math"
	"regexp"
	"strconv"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/require"
)

// FuzzParseAgreesWithExpfmt checks Parse against referenceParse: whatever
// expfmt parses, Parse reads the same Sample from; what expfmt rejects,
// Parse may read only if the line expfmt stopped at is of a family Parse
// does not read. Texts where expfmt reads a line by the family of the line
// before (leaked) are left out.
func FuzzParseAgreesWithExpfmt(f *testing.F) {
	for _, name := range []string{"vllm.txt", "sglang.txt", "trtllm.txt"} {
		f.Add(readTestdata(f, name))
	}
	f.Add(filteredVLLM(f))
	for _, text := range fuzzSeeds {
		f.Add(text)
	}
	f.Fuzz(func(t *testing.T, text string) {
		want, wantErr := safeReferenceParse(text)
		if errors.Is(wantErr, errPanicked) || leaked.MatchString(text) {
			return // expfmt's bugs, no verdict
		}
		// A parser kept from a scrape before reads it as a new one does.
		p := newParser()
		_, err := p.parse(strings.NewReader(loraSeed))
		require.NoError(t, err)
		got, err := p.parse(strings.NewReader(text))
		var perr expfmt.ParseError
		if !errors.As(wantErr, &perr) {
			if wantErr != nil {
				require.ErrorIs(t, err, wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, want, got)
			return
		}
		if err != nil && !errors.Is(err, ErrNoLoad) {
			return
		}
		line := ""
		if lines := strings.Split(text, "\n"); perr.Line <= len(lines) {
			line = lines[perr.Line-1]
		}
		require.False(t, readsLine(text, line), "expfmt: %v; Parse accepted line %d: %q", wantErr, perr.Line, line)
	})
}

// fuzzSeeds are edge cases of the format beyond the testdata expositions.
var fuzzSeeds = []string{
	"# TYPE foo histogram\nfoo_bucket{le=\"1\"} 1\n{le=\"1\",le=\"2\",\"vllm:num_requests_running\"} 3\n",
	"# TYPE vllm:kv_cache_usage_perc histogram\n# TYPE foo histogram\nfoo_bucket{le=\"1\"} 1\nvllm:num_requests_running 1\n{\"vllm:kv_cache_usage_perc_bucket\"} -1\n",
	"# TYPE vllm:num_requests_running summary\nfoo 1\n{\"vllm:num_requests_running\", a=\"b\"} 1\n",
	"vllm:num_requests_running 3\n",
	"vllm:num_requests_running{a=\"b\\\"c\\\\d\\ne\"} 3 1700000000000\n",
	"vllm:num_requests_running+5\nvllm:num_requests_waiting\t-1e1\t-5\n",
	"\"vllm:num_requests_running\" 5\n{\"vllm:num_requests_waiting\", \"a.b\"=\"x\"} 2\n",
	"{a=\"b\",\"vllm:kv_cache_usage_perc\"} 0.5\n{trtllm_num_requests_running} 3\n",
	"vllm:num_requests_running 3\r\n",
	"vllm:num_requests_running 3",
	"vllm:num_requests_running NaN\nvllm:num_requests_waiting +Inf\nvllm:kv_cache_usage_perc -Inf\n",
	"vllm:num_requests_running 0x1p3\nvllm:num_requests_waiting 1_0\n",
	"# HELP vllm:num_requests_running a \\\\ b \\n c\n# HELP vllm:num_requests_running again\nvllm:num_requests_running 1\n",
	"# TYPE vllm:num_requests_running gauge\n# TYPE vllm:num_requests_running counter\nvllm:num_requests_running 1\n",
	"vllm:num_requests_running 1\n# TYPE vllm:num_requests_running gauge\n",
	"# TYPE vllm:num_requests_running summary\nvllm:num_requests_running{quantile=\"0.5\"} 1\nvllm:num_requests_running_count 3\nvllm:num_requests_running_sum 4\nvllm:num_requests_waiting 1\n",
	"# TYPE vllm:kv_cache_usage_perc histogram\nvllm:kv_cache_usage_perc_bucket{le=\"+Inf\"} 1\nvllm:kv_cache_usage_perc_count -1\nvllm:kv_cache_usage_perc_sum 4\nvllm:num_requests_waiting 1\n",
	"vllm:num_requests_running_count 1\n# TYPE vllm:num_requests_running summary\nvllm:num_requests_running_count 2\n",
	"# TYPE vllm:num_requests_running GaUgE\nvllm:num_requests_running 1\n# TYPE sglang:token_usage gauge_histogram\nsglang:token_usage_bucket{le=\"1\"} 3\n",
	"vllm:num_requests_running{a=\"1\",a=\"2\"} 1\n",
	"vllm:num_requests_running{__name__=\"x\"} 1\n",
	"vllm:num_requests_running{a=\"b\",} 1\nvllm:num_requests_waiting {} 2\n",
	"vllm:num_requests_running{a=\"\xff\"} 1\n",
	"vllm:num_requests_running 1 2 3\n",
	"vllm:num_requests_running 1 \n",
	"process_open_fds{x=y} z\nvllm:num_requests_running 1\n",
	"# TYPE vllm:num_requests_running gauge\nprocess_open_fds 1\n",
	"# TYPE vllm:num_requests_running histogram\n# HELP vllm:num_requests_running_bucket h\n# HELP vllm:num_requests_running x\nvllm:num_requests_waiting 1\n",
	"# TYPE \"vllm:num_requests_running\" gauge\n{\"vllm:num_requests_running\"} 1\n# TYPE \"vllm:num_requests_waiting\"x gauge\n",
	"# HELP vllm:num_requests_running\n# HELP vllm:num_requests_running \t\n#\tHELP\tvllm:num_requests_running\ta\n vllm:num_requests_running 1\n",
	"vllm:num_requests_running 1\nvllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"100\"} 1\nvllm:cache_config_info{engine=\"1\",num_gpu_blocks=\"90\",block_size=\"16\"} 1\n" +
		"vllm:cache_config_info{num_gpu_blocks=\"None\",block_size=\"16\",engine=\"2\"} 1\nvllm:cache_config_info{num_gpu_blocks=\"5\",block_size=\"1\",engine=\"3\"} NaN\n",
	"vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"100\"} 1\n",
	"sglang:num_running_reqs 1\nsglang:max_total_num_tokens{tp_rank=\"0\"} 1000\nsglang:max_total_num_tokens{tp_rank=\"1\"} 900.5\nsglang:max_total_num_tokens{tp_rank=\"2\"} NaN\n",
	"sglang:max_total_num_tokens 5\n",
	loraSeed,
}

// loraSeed sets every kind of state parse keeps of a text.
const loraSeed = "# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n" +
	"vllm:num_requests_running 1\n" +
	`vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",waiting_lora_adapters="code"} 1.7e+09` + "\n" +
	`vllm:lora_requests_info{"max_lora"="2",running_lora_adapters=" a\\b ",waiting_lora_adapters=""} 1.8e+09` + "\n" +
	`vllm:lora_requests_info{max_lora="2",running_lora_adapters="nan"} NaN` + "\n" +
	"# TYPE vllm:kv_cache_usage_perc histogram\nvllm:kv_cache_usage_perc_count 1\nvllm:num_requests_waiting_count 1\n"

// readsLine tells, apart from the parser and loosely, whether a line of
// text is of a family Parse reads: a HELP or TYPE line or a sample of one
// of known, or of one with a summary's or histogram's suffix when text
// types it so.
func readsLine(text, line string) bool {
	s := strings.TrimLeft(line, " \t")
	if rest, ok := strings.CutPrefix(s, "#"); ok {
		f := strings.Fields(rest)
		if len(f) < 2 || f[0] != "HELP" && f[0] != "TYPE" {
			return false
		}
		_, s, _ = strings.Cut(rest, f[0])
		s = strings.TrimLeft(s, " \t")
	}
	name := nameIn(s)
	for _, k := range known {
		if name == k {
			return true
		}
		for _, sn := range suffixNames[1:] {
			if name == k+sn {
				typed := regexp.MustCompile(`(?i)TYPE[ \t]+"?` + regexp.QuoteMeta(k) + `"?[ \t]+(summary|histogram|gauge_?histogram)`)
				return typed.MatchString(text)
			}
		}
	}
	return false
}

var (
	nameRE   = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)?("(\\.|[^"\\])*")?`)
	valueRE  = regexp.MustCompile(`^[ \t]*=[ \t]*"(\\.|[^"\\])*"[ \t]*`)
	blanksRE = regexp.MustCompile(`^[ \t]*`)
)

// nameIn returns the metric name at the start of s, or inside the label set
// that s starts with.
func nameIn(s string) string {
	if !strings.HasPrefix(s, "{") {
		return unquoteName(nameRE.FindString(s))
	}
	for s = s[1:]; ; {
		s = s[len(blanksRE.FindString(s)):]
		n := nameRE.FindString(s)
		if n == "" {
			return ""
		}
		s = s[len(n):]
		v := valueRE.FindString(s)
		if v == "" {
			return unquoteName(n)
		}
		s = strings.TrimPrefix(s[len(v):], ",")
	}
}

func unquoteName(n string) string {
	prefix, quoted, ok := strings.Cut(n, `"`)
	if !ok {
		return prefix
	}
	u, err := strconv.Unquote(`"` + quoted)
	if err != nil {
		return ""
	}
	return prefix + u
}

// leaked matches a text in which expfmt may read a line by the family of
// the line before, as it sets that family only once it has the line's
// name: a label set opening a line, with an le or quantile label (a
// histogram's bucket, a summary's quantile) which may be before the name,
// or with a negative value, which expfmt may take for a bucket's count by
// the le of a line before.
var leaked = regexp.MustCompile(`(?m)^[ \t]*\{(.*[{, \t"](le|quantile)"?[ \t]*=|.*\}[ \t]*-)`)

// errPanicked is expfmt panicking: it writes to a nil map on a summary
// line whose name is inside its label set after a line of another type.
var errPanicked = errors.New("expfmt panicked")

func safeReferenceParse(text string) (s Sample, err error) {
	defer func() {
		if recover() != nil {
			err = errPanicked
		}
	}()
	return referenceParse(strings.NewReader(text))
}

// referenceParse is Parse as it was before its own scanner, on expfmt's
// parser: the reference the scanner is checked against.
func referenceParse(r io.Reader) (Sample, error) {
	text := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := text.TextToMetricFamilies(r)
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
			v, ok := referenceValue(m)
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
		s.LoRA = referenceLoRA(mf)
	}
	if mf, ok := mfs[cacheFamily]; ok {
		s.KVTokens, s.KVBlockSize = referenceKVTokens(mf)
	}
	if mf, ok := mfs[kvSizeFamily]; ok {
		for _, m := range mf.GetMetric() {
			if v, ok := referenceValue(m); ok && v >= 1 && v < 1<<53 && (s.KVTokens == 0 || int(v) < s.KVTokens) {
				s.KVTokens = int(v)
			}
		}
	}
	return s, nil
}

// referenceKVTokens is the least num_gpu_blocks × block_size of the
// family's series, and their least block_size.
func referenceKVTokens(mf *dto.MetricFamily) (int, int) {
	least, leastSize := 0, 0
	for _, m := range mf.GetMetric() {
		if _, ok := referenceValue(m); !ok {
			continue
		}
		blocks, size := -1, -1
		for _, lp := range m.GetLabel() {
			n, err := strconv.Atoi(lp.GetValue())
			if err != nil {
				continue
			}
			switch lp.GetName() {
			case "num_gpu_blocks":
				blocks = n
			case "block_size":
				size = n
			}
		}
		if blocks > 0 && size > 0 && blocks*size/size == blocks && (least == 0 || blocks*size < least) {
			least = blocks * size
		}
		if size > 0 && (leastSize == 0 || size < leastSize) {
			leastSize = size
		}
	}
	return least, leastSize
}

func referenceLoRA(mf *dto.MetricFamily) LoRA {
	var best *dto.Metric
	at := math.Inf(-1)
	for _, m := range mf.GetMetric() {
		if v, ok := referenceValue(m); ok && v > at {
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

func referenceValue(m *dto.Metric) (float64, bool) {
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

// TestParseDiffersFromExpfmt pins where Parse reads a line of a family it
// reads otherwise than expfmt, which sets the family whose rules apply to
// a line only once it has read the name: in a label set that opens the
// line, after the labels before the name. Parse applies the line's own.
func TestParseDiffersFromExpfmt(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, text string
		want       Sample
		wantErr    string // "" for no error
		expfmtErr  string // "" for no error, "panic"
	}{
		{
			name:      "le before the name is no bucket of a histogram the line before",
			text:      "# TYPE foo histogram\nfoo_bucket{le=\"1\"} 1\n{le=\"1\",le=\"2\",\"vllm:num_requests_running\"} 3\n",
			wantErr:   "line 3: duplicate label name",
			expfmtErr: "",
		},
		{
			name: "no le is no bucket, whatever le a line before had",
			text: "# TYPE vllm:kv_cache_usage_perc histogram\n# TYPE foo histogram\nfoo_bucket{le=\"1\"} 1\n" +
				"vllm:num_requests_running 1\n{\"vllm:kv_cache_usage_perc_bucket\"} -1\n",
			want:      Sample{Running: 1, KVUsage: -1},
			expfmtErr: "negative bucket population",
		},
		{
			name:      "a summary's line after a line of another family",
			text:      "# TYPE vllm:num_requests_running summary\nfoo 1\n{\"vllm:num_requests_running\", a=\"b\"} 1\n",
			want:      Sample{KVUsage: -1},
			expfmtErr: "panic",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := safeReferenceParse(tt.text)
			switch tt.expfmtErr {
			case "":
				require.NoError(t, err)
			case "panic":
				require.ErrorIs(t, err, errPanicked)
			default:
				require.ErrorContains(t, err, tt.expfmtErr)
			}
			got, err := Parse(strings.NewReader(tt.text))
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tt.want, got)
		})
	}
}
