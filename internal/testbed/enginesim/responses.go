package enginesim

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"
)

// The agent APIs of vLLM 0.32's OpenAI server: OpenAI's Responses API
// (vllm/entrypoints/openai/responses: protocol.py ResponsesRequest and
// ResponsesResponse, serving.py OpenAIServingResponses, streaming_events.py
// SimpleStreamingEventProcessor) and Anthropic's Messages API (messages.go).
// Both render their prompt through the model's chat template, as chat
// does, and take kv_transfer_params: a prefill's answer carries its own at
// the top level, as chat's does. The simulator serves them in the vLLM
// dialect only (SGLang and TensorRT-LLM take no P/D there).

// parseAgentRequest parses a Responses or Messages request as vLLM's
// request models do, in the fields the simulator acts on.
func parseAgentRequest(a api, d dialect, body []byte) (*inferenceRequest, error) {
	if d != dialectVLLM {
		return nil, &apiError{status: http.StatusNotFound, msg: "the simulator serves the Responses and Messages APIs as vLLM does, not in this engine's dialect"}
	}
	req := &inferenceRequest{api: a}
	if err := decodeJSON(body, &req.fields); err != nil || req.fields == nil {
		return nil, badRequest("request body is not a JSON object")
	}
	if err := req.field("model", &req.model); err != nil {
		return nil, err
	}
	var err error
	if a == apiResponses {
		err = req.parseResponses()
	} else {
		err = req.parseMessages()
	}
	if err != nil {
		return nil, err
	}
	req.promptTokens = promptTokens(req.prompt)
	if req.stream, err = req.boolField("stream"); err != nil {
		return nil, err
	}
	if err := req.parseKVTransferParams(); err != nil {
		return nil, err
	}
	return req, nil
}

// boolField reads an Optional bool (pydantic's lax bool), false when absent.
func (r *inferenceRequest) boolField(name string) (bool, error) {
	raw, ok := r.fields[name]
	if !ok || isNull(raw) {
		return false, nil
	}
	var v any
	if err := decodeJSON(raw, &v); err != nil {
		return false, badRequest("invalid %s: %v", name, err)
	}
	b, msg := laxBool(v)
	if msg != "" {
		return false, validationError(name + ": " + msg)
	}
	return b, nil
}

// parseResponses reads a ResponsesRequest: input (a string, or items),
// instructions, max_output_tokens, and the stored state vLLM refuses
// without VLLM_ENABLE_RESPONSES_API_STORE (the default): background needs
// it (_validate_create_responses_input: 400), a previous_response_id names
// a response it never stored (404); store itself is ignored.
func (r *inferenceRequest) parseResponses() error {
	raw, ok := r.fields["input"]
	if !ok {
		return validationError("input: Field required")
	}
	msgs, err := responsesInput(raw)
	if err != nil {
		return err
	}
	var instructions string
	if err := r.field("instructions", &instructions); err != nil {
		return err
	}
	if instructions != "" {
		// The renderer puts instructions first, as a system message.
		msgs = append([]Message{{Role: "system", Content: instructions}}, msgs...)
	}
	r.prompt = ChatPromptText(msgs)
	r.maxTokens = defaultMaxTokens // vLLM: what the context leaves; the simulator's short default
	if r.has("max_output_tokens") {
		n, err := r.intField("max_output_tokens")
		switch {
		case err != nil:
			return err
		case n < 1:
			return vllmValidationError(fmt.Sprintf("max_tokens must be at least 1, got %d.", n), "max_tokens", n)
		}
		r.maxTokens = int(min(n, maxMaxTokens))
	}
	background, err := r.boolField("background")
	if err != nil {
		return err
	}
	store := true
	if r.has("store") {
		if store, err = r.boolField("store"); err != nil {
			return err
		}
	}
	switch {
	case background && !store:
		return validationError("Value error, background can only be used when `store` is true")
	case background:
		return badRequest("This vLLM engine does not support `store=True` and therefore does not support the background mode. " +
			"To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.")
	}
	var prev string
	if err := r.field("previous_response_id", &prev); err != nil {
		return err
	}
	if prev != "" {
		return &apiError{status: http.StatusNotFound, msg: fmt.Sprintf("Response with id '%s' not found.", prev)}
	}
	return nil
}

