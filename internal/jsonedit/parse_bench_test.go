package jsonedit

import (
	"fmt"
	"strings"
	"testing"
)

// BenchmarkParse measures the validating scan alone, on a chat body with a
// long plain prompt and on one whose prompt has an escape every 40 bytes.
func BenchmarkParse(b *testing.B) {
	for _, tc := range []struct{ name, chunk string }{
		{"plain", strings.Repeat("x", 40)},
		{"escapes", strings.Repeat("x", 38) + `\n`},
		{"unicode", strings.Repeat("é", 19) + `\"`},
	} {
		content := strings.Repeat(tc.chunk, (2<<20)/40)
		body := []byte(fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"%s"}],"max_tokens":64,"stream":true}`, content))
		b.Run(tc.name, func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := Parse(body); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
