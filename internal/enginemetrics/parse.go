// Package enginemetrics reads the load an inference engine reports on its
// Prometheus endpoint (queue, running batch, KV cache usage) and keeps it
// fresh by scraping every engine off the request path.
package enginemetrics

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Sample is what one scrape tells of an engine's load.
type Sample struct {
	Waiting int     // requests queued in the engine
	Running int     // requests in its running batch
	KVUsage float64 // KV cache usage, 0–1; -1 when the engine does not say
	// KVTokens is how many tokens the KV cache holds (vLLM's
	// vllm:cache_config_info, num_gpu_blocks × block_size; SGLang's
	// sglang:max_total_num_tokens; the least of their series, one per
	// engine of a data-parallel server); 0 when the engine does not say.
	KVTokens int
	// KVBlockSize is how many tokens a block of that KV holds (vLLM's
	// vllm:cache_config_info block_size, the least of its series): the
	// unit in which the engine caches a prompt's prefix; 0 when the
	// engine does not say.
	KVBlockSize int
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

// cacheFamily is vLLM's cache configuration gauge (value 1): its labels
// are the CacheConfig's fields, num_gpu_blocks and block_size among them.
const cacheFamily = "vllm:cache_config_info"

// kvSizeFamily is SGLang's KV token pool size gauge (its
// metrics_collector, set once at start), a series per rank.
const kvSizeFamily = "sglang:max_total_num_tokens"

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

// known lists the families parse reads, the loads first, then
// kvSizeFamily, cacheFamily and loraFamily, which are not.
var (
	known       = append(slices.Sorted(maps.Keys(families)), kvSizeFamily, cacheFamily, loraFamily)
	kvSizeIndex = len(known) - 3
	cacheIndex  = len(known) - 2
	loraIndex   = len(known) - 1
)

// A suffix of a summary's or histogram's lines. expfmt files a line named
// after a family with one of these under that family once it is typed a
// summary (_count, _sum) or histogram (all three).
type suffix uint8

const (
	noSuffix suffix = iota
	countSuffix
	sumSuffix
	bucketSuffix
)

var suffixNames = [...]string{"", "_count", "_sum", "_bucket"}

// ref is a name a line of a known family may have.
type ref struct {
	fam    int // in known
	suffix suffix
}

var refs = func() map[string]ref {
	m := map[string]ref{}
	for fi, name := range known {
		for s, sn := range suffixNames {
			m[name+sn] = ref{fi, suffix(s)}
		}
	}
	return m
}()

// metricType is a family's TYPE; 0 until a TYPE line or a sample sets it.
type metricType uint8

const (
	untyped metricType = iota + 1
	counter
	gauge
	summary
	histogram // or gauge histogram: the same to parse
)

// types are the TYPE line's types expfmt knows, upper-cased.
var types = map[string]metricType{
	"UNTYPED":         untyped,
	"COUNTER":         counter,
	"GAUGE":           gauge,
	"SUMMARY":         summary,
	"HISTOGRAM":       histogram,
	"GAUGE_HISTOGRAM": histogram,
	"GAUGEHISTOGRAM":  histogram, // as OpenMetrics spells it
}

// parser scans the text exposition format (0.0.4, with the quoted UTF-8
// names of newer clients, also inside the label set) for the families
// Parse reads, without building the others: a line of any other family is
// skipped once its name is read, unchecked. A line of a family Parse reads
// is checked as prometheus/common's expfmt checks it, so that a malformed
// one fails the scrape rather than giving a wrong number; but in a label
// set that opens a line, le and quantile labels before the metric name
// follow the rules of the line's own family, where expfmt (which has not
// read the name yet) follows those of the line before, or panics. A
// scrape loop keeps one parser, and so its buffers.
type parser struct {
	body bytes.Buffer
	line int // the line being read, from 1

	sample Sample
	fams   []family // by index in known
	// lora holds the labels of the latest vllm:lora_requests_info series so
	// far, unescaped; loraLine those of the series being read, raw.
	lora, loraLine loraLabels
	loraAt         float64 // lora's value
	// blocks and blockSize are the vllm:cache_config_info series' being
	// read, raw.
	blocks, blockSize []byte
	bucket            bool // the histogram line being read has an le

	name       []byte // a quoted metric name, unquoted
	labelNames []byte // of the line being read, unquoted, one after another
	labelEnds  []int  // where each ends in labelNames
}

// family is what parse has seen of a family it reads.
type family struct {
	typ     metricType
	help    bool // a HELP line was read
	samples bool
	// own tells for a suffix whether a family of the suffixed name was
	// made before this one was typed a summary or histogram: expfmt then
	// files the lines of that name under it, not here.
	own [len(suffixNames)]bool
}

// loraLabels are the labels parse reads of a vllm:lora_requests_info series.
type loraLabels struct{ maxLoRA, running, waiting []byte }

// keepBytes bounds the body buffer a parser keeps between scrapes, so that
// a rare huge exposition does not stay allocated for every engine.
const keepBytes = 1 << 20

func newParser() *parser {
	return &parser{fams: make([]family, len(known))}
}

func (p *parser) parse(r io.Reader) (Sample, error) {
	p.body.Reset()
	defer func() {
		if p.body.Cap() > keepBytes {
			p.body = bytes.Buffer{}
		}
	}()
	if _, err := p.body.ReadFrom(r); err != nil {
		return Sample{}, fmt.Errorf("enginemetrics: %w", err)
	}
	return p.parseBytes(p.body.Bytes())
}

// parseBytes parses an exposition already in memory (direct's read buffer),
// without copying it.
func (p *parser) parseBytes(text []byte) (Sample, error) {
	p.line = 0
	p.sample = Sample{KVUsage: -1}
	clear(p.fams)
	p.lora = loraLabels{p.lora.maxLoRA[:0], p.lora.running[:0], p.lora.waiting[:0]}
	p.loraAt = math.Inf(-1)
	for rest := text; len(rest) > 0; {
		p.line++
		line := rest
		if i := bytes.IndexByte(rest, '\n'); i >= 0 {
			line, rest = rest[:i], rest[i+1:]
		} else if rest = nil; skipBlank(line, 0) < len(line) {
			return Sample{}, p.errorf("unexpected end of input")
		}
		if err := p.parseLine(line); err != nil {
			return Sample{}, err
		}
	}
	found := false
	for _, f := range p.fams[:kvSizeIndex] {
		found = found || f.samples
	}
	if !found {
		return Sample{}, ErrNoLoad
	}
	s := p.sample
	s.LoRA = p.lora.parse()
	return s, nil
}

// parseLine reads one line, without its newline.
func (p *parser) parseLine(line []byte) error {
	i := skipBlank(line, 0)
	switch {
	case i == len(line):
		return nil
	case line[i] == '#':
		return p.comment(line, i+1)
	case line[i] == '{':
		// The metric name is inside the label set.
		name, _, err := p.labels(line, i, true, -1)
		if err != nil {
			return err
		}
		return p.series(name, line, i, true)
	}
	e, quoted, err := p.nameEnd(line, i, metricChars)
	if err != nil {
		return err
	}
	if e == i {
		return p.errorf("no metric name")
	}
	name := line[i:e]
	if quoted {
		p.name = unquote(p.name[:0], name)
		name = p.name
	}
	return p.series(name, line, skipBlank(line, e), false)
}

// comment reads a comment line from after its '#'. A HELP or TYPE line of
// a family parse reads is checked; any other comment is skipped.
func (p *parser) comment(line []byte, i int) error {
	i = skipBlank(line, i)
	e := tokenEnd(line, i)
	help, typ := string(line[i:e]) == "HELP", string(line[i:e]) == "TYPE"
	if e == len(line) || !help && !typ {
		return nil
	}
	i = skipBlank(line, e)
	e, quoted, err := p.nameEnd(line, i, metricChars)
	if err != nil {
		return err
	}
	name := line[i:e]
	if quoted {
		p.name = unquote(p.name[:0], name)
		name = p.name
	}
	if e == len(line) {
		return nil // a name and nothing else is no error
	}
	if !isBlank(line[e]) {
		if _, ok := refs[string(name)]; ok {
			return p.errorf("invalid metric name %q in comment", line[i:])
		}
		return nil
	}
	fi, _, ok := p.resolve(name)
	if i = skipBlank(line, e); !ok || i == len(line) {
		return nil
	}
	f := &p.fams[fi]
	text := line[i:]
	if help {
		if f.help {
			return p.errorf("second HELP line for %q", known[fi])
		}
		f.help = true
		for j := bytes.IndexByte(text, '\\'); j >= 0; j = bytes.IndexByte(text, '\\') {
			if j+1 == len(text) || !isEscape(text[j+1]) {
				return p.errorf("invalid escape sequence in HELP text")
			}
			text = text[j+2:]
		}
		return nil
	}
	if f.typ != 0 {
		return p.errorf("second TYPE line for %q, or TYPE after its samples", known[fi])
	}
	if f.typ, ok = typeOf(text); !ok {
		return p.errorf("unknown metric type %q", text)
	}
	return nil
}

// series reads a sample line from after its metric name, at line[i]: its
// labels, if any, then value and timestamp. braced tells whether the name
// is inside the label set, which then opens the line.
func (p *parser) series(name, line []byte, i int, braced bool) error {
	fi, suffix, ok := p.resolve(name)
	if !ok {
		return nil
	}
	f := &p.fams[fi]
	if f.typ == 0 {
		f.typ = untyped
	}
	f.samples = true
	p.bucket, p.loraLine, p.blocks, p.blockSize = false, loraLabels{}, nil, nil
	if i < len(line) && line[i] == '{' {
		_, end, err := p.labels(line, i, braced, fi)
		if err != nil {
			return err
		}
		i = skipBlank(line, end)
	}
	e := tokenEnd(line, i)
	v, err := parseFloat(line[i:e])
	if err != nil {
		return p.errorf("value %q is not a float", line[i:e])
	}
	if e < len(line) {
		i = skipBlank(line, e)
		e = tokenEnd(line, i)
		if _, err := strconv.ParseInt(string(line[i:e]), 10, 64); err != nil {
			return p.errorf("timestamp %q is not an integer", line[i:e])
		}
		if e < len(line) {
			return p.errorf("text after timestamp: %q", line[e:])
		}
	}
	return p.add(fi, suffix, v)
}

// add counts the value of a series of known[fi], whatever TYPE the family
// declared but a summary or histogram (an engine that leaves TYPE out gets
// untyped); NaN and ±Inf say nothing.
func (p *parser) add(fi int, s suffix, v float64) error {
	switch p.fams[fi].typ {
	case summary:
		return nil
	case histogram:
		if v < 0 && (s == countSuffix || s != sumSuffix && p.bucket) {
			return p.errorf("negative count in histogram %q", known[fi])
		}
		return nil
	}
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return nil
	}
	if fi == kvSizeIndex {
		if v >= 1 && v < 1<<53 {
			p.leastKVTokens(int(v))
		}
		return nil
	}
	if fi == cacheIndex {
		// Its value is 1; the labels say.
		blocks, err1 := strconv.Atoi(string(p.blocks))
		size, err2 := strconv.Atoi(string(p.blockSize))
		if t := blocks * size; err1 == nil && err2 == nil && blocks > 0 && size > 0 && t/size == blocks {
			p.leastKVTokens(t)
		}
		if err2 == nil && size > 0 && (p.sample.KVBlockSize == 0 || size < p.sample.KVBlockSize) {
			p.sample.KVBlockSize = size
		}
		return nil
	}
	if fi == loraIndex {
		// Its value is the time it was set: the latest series counts.
		if v > p.loraAt {
			p.loraAt = v
			p.lora.maxLoRA = unquote(p.lora.maxLoRA[:0], p.loraLine.maxLoRA)
			p.lora.running = unquote(p.lora.running[:0], p.loraLine.running)
			p.lora.waiting = unquote(p.lora.waiting[:0], p.loraLine.waiting)
		}
		return nil
	}
	switch families[known[fi]] {
	case waiting:
		p.sample.Waiting += count(v)
	case running:
		p.sample.Running += count(v)
	case kvUsage:
		p.sample.KVUsage = max(p.sample.KVUsage, min(max(v, 0), 1))
	}
	return nil
}

