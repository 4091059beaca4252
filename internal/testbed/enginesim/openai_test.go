package enginesim

import (
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/stretchr/testify/require"
)

// The response shapes must be what the official SDK expects.

func newOpenAI(t *testing.T, s *Server) openai.Client {
	t.Helper()
	return openai.NewClient(
		option.WithBaseURL("http://"+s.Addr()+"/v1/"),
		option.WithAPIKey("sim"),
		option.WithHTTPClient(testClient(t)),
		option.WithMaxRetries(0),
		option.WithHeader("X-Request-Id", "sdk-1"),
	)
}

func TestOpenAIChat(t *testing.T) {
	s := startSim(t, Config{Role: RoleDecode})
	c := newOpenAI(t, s)
	want := "pdx-sim:" + Fingerprint("user: hello\n") + " t1 t2"

	resp, err := c.Chat.Completions.New(t.Context(), openai.ChatCompletionNewParams{
		Model:     "m",
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello")},
		MaxTokens: openai.Int(3),
	})
	require.NoError(t, err)
	require.Equal(t, "chatcmpl-sdk-1", resp.ID)
	require.Equal(t, "m", resp.Model)
	require.Len(t, resp.Choices, 1)
	require.Equal(t, want, resp.Choices[0].Message.Content)
	require.Equal(t, "length", resp.Choices[0].FinishReason)
	require.EqualValues(t, 3, resp.Usage.CompletionTokens)
	require.Equal(t, resp.Usage.PromptTokens+resp.Usage.CompletionTokens, resp.Usage.TotalTokens)
}

func TestOpenAIChatStream(t *testing.T) {
	s := startSim(t, Config{Role: RoleDecode})
	c := newOpenAI(t, s)
	stream := c.Chat.Completions.NewStreaming(t.Context(), openai.ChatCompletionNewParams{
		Model:               "m",
		Messages:            []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello")},
		MaxCompletionTokens: openai.Int(4),
		StreamOptions:       openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
	})
	defer stream.Close()

	var acc openai.ChatCompletionAccumulator
	var roles, finishes []string
	var usageChunks int
	for stream.Next() {
		chunk := stream.Current()
		acc.AddChunk(chunk)
		require.Equal(t, "chat.completion.chunk", string(chunk.Object))
		if len(chunk.Choices) == 0 {
			usageChunks++
			require.EqualValues(t, 4, chunk.Usage.CompletionTokens)
			continue
		}
		if r := chunk.Choices[0].Delta.Role; r != "" {
			roles = append(roles, r)
		}
		if f := chunk.Choices[0].FinishReason; f != "" {
			finishes = append(finishes, f)
		}
	}
	require.NoError(t, stream.Err())
	require.Equal(t, []string{"assistant"}, roles, "role comes once, first")
	require.Equal(t, []string{"length"}, finishes)
	require.Equal(t, 1, usageChunks)
	require.Equal(t, "pdx-sim:"+Fingerprint("user: hello\n")+" t1 t2 t3", acc.Choices[0].Message.Content)
	require.EqualValues(t, 4, acc.Usage.CompletionTokens)
	require.Equal(t, KindPlain, lastRecord(t, s).Kind)
	require.Equal(t, 200, lastRecord(t, s).Status)
}

func TestOpenAICompletions(t *testing.T) {
	s := startSim(t, Config{Role: RoleBoth})
	c := newOpenAI(t, s)
	params := openai.CompletionNewParams{
		Model:     "m",
		Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String("Once")},
		MaxTokens: openai.Int(2),
	}
	want := "pdx-sim:" + Fingerprint("Once") + " t1"

	resp, err := c.Completions.New(t.Context(), params)
	require.NoError(t, err)
	require.Equal(t, "text_completion", string(resp.Object))
	require.Len(t, resp.Choices, 1)
	require.Equal(t, want, resp.Choices[0].Text)
	require.Equal(t, openai.CompletionChoiceFinishReasonLength, resp.Choices[0].FinishReason)
	require.EqualValues(t, 2, resp.Usage.CompletionTokens)

	stream := c.Completions.NewStreaming(t.Context(), params)
	defer stream.Close()
	var text string
	var finish openai.CompletionChoiceFinishReason
	for stream.Next() {
		for _, ch := range stream.Current().Choices {
			text += ch.Text
			if ch.FinishReason != "" {
				finish = ch.FinishReason
			}
		}
	}
	require.NoError(t, stream.Err())
	require.Equal(t, want, text)
	require.Equal(t, openai.CompletionChoiceFinishReasonLength, finish)
}

func TestOpenAIError(t *testing.T) {
	s := startSim(t, Config{Role: RoleDecode})
	c := newOpenAI(t, s)
	_, err := c.Chat.Completions.New(t.Context(), openai.ChatCompletionNewParams{
		Model:    "m",
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello")},
	}, option.WithJSONSet("kv_transfer_params", map[string]any{"do_remote_decode": true}))
	var apiErr *openai.Error
	require.ErrorAs(t, err, &apiErr)
	require.Equal(t, 400, apiErr.StatusCode)
	require.Contains(t, apiErr.Message, "engine is a KV consumer")
}