// responsesInput is the conversation of a Responses input: a string is
// one user message; items of type "message" (or without a type) keep
// their role and the text of their content (a string, or input_text and
// output_text parts).
func responsesInput(raw json.RawMessage) ([]Message, error) {
	var text string
	if err := json.Unmarshal(raw, &text); err == nil {
		return []Message{{Role: "user", Content: text}}, nil
	}
	var items []struct {
		Type    string          `json:"type"`
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(raw, &items); err != nil {
		return nil, validationError("input: Input should be a valid string or a valid list")
	}
	var msgs []Message
	for i, it := range items {
		if it.Type != "" && it.Type != "message" {
			continue // function calls and their outputs carry no text here
		}
		if it.Role == "" {
			return nil, validationError(fmt.Sprintf("input.%d.role: Field required", i))
		}
		content, err := partsText(it.Content, "input_text", "output_text", "text")
		if err != nil {
			return nil, validationError(fmt.Sprintf("input.%d.content: %v", i, err))
		}
		msgs = append(msgs, Message{Role: it.Role, Content: content})
	}
	return msgs, nil
}

// partsText is the text of content: a string, or the text of its parts of
// the given types, joined.
func partsText(raw json.RawMessage, types ...string) (string, error) {
	if isNull(raw) {
		return "", nil
	}
	var text string
	if err := json.Unmarshal(raw, &text); err == nil {
		return text, nil
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", fmt.Errorf("content must be a string or an array of content parts")
	}
	var sb strings.Builder
	for _, p := range parts {
		for _, t := range types {
			if p.Type == t {
				sb.WriteString(p.Text)
			}
		}
	}
	return sb.String(), nil
}

// responsesID is a Responses answer's id: the request's request_id, or
// vLLM's default resp_<uuid>.
func responsesID(x *exchange) string {
	var id string
	if err := x.req.field("request_id", &id); err == nil && id != "" {
		return id
	}
	return "resp_" + randomHex(16)
}

// Responses' answer objects, in vLLM's field order (ResponsesResponse is
// dumped with mode="json", by_alias=True: nulls included).
type responsesObject struct {
	ID                 string                `json:"id"`
	CreatedAt          int64                 `json:"created_at"`
	IncompleteDetails  *responsesIncomplete  `json:"incomplete_details"`
	Instructions       json.RawMessage       `json:"instructions"`
	Metadata           json.RawMessage       `json:"metadata"`
	Model              string                `json:"model"`
	Object             string                `json:"object"`
	Output             []responsesOutputItem `json:"output"`
	ParallelToolCalls  bool                  `json:"parallel_tool_calls"`
	Temperature        float64               `json:"temperature"`
	ToolChoice         string                `json:"tool_choice"`
	Tools              []any                 `json:"tools"`
	TopP               float64               `json:"top_p"`
	Background         bool                  `json:"background"`
	MaxOutputTokens    int                   `json:"max_output_tokens"`
	MaxToolCalls       *int                  `json:"max_tool_calls"`
	PreviousResponseID *string               `json:"previous_response_id"`
	Prompt             any                   `json:"prompt"`
	Reasoning          any                   `json:"reasoning"`
	ServiceTier        string                `json:"service_tier"`
	Status             string                `json:"status"`
	Text               any                   `json:"text"`
	TopLogprobs        *int                  `json:"top_logprobs"`
	Truncation         string                `json:"truncation"`
	Usage              *responsesUsage       `json:"usage"`
	User               *string               `json:"user"`
	PresencePenalty    float64               `json:"presence_penalty"`
	FrequencyPenalty   float64               `json:"frequency_penalty"`
	KVTransferParams   json.RawMessage       `json:"kv_transfer_params"`
	ECTransferParams   json.RawMessage       `json:"ec_transfer_params"`
	InputMessages      any                   `json:"input_messages"`
	OutputMessages     any                   `json:"output_messages"`
}

type responsesIncomplete struct {
	Reason string `json:"reason"`
}

type responsesOutputItem struct {
	ID      string              `json:"id"`
	Content []responsesTextPart `json:"content"`
	Role    string              `json:"role"`
	Status  string              `json:"status"`
	Type    string              `json:"type"`
}

type responsesTextPart struct {
	Annotations []any  `json:"annotations"`
	Text        string `json:"text"`
	Type        string `json:"type"`
	Logprobs    []any  `json:"logprobs"`
}

// responsesUsage is vLLM's ResponseUsage: the cached tokens always (the
// context's num_cached_tokens), unlike chat's prompt_tokens_details.
type responsesUsage struct {
	InputTokens         int                   `json:"input_tokens"`
	InputTokensDetails  responsesInputDetails `json:"input_tokens_details"`
	OutputTokens        int                   `json:"output_tokens"`
	OutputTokensDetails responsesOutDetails   `json:"output_tokens_details"`
	TotalTokens         int                   `json:"total_tokens"`
}

type responsesInputDetails struct {
	CachedTokens        int   `json:"cached_tokens"`
	CacheWriteTokens    int   `json:"cache_write_tokens"`
	InputTokensPerTurn  []int `json:"input_tokens_per_turn"`
	CachedTokensPerTurn []int `json:"cached_tokens_per_turn"`
}

type responsesOutDetails struct {
	ReasoningTokens         int   `json:"reasoning_tokens"`
	ToolOutputTokens        int   `json:"tool_output_tokens"`
	OutputTokensPerTurn     []int `json:"output_tokens_per_turn"`
	ToolOutputTokensPerTurn []int `json:"tool_output_tokens_per_turn"`
}

// responsesUsageOf is the usage of an answer with completion output tokens.
func (s *Server) responsesUsageOf(x *exchange, completion int) *responsesUsage {
	u := s.usageOf(x, completion)
	cached := 0
	if d := u.PromptTokensDetails; d != nil {
		cached = d.CachedTokens
	}
	return &responsesUsage{
		InputTokens: u.PromptTokens, OutputTokens: completion, TotalTokens: u.PromptTokens + completion,
		InputTokensDetails:  responsesInputDetails{CachedTokens: cached, InputTokensPerTurn: []int{}, CachedTokensPerTurn: []int{}},
		OutputTokensDetails: responsesOutDetails{OutputTokensPerTurn: []int{}, ToolOutputTokensPerTurn: []int{}},
	}
}

// tokenScale is KVEvents.TokenScale, 1 without.
func (s *Server) tokenScale() int {
	if k := s.cfg.KVEvents; k != nil && k.TokenScale > 1 {
		return k.TokenScale
	}
	return 1
}

// responsesAnswer is the ResponsesResponse of toks ending with finish:
// in_progress with no output and no usage while a stream announces it.
func (s *Server) responsesAnswer(x *exchange, id, itemID string, created int64, toks []string, finish string, kvParams json.RawMessage) responsesObject {
	o := responsesObject{
		ID: id, CreatedAt: created, Model: x.req.model, Object: "response", Output: []responsesOutputItem{},
		Instructions: rawOrNull(x.req.fields["instructions"]), Metadata: rawOrNull(x.req.fields["metadata"]),
		ParallelToolCalls: true, Temperature: 1, ToolChoice: "auto", Tools: []any{}, TopP: 1,
		MaxOutputTokens: x.req.maxTokens, ServiceTier: "auto", Status: "in_progress", Truncation: "disabled",
		KVTransferParams: kvParams,
	}
	if toks == nil {
		return o
	}
	text := strings.Join(toks, "")
	o.Output = []responsesOutputItem{{ID: itemID, Role: "assistant", Status: "completed", Type: "message",
		Content: []responsesTextPart{{Annotations: []any{}, Text: text, Type: "output_text"}}}}
	o.Status = "completed"
	if finish == "length" {
		o.Status, o.IncompleteDetails = "incomplete", &responsesIncomplete{Reason: "max_output_tokens"}
	}
	o.Usage = s.responsesUsageOf(x, len(toks))
	return o
}

func rawOrNull(raw json.RawMessage) json.RawMessage {
	if len(raw) == 0 {
		return json.RawMessage("null")
	}
	return raw
}

// streamResponses answers a streamed Responses request with vLLM's events:
// response.created and response.in_progress, the message item and its
// text part opened, a response.output_text.delta per token, the part and
// item done, and response.completed with the whole response and its usage
// (responses_stream_generator, _process_simple_streaming_events). Each is
// "event: <type>" and its JSON, numbered by sequence_number.
func (s *Server) streamResponses(x *exchange, toks []string, delay func(int) time.Duration, finish string) {
	id, itemID, created := responsesID(x), "msg_"+randomHex(16), time.Now().Unix()
	seq := 0
	events := func(evs ...map[string]any) []agentEvent {
		out := make([]agentEvent, len(evs))
		for i, ev := range evs {
			ev["sequence_number"] = seq
			seq++
			out[i] = agentEvent{name: ev["type"].(string), data: ev}
		}
		return out
	}
	announce := s.responsesAnswer(x, id, itemID, created, nil, "", nil)
	part := func(text string, logprobs []any) responsesTextPart {
		return responsesTextPart{Annotations: []any{}, Text: text, Type: "output_text", Logprobs: logprobs}
	}
	var text strings.Builder
	s.agentStream(x, toks, delay, finish, agentStreamEvents{
		start: events(
			map[string]any{"type": "response.created", "response": announce},
			map[string]any{"type": "response.in_progress", "response": announce}),
		first: func() []agentEvent {
			return events(
				map[string]any{"type": "response.output_item.added", "output_index": 0,
					"item": responsesOutputItem{ID: itemID, Content: []responsesTextPart{}, Role: "assistant", Status: "in_progress", Type: "message"}},
				map[string]any{"type": "response.content_part.added", "output_index": 0, "content_index": 0, "item_id": itemID, "part": part("", []any{})})
		},
		token: func(tok string) []agentEvent {
			text.WriteString(tok)
			return events(map[string]any{"type": "response.output_text.delta", "output_index": 0, "content_index": 0,
				"item_id": itemID, "delta": tok, "logprobs": []any{}})
		},
		end: func(n int, finish string) []agentEvent {
			var evs []agentEvent
			if n > 0 {
				done := part(text.String(), nil)
				evs = events(
					map[string]any{"type": "response.output_text.done", "output_index": 0, "content_index": 0, "item_id": itemID,
						"text": text.String(), "logprobs": []any{}},
					map[string]any{"type": "response.content_part.done", "output_index": 0, "content_index": 0, "item_id": itemID, "part": done},
					map[string]any{"type": "response.output_item.done", "output_index": 0,
						"item": responsesOutputItem{ID: itemID, Content: []responsesTextPart{done}, Role: "assistant", Status: "completed", Type: "message"}})
			}
			return append(evs, events(map[string]any{"type": "response.completed",
				"response": s.responsesAnswer(x, id, itemID, created, toks[:n], finish, nil)})...)
		},
	})
}
