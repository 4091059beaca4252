package enginesim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// asyncReply is the outcome of a request sent in the background.
type asyncReply struct {
	reply
	err error
}

// goPost sends a request in the background, so that the two legs of a
// concurrent protocol can be in flight at once.
func goPost(t *testing.T, s *Server, path, requestID string, body any) <-chan asyncReply {
	t.Helper()
	return goPostCtx(t, t.Context(), s, path, requestID, body)
}

// goPostCtx is goPost with the client's context: cancelling it makes the
// client go away.
func goPostCtx(t *testing.T, ctx context.Context, s *Server, path, requestID string, body any) <-chan asyncReply {
	t.Helper()
	data := marshal(t, body)
	client := testClient(t)
	url := "http://" + s.Addr() + path
	ch := make(chan asyncReply, 1)
	go func() {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(data))
		if err != nil {
			ch <- asyncReply{err: err}
			return
		}
		req.Header.Set("Content-Type", "application/json")
		if requestID != "" {
			req.Header.Set("X-Request-Id", requestID)
		}
		resp, err := client.Do(req)
		if err != nil {
			ch <- asyncReply{err: err}
			return
		}
		defer resp.Body.Close()
		var buf bytes.Buffer
		_, err = buf.ReadFrom(resp.Body)
		ch <- asyncReply{reply: reply{status: resp.StatusCode, header: resp.Header, trailer: resp.Trailer, body: buf.Bytes()}, err: err}
	}()
	return ch
}

// await takes a background reply.
func await(t *testing.T, ch <-chan asyncReply) reply {
	t.Helper()
	r := <-ch
	require.NoError(t, r.err)
	return r.reply
}

func marshal(t *testing.T, body any) []byte {
	t.Helper()
	if data, ok := body.([]byte); ok {
		return data
	}
	data, err := json.Marshal(body)
	require.NoError(t, err)
	return data
}

// sseText checks an SSE answer and returns its generated text and last
// finish reason.
func sseText(t *testing.T, r reply) (string, string) {
	t.Helper()
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	require.Equal(t, "text/event-stream", r.header.Get("Content-Type"))
	var text, finish string
	var done bool
	sc := bufio.NewScanner(bytes.NewReader(r.body))
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if line == "[DONE]" {
			done = true
			continue
		}
		var chunk struct {
			Choices []struct {
				Text         *string                  `json:"text"`
				Delta        struct{ Content string } `json:"delta"`
				FinishReason *string                  `json:"finish_reason"`
			} `json:"choices"`
		}
		require.NoError(t, json.Unmarshal([]byte(line), &chunk), line)
		for _, c := range chunk.Choices {
			if c.Text != nil {
				text += *c.Text
			}
			text += c.Delta.Content
			if c.FinishReason != nil {
				finish = *c.FinishReason
			}
		}
	}
	require.True(t, done, "stream ends with [DONE]")
	return text, finish
}

// answerText is the generated text of a JSON or SSE answer.
func answerText(t *testing.T, r reply, stream bool) string {
	t.Helper()
	if stream {
		text, _ := sseText(t, r)
		return text
	}
	return r.decode(t).text()
}

// prefillEdits applies the prefill-only edits to a client body as vLLM's
// toy_proxy_server.py does: max_tokens 1 always, max_completion_tokens 1
// when the client used it.
func (b body) prefillEdits() body {
	out := b.with("stream", false, "stream_options", nil, "min_tokens", nil, "min_completion_tokens", nil, "max_tokens", 1)
	if _, ok := b["max_completion_tokens"]; ok {
		return out.with("max_completion_tokens", 1)
	}
	return out
}

// streaming makes a client body stream (with usage) or not.
func (b body) streaming(stream bool) body {
	if !stream {
		return b
	}
	return b.with("stream", true, "stream_options", map[string]any{"include_usage": true})
}

