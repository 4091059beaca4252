package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"
	"github.com/stretchr/testify/require"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// agentAPIs are the APIs coding agents speak, which pdx disaggregates
// besides chat and completions.
var agentAPIs = []connectors.API{connectors.APIResponses, connectors.APIMessages}

// disaggregates reports whether the connector of cc hands the KV over on
// api (its spec's traits).
func disaggregates(t *testing.T, cc connectorCase, api connectors.API) bool {
	t.Helper()
	spec, err := connectors.Lookup(cc.opts.Connector)
	require.NoError(t, err)
	pool := &configv1.Pool{Connector: cc.opts.Connector, MooncakeProtocol: cc.opts.MooncakeProtocol}
	if spec.Defaults != nil {
		spec.Defaults(pool)
	}
	return !spec.Traits(pool).NotDisaggregated.Has(api)
}

// agentRequest sends text as one user turn in api, streaming or not, and
// returns the answer's text: Responses through the OpenAI client, Messages
// as Anthropic's clients send it (plain HTTP: the Go module graph has no
// Anthropic client).
func agentRequest(t *testing.T, client openai.Client, hc *http.Client, url string, api connectors.API, stream bool, id, text string) (string, error) {
	ctx := t.Context()
	if api == connectors.APIResponses {
		params := responses.ResponseNewParams{
			Model:           stack.Model,
			Input:           responses.ResponseNewParamsInputUnion{OfString: openai.String(text)},
			MaxOutputTokens: openai.Int(4),
		}
		hdr := option.WithHeader("X-Request-Id", id)
		if !stream {
			resp, err := client.Responses.New(ctx, params, hdr)
			if err != nil {
				return "", err
			}
			return resp.OutputText(), nil
		}
		s := client.Responses.NewStreaming(ctx, params, hdr)
		defer s.Close()
		var b strings.Builder
		completed := false
		for s.Next() {
			switch ev := s.Current(); ev.Type {
			case "response.output_text.delta":
				b.WriteString(ev.Delta)
			case "response.completed":
				completed = true
			}
		}
		if s.Err() == nil && !completed {
			return "", fmt.Errorf("the stream ended without response.completed")
		}
		return b.String(), s.Err()
	}
	body := fmt.Sprintf(`{"model":%q,"max_tokens":4,"stream":%t,"messages":[{"role":"user","content":%s}]}`, stack.Model, stream, mustJSON(text))
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+connectors.MessagesPath, strings.NewReader(body))
	if err != nil {
		return "", err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("anthropic-version", "2023-06-01")
	req.Header.Set("X-Request-Id", id)
	resp, err := hc.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return "", fmt.Errorf("status %d: %s", resp.StatusCode, b)
	}
	if !stream {
		var m struct {
			Type    string `json:"type"`
			Content []struct{ Type, Text string }
		}
		if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
			return "", err
		}
		if m.Type != "message" || len(m.Content) == 0 {
			return "", fmt.Errorf("not a message: %+v", m)
		}
		return m.Content[0].Text, nil
	}
	return messagesStreamText(resp.Body)
}

// messagesStreamText reads an Anthropic event stream: its text deltas,
// checking that it starts with message_start and ends with message_stop.
func messagesStreamText(r io.Reader) (string, error) {
	var b strings.Builder
	var events []string
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if name, ok := strings.CutPrefix(line, "event: "); ok {
			events = append(events, name)
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			continue
		}
		var ev struct {
			Type  string
			Delta struct{ Type, Text string }
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			return "", fmt.Errorf("event data %q: %w", data, err)
		}
		if ev.Type == "content_block_delta" && ev.Delta.Type == "text_delta" {
			b.WriteString(ev.Delta.Text)
		}
	}
	if err := sc.Err(); err != nil {
		return "", err
	}
	if len(events) < 2 || events[0] != "message_start" || events[len(events)-1] != "message_stop" {
		return "", fmt.Errorf("events %v: not message_start ... message_stop", events)
	}
	return b.String(), nil
}

func mustJSON(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return string(b)
}

// TestAgentAPIs sends both agent APIs, streamed and not, through Envoy and
// pdx to every connector: those whose engines serve them with a hand-off
// answer with their decode's output for the prompt the prefill computed
// (the engines' records show one prefill and one decode that pulled its
// KV); the others answer 501 in the API's own error shape.
func TestAgentAPIs(t *testing.T) {
	for _, cc := range connectorCases(t) {
		t.Run(cc.name, func(t *testing.T) {
			st := startStack(t, cc.opts)
			client, hc := newClient(t, st)
			for _, api := range agentAPIs {
				if !disaggregates(t, cc, api) {
					a := post(t, hc, st.URL()+api.Path(), agentBody(api, "x"))
					if api.Anthropic() {
						requireAnthropicError(t, a, 501, "api_error", "is not disaggregated")
					} else {
						requireAPIError(t, a, 501, "unsupported_api", "is not disaggregated")
					}
					requireNoEngineTraffic(t, st)
					continue
				}
				for _, stream := range []bool{false, true} {
					text := fmt.Sprintf("%s %s stream=%t: tell me about KV caches", cc.name, api.Path(), stream)
					got, err := agentRequest(t, client, hc, st.URL(), api, stream, newRequestID(t), text)
					require.NoError(t, err, "%s stream=%t", api.Path(), stream)
					require.True(t, strings.HasPrefix(got, wantPrefix(chatPrompt(text))), "%s stream=%t: got %q", api.Path(), stream, got)
					requireHandoff(t, st, chatPrompt(text))
				}
			}
		})
	}
}

// agentBody is a minimal valid request of api.
func agentBody(api connectors.API, text string) string {
	if api == connectors.APIResponses {
		return fmt.Sprintf(`{"model":%q,"input":%s,"max_output_tokens":4}`, stack.Model, mustJSON(text))
	}
	return fmt.Sprintf(`{"model":%q,"max_tokens":4,"messages":[{"role":"user","content":%s}]}`, stack.Model, mustJSON(text))
}

// requireAnthropicError checks an error answer in Anthropic's shape.
func requireAnthropicError(t *testing.T, a answer, status int, typ, msgPart string) {
	t.Helper()
	require.Equal(t, status, a.status, a.body)
	require.Equal(t, "application/json", a.header.Get("Content-Type"))
	var e struct {
		Type  string `json:"type"`
		Error struct{ Type, Message string }
	}
	require.NoError(t, json.Unmarshal([]byte(a.body), &e), a.body)
	require.Equal(t, "error", e.Type, a.body)
	require.Equal(t, typ, e.Error.Type, a.body)
	require.Contains(t, e.Error.Message, msgPart)
	require.NotContains(t, a.body, `"code"`, "Anthropic's shape, not OpenAI's")
}

// The APIs' companions reach the engines without a prefill.
func TestAgentAPIsPassThrough(t *testing.T) {
	st := startStack(t, stack.Options{})
	_, hc := newClient(t, st)
	a := post(t, hc, st.URL()+"/tokenize", `{"model":"`+stack.Model+`","prompt":"hello"}`)
	// The simulator serves no /tokenize: its 404 is the engine's, in its
	// own words, which proves the request reached a decode engine.
	require.Equal(t, http.StatusNotFound, a.status, a.body)
	require.Contains(t, a.body, "no route for /tokenize")
	require.NotEmpty(t, a.header.Get("X-Pdx-Sim-Engine"), "answered by an engine")
}
