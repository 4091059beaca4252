package replay

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// Outcome is what the client saw of one request.
type Outcome struct {
	Index int
	// Sent is when the request went out, from the run's start.
	Sent time.Duration
	// Status is the HTTP status; 0 when no answer came.
	Status int
	// TTFT is the time to the first content chunk, E2E to the stream's end.
	TTFT, E2E time.Duration
	// Tokens is the content chunks received; Want the max_tokens asked.
	Tokens, Want int
	// Err says why the request failed (non-200, broken stream); "" when it
	// succeeded.
	Err string
	// MixedUp is set when the answer starts with another prompt's
	// fingerprint: a cross-request mix-up.
	MixedUp bool
}

// OK reports whether the request got its whole, own answer.
func (o Outcome) OK() bool { return o.Err == "" && !o.MixedUp }

// TPOT is the time per output token after the first; 0 for one-token
// answers.
func (o Outcome) TPOT() time.Duration {
	if o.Tokens < 2 {
		return 0
	}
	return (o.E2E - o.TTFT) / time.Duration(o.Tokens-1)
}

// newClient is the load generator's HTTP client: connections enough for
// every request in flight, no overall timeout (the context bounds each).
func newClient() *http.Client {
	return &http.Client{Transport: &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		MaxIdleConns:        4096,
		MaxIdleConnsPerHost: 4096,
		IdleConnTimeout:     30 * time.Second,
		DisableCompression:  true,
	}}
}

// chatBody is the request of r: one user message holding the prompt, so
// the prompt text the engine sees is a fixed chat prefix ("user: ") plus
// the synthesized blocks, and equal leading blocks stay an equal prefix.
func chatBody(r Request) []byte {
	body, _ := json.Marshal(map[string]any{
		"model":          stack.Model,
		"messages":       []map[string]string{{"role": "user", "content": r.Prompt}},
		"max_tokens":     r.MaxTokens,
		"stream":         true,
		"stream_options": map[string]bool{"include_usage": true},
	})
	return body
}

// wantPrefix is how the simulator's answer to r starts.
func wantPrefix(r Request) string {
	text := enginesim.ChatPromptText([]enginesim.Message{{Role: "user", Content: r.Prompt}})
	return "pdx-sim:" + enginesim.Fingerprint(text)
}

// send posts r and reads its SSE stream to the end.
func send(ctx context.Context, client *http.Client, url string, r Request) Outcome {
	o := Outcome{Index: r.Index, Want: r.MaxTokens}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", bytes.NewReader(chatBody(r)))
	if err != nil {
		o.Err = err.Error()
		return o
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", "replay-"+strconv.Itoa(r.Index)+"-"+strconv.FormatInt(time.Now().UnixNano(), 36))
	if r.Objective != "" {
		req.Header.Set("X-Llm-D-Inference-Objective", r.Objective)
	}
	if r.Flow != "" {
		req.Header.Set("X-Llm-D-Inference-Fairness-Id", r.Flow)
	}
	start := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		o.Err = err.Error()
		return o
	}
	defer resp.Body.Close()
	o.Status = resp.StatusCode
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		o.Err = fmt.Sprintf("status %d: %s", resp.StatusCode, bytes.TrimSpace(b))
		return o
	}
	content, err := readStream(resp.Body, start, &o)
	o.E2E = time.Since(start)
	switch {
	case err != nil:
		o.Err = "broken stream: " + err.Error()
	case o.Tokens != r.MaxTokens:
		o.Err = fmt.Sprintf("broken stream: %d content chunks, want %d", o.Tokens, r.MaxTokens)
	}
	if o.Tokens > 0 && !strings.HasPrefix(content, wantPrefix(r)) {
		o.MixedUp = true
	}
	return o
}

// sseChunk is the part of a chat completion chunk (or an SSE error event)
// the client reads.
type sseChunk struct {
	Choices []struct {
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
	} `json:"choices"`
	Error json.RawMessage `json:"error"`
}

// readStream reads SSE events until [DONE], counting content chunks and
// timing the first; it returns the first 64 bytes of content, enough for
// the fingerprint.
func readStream(body io.Reader, start time.Time, o *Outcome) (string, error) {
	br := bufio.NewReaderSize(body, 16<<10)
	var head strings.Builder
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return head.String(), err
		}
		data, ok := strings.CutPrefix(strings.TrimRight(line, "\r\n"), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			return head.String(), nil
		}
		var c sseChunk
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			return head.String(), fmt.Errorf("bad chunk %.80q: %w", data, err)
		}
		if len(c.Error) > 0 {
			return head.String(), fmt.Errorf("error event: %.200s", c.Error)
		}
		for _, ch := range c.Choices {
			if ch.Delta.Content == "" {
				continue
			}
			if o.Tokens == 0 {
				o.TTFT = time.Since(start)
			}
			o.Tokens++
			if head.Len() < 64 {
				head.WriteString(ch.Delta.Content)
			}
		}
	}
}
