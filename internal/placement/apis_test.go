package placement

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/jsonedit"
)

// Placement reads each API's own prompt fields, never an empty prompt for
// a request that has one.
func TestPromptOfEachAPI(t *testing.T) {
	for _, tc := range []struct {
		name, path, body, want string
	}{
		{"chat", "/v1/chat/completions", `{"model":"m","tools":[1],"messages":[{"role":"user","content":"hi"}]}`, `[{"role":"user","content":"hi"}]`},
		{"completions", "/v1/completions", `{"model":"m","prompt":"hi"}`, `"hi"`},
		{"responses string input", "/v1/responses", `{"model":"m","input":"hi"}`, `"hi"`},
		{"responses items, instructions and tools, system part first", "/v1/responses",
			`{"input":[{"role":"user","content":"hi"}],"model":"m","tools":[{"type":"function","name":"f"}],"instructions":"be brief"}`,
			`"be brief"[{"type":"function","name":"f"}][{"role":"user","content":"hi"}]`},
		{"responses null instructions", "/v1/responses", `{"model":"m","instructions":null,"input":"hi"}`, `"hi"`},
		{"messages", "/v1/messages", `{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`, `[{"role":"user","content":"hi"}]`},
		{"messages with system blocks and tools", "/v1/messages",
			`{"model":"m","messages":[{"role":"user","content":"hi"}],"system":[{"type":"text","text":"s"}],"tools":[{"name":"f","input_schema":{}}]}`,
			`[{"type":"text","text":"s"}][{"name":"f","input_schema":{}}][{"role":"user","content":"hi"}]`},
		{"messages' system alone is its prompt too", "/v1/messages", `{"model":"m","system":"s"}`, `"s"`},
		{"nothing to read", "/v1/messages", `{"model":"m"}`, ``},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body, err := jsonedit.Parse([]byte(tc.body))
			require.NoError(t, err)
			require.Equal(t, tc.want, string(prompt(tc.path, body)))
		})
	}
}

func TestRenderPath(t *testing.T) {
	for path, want := range map[string]string{
		"/v1/chat/completions": RenderChatPath, "/v1/completions": RenderCompletionsPath,
		"/v1/responses": "/v1/responses/render", "/v1/messages": "/v1/messages/render",
	} {
		require.Equal(t, want, renderPath(path), path)
	}
}
