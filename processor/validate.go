package processor

import (
	"bytes"
	"fmt"
	"strconv"

	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/jsonedit"
	"github.com/pdx-router/pdx/internal/routing"
)

// validate checks the fields pdx and its connectors act on, so that a bad
// request is answered by pdx with a clear error instead of reaching an
// engine (which would fail it after a prefill, or in the middle of a
// stream). Fields pdx does not act on are the engine's to judge.
func validate(body jsonedit.Object, path string, pool *routing.Pool) error {
	api := connectors.APIOf(path)
	if pool.Traits.NotDisaggregated.Has(api) {
		return &apiError{status: 501, typ: typeInvalidRequest, code: "unsupported_api", msg: fmt.Sprintf(
			"POST %s is not disaggregated by connector %q of pool %s: its engines take no prefill hand-off on that API; use POST %s",
			path, pool.ConnectorName, pool.Name, connectors.ChatCompletionsPath)}
	}
	if raw, ok := body.Raw("stream"); ok && string(raw) != "true" && string(raw) != "false" && string(raw) != "null" {
		return badRequest("invalid_type", fmt.Sprintf(`"stream" must be a boolean, got %.40s`, raw))
	}
	switch api {
	case connectors.APIResponses:
		return validateResponses(body)
	case connectors.APIMessages:
		return validateMessages(body)
	}
	for _, key := range []string{"max_tokens", "max_completion_tokens"} {
		if _, err := positiveInt(body, key); err != nil {
			return err
		}
	}
	n, err := positiveInt(body, "n")
	if err != nil {
		return err
	}
	if n > 1 && !pool.Traits.MultipleChoices {
		return badRequest("unsupported_value", fmt.Sprintf(
			`"n" is %d, but connector %q hands over the KV of one sequence: send n of 1 (or leave it out)`, n, pool.ConnectorName))
	}
	switch api {
	case connectors.APIChat:
		return requireArray(body, "messages", "message")
	case connectors.APICompletions:
		raw, ok := body.Raw("prompt")
		switch {
		case !ok || string(raw) == "null":
			return badRequest("missing_prompt", `the request has no "prompt"`)
		case raw[0] != '"' && raw[0] != '[':
			return badRequest("invalid_type", fmt.Sprintf(`"prompt" must be a string or an array, got %.40s`, raw))
		case isEmptyArray(raw):
			return badRequest("empty_prompt", `"prompt" is an empty array`)
		}
	}
	return nil
}

// validateResponses checks a Responses request: its input, the output
// limit pdx sets on the prefill, and the stored state it may ask for,
// which pdx refuses: it holds no responses, and the engine that would
// hold one (the decode engine that answered, with vLLM's
// VLLM_ENABLE_RESPONSES_API_STORE) is not the one a later request's
// prefill reaches.
func validateResponses(body jsonedit.Object) error {
	raw, ok := body.Raw("input")
	switch {
	case !ok || string(raw) == "null":
		return badRequest("missing_input", `the request has no "input"`)
	case raw[0] != '"' && raw[0] != '[':
		return badRequest("invalid_type", fmt.Sprintf(`"input" must be a string or an array of items, got %.40s`, raw))
	case isEmptyArray(raw):
		return badRequest("empty_input", `"input" is an empty array; send at least one item`)
	}
	if _, err := positiveInt(body, "max_output_tokens"); err != nil {
		return err
	}
	if raw, ok := body.Raw("previous_response_id"); ok && string(raw) != "null" {
		return badRequest("unsupported_value", `"previous_response_id" needs a stored response, and pdx stores none: `+
			`send the conversation so far in "input" (a stored response lives only on the engine that answered it, `+
			`with vLLM's VLLM_ENABLE_RESPONSES_API_STORE, which the next request's prefill does not reach)`)
	}
	if raw, ok := body.Raw("background"); ok && string(raw) == "true" {
		return badRequest("unsupported_value", `"background": true needs a stored response to poll, and pdx stores none: `+
			`send the request without it (streamed, if it is long)`)
	}
	if raw, ok := body.Raw("store"); ok && string(raw) != "true" && string(raw) != "false" && string(raw) != "null" {
		return badRequest("invalid_type", fmt.Sprintf(`"store" must be a boolean, got %.40s`, raw))
	}
	return nil
}

// validateMessages checks a Messages request: its messages, system prompt
// and the output limit, which Anthropic's API requires.
func validateMessages(body jsonedit.Object) error {
	if err := requireArray(body, "messages", "message"); err != nil {
		return err
	}
	if raw, ok := body.Raw("system"); ok && string(raw) != "null" && raw[0] != '"' && raw[0] != '[' {
		return badRequest("invalid_type", fmt.Sprintf(`"system" must be a string or an array of content blocks, got %.40s`, raw))
	}
	n, err := positiveInt(body, "max_tokens")
	if err != nil {
		return err
	}
	if n == 0 {
		return badRequest("missing_max_tokens", `the request has no "max_tokens", which the Messages API requires`)
	}
	return nil
}

// requireArray checks that key is a non-empty array (of what, for
// messages).
func requireArray(body jsonedit.Object, key, what string) error {
	raw, ok := body.Raw(key)
	switch {
	case !ok || string(raw) == "null":
		return badRequest("missing_"+key, fmt.Sprintf(`the request has no %q`, key))
	case raw[0] != '[':
		return badRequest("invalid_type", fmt.Sprintf(`%q must be an array, got %.40s`, key, raw))
	case isEmptyArray(raw):
		return badRequest("empty_"+key, fmt.Sprintf(`%q is empty; send at least one %s`, key, what))
	}
	return nil
}

// positiveInt returns the integer value of key, 0 when absent or null, or an
// error when it is not a whole number of at least 1.
func positiveInt(body jsonedit.Object, key string) (int64, error) {
	raw, ok := body.Raw(key)
	if !ok || string(raw) == "null" {
		return 0, nil
	}
	n, err := strconv.ParseInt(string(raw), 10, 64)
	switch {
	case err != nil:
		return 0, badRequest("invalid_type", fmt.Sprintf(`%q must be an integer, got %.40s`, key, raw))
	case n < 1:
		return 0, badRequest("invalid_value", fmt.Sprintf(`%q must be at least 1, got %d`, key, n))
	}
	return n, nil
}

// isEmptyArray reports whether raw, a JSON array, has no elements.
func isEmptyArray(raw []byte) bool {
	return len(bytes.TrimSpace(raw[1:len(raw)-1])) == 0
}
