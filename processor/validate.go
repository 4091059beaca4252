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
	if raw, ok := body.Raw("stream"); ok && string(raw) != "true" && string(raw) != "false" && string(raw) != "null" {
		return badRequest("invalid_type", fmt.Sprintf(`"stream" must be a boolean, got %.40s`, raw))
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
	switch path {
	case connectors.ChatCompletionsPath:
		raw, ok := body.Raw("messages")
		switch {
		case !ok || string(raw) == "null":
			return badRequest("missing_messages", `the request has no "messages"`)
		case raw[0] != '[':
			return badRequest("invalid_type", fmt.Sprintf(`"messages" must be an array, got %.40s`, raw))
		case isEmptyArray(raw):
			return badRequest("empty_messages", `"messages" is empty; send at least one message`)
		}
	case connectors.CompletionsPath:
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
