package enginemetrics

import (
	"io"
	"net/http/httptest"
	"strings"
	"testing"
)

// BenchmarkParse parses a realistic vLLM v1 exposition (testdata/vllm.txt:
// 410 lines, 40 KB; 16 histograms and the process, Python and HTTP
// instrumentator families around the three load gauges): what an engine
// that ignores the name[] filter sends on every scrape.
func BenchmarkParse(b *testing.B) {
	benchParse(b, readTestdata(b, "vllm.txt"))
}

// BenchmarkParseFiltered parses what vLLM sends when asked for only the
// load families (name[] honoured by a single-process prometheus_client).
func BenchmarkParseFiltered(b *testing.B) {
	benchParse(b, filteredVLLM(b))
}

// BenchmarkParseReused parses as a scrape loop does, with one parser kept
// from scrape to scrape.
func BenchmarkParseReused(b *testing.B) {
	for _, bench := range []struct{ name, text string }{
		{"full", readTestdata(b, "vllm.txt")},
		{"filtered", filteredVLLM(b)},
	} {
		b.Run(bench.name, func(b *testing.B) {
			b.SetBytes(int64(len(bench.text)))
			b.ReportAllocs()
			p := newParser()
			for b.Loop() {
				if _, err := p.parse(strings.NewReader(bench.text)); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func benchParse(b *testing.B, text string) {
	b.SetBytes(int64(len(text)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Parse(strings.NewReader(text)); err != nil {
			b.Fatal(err)
		}
	}
}

// filteredVLLM is testdata/vllm.txt as promClient filters it for a scrape.
func filteredVLLM(tb testing.TB) string {
	rec := httptest.NewRecorder()
	promClient(readTestdata(tb, "vllm.txt"), false)(rec, httptest.NewRequest("GET", "/metrics?"+filterQuery, nil))
	body, _ := io.ReadAll(rec.Body)
	return string(body)
}
