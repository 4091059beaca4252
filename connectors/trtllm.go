package connectors

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"strconv"
	"strings"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/jsonedit"
)

// TensorRT-LLM protocols (a pool's trtllm_protocol).
const (
	// TRTLLMCurrent is what TensorRT-LLM's disagg server sends today: a
	// disagg_request_id on both legs, and the context's usage and prompt
	// token ids on the generation leg. The default.
	TRTLLMCurrent = "current"
	// TRTLLMLegacy is for servers whose DisaggregatedParams has only
	// request_type, first_gen_tokens, ctx_request_id, encoded_opaque_state
	// and draft_tokens: they refuse any other member (extra="forbid").
	TRTLLMLegacy = "legacy"
)

var _ Connector = TRTLLM{}

func trtllmSpec() Spec {
	return Spec{
		Names:      []string{"trtllm"},
		Fields:     []string{FieldTRTLLMProtocol},
		ClientKeys: []string{keyDisaggregatedParams},
		Defaults: func(p *configv1.Pool) {
			if p.TrtllmProtocol == "" {
				p.TrtllmProtocol = TRTLLMCurrent
			}
		},
		Validate: func(p *configv1.Pool, path string) []error {
			if tp := p.GetTrtllmProtocol(); tp != TRTLLMCurrent && tp != TRTLLMLegacy {
				return []error{fieldError(path+".trtllm_protocol", "%q is not %q or %q", tp, TRTLLMCurrent, TRTLLMLegacy)}
			}
			return nil
		},
		// No decode fallback: whether a generation server other than the
		// first can still fetch the context server's KV once the first has
		// (or has failed to) is not established; pdx does not bet on it.
		// TensorRT-LLM's disaggregated server routes only completions and
		// chat (tensorrt_llm/serve/openai_disagg_server.py,
		// OpenAIDisaggServer.register_routes): its Responses and Messages
		// endpoints take no disaggregated_params.
		Traits: func(*configv1.Pool) Traits {
			return Traits{Prefills: true, NotDisaggregated: APIResponses | APIMessages}
		},
		New: func(p *configv1.Pool) (Connector, error) {
			switch p.GetTrtllmProtocol() {
			case "", TRTLLMCurrent:
				return TRTLLM{}, nil
			case TRTLLMLegacy:
				return TRTLLM{Legacy: true}, nil
			}
			return nil, fmt.Errorf("unknown trtllm protocol %q (known: %s, %s)", p.GetTrtllmProtocol(), TRTLLMCurrent, TRTLLMLegacy)
		},
	}
}

// TRTLLM is TensorRT-LLM's disaggregated serving protocol, as its disagg
// server drives it (context first): a context_only request to the context
// server, whose answer carries disaggregated_params (the context request id,
// the first generated tokens, an opaque transfer state), then a
// generation_only request carrying those params to the generation server.
type TRTLLM struct {
	// Legacy leaves out what servers older than disagg_request_id refuse.
	Legacy bool
}

// trtllmGenerationOnly is the request_type of the generation leg. It is
// only ever read (see stateless_test.go).
var trtllmGenerationOnly = []byte(`"generation_only"`)

// Prepare implements [Connector].
func (c TRTLLM) Prepare(ctx context.Context, env Env, req *Request) (Handoff, error) {
	var disaggID uint64
	if !c.Legacy {
		disaggID = trtllmDisaggRequestID()
	}
	answer, err := env.Engine.Post(ctx, req.Prefill, req.Path, req.ID, endpoint.Rank{}, trtllmContextBody(req.Body, disaggID))
	if err != nil {
		return Handoff{}, engineFailure(req.Prefill, err)
	}
	ca, err := parseTRTLLMContext(answer)
	if err == nil && !ca.finished {
		err = trtllmCheckSource(req, ca.params)
	}
	if err != nil {
		return Handoff{}, &engines.Error{Endpoint: req.Prefill, Message: "reading the context answer", Err: err}
	}
	if ca.finished {
		// The context server finished the request (EOS or a stop string on
		// the first token): as upstream's disagg server does, the client
		// gets the context's answer, and no generation server is asked.
		return Handoff{Answer: trtllmFinalAnswer(req.Body, req.Path, ca)}, nil
	}
	return Handoff{Decode: Decode{Body: trtllmGenerationBody(req, ca, c.Legacy, disaggID)}}, nil
}

// trtllmDisaggRequestID returns a fresh id in [2^40, 2^63-1), the range of
// the global ids TensorRT-LLM's disagg server generates (below 2^40 the
// workers number requests themselves). Fresh per attempt, as upstream
// regenerates it on retry.
func trtllmDisaggRequestID() uint64 {
	const lo, hi = 1 << 40, 1<<63 - 1
	return lo + rand.Uint64N(hi-lo)
}