// leastKVTokens takes t tokens of KV from a series: the sample says the
// least of its series'.
func (p *parser) leastKVTokens(t int) {
	if p.sample.KVTokens == 0 || t < p.sample.KVTokens {
		p.sample.KVTokens = t
	}
}

// resolve finds the family parse reads, if any, that a line of the given
// metric name belongs to, as expfmt does: a name with a summary's or
// histogram's suffix belongs to that summary or histogram, unless a family
// of the suffixed name exists already.
func (p *parser) resolve(name []byte) (fi int, s suffix, ok bool) {
	r, ok := refs[string(name)]
	if !ok {
		return 0, 0, false
	}
	f := &p.fams[r.fam]
	switch {
	case r.suffix == noSuffix:
	case f.own[r.suffix]:
		return 0, 0, false
	case f.typ == histogram, f.typ == summary && r.suffix != bucketSuffix:
	default:
		f.own[r.suffix] = true
		return 0, 0, false
	}
	return r.fam, r.suffix, true
}

// labels reads the label set whose '{' is line[i] and returns the index
// after its '}'. In a set that opens the line (braced), one item is the
// metric name rather than a label, which labels returns: quoted if it must
// be, first as the format has it, though expfmt takes it anywhere. fi is
// the index in known of the line's family, whose labels are then checked
// as expfmt checks them; -1 to check only the syntax, to find the name.
func (p *parser) labels(line []byte, i int, braced bool, fi int) (name []byte, end int, err error) {
	p.labelNames, p.labelEnds = p.labelNames[:0], p.labelEnds[:0]
	named := false
	for i++; ; {
		if i = skipBlank(line, i); i == len(line) {
			return nil, 0, p.errorf("label set not terminated")
		}
		if line[i] == '}' {
			if braced && !named {
				return nil, 0, p.errorf("no metric name in label set")
			}
			return name, i + 1, nil
		}
		e, quoted, err := p.nameEnd(line, i, labelChars)
		if err != nil {
			return nil, 0, err
		}
		if e == i {
			return nil, 0, p.errorf("invalid label name at %q", line[i:])
		}
		label := line[i:e]
		if i = skipBlank(line, e); i == len(line) {
			return nil, 0, p.errorf("label set not terminated")
		}
		if line[i] != '=' {
			if !braced || line[i] != ',' && line[i] != '}' {
				return nil, 0, p.errorf("expected '=' after label name %s", label)
			}
			if named {
				return nil, 0, p.errorf("second metric name %s in label set", label)
			}
			named, name = true, label
			if quoted && fi < 0 {
				p.name = unquote(p.name[:0], label)
				name = p.name
			}
			if line[i] == ',' {
				i++
			}
			continue
		}
		if i = skipBlank(line, i+1); i == len(line) || line[i] != '"' {
			return nil, 0, p.errorf("value of label %s not quoted", label)
		}
		ve, err := p.valueEnd(line, i+1)
		if err != nil {
			return nil, 0, err
		}
		value := line[i+1 : ve]
		if i = skipBlank(line, ve+1); i == len(line) {
			return nil, 0, p.errorf("label set not terminated")
		}
		switch line[i] {
		case ',':
			i++
		case '}':
		default:
			return nil, 0, p.errorf("expected ',' or '}' after label %s", label)
		}
		if fi >= 0 {
			if err := p.label(fi, label, quoted, value); err != nil {
				return nil, 0, err
			}
		}
	}
}

