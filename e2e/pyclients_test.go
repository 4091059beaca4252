package e2e

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// pyclientsDir is where `make pyclients` installs the pinned OpenAI and
// Anthropic Python clients (PYCLIENTS_DIR, which the Makefile exports).
func pyclientsDir() string {
	if d := os.Getenv("PYCLIENTS_DIR"); d != "" {
		return d
	}
	return filepath.Join("..", ".tools", "pyclients")
}

// TestPythonClients runs the official OpenAI and Anthropic Python clients'
// ordinary calls, responses.create and responses.stream, messages.create
// and messages.stream, through Envoy and pdx to NIXL engines: each gets
// its own prompt's answer, handed over from its prefill, and pdx's errors
// reach each client as its own exception.
func TestPythonClients(t *testing.T) {
	dir, err := filepath.Abs(pyclientsDir())
	require.NoError(t, err)
	python := os.Getenv("PYTHON")
	if python == "" {
		python = "python3"
	}
	check := exec.Command(python, "-c", "import openai, anthropic")
	check.Env = append(os.Environ(), "PYTHONPATH="+dir)
	if out, err := check.CombinedOutput(); err != nil {
		t.Fatalf("the OpenAI and Anthropic Python clients are not in %s: run `make pyclients` (%v: %s)", dir, err, out)
	}
	st := startStack(t, stack.Options{})
	prompts := map[string]string{}
	for _, call := range []string{"responses.create", "responses.stream", "messages.create", "messages.stream"} {
		prompts[call] = "python " + call + ": what is disaggregated serving?"
	}
	args, err := json.Marshal(prompts)
	require.NoError(t, err)
	cmd := exec.CommandContext(t.Context(), python, filepath.Join("testdata", "pyclients.py"), st.URL(), stack.Model, string(args))
	cmd.Env = append(os.Environ(), "PYTHONPATH="+dir)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "pyclients.py: %s", stderr.String())
	var got map[string]map[string]any
	require.NoError(t, json.Unmarshal(out, &got), "%s", out)
	for call, prompt := range prompts {
		want := wantPrefix(chatPrompt(prompt))
		require.True(t, strings.HasPrefix(got[call]["text"].(string), want), "%s: got %v", call, got[call])
		if final, ok := got[call]["final"]; ok {
			require.Equal(t, got[call]["text"], final, "%s: the stream's final message is its deltas", call)
		}
		requireHandoff(t, st, chatPrompt(prompt))
	}
	require.Equal(t, "incomplete", got["responses.create"]["status"], "max_output_tokens reached")
	require.Equal(t, "max_tokens", got["messages.create"]["stop_reason"])
	require.Equal(t, map[string]any{"status": 400.0, "type": "invalid_request_error"}, got["messages.error"])
	require.Equal(t, map[string]any{"status": 400.0, "code": "unsupported_value"}, got["responses.error"])
}
