package enginesim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"
)

// Anthropic's Messages API as vLLM 0.32 serves it
// (vllm/entrypoints/anthropic: protocol.py AnthropicMessagesRequest and
// AnthropicMessagesResponse, serving.py AnthropicServingMessages): the
// request becomes a chat request (its X-Request-Id the chat id), the
// answer is converted back, and a stream's events are message_start (with
// the first token), content_block_start, a content_block_delta per token,
// content_block_stop, message_delta (the stop reason and usage) and
// message_stop.

// parseMessages reads an AnthropicMessagesRequest: model, messages and
// max_tokens are required (a 400 from pydantic otherwise), max_tokens
// positive; system (a string or text blocks) comes first in the prompt.
func (r *inferenceRequest) parseMessages() error {
	var missing []string
	for _, f := range []string{"model", "messages", "max_tokens"} {
		if _, ok := r.fields[f]; !ok {
			missing = append(missing, f+": Field required")
		}
	}
	if len(missing) > 0 {
		return validationError(missing...)
	}
	var msgs []struct {
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(r.fields["messages"], &msgs); err != nil {
		return validationError("messages: Input should be a valid list")
	}
	var conv []Message
	system, err := partsText(r.fields["system"], "text")
	if err != nil {
		return validationError("system: " + err.Error())
	}
	for i, m := range msgs {
		if m.Role != "user" && m.Role != "assistant" && m.Role != "system" {
			return validationError(fmt.Sprintf("messages.%d.role: Input should be 'user', 'assistant' or 'system'", i))
		}
		text, err := partsText(m.Content, "text")
		if err != nil {
			return validationError(fmt.Sprintf("messages.%d.content: %v", i, err))
		}
		if m.Role == "system" {
			system += text // joined into the one system message
			continue
		}
		conv = append(conv, Message{Role: m.Role, Content: text})
	}
	if system != "" {
		conv = append([]Message{{Role: "system", Content: system}}, conv...)
	}
	r.prompt = ChatPromptText(conv)
	n, err := r.intField("max_tokens")
	switch {
	case err != nil:
		return err
	case n <= 0:
		return validationError("max_tokens: Value error, max_tokens must be positive")
	}
	r.maxTokens = int(min(n, maxMaxTokens))
	return nil
}

// messagesObject is AnthropicMessagesResponse dumped with
// exclude_none=True.
type messagesObject struct {
	ID               string          `json:"id"`
	Type             string          `json:"type"`
	Role             string          `json:"role"`
	Content          []messagesBlock `json:"content"`
	Model            string          `json:"model"`
	StopReason       *string         `json:"stop_reason,omitempty"`
	Usage            *messagesUsage  `json:"usage,omitempty"`
	KVTransferParams json.RawMessage `json:"kv_transfer_params,omitempty"`
}

type messagesBlock struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

// messagesUsage is AnthropicUsage as _build_anthropic_usage makes it from
// chat's usage: the cached tokens, known with
// --enable-prompt-tokens-details, are not input_tokens.
type messagesUsage struct {
	InputTokens          int  `json:"input_tokens"`
	OutputTokens         int  `json:"output_tokens"`
	CacheReadInputTokens *int `json:"cache_read_input_tokens,omitempty"`
}

func (s *Server) messagesUsageOf(x *exchange, completion int) *messagesUsage {
	u := s.usageOf(x, completion)
	m := &messagesUsage{InputTokens: u.PromptTokens, OutputTokens: completion}
	if d := u.PromptTokensDetails; d != nil {
		m.InputTokens -= d.CachedTokens
		m.CacheReadInputTokens = &d.CachedTokens
	}
	return m
}

// messagesStopReason maps chat's finish reason as
// _to_anthropic_stop_reason does; nil for an aborted request.
func messagesStopReason(finish string) *string {
	var r string
	switch finish {
	case "length":
		r = "max_tokens"
	case "stop":
		r = "end_turn"
	default:
		return nil
	}
	return &r
}

func (s *Server) messagesAnswer(x *exchange, toks []string, finish string, kvParams json.RawMessage) messagesObject {
	if isNull(kvParams) {
		kvParams = nil // exclude_none
	}
	return messagesObject{
		ID: messagesID(x), Type: "message", Role: "assistant", Model: x.req.model,
		Content:    []messagesBlock{{Type: "text", Text: strings.Join(toks, "")}},
		StopReason: messagesStopReason(finish), Usage: s.messagesUsageOf(x, len(toks)), KVTransferParams: kvParams,
	}
}

// messagesID is chat's id, from the X-Request-Id.
func messagesID(x *exchange) string {
	rid := x.rec.RequestID
	if rid == "" {
		rid = randomHex(16)
	}
	return "chatcmpl-" + rid
}

func (s *Server) streamMessages(x *exchange, toks []string, delay func(int) time.Duration, finish string) {
	id := messagesID(x)
	ev := func(data map[string]any) agentEvent { return agentEvent{name: data["type"].(string), data: data} }
	start := func() agentEvent {
		return ev(map[string]any{"type": "message_start", "message": map[string]any{
			"id": id, "type": "message", "role": "assistant", "content": []any{}, "model": x.req.model,
			"stop_reason": nil, "stop_sequence": nil, "usage": s.messagesUsageOf(x, 0)}})
	}
	s.agentStream(x, toks, delay, finish, agentStreamEvents{
		first: func() []agentEvent {
			return []agentEvent{start(), ev(map[string]any{"type": "content_block_start", "index": 0,
				"content_block": messagesBlock{Type: "text"}})}
		},
		token: func(tok string) []agentEvent {
			return []agentEvent{ev(map[string]any{"type": "content_block_delta", "index": 0,
				"delta": map[string]any{"type": "text_delta", "text": tok}})}
		},
		end: func(n int, finish string) []agentEvent {
			var evs []agentEvent
			if n == 0 {
				evs = append(evs, start())
			} else {
				evs = append(evs, ev(map[string]any{"type": "content_block_stop", "index": 0}))
			}
			return append(evs,
				ev(map[string]any{"type": "message_delta", "delta": map[string]any{"stop_reason": messagesStopReason(finish), "stop_sequence": nil},
					"usage": s.messagesUsageOf(x, n)}),
				ev(map[string]any{"type": "message_stop"}))
		},
	})
}

// agentEvent is one SSE event of the agent APIs: "event: <name>" and its
// data.
type agentEvent struct {
	name string
	data any
}

// agentStreamEvents are what a stream of an agent API sends: at its start,
// with its first token, for each token, and at its end (n tokens sent).
type agentStreamEvents struct {
	start []agentEvent
	first func() []agentEvent
	token func(tok string) []agentEvent
	end   func(n int, finish string) []agentEvent
}

// agentStream paces toks as stream does, with the API's events.
func (s *Server) agentStream(x *exchange, toks []string, delay func(int) time.Duration, finish string, evs agentStreamEvents) {
	ctx := x.runContext()
	if !x.headersSent {
		x.writeStreamHeader()
	}
	rc := http.NewResponseController(x.w)
	send := func(events []agentEvent) error {
		for _, e := range events {
			if _, err := fmt.Fprintf(x.w, "event: %s\ndata: %s\n\n", e.name, mustJSON(e.data)); err != nil {
				return err
			}
		}
		return rc.Flush()
	}
	if err := send(evs.start); err != nil {
		s.abandon(x, err)
		return
	}
	n := 0
	for i, tok := range toks {
		if err := sleep(ctx, delay(i)); err != nil {
			if !errors.Is(context.Cause(ctx), errAborted) {
				s.abandon(x, context.Cause(ctx))
				return
			}
			finish = "abort"
			break
		}
		var out []agentEvent
		if i == 0 {
			out = evs.first()
		}
		out = append(out, evs.token(tok)...)
		if err := send(out); err != nil {
			s.abandon(x, err)
			return
		}
		n++
	}
	// Record before the last events so that a client which has read the
	// whole stream always finds the record.
	x.rec.Status = http.StatusOK
	s.commit(x.seq, x.rec)
	_ = send(evs.end(n, finish))
}