// label checks a label of a series of known[fi] as expfmt does, raw as in
// the exposition, and keeps what parse needs of it.
func (p *parser) label(fi int, raw []byte, quoted bool, value []byte) error {
	start := len(p.labelNames)
	if quoted {
		p.labelNames = unquote(p.labelNames, raw)
	} else {
		p.labelNames = append(p.labelNames, raw...)
	}
	name := p.labelNames[start:]
	switch {
	case string(name) == "__name__":
		return p.errorf("label name __name__ is reserved")
	case !utf8.Valid(name):
		return p.errorf("label name %q is not UTF-8", name)
	case !utf8.Valid(value):
		return p.errorf("value of label %q is not UTF-8", name)
	}
	typ := p.fams[fi].typ
	if typ == summary && string(name) == "quantile" || typ == histogram && string(name) == "le" {
		// Not a label to expfmt but the quantile or bucket: a number, and
		// no duplicate.
		x, err := parseFloat(value)
		if err != nil {
			return p.errorf("value of label %q is not a float", name)
		}
		p.bucket = p.bucket || typ == histogram && !math.IsNaN(x)
		p.labelNames = p.labelNames[:start]
		return nil
	}
	prev := 0
	for _, end := range p.labelEnds {
		if bytes.Equal(p.labelNames[prev:end], name) {
			return p.errorf("duplicate label name %q", name)
		}
		prev = end
	}
	p.labelEnds = append(p.labelEnds, len(p.labelNames))
	if fi == cacheIndex {
		switch string(name) {
		case "num_gpu_blocks":
			p.blocks = value
		case "block_size":
			p.blockSize = value
		}
	}
	if fi == loraIndex {
		switch string(name) {
		case "max_lora":
			p.loraLine.maxLoRA = value
		case "running_lora_adapters":
			p.loraLine.running = value
		case "waiting_lora_adapters":
			p.loraLine.waiting = value
		}
	}
	return nil
}

