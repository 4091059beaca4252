package enginesim

import (
	"bytes"
	"encoding/json"
	"io"
	"maps"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// startSim runs a simulator for the duration of the test.
func startSim(t *testing.T, cfg Config) *Server {
	t.Helper()
	s, err := Start(t.Context(), "127.0.0.1:0", cfg)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, s.Close()) })
	return s
}

// testClient is an HTTP client whose connections are closed with the test,
// so goleak sees no lingering transport goroutines.
func testClient(t *testing.T) *http.Client {
	t.Helper()
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 10 * time.Second}
}

type reply struct {
	status  int
	header  http.Header
	trailer http.Header // read after the body
	body    []byte
}

// post sends body (marshaled unless already []byte) with an X-Request-Id
// header when requestID is not empty.
func post(t *testing.T, s *Server, path, requestID string, body any) reply {
	t.Helper()
	data, ok := body.([]byte)
	if !ok {
		var err error
		data, err = json.Marshal(body)
		require.NoError(t, err)
	}
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://"+s.Addr()+path, bytes.NewReader(data))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	if requestID != "" {
		req.Header.Set("X-Request-Id", requestID)
	}
	return do(t, req)
}

func get(t *testing.T, s *Server, path string) reply {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, "http://"+s.Addr()+path, nil)
	require.NoError(t, err)
	return do(t, req)
}

func do(t *testing.T, req *http.Request) reply {
	t.Helper()
	resp, err := testClient(t).Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return reply{status: resp.StatusCode, header: resp.Header, trailer: resp.Trailer, body: body}
}

// body is a request body under construction.
type body map[string]any

func chatBody(content string) body {
	return body{"model": "m", "messages": []any{map[string]any{"role": "user", "content": content}}}
}

func completionBody(prompt string) body {
	return body{"model": "m", "prompt": prompt}
}

// with returns a copy with fields set; a nil value deletes the field.
func (b body) with(kv ...any) body {
	out := maps.Clone(b)
	for i := 0; i < len(kv); i += 2 {
		if kv[i+1] == nil {
			delete(out, kv[i].(string))
			continue
		}
		out[kv[i].(string)] = kv[i+1]
	}
	return out
}

// asPrefill derives a NixlConnector prefill request the way a router should.
func (b body) asPrefill() body {
	return b.with("stream", false, "max_tokens", 1, "kv_transfer_params", map[string]any{
		"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
		"remote_block_ids": nil, "remote_host": nil, "remote_port": nil,
	})
}

// response is the union of the response shapes the tests read.
type response struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Model   string `json:"model"`
	Choices []struct {
		Message struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
		Text         string `json:"text"`
		FinishReason string `json:"finish_reason"`
	} `json:"choices"`
	Usage struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
		TotalTokens      int `json:"total_tokens"`
	} `json:"usage"`
	KVTransferParams json.RawMessage `json:"kv_transfer_params"`
}

func (r reply) decode(t *testing.T) response {
	t.Helper()
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	var out response
	require.NoError(t, json.Unmarshal(r.body, &out))
	require.Len(t, out.Choices, 1)
	return out
}

// text is the generated text of either endpoint.
func (r response) text() string {
	if r.Object == "chat.completion" {
		return r.Choices[0].Message.Content
	}
	return r.Choices[0].Text
}

// errorMessage checks the vLLM error shape and returns the message.
func (r reply) errorMessage(t *testing.T, status int) string {
	t.Helper()
	require.Equal(t, status, r.status, "body: %s", r.body)
	var eb struct {
		Error map[string]any `json:"error"`
	}
	require.NoError(t, json.Unmarshal(r.body, &eb), "body: %s", r.body)
	require.Contains(t, eb.Error, "param")
	require.Nil(t, eb.Error["param"])
	require.EqualValues(t, status, eb.Error["code"])
	require.NotEmpty(t, eb.Error["type"])
	msg, _ := eb.Error["message"].(string)
	return msg
}

// lastRecord is the latest record of s.
func lastRecord(t *testing.T, s *Server) Record {
	t.Helper()
	recs := s.Records()
	require.NotEmpty(t, recs)
	return recs[len(recs)-1]
}
