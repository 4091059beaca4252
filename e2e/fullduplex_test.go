package e2e

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// The Envoy filter of these tests streams request bodies to pdx in
// FULL_DUPLEX_STREAMED mode, as the Gateway API Inference Extension's
// InferencePool integrations configure it. pdx is not told: it learns the
// mode from what Envoy sends.

// megabytePrompt is a prompt of about 1 MB, unique by name.
func megabytePrompt(name string) string {
	return name + ": " + strings.Repeat("a long context of many tokens ", 1<<20/30)
}

func TestFullDuplexLongPrompts(t *testing.T) {
	for _, connector := range []string{"nixl", "sglang"} {
		t.Run(connector, func(t *testing.T) {
			st := startStack(t, stack.Options{Connector: connector, RequestBodyMode: envoy.BodyFullDuplexStreamed})
			client, _ := newClient(t, st)
			id := option.WithHeader("X-Request-Id", newRequestID(t))

			t.Run("chat", func(t *testing.T) {
				text := megabytePrompt(connector + " chat")
				resp, err := client.Chat.Completions.New(t.Context(), openai.ChatCompletionNewParams{
					Model:     stack.Model,
					Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage(text)},
					MaxTokens: openai.Int(3),
				}, id)
				require.NoError(t, err)
				require.Equal(t, wantPrefix(chatPrompt(text))+" t1 t2", resp.Choices[0].Message.Content)
				requireHandoff(t, st, chatPrompt(text))
			})

			t.Run("chat streaming", func(t *testing.T) {
				text := megabytePrompt(connector + " chat streaming")
				stream := client.Chat.Completions.NewStreaming(t.Context(), openai.ChatCompletionNewParams{
					Model:     stack.Model,
					Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage(text)},
					MaxTokens: openai.Int(4),
				}, id)
				var content strings.Builder
				for stream.Next() {
					for _, ch := range stream.Current().Choices {
						content.WriteString(ch.Delta.Content)
					}
				}
				require.NoError(t, stream.Err())
				require.NoError(t, stream.Close())
				require.Equal(t, wantPrefix(chatPrompt(text))+" t1 t2 t3", content.String())
				requireHandoff(t, st, chatPrompt(text))
			})

			t.Run("completion", func(t *testing.T) {
				text := megabytePrompt(connector + " completion")
				resp, err := client.Completions.New(t.Context(), openai.CompletionNewParams{
					Model:     stack.Model,
					Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String(text)},
					MaxTokens: openai.Int(2),
				}, id)
				require.NoError(t, err)
				require.Equal(t, wantPrefix(text)+" t1", resp.Choices[0].Text)
				requireHandoff(t, st, text)
			})

			t.Run("completion streaming", func(t *testing.T) {
				text := megabytePrompt(connector + " completion streaming")
				stream := client.Completions.NewStreaming(t.Context(), openai.CompletionNewParams{
					Model:     stack.Model,
					Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String(text)},
					MaxTokens: openai.Int(3),
				}, id)
				var content strings.Builder
				for stream.Next() {
					for _, ch := range stream.Current().Choices {
						content.WriteString(ch.Text)
					}
				}
				require.NoError(t, stream.Err())
				require.NoError(t, stream.Close())
				require.Equal(t, wantPrefix(text)+" t1 t2", content.String())
				requireHandoff(t, st, text)
			})
		})
	}
}

