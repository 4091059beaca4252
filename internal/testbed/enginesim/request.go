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
	apiResponses // OpenAI's Responses API (responses.go)
	apiMessages  // Anthropic's Messages API (messages.go)
)

// chatTemplated reports whether the API's prompt goes through the model's
// chat template: all but completions.
func (a api) chatTemplated() bool { return a != apiCompletions }

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
	promptTokens int // counted in usage (TensorRT-LLM's ctx_usage may override it)
	// cachedTokens are the prompt tokens its prefill found in the prefix
	// cache (the capacity model's), when it computed the prompt.
	cachedTokens int
	stream       bool
	includeUsage bool
	maxTokens    int  // resolved output length
	minTokens    int  // tokens generated before EOS may end the output (vLLM's min_tokens)
	ignoreEOS    bool // vLLM's ignore_eos: EOS does not end the output
	mode         mode
	kv           kvTransferParams // meaningful unless mode is modePlain
}

// dialect is the request model of an engine family: vLLM, SGLang and
// TensorRT-LLM declare the same OpenAI fields with different types, so they
// differ in which nulls they refuse and in token-id prompts.
type dialect int

const (
	dialectVLLM   dialect = iota // connectors nixl, mooncake, http/lmcache, p2p-nccl
	dialectSGLang                // connector sglang
	dialectTRTLLM                // connector trtllm
)

func dialectOf(connector string) dialect {
	switch connector {
	case ConnectorSGLang:
		return dialectSGLang
	case ConnectorTRTLLM:
		return dialectTRTLLM
	}
	return dialectVLLM
}

// notNull is a field an engine declares with a default but not Optional:
// pydantic refuses an explicit null for it (a 400), where it treats null as
// absent for the Optional fields.
type notNull struct {
	api   api
	field string
	decl  string // the declaration, for the message
}

// nullRefused are the non-Optional fields of the SGLang and TensorRT-LLM
// request models (vLLM's are in vllmChatFields and vllmCompletionFields).
var nullRefused = map[dialect][]notNull{
	// sglang/srt/entrypoints/openai/protocol.py: stream: bool = False on
	// both requests, CompletionRequest.max_tokens: int = 16 (the chat one
	// is Optional[int]).
	dialectSGLang: {
		{apiChat, "stream", "SGLang's ChatCompletionRequest.stream: bool = False"},
		{apiCompletions, "stream", "SGLang's CompletionRequest.stream: bool = False"},
		{apiCompletions, "max_tokens", "SGLang's CompletionRequest.max_tokens: int = 16"},
	},
}

// refuseNulls refuses an explicit null for a field the dialect does not
// declare Optional.
func (r *inferenceRequest) refuseNulls(d dialect) error {
	for _, nn := range nullRefused[d] {
		if raw, ok := r.fields[nn.field]; ok && nn.api == r.api && isNull(raw) {
			return badRequest("%s must not be null (%s is not Optional)", nn.field, nn.decl)
		}
	}
	return nil
}

// parseRequest validates an OpenAI request body the way the dialect's
// request models would, keeping unknown fields out of the way.
// parseRequest parses a request to the engine, its chat prompt as the
// engine's chat template makes it (Config.ChatTemplate).
func (s *Server) parseRequest(a api, body []byte) (*inferenceRequest, error) {
	req, err := parseRequest(a, dialectOf(s.cfg.Connector), body)
	if err == nil && a.chatTemplated() && s.cfg.ChatTemplate != "" {
		req.prompt = s.cfg.ChatTemplate + req.prompt
		req.promptTokens = promptTokens(req.prompt)
	}
	return req, err
}

func parseRequest(a api, d dialect, body []byte) (*inferenceRequest, error) {
	if a == apiResponses || a == apiMessages {
		return parseAgentRequest(a, d, body)
	}
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
	if err := req.refuseNulls(d); err != nil {
		return nil, err
	}
	if err := req.parsePrompt(d); err != nil {
		return nil, err
	}
	req.promptTokens = promptTokens(req.prompt)

	if d == dialectVLLM {
		if err := req.parseVLLM(); err != nil {
			return nil, err
		}
	} else if err := req.parseSampling(); err != nil {
		return nil, err
	}

	if err := req.parseKVTransferParams(); err != nil {
		return nil, err
	}
	return req, nil
}

// parseKVTransferParams reads kv_transfer_params, which decide the mode.
func (r *inferenceRequest) parseKVTransferParams() error {
	if !r.has("kv_transfer_params") {
		return nil
	}
	if err := r.field("kv_transfer_params", &r.kv); err != nil {
		return err
	}
	switch {
	case r.kv.DoRemoteDecode && r.kv.DoRemotePrefill:
		return badRequest("kv_transfer_params sets both do_remote_decode and do_remote_prefill")
	case r.kv.DoRemoteDecode:
		r.mode = modePrefill
	case r.kv.DoRemotePrefill:
		r.mode = modeDecode
	}
	return nil
}

