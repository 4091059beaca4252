package realvllm

import (
	"crypto/sha256"
	"encoding/hex"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
)

// digests are the SHA-256 of every file under dir, by path.
func digests(t *testing.T, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	require.NoError(t, filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, path)
		sum := sha256.Sum256(b)
		out[rel] = hex.EncodeToString(sum[:])
		return nil
	}))
	return out
}

// TestModelIsReproducible: the project's model maker, run again, makes
// byte for byte the model, tokenizer and LoRA adapter the engines serve
// (fixed seeds, text made by the script itself, nothing from a hub).
func TestModelIsReproducible(t *testing.T) {
	in := engines.install(t)
	_, file, _, _ := runtime.Caller(0)
	script := filepath.Join(filepath.Dir(file), "..", "..", "internal", "testbed", "realvllm", "makemodel.py")
	out := t.TempDir()
	cmd := exec.CommandContext(t.Context(), in.Python, script, "--out", out)
	cmd.Env = append(os.Environ(), "HF_HUB_OFFLINE=1", "HF_HUB_DISABLE_PROGRESS_BARS=1")
	log, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", log)
	for _, sub := range []string{"model", "lora"} {
		made := digests(t, filepath.Join(out, sub))
		require.NotEmpty(t, made)
		require.Equal(t, digests(t, filepath.Join(in.Dir, "testmodel", sub)), made, "%s made again", sub)
	}
}
