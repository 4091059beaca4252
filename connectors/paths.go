package connectors

// The generation APIs pdx routes with a prefill: the OpenAI paths whose
// bodies connectors know how to split into a prefill and a decode. Other
// paths are a pool's pass-through, or refused.
const (
	ChatCompletionsPath = "/v1/chat/completions"
	CompletionsPath     = "/v1/completions"
)

// RoutedPaths lists the paths pdx routes with a prefill.
func RoutedPaths() []string { return []string{ChatCompletionsPath, CompletionsPath} }

// Routed reports whether pdx routes path with a prefill.
func Routed(path string) bool { return path == ChatCompletionsPath || path == CompletionsPath }
