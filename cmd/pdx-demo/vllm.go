package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/pdx-router/pdx/internal/testbed/realvllm"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// demoVLLM runs the demo on real vLLM engines (`make vllm`): a NIXL
// prefill and a decode engine on CPU serving the tiny test model, pdx and
// Envoy in front. Each answer is checked against the decode engine's own
// computation of its prompt at temperature 0, and the decode engine's
// counters tell how the prompts' KV got there.
func demoVLLM(ctx context.Context, port, n int, keep bool, stdout io.Writer) (err error) {
	in, err := realvllm.Find()
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "Starting 1 prefill + 1 decode real vLLM %s engines (CPU, NIXL over CPU buffers, the tiny random model `make vllm` made), pdx and Envoy on loopback.\n"+
		"The engines take a few minutes to start...\n", realvllm.Version)
	cfg := func(name, role string) realvllm.Config {
		return realvllm.Config{Name: name, Model: stack.Model, Connector: realvllm.ConnectorNixl, Role: role}
	}
	start := time.Now()
	es, err := realvllm.StartAll(ctx, in, cfg("prefill", realvllm.RoleProducer), cfg("decode", realvllm.RoleConsumer))
	if err != nil {
		return err
	}
	prefill, decode := es[0], es[1]
	defer func() {
		if err != nil {
			fmt.Fprintf(stdout, "\n----- prefill engine log (tail) -----\n%s\n----- decode engine log (tail) -----\n%s\n", tail(prefill.Log(), 40), tail(decode.Log(), 40))
		}
		prefill.Stop()
		decode.Stop()
	}()
	fmt.Fprintf(stdout, "Engines ready in %v.\n", time.Since(start).Round(time.Second))
	st, err := stack.Start(ctx, stack.Options{
		ListenPort: port, Connector: "nixl", PrefillTimeout: 2 * time.Minute,
		External: &stack.External{
			Prefill: []stack.Endpoint{{Addr: prefill.Addr(), KVAddr: prefill.SideChannel()}},
			Decode:  []stack.Endpoint{{Addr: decode.Addr()}},
		},
		ConfigYAML: "engine_metrics: {interval: 500ms, stale_after: 5s}",
	})
	if err != nil {
		return err
	}
	defer st.Close()
	fmt.Fprintf(stdout, "Envoy %s -> pdx %s -> prefill %s (vLLM %s); decode %s (vLLM %s)\n\n",
		st.URL(), st.Pdx.GRPCAddr(), prefill.Addr(), realvllm.Version, decode.Addr(), realvllm.Version)

	client := &http.Client{Timeout: 3 * time.Minute}
	defer client.CloseIdleConnections()
	before, err := promptSources(ctx, client, decode.URL())
	if err != nil {
		return err
	}
	results := make([]vllmResult, n)
	var wg sync.WaitGroup
	for i := range results {
		wg.Go(func() { results[i] = vllmRequest(ctx, client, st.URL(), i) })
	}
	wg.Wait()
	after, err := promptSources(ctx, client, decode.URL())
	if err != nil {
		return err
	}
	// The decode engine's own computation of each prompt, sent to it
	// directly, one at a time.
	for i := range results {
		r := &results[i]
		if r.err != nil {
			continue
		}
		body := vllmBody(i, false)
		want, _, err := complete(ctx, client, decode.URL()+r.path, body, false)
		switch {
		case err != nil:
			r.err = fmt.Errorf("the decode engine's own run: %w", err)
		case want != r.text:
			r.err = fmt.Errorf("answer %q, the decode engine's own %q", r.text, want)
		}
	}

	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "#\trequest\tstatus\tlatency\tprompt tokens\tanswer (temperature 0)")
	failed := 0
	for i, r := range results {
		check := "= the decode engine's own computation"
		if r.err != nil {
			failed++
			check = "FAILED: " + r.err.Error()
			if len(check) > 100 {
				check = check[:100] + "..."
			}
		}
		fmt.Fprintf(tw, "%d\t%s\t%d\t%s\t%d\t%s\n", i+1, r.kind, r.status, r.latency.Round(time.Millisecond), r.promptTokens, check)
	}
	tw.Flush()
	local, external := after["local_compute"]-before["local_compute"], after["external_kv_transfer"]-before["external_kv_transfer"]
	fmt.Fprintf(stdout, "\nThe decode engine's vllm:prompt_tokens_by_source_total over the batch: %.0f prompt tokens arrived by NIXL KV transfer, %.0f computed on the decode engine itself.\n", external, local)
	if failed > 0 || local > 0 || external == 0 {
		fmt.Fprintf(stdout, "\n%d of %d requests FAILED.\n%s", failed, n, st.Logs())
		return fmt.Errorf("demo on real vLLM: %d of %d requests failed, %.0f prompt tokens computed on the decode engine", failed, n, local)
	}
	fmt.Fprintf(stdout, "\nAll %d requests succeeded on real vLLM engines: every prompt was prefilled on the prefill engine and its KV pulled by the decode engine.\n", n)
	if keep {
		keepServing(ctx, stdout, st.URL())
	}
	return nil
}

