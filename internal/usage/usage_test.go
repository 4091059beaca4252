package usage

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// feed writes body to a Reader in chunks of size n (all at once for 0).
func feed(sse bool, body string, n int) (Counts, bool) {
	r := NewReader(sse)
	if n <= 0 {
		n = len(body) + 1
	}
	for len(body) > 0 {
		k := min(n, len(body))
		_, _ = r.Write([]byte(body[:k]))
		body = body[k:]
	}
	return r.Usage()
}

const vllmChat = `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m",` +
	`"choices":[{"index":0,"message":{"role":"assistant","content":"say \"usage\":{\"prompt_tokens\":99} {[,"},"finish_reason":"length"}],` +
	`"usage":{"prompt_tokens":12,"total_tokens":15,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":11}},"kv_transfer_params":null}`

const sseChat = "data: {\"id\":\"1\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n" +
	"data: {\"id\":\"1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"usage\\\": {\"}}],\"usage\":null}\n\n" +
	": a comment\n" +
	"event: message\n" +
	"data: {\"id\":\"1\",\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":5,\"total_tokens\":12}}\r\n\r\n" +
	"data: [DONE]\n\n"

func TestReader(t *testing.T) {
	huge := `{"choices":[{"text":"` + strings.Repeat("x", 8<<20) + `"}],"usage":{"prompt_tokens":1,"completion_tokens":2}}`
	tests := []struct {
		name  string
		sse   bool
		body  string
		want  Counts
		found bool
	}{
		{"json with cached tokens", false, vllmChat, Counts{Prompt: 12, Cached: 11, Completion: 3}, true},
		{"json usage first", false, `{"usage":{"prompt_tokens":4,"completion_tokens":1},"choices":[]}`, Counts{Prompt: 4, Completion: 1}, true},
		{"json without usage", false, `{"id":"x","choices":[{"text":"usage"}]}`, Counts{}, false},
		{"json usage null", false, `{"usage":null}`, Counts{}, false},
		{"json nested usage is not the answer's", false, `{"choices":[{"usage":{"prompt_tokens":5}}]}`, Counts{}, false},
		{"json truncated", false, `{"choices":[],"usage":{"prompt_tokens":4,"comp`, Counts{}, false},
		{"json malformed usage", false, `{"usage":{"prompt_tokens":"four"}}`, Counts{}, false},
		{"json cached over prompt", false, `{"usage":{"prompt_tokens":4,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":5}}}`, Counts{}, false},
		{"json escaped key", false, `{"us\u0061ge":{"prompt_tokens":4}}`, Counts{}, false},
		{"not an object", false, `[{"usage":{"prompt_tokens":4}}]`, Counts{}, false},
		{"html error page", false, `<html>usage</html>`, Counts{}, false},
		{"huge body, usage last", false, huge, Counts{Prompt: 1, Completion: 2}, true},
		{"oversized usage dropped", false, `{"usage":{"prompt_tokens":1,"pad":"` + strings.Repeat("y", maxValue) + `"}}`, Counts{}, false},
		{"sse usage chunk", true, sseChat, Counts{Prompt: 7, Completion: 5}, true},
		{"sse without include_usage", true, "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n", Counts{}, false},
		{"sse last usage wins (continuous_usage_stats)", true,
			"data: {\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\ndata: {\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\n", Counts{Prompt: 3, Completion: 2}, true},
		{"sse event not ended", true, "data: {\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n", Counts{}, false},
		{"sse data split over lines", true, "data: {\"usage\":\ndata: {\"prompt_tokens\":3,\"completion_tokens\":1}}\n\n", Counts{Prompt: 3, Completion: 1}, true},
		{"sse no space after colon", true, "data:{\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":1}}\n\n", Counts{Prompt: 2, Completion: 1}, true},
		{"sse error event", true, "data: {\"error\":{\"message\":\"usage\",\"code\":500}}\n\ndata: [DONE]\n\n", Counts{}, false},
		{"sse not data lines", true, "event: {\"usage\":{\"prompt_tokens\":2}}\n\n", Counts{}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Whole, and split at every awkward place: 1, 2, 3 and 7 bytes a
			// chunk cut keys, escapes, "data:" and \r\n apart.
			for _, n := range []int{0, 1, 2, 3, 7, 64} {
				if n > 0 && n < 64 && len(tt.body) > 1<<16 {
					continue // the huge body once per chunking is enough
				}
				got, ok := feed(tt.sse, tt.body, n)
				require.Equal(t, tt.found, ok, "chunks of %d", n)
				require.Equal(t, tt.want, got, "chunks of %d", n)
			}
		})
	}
}

func TestReaderKeepsLittle(t *testing.T) {
	// A body of many megabytes leaves the reader with a bounded value.
	r := NewReader(false)
	_, _ = r.Write([]byte(`{"usage":{"prompt_tokens":1,"pad":"`))
	chunk := []byte(strings.Repeat("z", 1<<20))
	for range 16 {
		_, _ = r.Write(chunk)
	}
	require.Nil(t, r.scan.value, "an oversized value is dropped, not grown")
	_, ok := r.Usage()
	require.False(t, ok)
}

func BenchmarkReader(b *testing.B) {
	var sb strings.Builder
	for i := range 256 {
		sb.WriteString(`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" t`)
		sb.WriteString(strings.Repeat("x", i%7))
		sb.WriteString("\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n")
	}
	sb.WriteString("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":256}}\n\ndata: [DONE]\n\n")
	body := []byte(sb.String())
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		r := NewReader(true)
		_, _ = r.Write(body)
		if _, ok := r.Usage(); !ok {
			b.Fatal("no usage")
		}
	}
}