// nameEnd returns where the name at line[i] ends, read as expfmt reads it:
// unquoted characters (chars), the first not a digit, then possibly a
// quoted part, which ends it. quoted tells whether there is one; e is i
// when there is no name.
func (p *parser) nameEnd(line []byte, i int, chars *[256]bool) (e int, quoted bool, err error) {
	if i == len(line) || line[i] >= '0' && line[i] <= '9' {
		return i, false, nil
	}
	for e = i; e < len(line) && chars[line[e]]; e++ {
	}
	if e == len(line) || line[e] != '"' {
		return e, false, nil
	}
	for e++; e < len(line); e++ {
		switch line[e] {
		case '"':
			if e == i+1 {
				return i, false, nil // "" is no name
			}
			return e + 1, true, nil
		case '\\':
			if e++; e == len(line) || !isEscape(line[e]) {
				return 0, false, p.errorf("invalid escape sequence in name %s", line[i:e])
			}
		}
	}
	return 0, false, p.errorf("quoted name not terminated")
}

// valueEnd returns the index of the quote that ends the label value
// starting at line[i].
func (p *parser) valueEnd(line []byte, i int) (int, error) {
	for ; i < len(line); i++ {
		switch line[i] {
		case '"':
			return i, nil
		case '\\':
			if i++; i == len(line) || !isEscape(line[i]) {
				return 0, p.errorf("invalid escape sequence in label value")
			}
		}
	}
	return 0, p.errorf("label value not terminated")
}

