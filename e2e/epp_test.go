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
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// pdx as the endpoint picker of an InferencePool, behind an Envoy shaped as
// Envoy AI Gateway's translation shapes it (envoy.ProfileAIGateway): TLS
// to pdx's self-signed certificate, every request and response phase sent
// to pdx, both bodies FULL_DUPLEX_STREAMED, trailers sent.

// aiGateway is a stack in the AI Gateway profile.
func aiGateway(opts stack.Options) stack.Options {
	opts.Profile = envoy.ProfileAIGateway
	return opts
}

func TestEndpointPickerProfile(t *testing.T) {
	for _, connector := range []string{"nixl", "sglang"} {
		t.Run(connector, func(t *testing.T) {
			st := startStack(t, aiGateway(stack.Options{Connector: connector}))
			require.Contains(t, st.PdxLog(), `"self_signed":true`)
			client, hc := newClient(t, st)
			hc.Transport = drainedBodies{hc.Transport}
			id := option.WithHeader("X-Request-Id", newRequestID(t))

			t.Run("chat", func(t *testing.T) {
				text := connector + " through the picker profile"
				resp, err := client.Chat.Completions.New(t.Context(), openai.ChatCompletionNewParams{
					Model:     stack.Model,
					Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage(text)},
					MaxTokens: openai.Int(3),
				}, id)
				require.NoError(t, err)
				require.Equal(t, wantPrefix(chatPrompt(text))+" t1 t2", resp.Choices[0].Message.Content)
				requireHandoff(t, st, chatPrompt(text))
			})

			t.Run("streaming response phases pass through pdx", func(t *testing.T) {
				text := megabytePrompt(connector + " streamed through the picker")
				stream := client.Completions.NewStreaming(t.Context(), openai.CompletionNewParams{
					Model:     openai.CompletionNewParamsModel(stack.Model),
					Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String(text)},
					MaxTokens: openai.Int(40),
				}, id)
				var content strings.Builder
				chunks := 0
				for stream.Next() {
					chunks++
					for _, ch := range stream.Current().Choices {
						content.WriteString(ch.Text)
					}
				}
				require.NoError(t, stream.Err())
				want := wantPrefix(text)
				for i := 1; i < 40; i++ {
					want += fmt.Sprintf(" t%d", i)
				}
				require.Equal(t, want, content.String())
				require.Greater(t, chunks, 20, "the answer streams chunk by chunk")
				requireHandoff(t, st, text)
			})

			// pdx times a decode's response to its end only from the
			// response phases Envoy sends it: both requests' reached pdx
			// (the client read them to their end: drainedBodies).
			demo := map[string]string{"pool": "demo", "connector": connector}
			require.EventuallyWithT(t, func(c *assert.CollectT) {
				fams := scrape(t, "http://"+st.Pdx.AdminAddr()+"/metrics")
				assert.EqualValues(c, 2, count(fams, "pdx_decode_ttfb_seconds", demo), "response headers timed")
				assert.EqualValues(c, 2, count(fams, "pdx_decode_duration_seconds", demo), "responses timed to their end")
			}, 10*time.Second, 50*time.Millisecond, "every response phase reached pdx")
		})
	}
}

// The gateway's subset hint: pdx picks only among the endpoints it lists,
// and answers 503 when none of them is a decode endpoint.
func TestSubsetHintThroughEnvoy(t *testing.T) {
	for _, profile := range []string{envoy.ProfileAIGateway, envoy.ProfilePdx} {
		t.Run(profile, func(t *testing.T) {
			st := startStack(t, stack.Options{Profile: profile, SubsetHintHeader: "x-test-subset", Decode: 3,
				Engine: enginesim.Config{DecodeLatency: time.Millisecond}})
			_, hc := newClient(t, st)
			only := st.Decode[1].Addr()
			for i := range 6 {
				text := fmt.Sprintf("%s subset %d", profile, i)
				a := post(t, hc, st.URL()+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, stack.Model, text),
					"x-test-subset", "10.255.0.1:80,"+only)
				require.Equal(t, 200, a.status, a.body)
				recs := recordsWhere(st, func(r enginesim.Record) bool { return r.Fingerprint == enginesim.Fingerprint(text) })
				require.Len(t, recs["decode"], 1)
				require.Equal(t, only, recs["decode"][0].Engine, "the decode is the one the hint allows")
			}
			a := post(t, hc, st.URL()+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"nowhere","max_tokens":2}`, stack.Model),
				"x-test-subset", st.Prefill[0].Addr())
			requireAPIError(t, a, 503, "no_endpoint", "subset hint")
		})
	}
}

// drainedBodies reads each response body to its end before closing it.
// openai-go closes a stream's body at its [DONE] event, which may reach
// the client before the engine has ended its chunked body: the connection
// is then dropped, and Envoy ends the request, its ext_proc stream with
// it, without the response's end, which pdx then never sees (once in
// CI, twice in 200 runs here with the cores kept busy).
type drainedBodies struct{ http.RoundTripper }

func (d drainedBodies) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := d.RoundTripper.RoundTrip(r)
	if err == nil {
		resp.Body = drainingBody{resp.Body}
	}
	return resp, err
}

type drainingBody struct{ io.ReadCloser }

func (b drainingBody) Close() error {
	_, _ = io.Copy(io.Discard, b.ReadCloser)
	return b.ReadCloser.Close()
}
