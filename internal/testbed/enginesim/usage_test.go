package enginesim

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestPromptTokensDetails: like vLLM with --enable-prompt-tokens-details,
// usage reports cached_tokens only when the flag is on and the count is not
// 0: a decode that pulled its prompt's KV has all but the last token; a
// prefill, or a request computed where it runs, none.
func TestPromptTokensDetails(t *testing.T) {
	type details struct {
		Usage struct {
			PromptTokens        int `json:"prompt_tokens"`
			PromptTokensDetails *struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	for _, tt := range []struct {
		name       string
		enabled    bool
		wantDecode bool // the decode's usage has the details
	}{{"enabled", true, true}, {"off by default", false, false}} {
		t.Run(tt.name, func(t *testing.T) {
			p := startSim(t, Config{Role: RolePrefill, PromptTokensDetails: tt.enabled})
			d := startSim(t, Config{Role: RoleDecode, PromptTokensDetails: tt.enabled})
			b := chatBody("a prompt of some tokens for the cache")
			pr := post(t, p, pathFor(b), "req-u", b.asPrefill())
			var pu details
			require.NoError(t, json.Unmarshal(pr.body, &pu), string(pr.body))
			require.Nil(t, pu.Usage.PromptTokensDetails, "the prefill computed its whole prompt: nothing cached, no details")
			presp := pr.decode(t)
			var kv map[string]any
			require.NoError(t, json.Unmarshal(presp.KVTransferParams, &kv))

			dr := post(t, d, pathFor(b), "req-u", b.with("max_tokens", 2, "kv_transfer_params", kv))
			var du details
			require.NoError(t, json.Unmarshal(dr.body, &du), string(dr.body))
			if !tt.wantDecode {
				require.Nil(t, du.Usage.PromptTokensDetails)
				return
			}
			require.NotNil(t, du.Usage.PromptTokensDetails, string(dr.body))
			require.Equal(t, du.Usage.PromptTokens-1, du.Usage.PromptTokensDetails.CachedTokens)

			plain := startSim(t, Config{Role: RoleBoth, PromptTokensDetails: true})
			var pl details
			pb := post(t, plain, pathFor(b), "req-v", b.with("max_tokens", 2))
			require.NoError(t, json.Unmarshal(pb.body, &pl), string(pb.body))
			require.Nil(t, pl.Usage.PromptTokensDetails, "a request the engine computed itself has no cached tokens")
		})
	}
}
