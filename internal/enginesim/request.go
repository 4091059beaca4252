package enginesim

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
)

// Fingerprint returns the first 12 hex chars of sha256(text). Generated output
// always starts with "pdx-sim:" + Fingerprint(prompt text), so a test can check
// that a response belongs to its own prompt.
func Fingerprint(text string) string {
	sum := sha256.Sum256([]byte(text))
	return hex.EncodeToString(sum[:])[:12]
}

// Message is a chat message reduced to its text.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// UnmarshalJSON accepts OpenAI's content forms: a string, null, or an array of
// parts of which the "text" of text parts is kept (concatenated).
func (m *Message) UnmarshalJSON(b []byte) error {
	var wire struct {
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(b, &wire); err != nil {
		return err
	}
	m.Role = wire.Role
	m.Content = ""
	switch {
	case isNull(wire.Content):
	case wire.Content[0] == '"':
		return json.Unmarshal(wire.Content, &m.Content)
	default:
		var parts []struct {
			Type string `json:"type"`
			Text string `json:"text"`
		}
		if err := json.Unmarshal(wire.Content, &parts); err != nil {
			return errors.New("content must be a string or an array of content parts")
		}
		var sb strings.Builder
		for _, p := range parts {
			if p.Type == "text" {
				sb.WriteString(p.Text)
			}
		}
		m.Content = sb.String()
	}
	return nil
}

// ChatPromptText is the canonical prompt text of chat messages: for each
// message role + ": " + content + "\n".
func ChatPromptText(messages []Message) string {
	var sb strings.Builder
	for _, m := range messages {
		sb.WriteString(m.Role)
		sb.WriteString(": ")
		sb.WriteString(m.Content)
		sb.WriteString("\n")
	}
	return sb.String()
}

// api is the OpenAI endpoint a request came in on; the two differ in prompt
// shape, limit fields and response objects.
type api int

const (
	apiChat api = iota
	apiCompletions
)

// mode is what a request asks of the engine, decided by its kv_transfer_params.
type mode int

const (
	modePlain   mode = iota // no KV transfer
	modePrefill             // do_remote_decode: compute KV for a remote decode
	modeDecode              // do_remote_prefill: pull KV computed remotely
)

const (
	defaultMaxTokens = 16
	maxMaxTokens     = 4096
)

// inferenceRequest is the part of a completion request the simulator acts on.
type inferenceRequest struct {
	api          api
	fields       map[string]json.RawMessage // every top-level field, for presence checks
	model        string
	prompt       string
	stream       bool
	includeUsage bool
	maxTokens    int // resolved output length
	mode         mode
	kv           kvTransferParams // meaningful unless mode is modePlain
}

// parseRequest validates an OpenAI request body the way vLLM's request
// models would, keeping unknown fields out of the way.
func parseRequest(a api, body []byte) (*inferenceRequest, error) {
	req := &inferenceRequest{api: a}
	if err := decodeJSON(body, &req.fields); err != nil {
		return nil, badRequest("request body is not a JSON object: %v", err)
	}
	if req.fields == nil {
		return nil, badRequest("request body is not a JSON object")
	}
	if !req.has("model") {
		return nil, badRequest("model is required")
	}
	if err := req.field("model", &req.model); err != nil {
		return nil, err
	}

	switch a {
	case apiChat:
		var msgs []Message
		if err := req.field("messages", &msgs); err != nil {
			return nil, err
		}
		if len(msgs) == 0 {
			return nil, badRequest("messages is required and must not be empty")
		}
		for i, m := range msgs {
			if m.Role == "" {
				return nil, badRequest("messages[%d].role is required", i)
			}
		}
		req.prompt = ChatPromptText(msgs)
	case apiCompletions:
		if !req.has("prompt") {
			return nil, badRequest("prompt is required")
		}
		p, err := completionPrompt(req.fields["prompt"])
		if err != nil {
			return nil, err
		}
		req.prompt = p
	}

	if err := req.field("stream", &req.stream); err != nil {
		return nil, err
	}
	if req.has("stream_options") {
		if !req.stream {
			return nil, badRequest("stream_options can only be set when stream is true")
		}
		var opts struct {
			IncludeUsage bool `json:"include_usage"`
		}
		if err := req.field("stream_options", &opts); err != nil {
			return nil, err
		}
		req.includeUsage = opts.IncludeUsage
	}

	limit, err := req.outputLimit()
	if err != nil {
		return nil, err
	}
	req.maxTokens = min(limit, maxMaxTokens)

	if req.has("kv_transfer_params") {
		if err := req.field("kv_transfer_params", &req.kv); err != nil {
			return nil, err
		}
		switch {
		case req.kv.DoRemoteDecode && req.kv.DoRemotePrefill:
			return nil, badRequest("kv_transfer_params sets both do_remote_decode and do_remote_prefill")
		case req.kv.DoRemoteDecode:
			req.mode = modePrefill
		case req.kv.DoRemotePrefill:
			req.mode = modeDecode
		}
	}
	return req, nil
}

// limitFields are the fields that bound the output length on each endpoint, in
// order of precedence. vLLM's completions API has no max_completion_tokens and
// silently ignores it, so it does not count there.
func limitFields(a api) []string {
	if a == apiChat {
		return []string{"max_completion_tokens", "max_tokens"}
	}
	return []string{"max_tokens"}
}

// outputLimit resolves the number of tokens to generate.
func (r *inferenceRequest) outputLimit() (int, error) {
	for _, name := range limitFields(r.api) {
		if !r.has(name) {
			continue
		}
		n, err := r.intField(name)
		if err != nil {
			return 0, err
		}
		if n < 1 {
			return 0, badRequest("%s must be at least 1, got %d", name, n)
		}
		return int(min(n, maxMaxTokens)), nil
	}
	return defaultMaxTokens, nil
}

// has reports whether a top-level field is present and not null; OpenAI
// treats null as absent.
func (r *inferenceRequest) has(name string) bool {
	raw, ok := r.fields[name]
	return ok && !isNull(raw)
}

// field decodes a top-level field into v when present, leaving v alone otherwise.
func (r *inferenceRequest) field(name string, v any) error {
	if !r.has(name) {
		return nil
	}
	if err := decodeJSON(r.fields[name], v); err != nil {
		return badRequest("invalid %s: %v", name, err)
	}
	return nil
}

// intField decodes an integer field exactly: a JSON string or a fraction is
// an error rather than being coerced.
func (r *inferenceRequest) intField(name string) (int64, error) {
	var v any
	if err := decodeJSON(r.fields[name], &v); err != nil {
		return 0, badRequest("invalid %s: %v", name, err)
	}
	num, ok := v.(json.Number)
	if !ok {
		return 0, badRequest("%s must be an integer, got %s", name, r.fields[name])
	}
	n, err := num.Int64()
	if err != nil {
		return 0, badRequest("%s must be an integer, got %s", name, num)
	}
	return n, nil
}

// completionPrompt is the prompt text of /v1/completions: the string, or the
// strings of an array joined by "\n". Token-id prompts have no text to
// fingerprint, so the simulator refuses them.
func completionPrompt(raw json.RawMessage) (string, error) {
	var v any
	if err := decodeJSON(raw, &v); err != nil {
		return "", badRequest("invalid prompt: %v", err)
	}
	switch p := v.(type) {
	case string:
		return p, nil
	case []any:
		if len(p) == 0 {
			return "", badRequest("prompt must not be empty")
		}
		parts := make([]string, len(p))
		for i, e := range p {
			s, ok := e.(string)
			if !ok {
				return "", badRequest("prompt must be a string or an array of strings (token-id prompts are not supported by the simulator)")
			}
			parts[i] = s
		}
		return strings.Join(parts, "\n"), nil
	}
	return "", badRequest("prompt must be a string or an array of strings")
}

// promptTokens approximates a tokenizer: about four characters a token.
func promptTokens(text string) int {
	return max(1, len(text)/4)
}

// decodeJSON decodes exactly one JSON value, keeping numbers as json.Number
// so that no integer loses precision on the way.
func decodeJSON(data []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return fmt.Errorf("unexpected data after the JSON value")
	}
	return nil
}

func isNull(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) == 0 || string(raw) == "null"
}
