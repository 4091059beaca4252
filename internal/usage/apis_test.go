package usage

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Bodies as vLLM 0.32 writes them (responses/api_router.py
// _convert_stream_to_sse_events; anthropic/serving.py
// message_stream_converter, wrap_data_with_event).
const (
	responsesJSON = `{"id":"resp_1","created_at":1,"incomplete_details":null,"instructions":null,"metadata":null,"model":"m","object":"response",` +
		`"output":[{"id":"msg_1","content":[{"annotations":[],"text":"\"usage\": {","type":"output_text","logprobs":null}],"role":"assistant","status":"completed","type":"message"}],` +
		`"status":"completed","usage":{"input_tokens":20,"input_tokens_details":{"cached_tokens":19,"cache_write_tokens":0,"input_tokens_per_turn":[],"cached_tokens_per_turn":[]},` +
		`"output_tokens":4,"output_tokens_details":{"reasoning_tokens":0,"tool_output_tokens":0},"total_tokens":24},"user":null,"kv_transfer_params":null}`

	responsesSSE = "event: response.created\ndata: {\"response\":{\"id\":\"resp_1\",\"status\":\"in_progress\",\"usage\":null},\"sequence_number\":0,\"type\":\"response.created\"}\n\n" +
		"event: response.in_progress\ndata: {\"response\":{\"id\":\"resp_1\",\"status\":\"in_progress\",\"usage\":null},\"sequence_number\":1,\"type\":\"response.in_progress\"}\n\n" +
		"event: response.output_item.added\ndata: {\"item\":{\"id\":\"msg_1\",\"content\":[],\"role\":\"assistant\",\"status\":\"in_progress\",\"type\":\"message\"},\"output_index\":0,\"sequence_number\":2,\"type\":\"response.output_item.added\"}\n\n" +
		"event: response.output_text.delta\ndata: {\"content_index\":0,\"delta\":\"usage\",\"item_id\":\"msg_1\",\"logprobs\":[],\"output_index\":0,\"sequence_number\":3,\"type\":\"response.output_text.delta\"}\n\n" +
		"event: response.completed\ndata: {\"response\":{\"id\":\"resp_1\",\"output\":[{\"content\":[{\"text\":\"usage\"}]}],\"status\":\"completed\"," +
		"\"usage\":{\"input_tokens\":20,\"input_tokens_details\":{\"cached_tokens\":19,\"cache_write_tokens\":0},\"output_tokens\":4,\"total_tokens\":24},\"user\":null},\"sequence_number\":9,\"type\":\"response.completed\"}\n\n"

	messagesJSON = `{"id":"chatcmpl-1","type":"message","role":"assistant","content":[{"type":"text","text":"hi"}],"model":"m","stop_reason":"max_tokens",` +
		`"usage":{"input_tokens":1,"output_tokens":4,"cache_read_input_tokens":19},"kv_transfer_params":{"do_remote_prefill":true}}`

	messagesSSE = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"chatcmpl-1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"m\",\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":20,\"output_tokens\":0}}}\n\n" +
		"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n" +
		"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"hi\"}}\n\n" +
		"event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n" +
		"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\",\"stop_sequence\":null},\"usage\":{\"input_tokens\":20,\"output_tokens\":4}}\n\n" +
		"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
)

func TestReaderAgentAPIs(t *testing.T) {
	tests := []struct {
		name  string
		sse   bool
		body  string
		want  Counts
		found bool
	}{
		{"responses json", false, responsesJSON, Counts{Prompt: 20, Cached: 19, Completion: 4}, true},
		{"responses stream: the completed response's usage", true, responsesSSE, Counts{Prompt: 20, Cached: 19, Completion: 4}, true},
		{"responses stream cut before completed", true, responsesSSE[:len(responsesSSE)/2], Counts{}, false},
		{"responses nested response without usage", false, `{"response":{"id":"x"},"usage":{"input_tokens":3,"total_tokens":4,"output_tokens":1}}`, Counts{Prompt: 3, Completion: 1}, true},
		{"response deeper down is not the answer's", false, `{"output":[{"response":{"usage":{"input_tokens":3,"total_tokens":3}}}]}`, Counts{}, false},
		{"messages json: input_tokens without the cached", false, messagesJSON, Counts{Prompt: 20, Cached: 19, Completion: 4}, true},
		{"messages stream: message_delta's usage", true, messagesSSE, Counts{Prompt: 20, Completion: 4}, true},
		{"messages cache creation counts in the prompt", false, `{"usage":{"input_tokens":2,"cache_creation_input_tokens":5,"cache_read_input_tokens":3,"output_tokens":1}}`, Counts{Prompt: 10, Cached: 3, Completion: 1}, true},
		{"messages negative cache", false, `{"usage":{"input_tokens":2,"cache_read_input_tokens":-3}}`, Counts{}, false},
		{"escaped response key", false, `{"respons\u0065":{"usage":{"input_tokens":3,"total_tokens":3}}}`, Counts{}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, n := range []int{0, 1, 2, 3, 7, 64} {
				got, ok := feed(tt.sse, tt.body, n)
				require.Equal(t, tt.found, ok, "chunks of %d", n)
				require.Equal(t, tt.want, got, "chunks of %d", n)
			}
		})
	}
}

// A stream's output starts with its first event that is not a preamble:
// a Responses stream announces the response before its first token.
func TestReaderStarted(t *testing.T) {
	firstOutput := func(sse bool, body string) int {
		r := NewReader(sse)
		for i := range len(body) {
			_, _ = r.Write([]byte{body[i]})
			if r.Started() {
				return i
			}
		}
		return -1
	}
	at := firstOutput(true, responsesSSE)
	require.Equal(t, indexOf(responsesSSE, "event: response.output_item.added")+len("event: response.output_item.added\ndata: "), at,
		"the output item's data, after response.created and response.in_progress")
	require.Equal(t, indexOf(messagesSSE, "data: ")+len("data: "), firstOutput(true, messagesSSE), "message_start comes with the first token")
	require.Equal(t, len("data: "), firstOutput(true, "data: {\"choices\":[]}\n\n"), "chat: the first event")
	require.Equal(t, 0, firstOutput(false, messagesJSON), "a JSON body: its first byte")
	require.Equal(t, -1, firstOutput(true, "event: ping\ndata: {\"type\":\"ping\"}\n\n: comment\n\n"), "keep-alives are no output")
}

func indexOf(s, sub string) int {
	for i := range len(s) - len(sub) + 1 {
		if s[i:i+len(sub)] == sub {
			return i
		}
	}
	return -1
}
