package processor

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"

	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/kvcache"
	"github.com/pdx-router/pdx/internal/routing"
)

// Where a request's token count came from (metrics' sources).
const (
	tokensRendered = "render"
	tokensEstimate = "estimate"
)

// vLLM's Renderer APIs (vllm/entrypoints/serve/render/api_router.py): the
// request as the engine would run it, tokens and all, without running it.
const (
	renderChatPath        = "/v1/chat/completions/render"
	renderCompletionsPath = "/v1/completions/render"
)

// maxTokenBlocks bounds the blocks of a rendered prompt that are matched:
// 128k tokens in vLLM's 16-token blocks; engines with smaller blocks match
// a shorter head.
const maxTokenBlocks = 8192

// rendered is the part of a render answer pdx reads: vLLM's
// GenerateRequest (vllm/entrypoints/serve/disagg/protocol.py).
type rendered struct {
	TokenIDs []uint32 `json:"token_ids"`
}

// tokenize gets the request's prompt tokens from the pool's render server
// and hashes them in the engines' blocks for precise placement. It reports
// whether it did; on failure the request is placed by the byte estimate,
// which it never fails for.
func (r *request) tokenize(ctx context.Context, pool *routing.Pool, creq *connectors.Request, model string) bool {
	rd := pool.Render
	if rd == nil {
		return false
	}
	ids, err := r.render(ctx, pool, creq)
	if err != nil {
		r.obs.tokenized(pool, tokensEstimate)
		r.log.LogAttrs(ctx, slog.LevelDebug, "render failed, placing by the estimate",
			slog.String("pool", pool.Name), slog.String("error", err.Error()))
		return false
	}
	r.obs.tokenized(pool, tokensRendered)
	if pool.Cache != nil {
		seed := pool.Cache.SeedFor(model)
		r.tokenBlocks = kvcache.HashTokens(r.tokenBlocks[:0], seed, ids, pool.KVBlockSize, maxTokenBlocks)
		if r.tokenBlocks == nil {
			// Shorter than a block: no engine holds any of it, and the
			// estimate's blocks must not say otherwise.
			r.tokenBlocks = []uint64{}
		}
	}
	r.tokens = len(ids)
	return true
}

// render asks the pool's render server for the tokens of creq's prompt,
// within the pool's render timeout.
func (r *request) render(ctx context.Context, pool *routing.Pool, creq *connectors.Request) ([]uint32, error) {
	ep, ok := pool.RenderEndpoint()
	if !ok {
		return nil, errors.New("no render server")
	}
	ctx, cancel := context.WithTimeout(ctx, pool.Render.Timeout)
	defer cancel()
	path := renderCompletionsPath
	if r.path == connectors.ChatCompletionsPath {
		path = renderChatPath
	}
	answer, err := r.env.Engine.Post(ctx, ep, path, r.id, endpoint.Rank{}, net.Buffers{connectors.Plain(creq.Body)})
	if err != nil {
		return nil, fmt.Errorf("render on %s: %w", ep.Address, err)
	}
	return renderedTokens(answer)
}

// renderedTokens reads the token ids of a render answer: one
// GenerateRequest for a chat, a list of them (one a prompt) for a
// completion, of which placement uses the first.
func renderedTokens(answer []byte) ([]uint32, error) {
	answer = bytes.TrimSpace(answer)
	var g rendered
	if len(answer) > 0 && answer[0] == '[' {
		var list []rendered
		if err := json.Unmarshal(answer, &list); err != nil {
			return nil, fmt.Errorf("render answer: %w", err)
		}
		if len(list) == 0 {
			return nil, errors.New("render answer: an empty list")
		}
		g = list[0]
	} else if err := json.Unmarshal(answer, &g); err != nil {
		return nil, fmt.Errorf("render answer: %w", err)
	}
	if len(g.TokenIDs) == 0 {
		return nil, errors.New("render answer: no token_ids")
	}
	return g.TokenIDs, nil
}
