package realvllm

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/realvllm"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

const (
	responsesPath = "/v1/responses"
	messagesPath  = "/v1/messages"
)

// responsesCall is an OpenAI Responses request for prompt, temperature 0.
func responsesCall(prompt string, maxTokens int) call {
	return call{responsesPath, map[string]any{"model": stack.Model, "input": prompt, "max_output_tokens": maxTokens, "temperature": 0}}
}

// messagesCall is an Anthropic Messages request of one user message,
// temperature 0.
func messagesCall(prompt string, maxTokens int) call {
	return call{messagesPath, map[string]any{"model": stack.Model, "max_tokens": maxTokens, "temperature": 0,
		"messages": []map[string]string{{"role": "user", "content": prompt}}}}
}

// apiAnswer is what an answer of either API said: its text and its
// input and output tokens, whole or streamed in the API's own events.
type apiAnswer struct {
	status                int
	raw                   string
	text                  string
	input, output         int
	events                []string // a stream's event types, in order
	completed, messageEnd bool     // response.completed, message_stop
}

// sendAPI posts c to base and reads its answer in c's API's shape.
func sendAPI(t *testing.T, hc *http.Client, base string, c call) apiAnswer {
	t.Helper()
	payload, err := json.Marshal(c.body)
	require.NoError(t, err)
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, base+c.path, bytes.NewReader(payload))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	resp, err := hc.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	a := apiAnswer{status: resp.StatusCode, raw: string(raw)}
	if resp.StatusCode != http.StatusOK {
		return a
	}
	if !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		var obj map[string]any
		require.NoError(t, json.Unmarshal(raw, &obj), "answer %s", raw)
		a.whole(obj)
		return a
	}
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(make([]byte, 0, 64<<10), 4<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var ev map[string]any
		require.NoError(t, json.Unmarshal([]byte(data), &ev), "event %s", data)
		a.event(ev)
	}
	require.NoError(t, sc.Err())
	return a
}

// whole reads a whole answer: a Responses response or a Messages message.
func (a *apiAnswer) whole(obj map[string]any) {
	switch obj["object"] {
	case "response":
		for _, item := range list(obj["output"]) {
			for _, part := range list(m(item)["content"]) {
				a.text += str(m(part)["text"])
			}
		}
	default: // an Anthropic message
		for _, block := range list(obj["content"]) {
			a.text += str(m(block)["text"])
		}
	}
	u := m(obj["usage"])
	a.input, a.output = num(u["input_tokens"]), num(u["output_tokens"])
}

// event reads one streamed event of either API.
func (a *apiAnswer) event(ev map[string]any) {
	typ := str(ev["type"])
	a.events = append(a.events, typ)
	switch typ {
	case "response.output_text.delta":
		a.text += str(ev["delta"])
	case "response.completed":
		a.completed = true
		u := m(m(ev["response"])["usage"])
		a.input, a.output = num(u["input_tokens"]), num(u["output_tokens"])
	case "message_start":
		a.input = num(m(m(ev["message"])["usage"])["input_tokens"])
	case "content_block_delta":
		a.text += str(m(ev["delta"])["text"])
	case "message_delta":
		a.output = num(m(ev["usage"])["output_tokens"])
	case "message_stop":
		a.messageEnd = true
	}
}

func m(v any) map[string]any { x, _ := v.(map[string]any); return x }
func list(v any) []any       { x, _ := v.([]any); return x }
func str(v any) string       { x, _ := v.(string); return x }
func num(v any) int          { x, _ := v.(float64); return int(x) }

// apiReference is the decode engine's own answer to c: c sent to it
// directly, whole.
func apiReference(t *testing.T, hc *http.Client, e *realvllm.Engine, c call) apiAnswer {
	t.Helper()
	ref := c.with()
	delete(ref.body, "stream")
	a := sendAPI(t, hc, e.URL(), ref)
	require.Equal(t, http.StatusOK, a.status, "%s directly: %s", e.Name(), a.raw)
	return a
}

// TestAgentAPIsHandoff sends OpenAI Responses and Anthropic Messages
// requests, whole and streamed, through Envoy and pdx to the real NIXL
// engines: each answer is the decode engine's own computation of the
// prompt at temperature 0, in the API's own shape (a stream's events from
// response.created to response.completed, message_start to message_stop),
// and the decode engine's prompt token sources show the prompt arrived by
// KV transfer, none of it computed there.
func TestAgentAPIsHandoff(t *testing.T) {
	s, st := sharedStack(t)
	hc := httpClient(t)
	for _, tc := range []struct {
		name string
		call call
	}{
		{"responses", responsesCall(prompt("responses"), 8)},
		{"responses-stream", responsesCall(prompt("responses streamed"), 8).with("stream", true)},
		{"messages", messagesCall(prompt("messages"), 8)},
		{"messages-stream", messagesCall(prompt("messages streamed"), 8).with("stream", true)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := sourcesOf(t, s.decode)
			got := sendAPI(t, hc, st.URL(), tc.call)
			require.Equal(t, http.StatusOK, got.status, got.raw)
			d := sourcesOf(t, s.decode).minus(before)
			requireHandedOff(t, d, tc.name)
			want := apiReference(t, hc, s.decode, tc.call)
			require.NotEmpty(t, want.text)
			require.Equal(t, want.text, got.text, "the answer through pdx is the decode engine's own")
			require.Equal(t, 8, got.output)
			require.Positive(t, got.input)
			if tc.call.stream() {
				switch tc.call.path {
				case responsesPath:
					require.Equal(t, "response.created", got.events[0])
					require.True(t, got.completed, "ends with response.completed: %v", got.events)
				case messagesPath:
					require.Equal(t, "message_start", got.events[0])
					require.True(t, got.messageEnd, "ends with message_stop: %v", got.events)
				}
			}
			t.Logf("%s: %d input tokens, %v by KV transfer, %v computed on the decode engine", tc.name, got.input, d.external, d.local)
		})
	}
}

// TestAgentAPIsConcurrentPrompts sends distinct prompts of both APIs all
// at once: each gets its own answer, equal to the decode engine's own.
func TestAgentAPIsConcurrentPrompts(t *testing.T) {
	s, st := sharedStack(t)
	hc := httpClient(t)
	const n = 8
	calls := make([]call, n)
	for i := range calls {
		p := prompt("agent prompt " + string(rune('a'+i)))
		calls[i] = responsesCall(p, 6)
		if i%2 == 1 {
			calls[i] = messagesCall(p, 6)
		}
		if i%4 >= 2 {
			calls[i] = calls[i].with("stream", true)
		}
	}
	before := sourcesOf(t, s.decode)
	got := make([]apiAnswer, n)
	var wg sync.WaitGroup
	for i := range calls {
		wg.Go(func() { got[i] = sendAPI(t, hc, st.URL(), calls[i]) })
	}
	wg.Wait()
	requireHandedOff(t, sourcesOf(t, s.decode).minus(before), "concurrent agent API prompts")
	for i, c := range calls {
		require.Equal(t, http.StatusOK, got[i].status, got[i].raw)
		require.Equal(t, apiReference(t, hc, s.decode, c).text, got[i].text, "prompt %d (%s) got its own answer", i, c.path)
	}
}
