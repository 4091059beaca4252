package processor

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"

	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/jsonedit"
	"github.com/pdx-router/pdx/internal/kvcache"
	"github.com/pdx-router/pdx/internal/routing"
)

// Where a request's token count came from (metrics' sources).
const (
	tokensRendered = "render"
	tokensEstimate = "estimate"
)

// Why a render failed (pdx_render_failures_total's reasons).
const (
	// renderForbidden: the server answered 403, as vLLM does unless it
	// runs with --enable-scale-out.
	renderForbidden = "forbidden"
	renderError     = "error"
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

// tokenize gets the request's prompt tokens from the pool's render server
// and hashes them in the engines' blocks for precise placement. It reports
// whether it did; on failure the request is placed by the byte estimate,
// which it never fails for. Renders that keep failing (engines without the
// render API: SGLang's) pause for routing.RenderPause, so that every
// request does not pay for one more.
func (r *request) tokenize(ctx context.Context, pool *routing.Pool, creq *connectors.Request, model string) bool {
	rd := pool.Render
	if rd == nil {
		return false
	}
	if !rd.Ready() {
		r.obs.tokenized(pool, tokensEstimate)
		return false
	}
	ids, err := r.render(ctx, pool, creq)
	if err != nil {
		reason := renderError
		if e, ok := errors.AsType[*engines.Error](err); ok && e.Status == http.StatusForbidden {
			reason = renderForbidden
			if rd.Forbidden() {
				r.log.LogAttrs(ctx, slog.LevelWarn, "the render server refused to render (403): vLLM serves its render API only when started with --enable-scale-out; placing by the estimate",
					slog.String("pool", pool.Name), slog.String("render_server", e.Endpoint.Address), slog.String("error", err.Error()))
			}
		}
		r.obs.renderFailed(pool, reason)
		if rd.Failed() {
			r.log.LogAttrs(ctx, slog.LevelWarn, "renders keep failing, placing by the estimate for a while",
				slog.String("pool", pool.Name), slog.Duration("pause", routing.RenderPause), slog.String("error", err.Error()))
		}
		r.obs.tokenized(pool, tokensEstimate)
		r.log.LogAttrs(ctx, slog.LevelDebug, "render failed, placing by the estimate",
			slog.String("pool", pool.Name), slog.String("error", err.Error()))
		return false
	}
	rd.Succeeded()
	r.obs.tokenized(pool, tokensRendered)
	if pool.Cache != nil {
		seed := pool.Cache.SeedFor(model)
		r.tokenBlocks = kvcache.HashTokens(r.tokenBlocks[:0], seed, ids, pool.KVBlockSize, maxTokenBlocks)
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
	answer, err := r.env.Engine.Post(ctx, ep, path, r.id, endpoint.Rank{}, connectors.PlainPieces(nil, creq.Body))
	if err != nil {
		return nil, fmt.Errorf("render on %s: %w", ep.Address, err)
	}
	return renderedTokens(answer)
}

// renderedTokens reads the token ids of a render answer: one
// GenerateRequest (vllm/entrypoints/serve/disagg/protocol.py) for a chat,
// a list of them (one a prompt) for a completion, of which placement uses
// the first. jsonedit validates the object and reads its ids, which
// encoding/json takes milliseconds to decode for a long prompt.
func renderedTokens(answer []byte) ([]uint32, error) {
	answer = bytes.TrimSpace(answer)
	if len(answer) > 0 && answer[0] == '[' {
		var list []json.RawMessage
		if err := json.Unmarshal(answer, &list); err != nil {
			return nil, fmt.Errorf("render answer: %w", err)
		}
		if len(list) == 0 {
			return nil, errors.New("render answer: an empty list")
		}
		answer = list[0]
	}
	g, err := jsonedit.Parse(answer)
	if err != nil {
		return nil, fmt.Errorf("render answer: %w", err)
	}
	raw, ok := g.Raw("token_ids")
	if !ok {
		return nil, errors.New("render answer: no token_ids")
	}
	ids, err := jsonedit.Uint32s(raw)
	if err != nil {
		return nil, fmt.Errorf("render answer: token_ids: not an array of token ids: %w", err)
	}
	if len(ids) == 0 {
		return nil, errors.New("render answer: no token_ids")
	}
	return ids, nil
}