// trtllmContextBody is the client body as a context-only, non-streaming
// request. Like upstream's disagg server, pdx leaves the output limit alone.
func trtllmContextBody(client jsonedit.Object, disaggID uint64) net.Buffers {
	params := []byte(`{"request_type":"context_only"`)
	if disaggID != 0 {
		params = strconv.AppendUint(append(params, `,"disagg_request_id":`...), disaggID, 10)
	}
	params = append(params, '}')
	return enginePieces(nil, client,
		jsonedit.Set("stream", jsonFalse),
		jsonedit.Delete("stream_options"),
		jsonedit.Set(keyDisaggregatedParams, params))
}

// trtllmContext is what pdx reads from a context server's answer.
type trtllmContext struct {
	resp     jsonedit.Object
	choice   jsonedit.Object // choices[0]
	params   jsonedit.Object // choices[0].disaggregated_params; unset when finished
	finished bool
}

// parseTRTLLMContext reads a context answer. Every id stays its JSON text
// (ctx_request_id is a 64-bit integer).
func parseTRTLLMContext(answer []byte) (trtllmContext, error) {
	var ca trtllmContext
	var err error
	if ca.resp, err = jsonedit.Parse(answer); err != nil {
		return ca, fmt.Errorf("%w: %w", engines.ErrBadAnswer, err)
	}
	rawChoices, ok := ca.resp.Raw("choices")
	if !ok {
		return ca, fmt.Errorf("%w: no choices", engines.ErrBadAnswer)
	}
	// RawMessage keeps each choice's bytes; nothing goes through float64.
	var choices []json.RawMessage
	if err := json.Unmarshal(rawChoices, &choices); err != nil || len(choices) != 1 {
		return ca, fmt.Errorf("%w: choices is %.40s, not an array of one choice", engines.ErrBadAnswer, rawChoices)
	}
	if ca.choice, err = jsonedit.Parse(choices[0]); err != nil {
		return ca, fmt.Errorf("%w: choices[0] is %.40s, not an object", engines.ErrBadAnswer, choices[0])
	}
	if ca.finished = trtllmFinished(ca.choice); ca.finished {
		return ca, nil
	}
	raw, ok := ca.choice.Raw(keyDisaggregatedParams)
	if !ok || string(raw) == "null" {
		return ca, fmt.Errorf("%w: choices[0] has no disaggregated_params", engines.ErrBadAnswer)
	}
	if ca.params, err = jsonedit.Parse(raw); err != nil {
		return ca, fmt.Errorf("%w: disaggregated_params is %.40s, not an object", engines.ErrBadAnswer, raw)
	}
	if id, ok := ca.params.Raw("ctx_request_id"); !ok || !isJSONNumber(id) {
		return ca, fmt.Errorf("%w: disaggregated_params has no ctx_request_id", engines.ErrBadAnswer)
	}
	return ca, nil
}

// trtllmCheckSource checks ctx_info_endpoint, the one member of the
// context's params that names a host in the clear: it must be the context
// server pdx called (or an allowed host). The KV transfer's own addresses
// travel inside encoded_opaque_state, TensorRT-LLM's serialized transceiver
// state, which pdx cannot read.
func trtllmCheckSource(req *Request, params jsonedit.Object) error {
	raw, ok := params.Raw("ctx_info_endpoint")
	if !ok || string(raw) == "null" {
		return nil
	}
	var endpoints []string
	if s, ok := jsonString(raw); ok {
		endpoints = []string{string(s)}
	} else if json.Unmarshal(raw, &endpoints) != nil {
		return fmt.Errorf("%w: ctx_info_endpoint is %.40s, not a string or a list of strings", engines.ErrBadAnswer, raw)
	}
	for _, e := range endpoints {
		host := e
		if _, rest, ok := strings.Cut(host, "://"); ok {
			host = rest
		}
		if h, _, err := net.SplitHostPort(host); err == nil {
			host = h
		}
		if err := checkKVHost(req, []byte(host)); err != nil {
			return fmt.Errorf("ctx_info_endpoint %q: %w", e, err)
		}
	}
	return nil
}

// trtllmGenerationBody is the client body with the context's params as a
// generation_only request (every other member of them keeps its bytes). As
// upstream's disagg server does, the current protocol also hands over the
// context's usage, the disagg_request_id, and the context's prompt token
// ids, so that the generation server does not tokenize the prompt again.
func trtllmGenerationBody(req *Request, ca trtllmContext, legacy bool, disaggID uint64) []byte {
	edits := []jsonedit.Edit{jsonedit.Set("request_type", trtllmGenerationOnly)}
	var bodyEdits []jsonedit.Edit
	if !legacy {
		if usage, ok := ca.resp.Raw("usage"); ok && string(usage) != "null" {
			edits = append(edits, jsonedit.Set("ctx_usage", usage))
		}
		edits = append(edits, jsonedit.Set("disagg_request_id", strconv.AppendUint(nil, disaggID, 10)))
		if ids, ok := ca.resp.Raw("prompt_token_ids"); ok && len(ids) > 0 && ids[0] == '[' {
			key := "prompt_token_ids"
			if req.Path == "/v1/completions" {
				key = "prompt"
			}
			bodyEdits = append(bodyEdits, jsonedit.Set(key, ids))
		}
	}
	params := ca.params.AppendEdited(make([]byte, 0, ca.params.EditedLen(edits...)), edits...)
	return engineBody(req.Body, append(bodyEdits, jsonedit.Set(keyDisaggregatedParams, params))...)
}

