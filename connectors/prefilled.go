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
// (the connectors read kv_transfer_params from the same object), in the
// shape of the API that answered: chat's and completions'
// prompt_tokens and prompt_tokens_details.cached_tokens; Responses'
// input_tokens and input_tokens_details.cached_tokens (vLLM's
// ResponseUsage, which always has the details); Messages' input_tokens,
// which Anthropic counts without the cached tokens, cache_read_input_tokens
// and cache_creation_input_tokens (vLLM's _build_anthropic_usage, which
// sends the cache members only with --enable-prompt-tokens-details). A
// usage that is absent, null or not numbers reads as none.
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
	switch {
	case has(u, "prompt_tokens"):
		if p.PromptTokens, ok = count(u, "prompt_tokens"); !ok {
			return Prefilled{}
		}
		p.CachedTokens, p.Details = detail(u, "prompt_tokens_details")
	case has(u, "input_tokens_details") || has(u, "total_tokens"):
		if p.PromptTokens, ok = count(u, "input_tokens"); !ok {
			return Prefilled{}
		}
		p.CachedTokens, p.Details = detail(u, "input_tokens_details")
	default:
		input, ok := count(u, "input_tokens")
		if !ok {
			return Prefilled{}
		}
		created, _ := count(u, "cache_creation_input_tokens")
		p.CachedTokens, p.Details = count(u, "cache_read_input_tokens")
		p.PromptTokens = input + created + p.CachedTokens
	}
	if p.CachedTokens > p.PromptTokens {
		return Prefilled{}
	}
	return p
}

// has reports whether obj has member key.
func has(obj jsonedit.Object, key string) bool {
	_, ok := obj.Raw(key)
	return ok
}

// detail reads cached_tokens of the details object at key.
func detail(u jsonedit.Object, key string) (int, bool) {
	raw, ok := u.Raw(key)
	if !ok || len(raw) == 0 || raw[0] != '{' {
		return 0, false
	}
	d, err := jsonedit.Parse(raw)
	if err != nil {
		return 0, false
	}
	return count(d, "cached_tokens")
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