type vllmResult struct {
	kind, path   string
	status       int
	latency      time.Duration
	text         string
	promptTokens int
	err          error
}

// vllmBody is request i's body: chat or completions, streamed or not, in
// turn, at temperature 0.
func vllmBody(i int, stream bool) map[string]any {
	text := strings.Repeat(fmt.Sprintf("Demo request %d: tell me about prefill/decode disaggregation. ", i), 6)
	body := map[string]any{"model": stack.Model, "max_tokens": 8, "temperature": 0}
	if i%2 == 0 {
		body["messages"] = []map[string]string{{"role": "user", "content": text}}
	} else {
		body["prompt"] = text
	}
	if stream {
		body["stream"] = true
		body["stream_options"] = map[string]bool{"include_usage": true}
	}
	return body
}

func vllmRequest(ctx context.Context, client *http.Client, base string, i int) vllmResult {
	stream := i%4 >= 2
	r := vllmResult{kind: "completions", path: "/v1/completions"}
	if i%2 == 0 {
		r.kind, r.path = "chat/completions", "/v1/chat/completions"
	}
	if stream {
		r.kind += " (stream)"
	}
	start := time.Now()
	r.text, r.promptTokens, r.err = complete(ctx, client, base+r.path, vllmBody(i, stream), stream)
	r.latency = time.Since(start)
	if r.err == nil {
		r.status = http.StatusOK
	} else if se, ok := errors.AsType[*statusError](r.err); ok {
		r.status = se.status
	}
	return r
}

type statusError struct {
	status int
	body   string
}

func (e *statusError) Error() string { return fmt.Sprintf("status %d: %s", e.status, e.body) }

// complete posts body and returns the answer's text and its usage's prompt
// tokens.
func complete(ctx context.Context, client *http.Client, url string, body map[string]any, stream bool) (string, int, error) {
	payload, _ := json.Marshal(body)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(payload))
	if err != nil {
		return "", 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return "", 0, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", 0, err
	}
	if resp.StatusCode != http.StatusOK {
		return "", 0, &statusError{resp.StatusCode, string(raw)}
	}
	text, err := readCompletion(bytes.NewReader(raw), stream)
	if err != nil {
		return "", 0, err
	}
	var usage struct {
		Usage *struct {
			PromptTokens int `json:"prompt_tokens"`
		} `json:"usage"`
	}
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := strings.TrimPrefix(sc.Text(), "data: ")
		if json.Unmarshal([]byte(line), &usage) == nil && usage.Usage != nil {
			return text, usage.Usage.PromptTokens, nil
		}
	}
	return text, 0, nil
}

// promptSources reads the engine's vllm:prompt_tokens_by_source_total by
// source.
func promptSources(ctx context.Context, client *http.Client, base string) (map[string]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "vllm:prompt_tokens_by_source_total{") {
			continue
		}
		_, rest, _ := strings.Cut(line, `source="`)
		source, _, _ := strings.Cut(rest, `"`)
		fields := strings.Fields(line)
		v, err := strconv.ParseFloat(fields[len(fields)-1], 64)
		if err != nil {
			return nil, fmt.Errorf("%s/metrics: %q: %w", base, line, err)
		}
		out[source] += v
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%s/metrics: no vllm:prompt_tokens_by_source_total", base)
	}
	return out, sc.Err()
}

func tail(s string, lines int) string {
	parts := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(parts) > lines {
		parts = parts[len(parts)-lines:]
	}
	return strings.Join(parts, "\n")
}