// trtllmFinished reports whether a context answer's choice ended the request:
// upstream's disagg server skips the generation leg unless finish_reason is
// "length" or "not_finished". pdx is lenient where upstream is strict: a
// missing or null finish_reason counts as not finished.
func trtllmFinished(choice jsonedit.Object) bool {
	raw, _ := choice.Raw("finish_reason")
	reason, ok := jsonString(raw)
	return ok && string(reason) != "length" && string(reason) != "not_finished"
}

// trtllmFinalAnswer is the client's answer from a finished context answer:
// the answer without its disaggregated_params, as upstream returns it, or,
// for a client that asked for a stream, the same as server-sent events.
// (Upstream's disagg server streams only "data: [DONE]" then, dropping the
// text; pdx sends the text.)
func trtllmFinalAnswer(client jsonedit.Object, path string, ca trtllmContext) *Answer {
	choice := ca.choice.Edited(jsonedit.Delete(keyDisaggregatedParams))
	if raw, _ := client.Raw("stream"); string(raw) != "true" {
		choices := append(append([]byte{'['}, choice...), ']')
		return &Answer{ContentType: "application/json", Body: ca.resp.Edited(jsonedit.Set("choices", choices))}
	}
	return &Answer{ContentType: "text/event-stream", Body: trtllmEvents(client, path, ca)}
}

// trtllmEvents writes a finished answer as the chunks a streaming server
// sends: the whole text in one chunk, the usage chunk if the client asked
// for it, and the end marker.
func trtllmEvents(client jsonedit.Object, path string, ca trtllmContext) []byte {
	type delta struct {
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	type chunkChoice struct {
		Index        int             `json:"index"`
		Delta        *delta          `json:"delta,omitempty"`
		Text         json.RawMessage `json:"text,omitempty"`
		Logprobs     json.RawMessage `json:"logprobs"`
		FinishReason json.RawMessage `json:"finish_reason"`
	}
	type chunk struct {
		ID      json.RawMessage `json:"id,omitempty"`
		Object  string          `json:"object"`
		Created json.RawMessage `json:"created,omitempty"`
		Model   json.RawMessage `json:"model,omitempty"`
		Choices []chunkChoice   `json:"choices"`
		Usage   json.RawMessage `json:"usage,omitempty"`
	}
	raw := func(o jsonedit.Object, key string) json.RawMessage {
		if v, ok := o.Raw(key); ok {
			return v
		}
		return json.RawMessage("null")
	}
	c := chunk{ID: raw(ca.resp, "id"), Created: raw(ca.resp, "created"), Model: raw(ca.resp, "model")}
	cc := chunkChoice{Logprobs: json.RawMessage("null"), FinishReason: raw(ca.choice, "finish_reason")}
	if path == "/v1/completions" {
		c.Object = "text_completion"
		cc.Text = raw(ca.choice, "text")
	} else {
		c.Object = "chat.completion.chunk"
		content := json.RawMessage("null")
		if msg, err := jsonedit.Parse(raw(ca.choice, "message")); err == nil {
			content = raw(msg, "content")
		}
		cc.Delta = &delta{Role: "assistant", Content: content}
	}
	c.Choices = []chunkChoice{cc}
	var b bytes.Buffer
	event := func(v any) {
		data, _ := json.Marshal(v) // only raw values that parsed, and strings
		b.WriteString("data: ")
		b.Write(data)
		b.WriteString("\n\n")
	}
	event(c)
	if trtllmIncludeUsage(client) {
		event(chunk{ID: c.ID, Object: c.Object, Created: c.Created, Model: c.Model, Choices: []chunkChoice{}, Usage: raw(ca.resp, "usage")})
	}
	b.WriteString("data: [DONE]\n\n")
	return b.Bytes()
}

// trtllmIncludeUsage reports whether the client asked for the usage chunk.
func trtllmIncludeUsage(client jsonedit.Object) bool {
	raw, ok := client.Raw("stream_options")
	if !ok {
		return false
	}
	opts, err := jsonedit.Parse(raw)
	if err != nil {
		return false
	}
	v, _ := opts.Raw("include_usage")
	return string(v) == "true"
}

// isJSONNumber reports whether raw, a valid JSON value, is a number.
func isJSONNumber(raw []byte) bool {
	return raw[0] == '-' || raw[0] >= '0' && raw[0] <= '9'
}
