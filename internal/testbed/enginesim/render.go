package enginesim

import (
	"net/http"
)

// The Renderer APIs of vLLM's OpenAI server (vllm/entrypoints/serve/render/
// api_router.py: render_chat_completion, render_completion) turn a request
// into the token-in GenerateRequest the engine would run
// (vllm/entrypoints/serve/disagg/protocol.py) without running it:
// /v1/chat/completions/render answers one, /v1/completions/render a list
// (one per prompt). vllm-router's kv_aware policy asks a prefill engine for
// them to learn a request's token ids; the simulator answers with its own
// tokenizer's, the ids its KV events carry, so that the router's block
// keys and the engine's blocks agree.

// generateRequest is vLLM's GenerateRequest as it serializes one the
// renderer made: no multimodal features, no salt, default priority.
type generateRequest struct {
	RequestID        string         `json:"request_id"`
	TokenIDs         []uint32       `json:"token_ids"`
	Features         any            `json:"features"`
	SamplingParams   samplingParams `json:"sampling_params"`
	Model            string         `json:"model"`
	Stream           bool           `json:"stream"`
	StreamOptions    any            `json:"stream_options"`
	CacheSalt        any            `json:"cache_salt"`
	Priority         int            `json:"priority"`
	KVTransferParams any            `json:"kv_transfer_params"`
}

// samplingParams is the part of vLLM's SamplingParams the simulator
// resolves (the limits; the rest keeps vLLM's defaults and is left out).
type samplingParams struct {
	N         int `json:"n"`
	MaxTokens int `json:"max_tokens"`
	MinTokens int `json:"min_tokens"`
}

// scaleOutDisabled is vLLM 0.32's answer to a render without
// --enable-scale-out.
const scaleOutDisabled = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."

func (s *Server) handleRender(a api) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if s.cfg.NoScaleOut {
			writeError(w, &apiError{status: http.StatusForbidden, msg: scaleOutDisabled})
			return
		}
		body, err := readBody(w, r)
		if err != nil {
			writeError(w, badRequest("reading request body: %v", err))
			return
		}
		req, err := s.parseRequest(a, body)
		if err != nil {
			writeError(w, asAPIError(err))
			return
		}
		prefix := "cmpl-"
		switch a {
		case apiChat, apiMessages:
			prefix = "chatcmpl-"
		case apiResponses:
			prefix = "resp_"
		}
		g := generateRequest{
			RequestID:      prefix + randomHex(16),
			TokenIDs:       s.renderedTokens(req.prompt),
			SamplingParams: samplingParams{N: 1, MaxTokens: req.maxTokens, MinTokens: req.minTokens},
			Model:          req.model,
		}
		if a != apiCompletions {
			writeJSON(w, http.StatusOK, g) // one, as chat's (and vLLM 0.32's Responses and Messages renders)
			return
		}
		writeJSON(w, http.StatusOK, []generateRequest{g})
	}
}

// renderedTokens is the token ids of prompt as the engine's KV events
// carry them (scaled by KVEvents.TokenScale).
func (s *Server) renderedTokens(prompt string) []uint32 {
	ids := tokenize(prompt)
	if k := s.cfg.KVEvents; k != nil && k.TokenScale > 1 {
		return scaleTokens(ids, k.TokenScale)
	}
	return ids
}