func (p *parser) errorf(format string, args ...any) error {
	return fmt.Errorf("enginemetrics: line %d: %s", p.line, fmt.Sprintf(format, args...))
}

// metricChars and labelChars are the bytes of unquoted names.
var metricChars, labelChars = nameChars(":"), nameChars("")

func nameChars(extra string) *[256]bool {
	var t [256]bool
	for c := range t {
		t[c] = 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_' ||
			strings.IndexByte(extra, byte(c)) >= 0
	}
	return &t
}

// unquote appends a name or label value, raw as in the exposition, to dst
// without its quotes and with its escapes (\\, \", \n) resolved.
func unquote(dst, raw []byte) []byte {
	for i := 0; i < len(raw); i++ {
		switch c := raw[i]; c {
		case '"':
		case '\\':
			i++
			if raw[i] == 'n' {
				dst = append(dst, '\n')
			} else {
				dst = append(dst, raw[i])
			}
		default:
			dst = append(dst, c)
		}
	}
	return dst
}

func isEscape(c byte) bool { return c == '\\' || c == '"' || c == 'n' }

func isBlank(c byte) bool { return c == ' ' || c == '\t' }

func skipBlank(line []byte, i int) int {
	for i < len(line) && isBlank(line[i]) {
		i++
	}
	return i
}

// tokenEnd returns where the token at line[i] ends: at a blank or the end.
func tokenEnd(line []byte, i int) int {
	for i < len(line) && !isBlank(line[i]) {
		i++
	}
	return i
}

// parseFloat reads a value as expfmt does: strconv's syntax but for hex
// floats (their p exponent) and underscores.
func parseFloat(b []byte) (float64, error) {
	if bytes.ContainsAny(b, "pP_") {
		return 0, strconv.ErrSyntax
	}
	return strconv.ParseFloat(string(b), 64)
}

// typeOf reads a TYPE line's type as expfmt does: in any case, as
// strings.ToUpper has it.
func typeOf(text []byte) (metricType, bool) {
	var upper [len("GAUGE_HISTOGRAM")]byte
	if len(text) > len(upper) {
		return 0, false
	}
	for i, c := range text {
		if c >= utf8.RuneSelf {
			// Some letters outside ASCII upper-case into it (ſ to S).
			t, ok := types[strings.ToUpper(string(text))]
			return t, ok
		}
		if 'a' <= c && c <= 'z' {
			c -= 'a' - 'A'
		}
		upper[i] = c
	}
	t, ok := types[string(upper[:len(text)])]
	return t, ok
}

// parse reads a series' labels as vLLM sets them. One whose max_lora is not
// a positive number says nothing, and so does none.
func (l loraLabels) parse() LoRA {
	n, err := strconv.Atoi(string(bytes.TrimSpace(l.maxLoRA)))
	if err != nil || n <= 0 {
		return LoRA{}
	}
	return LoRA{Running: adapterList(string(l.running)), Waiting: adapterList(string(l.waiting)), MaxLoRA: n}
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

// count turns a gauge of requests (exported as a float) into a count.
func count(v float64) int {
	return int(math.Round(max(v, 0)))
}
