package connectors

import (
	"strconv"

	"github.com/pdx-router/pdx/internal/jsonedit"
)

// Prefilled is what a prefill engine said of the prompt in its answer's
// usage: its tokens, and those it found in its prefix cache (vLLM's
// usage.prompt_tokens_details.cached_tokens, which it sends only with
// --enable-prompt-tokens-details and only when some were). Placement's
// self-check compares them with what it predicted.
type Prefilled struct {
	// PromptTokens is 0 when the answer had no usage.
	PromptTokens int
	// CachedTokens counts only with Details: the answer had
	// prompt_tokens_details.
	CachedTokens int
	Details      bool
}

// prefilled reads the usage of a prefill's answer, answer already parsed
// (the connectors read kv_transfer_params from the same object). A usage
// that is absent, null or not numbers reads as none.
func prefilled(answer jsonedit.Object) Prefilled {
	raw, ok := answer.Raw("usage")
	if !ok || len(raw) == 0 || raw[0] != '{' {
		return Prefilled{}
	}
	u, err := jsonedit.Parse(raw)
	if err != nil {
		return Prefilled{}
	}
	var p Prefilled
	if p.PromptTokens, ok = count(u, "prompt_tokens"); !ok {
		return Prefilled{}
	}
	if raw, ok := u.Raw("prompt_tokens_details"); ok && len(raw) > 0 && raw[0] == '{' {
		if d, err := jsonedit.Parse(raw); err == nil {
			p.CachedTokens, p.Details = count(d, "cached_tokens")
		}
	}
	if p.CachedTokens > p.PromptTokens {
		return Prefilled{}
	}
	return p
}

// prefilledOf is prefilled of an answer not parsed yet.
func prefilledOf(answer []byte) Prefilled {
	obj, err := jsonedit.Parse(answer)
	if err != nil {
		return Prefilled{}
	}
	return prefilled(obj)
}

// count reads obj's member key as a count: a whole number from 0.
func count(obj jsonedit.Object, key string) (int, bool) {
	raw, ok := obj.Raw(key)
	if !ok {
		return 0, false
	}
	n, err := strconv.Atoi(string(raw))
	if err != nil || n < 0 {
		return 0, false
	}
	return n, true
}
