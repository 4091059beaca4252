package e2e

import (
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// The official OpenAI client, through Envoy and pdx, against engines of
// every connector; each engine checks its own side of the KV hand-off.
func TestOpenAIClient(t *testing.T) {
	for _, cc := range connectorCases(t) {
		t.Run(cc.name, func(t *testing.T) {
			st := startStack(t, cc.opts)
			client, _ := newClient(t, st)
			// The client's id is kept on both legs (P2P NCCL encodes its own).
			id := option.WithHeader("X-Request-Id", newRequestID(t))

			t.Run("chat", func(t *testing.T) {
				text := cc.name + ": what is disaggregated serving?"
				resp, err := client.Chat.Completions.New(t.Context(), openai.ChatCompletionNewParams{
					Model:     stack.Model,
					Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage(text)},
					MaxTokens: openai.Int(5),
				}, id)
				require.NoError(t, err)
				require.Len(t, resp.Choices, 1)
				require.Equal(t, wantPrefix(chatPrompt(text))+" t1 t2 t3 t4", resp.Choices[0].Message.Content)
				require.EqualValues(t, 5, resp.Usage.CompletionTokens)
				requireHandoff(t, st, chatPrompt(text))
			})

			t.Run("chat streaming", func(t *testing.T) {
				text := cc.name + ": stream me an answer."
				stream := client.Chat.Completions.NewStreaming(t.Context(), openai.ChatCompletionNewParams{
					Model:               stack.Model,
					Messages:            []openai.ChatCompletionMessageParamUnion{openai.UserMessage(text)},
					MaxCompletionTokens: openai.Int(6),
					StreamOptions:       openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
				}, id)
				var content strings.Builder
				var chunks, usage int64
				for stream.Next() {
					c := stream.Current()
					chunks++
					for _, ch := range c.Choices {
						content.WriteString(ch.Delta.Content)
					}
					if c.Usage.CompletionTokens > 0 {
						usage = c.Usage.CompletionTokens
					}
				}
				require.NoError(t, stream.Err())
				require.NoError(t, stream.Close())
				require.Equal(t, wantPrefix(chatPrompt(text))+" t1 t2 t3 t4 t5", content.String())
				require.Greater(t, chunks, int64(6), "tokens arrive as separate chunks")
				require.EqualValues(t, 6, usage, "include_usage survives the rewrite")
				requireHandoff(t, st, chatPrompt(text))
			})

			t.Run("completion", func(t *testing.T) {
				text := cc.name + ": once upon a time"
				resp, err := client.Completions.New(t.Context(), openai.CompletionNewParams{
					Model:     stack.Model,
					Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String(text)},
					MaxTokens: openai.Int(3),
				}, id)
				require.NoError(t, err)
				require.Equal(t, wantPrefix(text)+" t1 t2", resp.Choices[0].Text)
				requireHandoff(t, st, text)
			})

			t.Run("completion streaming", func(t *testing.T) {
				text := cc.name + ": count with me"
				stream := client.Completions.NewStreaming(t.Context(), openai.CompletionNewParams{
					Model:     stack.Model,
					Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String(text)},
					MaxTokens: openai.Int(4),
				}, id)
				var content strings.Builder
				for stream.Next() {
					for _, ch := range stream.Current().Choices {
						content.WriteString(ch.Text)
					}
				}
				require.NoError(t, stream.Err())
				require.NoError(t, stream.Close())
				require.Equal(t, wantPrefix(text)+" t1 t2 t3", content.String())
				requireHandoff(t, st, text)
			})
		})
	}
}