func TestFullDuplexRouting(t *testing.T) {
	st := startStack(t, stack.Options{RequestBodyMode: envoy.BodyFullDuplexStreamed})
	_, hc := newClient(t, st)

	t.Run("client cannot choose the decode endpoint", func(t *testing.T) {
		target := st.Prefill[0].Addr()
		for i := range 4 {
			text := fmt.Sprintf("duplex spoof %d", i)
			a := post(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"`+text+`","max_tokens":2}`,
				"X-Gateway-Destination-Endpoint", target, "X-Envoy-Original-Dst-Host", target)
			require.Equal(t, 200, a.status, a.body)
			require.True(t, isEngine(st.Decode, a.header.Get(enginesim.HeaderEngine)), "answered by a decode engine")
			requireHandoff(t, st, text)
		}
	})

	t.Run("chunked upload", func(t *testing.T) {
		// An io.Reader of unknown length makes Go send the body chunked,
		// in pieces that reach pdx as separate messages.
		text := "chunked " + strings.Repeat("x", 200<<10)
		body := io.MultiReader(strings.NewReader(`{"model":"demo-model",`), strings.NewReader(`"prompt":"`+text+`"}`))
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, st.URL()+"/v1/completions", body)
		require.NoError(t, err)
		a := do(t, hc, req)
		require.Equal(t, 200, a.status, a.body)
		requireHandoff(t, st, text)
	})

	t.Run("trailers end the body", func(t *testing.T) {
		// HTTP/2 request trailers reach pdx as a message of their own
		// after the last body chunk, which then does not end the stream.
		h2 := &http.Transport{Protocols: new(http.Protocols)}
		h2.Protocols.SetUnencryptedHTTP2(true)
		t.Cleanup(h2.CloseIdleConnections)
		text := "trailers " + strings.Repeat("y", 100<<10)
		pr, pw := io.Pipe()
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, st.URL()+"/v1/completions", pr)
		require.NoError(t, err)
		req.Trailer = http.Header{"X-Checksum": nil}
		go func() {
			_, _ = io.WriteString(pw, `{"model":"demo-model","prompt":"`+text+`"}`)
			req.Trailer.Set("X-Checksum", "abc")
			_ = pw.Close()
		}()
		a := do(t, &http.Client{Transport: h2, Timeout: time.Minute}, req)
		require.Equal(t, 200, a.status, a.body)
		requireHandoff(t, st, text)
	})

	t.Run("other paths: models answered by pdx, the rest 404", func(t *testing.T) {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, st.URL()+"/v1/models", nil)
		require.NoError(t, err)
		a := do(t, hc, req)
		require.Equal(t, 200, a.status, a.body)
		require.Contains(t, a.body, `"object":"list"`)
		require.Contains(t, a.body, `"id":"demo-model"`)

		// A body on a path no pool passes through reaches no engine.
		for _, e := range st.Engines() {
			e.Reset()
		}
		a = post(t, hc, st.URL()+"/v1/completions/other", `{"prompt":"`+strings.Repeat("z", 300<<10)+`","kv_transfer_params":{}}`)
		requireAPIError(t, a, 404, "not_found", "/v1/completions/other")
		require.Empty(t, a.header.Get(enginesim.HeaderEngine), "answered by pdx")
		requireNoEngineTraffic(t, st)
	})

	for _, tc := range []struct {
		name, path, body, code, msg string
	}{
		// Broken after the first chunks: the error is found once the body has ended.
		{name: "invalid JSON across chunks", path: "/v1/completions", code: "invalid_json",
			body: `{"model":"demo-model","prompt":"` + strings.Repeat("p", 300<<10) + `",`},
		{name: "missing model", path: "/v1/chat/completions", code: "missing_model",
			body: `{"messages":[{"role":"user","content":"` + strings.Repeat("q", 300<<10) + `"}]}`},
		{name: "empty messages", path: "/v1/chat/completions", body: `{"model":"demo-model","messages":[]}`, code: "empty_messages"},
	} {
		t.Run("bad input: "+tc.name, func(t *testing.T) {
			for _, e := range st.Engines() {
				e.Reset()
			}
			requireAPIError(t, post(t, hc, st.URL()+tc.path, tc.body), 400, tc.code, tc.msg)
			requireNoEngineTraffic(t, st)
		})
	}
}

func TestFullDuplexBodyLimit(t *testing.T) {
	st := startStack(t, stack.Options{MaxBodyBytes: 64 << 10, RequestBodyMode: envoy.BodyFullDuplexStreamed})
	_, hc := newClient(t, st)
	// Envoy buffers nothing in this mode: pdx counts the chunks and answers
	// before the body has ended.
	big := `{"model":"demo-model","prompt":"` + strings.Repeat("x", 1<<20) + `"}`
	requireAPIError(t, post(t, hc, st.URL()+"/v1/completions", big), 413, "body_too_large", "over the limit of 65536")
	requireNoEngineTraffic(t, st)

	// Just under the limit is routed.
	text := strings.Repeat("w", 60<<10)
	a := post(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"`+text+`"}`)
	require.Equal(t, 200, a.status, a.body)
	requireHandoff(t, st, text)
}

// fullDuplexRequests is how many distinct requests are in flight at once.
const fullDuplexRequests = 300

// TestFullDuplexIsolation sends many concurrent distinct requests, most with
// bodies of several chunks each way, and checks from the engines' records
// that every decode got its own prompt and its own prefill's KV.
func TestFullDuplexIsolation(t *testing.T) {
	for _, connector := range []string{"nixl", "sglang"} {
		t.Run(connector, func(t *testing.T) {
			st := startStack(t, stack.Options{
				Connector: connector, Prefill: 3, Decode: 3, RequestBodyMode: envoy.BodyFullDuplexStreamed,
				Engine: enginesim.Config{PrefillLatency: 200 * time.Millisecond, DecodeLatency: 50 * time.Millisecond, DecodePerToken: time.Millisecond},
				// Mix-ups are the point, not speed: under -race on a small
				// machine the engines can take longer than the default 30s.
				PrefillTimeout: 90 * time.Second,
			})
			// 0 to 99 KB of filler: one chunk each way for some, several
			// from Envoy for most, several back from pdx for a third.
			isolation(t, st, "duplex-"+connector, fullDuplexRequests, func(i int) string {
				return fmt.Sprintf("%s duplex prompt %d: %s", connector, i, strings.Repeat(string(rune('a'+i%26)), i%100*1000))
			})
		})
	}
}
