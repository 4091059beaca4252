package connectors

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestPrefilled(t *testing.T) {
	for _, tc := range []struct {
		answer string
		want   Prefilled
	}{
		{`{"usage":{"prompt_tokens":120,"total_tokens":121,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":64}}}`,
			Prefilled{PromptTokens: 120, CachedTokens: 64, Details: true}},
		// vLLM leaves the details out when nothing was cached, and without
		// --enable-prompt-tokens-details.
		{`{"usage":{"prompt_tokens":120,"completion_tokens":1}}`, Prefilled{PromptTokens: 120}},
		{`{"usage":{"prompt_tokens":120,"prompt_tokens_details":null}}`, Prefilled{PromptTokens: 120}},
		{`{"usage":{"prompt_tokens":120,"prompt_tokens_details":{"cached_tokens":0}}}`, Prefilled{PromptTokens: 120, Details: true}},
		{`{"usage":null}`, Prefilled{}},
		{`{"choices":[]}`, Prefilled{}},
		{`{"usage":{"prompt_tokens":"120"}}`, Prefilled{}},
		{`{"usage":{"prompt_tokens":-1}}`, Prefilled{}},
		{`{"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":11}}}`, Prefilled{}},
		{`not json`, Prefilled{}},
	} {
		require.Equal(t, tc.want, prefilledOf([]byte(tc.answer)), tc.answer)
	}
}