// parsePrompt sets the prompt text. TensorRT-LLM's generation server may
// get the prompt as the context server's token ids (its disagg server puts
// them in prompt for /v1/completions and in prompt_token_ids for chat,
// openai_disagg_service.py _get_gen_request); they then are the prompt.
func (r *inferenceRequest) parsePrompt(d dialect) error {
	switch r.api {
	case apiChat:
		var msgs []Message
		if err := r.field("messages", &msgs); err != nil {
			return err
		}
		if len(msgs) == 0 {
			return badRequest("messages is required and must not be empty")
		}
		for i, m := range msgs {
			if m.Role == "" {
				return badRequest("messages[%d].role is required", i)
			}
		}
		r.prompt = ChatPromptText(msgs)
		if d == dialectTRTLLM && r.has("prompt_token_ids") {
			ids, err := tokenIDs(r.fields["prompt_token_ids"], "prompt_token_ids")
			if err != nil {
				return err
			}
			r.prompt = detokenize(ids)
		}
	case apiCompletions:
		if !r.has("prompt") {
			return badRequest("prompt is required")
		}
		p, err := completionPrompt(r.fields["prompt"], d == dialectTRTLLM)
		if err != nil {
			return err
		}
		r.prompt = p
	}
	return nil
}

// parseSampling reads stream, stream_options and the output limit of the
// SGLang and TensorRT-LLM dialects (vLLM's are parseVLLM's).
func (r *inferenceRequest) parseSampling() error {
	if err := r.field("stream", &r.stream); err != nil {
		return err
	}
	if err := r.parseStreamOptions(); err != nil {
		return err
	}
	limit, err := r.outputLimit()
	if err != nil {
		return err
	}
	r.maxTokens = min(limit, maxMaxTokens)
	return nil
}

// parseStreamOptions reads stream_options, which needs stream true (a
// stricter rule than vLLM's validate_stream_options, see parseVLLM).
func (r *inferenceRequest) parseStreamOptions() error {
	if !r.has("stream_options") {
		return nil
	}
	var opts struct {
		IncludeUsage bool `json:"include_usage"`
	}
	if err := r.field("stream_options", &opts); err != nil {
		return err
	}
	if !r.stream {
		return badRequest("stream_options can only be set when stream is true")
	}
	r.includeUsage = opts.IncludeUsage
	return nil
}

// limitFields are the fields that bound the output length on each endpoint
// of the SGLang and TensorRT-LLM dialects, read in the order vLLM reads them
// (vLLM's own reading is resolveLimit's). Chat takes max_completion_tokens
// when it is set and not null, else max_tokens (chat_completion/serving.py,
// build_tok_params in chat_completion/protocol.py); vLLM's CompletionRequest
// has no max_completion_tokens (completion/protocol.py) and, allowing extra
// fields, ignores it there.
func limitFields(a api) []string {
	if a == apiChat {
		return []string{"max_completion_tokens", "max_tokens"}
	}
	return []string{"max_tokens"}
}

// limitRead is the output limit as the engine reads it: the key it takes
// and its value; set is false when no key is given (the engine's default).
type limitRead struct {
	key string
	n   int64
	set bool
}

// readLimit finds the limit key the endpoint reads. Every limit key it
// declares must be an integer (pydantic checks them all); only the first
// one set counts.
func (r *inferenceRequest) readLimit() (limitRead, error) {
	var read limitRead
	for _, name := range limitFields(r.api) {
		if !r.has(name) {
			continue
		}
		n, err := r.intField(name)
		if err != nil {
			return limitRead{}, err
		}
		if !read.set {
			read = limitRead{key: name, n: n, set: true}
		}
	}
	return read, nil
}

// outputLimit resolves the number of tokens to generate.
func (r *inferenceRequest) outputLimit() (int, error) {
	read, err := r.readLimit()
	switch {
	case err != nil:
		return 0, err
	case !read.set:
		return defaultMaxTokens, nil
	case read.n < 1:
		return 0, badRequest("%s must be at least 1, got %d", read.key, read.n)
	}
	return int(min(read.n, maxMaxTokens)), nil
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
// strings of an array joined by "\n". With tokens, an array of token ids is
// a prompt too (detokenized); elsewhere token-id prompts have no text to
// fingerprint, so the simulator refuses them.
func completionPrompt(raw json.RawMessage, tokens bool) (string, error) {
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
		if _, isNum := p[0].(json.Number); isNum && tokens {
			ids, err := tokenIDs(raw, "prompt")
			if err != nil {
				return "", err
			}
			return detokenize(ids), nil
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
