package e2e

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// isolationRequests is how many distinct requests are in flight at once.
const isolationRequests = 1000

// TestIsolation is the Kthena connector race, attempted with every
// connector: many concurrent requests with distinct prompts through Envoy
// and pdx. If any per-request value leaked between requests, a decode engine
// would be handed another request's KV (and reject it) or a client would get
// another prompt's answer. The engines' latency keeps all of them in flight
// together. Every API the connector disaggregates is in the race: chat,
// completions and, where the engines take a hand-off on them, Responses
// and Messages, each streamed and not.
func TestIsolation(t *testing.T) {
	for _, cc := range connectorCases(t) {
		t.Run(cc.name, func(t *testing.T) {
			opts := cc.opts
			opts.Prefill, opts.Decode = 3, 3
			opts.Engine = enginesim.Config{PrefillLatency: 200 * time.Millisecond, DecodeLatency: 50 * time.Millisecond, DecodePerToken: time.Millisecond}
			st := startStack(t, opts)
			agents := disaggregates(t, cc, connectors.APIResponses) && disaggregates(t, cc, connectors.APIMessages)
			isolationOf(t, st, cc.name, isolationRequests, func(i int) string {
				return fmt.Sprintf("%s isolation prompt %d: %s", cc.name, i, strings.Repeat(string(rune('a'+i%26)), i%50))
			}, agents)
		})
	}
}

// The same race behind an Envoy shaped as AI Gateway's InferencePool
// translation: both bodies stream through pdx in FULL_DUPLEX_STREAMED
// mode, over TLS, for the sequential and the concurrent protocol.
func TestIsolationEndpointPicker(t *testing.T) {
	for _, cc := range connectorCases(t) {
		if cc.name != "nixl" && cc.name != "sglang" {
			continue
		}
		t.Run(cc.name, func(t *testing.T) {
			opts := aiGateway(cc.opts)
			opts.Prefill, opts.Decode = 3, 3
			opts.Engine = enginesim.Config{PrefillLatency: 200 * time.Millisecond, DecodeLatency: 50 * time.Millisecond, DecodePerToken: time.Millisecond}
			st := startStack(t, opts)
			isolationOf(t, st, "picker-"+cc.name, isolationRequests, func(i int) string {
				return fmt.Sprintf("%s picker isolation prompt %d: %s", cc.name, i, strings.Repeat(string(rune('a'+i%26)), i%50))
			}, cc.name == "nixl")
		})
	}
}

// isolation sends n requests at once, request i with the prompt text(i), and
// checks that each client got its own prompt's answer and each decode
// engine its own prefill's KV.
func isolation(t *testing.T, st *stack.Stack, name string, n int, text func(i int) string) {
	isolationOf(t, st, name, n, text, false)
}

// isolationOf is isolation, with requests of the agent APIs among them
// (agents): request i is then chat, completions, Responses or Messages by
// i%4, streamed every other round of four.
func isolationOf(t *testing.T, st *stack.Stack, name string, n int, text func(i int) string, agents bool) {
	client, hc := newClient(t, st)
	type outcome struct {
		id, prompt, got string
		err             error
	}
	outcomes := make([]outcome, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range outcomes {
		wg.Go(func() {
			<-start
			o := &outcomes[i]
			o.id = fmt.Sprintf("iso-%s-%d", name, i)
			text := text(i)
			o.prompt = text
			switch {
			case agents && i%4 >= 2:
				api := agentAPIs[i%4-2]
				o.got, o.err = agentRequest(t, client, hc, st.URL(), api, (i/4)%2 == 1, o.id, text)
				o.prompt = chatPrompt(text)
			case agents:
				// Chat (even) or completions, streamed every other round.
				o.got, o.err = isolationRequest(t, client, i%2+2*((i/4)%2), o.id, text)
				if i%2 == 0 {
					o.prompt = chatPrompt(text)
				}
			default:
				o.got, o.err = isolationRequest(t, client, i, o.id, text)
				if i%2 == 0 {
					o.prompt = chatPrompt(text)
				}
			}
		})
	}
	close(start)
	wg.Wait()

	var failures []string
	for _, o := range outcomes {
		switch {
		case o.err != nil:
			failures = append(failures, fmt.Sprintf("%s: %v", o.id, o.err))
		case !strings.HasPrefix(o.got, wantPrefix(o.prompt)):
			failures = append(failures, fmt.Sprintf("%s: got %q, an answer to another prompt", o.id, o.got))
		}
	}
	require.Empty(t, failures[:min(len(failures), 20)], "%d of %d requests failed or were mixed up (first 20 shown)", len(failures), n)

	// The engines' side: every decode got exactly its own prefill's KV.
	byPrompt := map[string]map[string][]recordAt{}
	for _, e := range st.Engines() {
		for _, r := range e.Records() {
			if byPrompt[r.Fingerprint] == nil {
				byPrompt[r.Fingerprint] = map[string][]recordAt{}
			}
			byPrompt[r.Fingerprint][r.Kind] = append(byPrompt[r.Fingerprint][r.Kind], recordAt{Record: r, Engine: e.Addr()})
		}
	}
	for _, o := range outcomes {
		fp := enginesim.Fingerprint(o.prompt)
		requireOneHandoff(t, st, fp, byPrompt[fp])
	}
}

// isolationRequest sends request i as chat or completion, streaming or not,
// with the request options extra.
func isolationRequest(t *testing.T, client openai.Client, i int, id, text string, extra ...option.RequestOption) (string, error) {
	ctx, hdr := t.Context(), option.WithHeader("X-Request-Id", id)
	opts := append([]option.RequestOption{hdr}, extra...)
	stream := i%4 >= 2
	if i%2 == 0 {
		params := openai.ChatCompletionNewParams{
			Model:     stack.Model,
			Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage(text)},
			MaxTokens: openai.Int(4),
		}
		if !stream {
			resp, err := client.Chat.Completions.New(ctx, params, opts...)
			if err != nil {
				return "", err
			}
			return resp.Choices[0].Message.Content, nil
		}
		s := client.Chat.Completions.NewStreaming(ctx, params, opts...)
		defer s.Close()
		var b strings.Builder
		for s.Next() {
			for _, c := range s.Current().Choices {
				b.WriteString(c.Delta.Content)
			}
		}
		return b.String(), s.Err()
	}
	params := openai.CompletionNewParams{
		Model:     stack.Model,
		Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String(text)},
		MaxTokens: openai.Int(4),
	}
	if !stream {
		resp, err := client.Completions.New(ctx, params, opts...)
		if err != nil {
			return "", err
		}
		return resp.Choices[0].Text, nil
	}
	s := client.Completions.NewStreaming(ctx, params, opts...)
	defer s.Close()
	var b strings.Builder
	for s.Next() {
		for _, c := range s.Current().Choices {
			b.WriteString(c.Text)
		}
	}
	return b.String(), s.Err()
}