// requireDecodePulled checks a successful decode answer and the decode
// engine's record of it.
func requireDecodePulled(t *testing.T, d, p *Server, r reply, b body, stream bool, want string) {
	t.Helper()
	kv := r.header
	if stream && d.cfg.Connector == ConnectorSGLang {
		// The headers went out before the KV was there: it is named in
		// trailers.
		require.Empty(t, r.header.Get(HeaderKV), "body: %s", r.body)
		require.Empty(t, r.header.Get(HeaderKVSource))
		kv = r.trailer
	}
	require.Equal(t, KVPulled, kv.Get(HeaderKV), "body: %s", r.body)
	require.Equal(t, p.Addr(), kv.Get(HeaderKVSource))
	require.Equal(t, d.Addr(), r.header.Get(HeaderEngine))
	require.Equal(t, want, answerText(t, r, stream))
	rec := lastKind(t, d, KindDecode)
	require.Equal(t, KVPulled, rec.KV)
	require.Equal(t, p.Addr(), rec.KVSource)
	require.Equal(t, http.StatusOK, rec.Status)
	require.Equal(t, Fingerprint(promptOf(t, b)), rec.Fingerprint)
}

// lastKind is the latest record of a kind.
func lastKind(t *testing.T, s *Server, kind string) Record {
	t.Helper()
	recs := s.Records()
	for i := len(recs) - 1; i >= 0; i-- {
		if recs[i].Kind == kind {
			return recs[i]
		}
	}
	require.Failf(t, "no record", "no %s record in %+v", kind, recs)
	return Record{}
}

// requireRejected checks a refused request and its record.
func requireRejected(t *testing.T, s *Server, r reply, status int, wantMsg string) {
	t.Helper()
	require.Contains(t, r.errorMessage(t, status), wantMsg)
	require.Equal(t, "application/json", r.header.Get("Content-Type"), "refused before any token, even when streaming")
	require.Empty(t, r.header.Get(HeaderKV))
	rec := lastKind(t, s, KindRejected)
	require.Equal(t, status, rec.Status)
	require.Contains(t, rec.Error, wantMsg)
}

// requireStreamError checks a refusal sent, after a 200 SSE answer's
// headers, as one SGLang error event and the terminator, and its record.
func requireStreamError(t *testing.T, s *Server, r reply, status int, wantMsg string) {
	t.Helper()
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	require.Equal(t, "text/event-stream", r.header.Get("Content-Type"))
	require.Equal(t, s.Addr(), r.header.Get(HeaderEngine))
	require.Empty(t, r.header.Get(HeaderKV))
	require.Empty(t, r.trailer.Get(HeaderKV), "no KV was pulled")
	require.Empty(t, r.trailer.Get(HeaderKVSource))
	event, ok := strings.CutPrefix(string(r.body), "data: ")
	require.True(t, ok, "body: %s", r.body)
	event, ok = strings.CutSuffix(event, "\n\ndata: [DONE]\n\n")
	require.True(t, ok, "one error event, then [DONE]: %s", r.body)
	var eb struct {
		Error map[string]any `json:"error"`
	}
	require.NoError(t, json.Unmarshal([]byte(event), &eb), "event: %s", event)
	require.Equal(t, "error", eb.Error["object"])
	require.EqualValues(t, status, eb.Error["code"])
	require.Equal(t, errorType(status), eb.Error["type"])
	require.Contains(t, eb.Error, "param")
	require.Nil(t, eb.Error["param"])
	msg, _ := eb.Error["message"].(string)
	require.Contains(t, msg, wantMsg)
	rec := lastKind(t, s, KindRejected)
	require.Equal(t, status, rec.Status)
	require.Contains(t, rec.Error, wantMsg)
	require.Empty(t, rec.KV)
}

// bothAPIs are the client bodies of the hand-off tests.
var bothAPIs = []struct {
	name string
	body body
}{
	{"chat", chatBody("Tell me about KV caches.").with("max_tokens", 3)},
	{"completions", completionBody("Once upon a time").with("max_tokens", 3)},
}

// wantText is the text a decode of b with 3 output tokens generates.
func wantText(t *testing.T, b body) string {
	t.Helper()
	return "pdx-sim:" + Fingerprint(promptOf(t, b)) + " t1 t2"
}

func itoa(n int) string { return strconv.Itoa(n) }

// bytesOf is a request body reader of b.
func bytesOf(t *testing.T, b any) *bytes.Reader {
	t.Helper()
	return bytes.NewReader(marshal(t, b))
}

// requireRecordsAnyOrder compares records without their bodies, in any
// order (the legs of a concurrent protocol race).
func requireRecordsAnyOrder(t *testing.T, s *Server, want ...Record) {
	t.Helper()
	got := s.Records()
	for i := range got {
		require.NotEmpty(t, got[i].Body)
		got[i].Body, got[i].Headers = nil, nil // the client's headers vary
	}
	require.ElementsMatch(t, want, got)
}
