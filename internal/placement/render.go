package placement

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/jsonedit"
	"github.com/pdx-router/pdx/internal/kvcache"
)

// Where a request's token count came from (Placement.Source).
const (
	TokensRendered = "render"
	TokensEstimate = "estimate"
)

// Why a render failed (Placement.RenderFailure, pdx_render_failures_total's
// reasons).
const (
	// RenderForbidden: the server answered 403, as vLLM does unless it
	// runs with --enable-scale-out.
	RenderForbidden = "forbidden"
	RenderError     = "error"
)

// vLLM's Renderer APIs (vllm/entrypoints/serve/render/api_router.py): the
// request as the engine would run it, tokens and all, without running it.
const (
	RenderChatPath        = "/v1/chat/completions/render"
	RenderCompletionsPath = "/v1/completions/render"
	// RenderResponsesPath and RenderMessagesPath render the Responses and
	// Messages APIs' requests (vLLM 0.32 with --enable-scale-out), each
	// answering one GenerateRequest as chat's does.
	RenderResponsesPath = "/v1/responses/render"
	RenderMessagesPath  = "/v1/messages/render"
)

// renderPath is where the request of the API at path is rendered.
func renderPath(path string) string {
	switch connectors.APIOf(path) {
	case connectors.APIChat:
		return RenderChatPath
	case connectors.APIResponses:
		return RenderResponsesPath
	case connectors.APIMessages:
		return RenderMessagesPath
	}
	return RenderCompletionsPath
}

// maxTokenBlocks bounds the blocks of a rendered prompt that are matched:
// 128k tokens in vLLM's 16-token blocks; engines with smaller blocks match
// a shorter head.
const maxTokenBlocks = 8192

// Render is a pool's source of prompt tokens (the config's Render).
type Render struct {
	// Address is the render server; empty: the pool's engines in turn.
	Address string
	Timeout time.Duration
	turn    atomic.Uint64
	// failures counts renders failed in a row; pausedUntil (Unix
	// nanoseconds) is when renders are tried again after RenderFailures.
	failures    atomic.Int32
	pausedUntil atomic.Int64
	// forbidden is set by the first refused render since the last success.
	forbidden atomic.Bool
}

// Renders that fail RenderFailures times in a row pause for RenderPause:
// a pool whose engines have no render API (SGLang's) does not pay a failed
// call per request.
const (
	RenderFailures = 5
	RenderPause    = 10 * time.Second
)

// Ready reports whether renders are tried now.
func (r *Render) Ready() bool {
	until := r.pausedUntil.Load()
	return until == 0 || time.Now().UnixNano() >= until
}

// Failed counts a failed render and reports whether it paused renders.
func (r *Render) Failed() bool {
	if r.failures.Add(1) < RenderFailures {
		return false
	}
	r.failures.Store(0)
	r.pausedUntil.Store(time.Now().Add(RenderPause).UnixNano())
	return true
}

// Succeeded ends a run of failures.
func (r *Render) Succeeded() {
	if r.failures.Load() != 0 {
		r.failures.Store(0)
	}
	if r.forbidden.Load() {
		r.forbidden.Store(false)
	}
}

// Forbidden notes a render the server refused (403) and reports whether it
// is the first since renders last succeeded, so that the reason is logged
// once, not per request.
func (r *Render) Forbidden() bool {
	return !r.forbidden.Swap(true)
}

// RenderEndpoint is where the next render goes: the configured server, or
// the pool's prefill engines (decode engines without a prefill leg) in
// turn. False when the pool renders nowhere.
func (p *Pool) RenderEndpoint() (endpoint.Endpoint, bool) {
	r := p.Render
	if r == nil {
		return endpoint.Endpoint{}, false
	}
	if r.Address != "" {
		return endpoint.Endpoint{Address: r.Address}, true
	}
	set := p.Prefill.Set
	if !p.Prefills {
		set = p.Decode.Set
	}
	return set.At(r.turn.Add(1) - 1)
}

// tokenize gets the prompt's tokens from the pool's render server and
// hashes them in the engines' blocks for precise placement, into pl. It
// reports where the token count came from, "" when the pool does not
// render; on failure, or while the self-check does not trust the engines'
// word, the request is placed by the byte estimate, which it never fails
// for. Renders that keep failing (engines without the render
// API: SGLang's) pause for RenderPause, so that every request does not pay
// for one more.
func (p *Pool) tokenize(ctx context.Context, req *Request, pl *Placement) string {
	rd := p.Render
	if rd == nil {
		return ""
	}
	if !rd.Ready() || !p.Trusted() {
		return TokensEstimate
	}
	ids, err := p.render(ctx, req)
	if err != nil {
		pl.RenderFailure = RenderError
		if e, ok := errors.AsType[*engines.Error](err); ok && e.Status == http.StatusForbidden {
			pl.RenderFailure = RenderForbidden
			if rd.Forbidden() {
				req.Log.LogAttrs(ctx, slog.LevelWarn, "the render server refused to render (403): vLLM serves its render API only when started with --enable-scale-out; placing by the estimate",
					slog.String("pool", p.Name), slog.String("render_server", e.Endpoint.Address), slog.String("error", err.Error()))
			}
		}
		if rd.Failed() {
			req.Log.LogAttrs(ctx, slog.LevelWarn, "renders keep failing, placing by the estimate for a while",
				slog.String("pool", p.Name), slog.Duration("pause", RenderPause), slog.String("error", err.Error()))
		}
		req.Log.LogAttrs(ctx, slog.LevelDebug, "render failed, placing by the estimate",
			slog.String("pool", p.Name), slog.String("error", err.Error()))
		return TokensEstimate
	}
	rd.Succeeded()
	if p.Cache != nil {
		seed := p.Cache.SeedFor(req.Model)
		pl.prompt.TokenBlocks = kvcache.HashTokens(pl.prompt.TokenBlocks[:0], seed, ids, p.KVBlockSize, maxTokenBlocks)
	}
	pl.prompt.TokenBlockSize = p.KVBlockSize
	pl.prompt.Tokens = len(ids)
	pl.rendered = true
	return TokensRendered
}

// render asks the pool's render server for the tokens of the request's
// prompt, within the pool's render timeout.
func (p *Pool) render(ctx context.Context, req *Request) ([]uint32, error) {
	ep, ok := p.RenderEndpoint()
	if !ok {
		return nil, errors.New("no render server")
	}
	ctx, cancel := context.WithTimeout(ctx, p.Render.Timeout)
	defer cancel()
	answer, err := req.Engine.Post(ctx, ep, renderPath(req.Path), req.ID, endpoint.Rank{}, connectors.PlainPieces(nil, req.Body))
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
