package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// demoPort is the client port the demo prefers, so the printed curl command
// is easy to reuse; a free port is taken when it is busy.
const demoPort = 10000

// errUsage is returned for a command line the demo does not understand.
var errUsage = errors.New("bad usage")

func demo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("pdx-demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	keep := fs.Bool("keep", false, "keep everything running after the batch, until interrupted")
	n := fs.Int("requests", 16, "number of concurrent requests")
	port := fs.Int("port", demoPort, "Envoy's client port; 0 or a busy port picks a free one")
	prefillLatency := fs.Duration("prefill-latency", 20*time.Millisecond, "simulated prefill time")
	tokenLatency := fs.Duration("token-latency", 2*time.Millisecond, "simulated time per output token")
	engines := fs.String("engines", "sim", "the engines: sim (pdx's simulated vLLM engines) or vllm (real vLLM engines on CPU, as `make vllm` installs them: minutes to start)")
	if err := fs.Parse(args); err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}

	if ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", *port)); err != nil {
		*port = 0
	} else {
		ln.Close()
	}
	switch *engines {
	case "sim":
	case "vllm":
		return demoVLLM(ctx, *port, *n, *keep, stdout)
	default:
		return fmt.Errorf("%w: --engines=%q: sim or vllm", errUsage, *engines)
	}
	fmt.Fprintln(stdout, "Starting 2 prefill + 2 decode simulated vLLM engines (pdx's engine simulator, NIXL), pdx and Envoy on loopback...")
	st, err := stack.Start(ctx, stack.Options{
		ListenPort: *port,
		Engine:     enginesim.Config{PrefillLatency: *prefillLatency, DecodePerToken: *tokenLatency},
	})
	if err != nil {
		return err
	}
	defer st.Close()
	fmt.Fprintf(stdout, "Envoy %s -> pdx %s -> prefill %s, %s; decode %s, %s\n\n",
		st.URL(), st.Pdx.GRPCAddr(), st.Prefill[0].Addr(), st.Prefill[1].Addr(), st.Decode[0].Addr(), st.Decode[1].Addr())

	results := make([]demoResult, *n)
	var wg sync.WaitGroup
	client := &http.Client{Timeout: time.Minute}
	for i := range results {
		wg.Go(func() { results[i] = demoRequest(ctx, client, st.URL(), i) })
	}
	wg.Wait()

	failed := printResults(stdout, results)
	if failed > 0 {
		fmt.Fprintf(stdout, "\n%d of %d requests FAILED.\n%s", failed, len(results), st.Logs())
		return fmt.Errorf("demo: %d of %d requests failed", failed, len(results))
	}
	fmt.Fprintf(stdout, "\nAll %d requests succeeded: each decode engine pulled exactly the KV its own prefill produced.\n", len(results))
	if *keep {
		keepServing(ctx, stdout, st.URL())
	}
	return nil
}

// keepServing tells how to try the running stack at url and waits for the
// interrupt.
func keepServing(ctx context.Context, stdout io.Writer, url string) {
	fmt.Fprintf(stdout, "\nStill running; try it (Ctrl-C to stop):\n\n"+
		"  curl -s %s/v1/chat/completions -H 'content-type: application/json' \\\n"+
		"    -d '{\"model\":\"%s\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],\"max_tokens\":8}'\n\n",
		url, stack.Model)
	<-ctx.Done()
}

type demoResult struct {
	kind    string
	prefill string // where the decode engine pulled the KV from
	decode  string
	kv      string
	status  int
	latency time.Duration
	err     error
}

// demoRequest sends request i (kinds rotate through chat/completions,
// streaming or not) and checks the answer belongs to its prompt.
func demoRequest(ctx context.Context, client *http.Client, base string, i int) demoResult {
	chat, stream := i%2 == 0, i%4 >= 2
	text := fmt.Sprintf("Demo request %d: tell me about prefill/decode disaggregation.", i)
	body := map[string]any{"model": stack.Model, "max_tokens": 8, "stream": stream}
	path, prompt := "/v1/completions", text
	if chat {
		path = "/v1/chat/completions"
		body["messages"] = []map[string]string{{"role": "user", "content": text}}
		prompt = enginesim.ChatPromptText([]enginesim.Message{{Role: "user", Content: text}})
	} else {
		body["prompt"] = text
	}
	if stream {
		body["stream_options"] = map[string]bool{"include_usage": true}
	}
	res := demoResult{kind: strings.TrimPrefix(path, "/v1/")}
	if stream {
		res.kind += " (stream)"
	}
	payload, _ := json.Marshal(body)
	start := time.Now()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+path, bytes.NewReader(payload))
	if err != nil {
		res.err = err
		return res
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		res.err = err
		return res
	}
	defer resp.Body.Close()
	res.status = resp.StatusCode
	res.prefill = resp.Header.Get("X-Pdx-Sim-Kv-Source")
	res.decode = resp.Header.Get("X-Pdx-Sim-Engine")
	res.kv = resp.Header.Get("X-Pdx-Sim-Kv")
	text, err = readCompletion(resp.Body, stream)
	res.latency = time.Since(start)
	switch want := "pdx-sim:" + enginesim.Fingerprint(prompt); {
	case err != nil:
		res.err = err
	case resp.StatusCode != http.StatusOK:
		res.err = fmt.Errorf("status %d: %s", resp.StatusCode, text)
	case res.kv != "pulled":
		res.err = fmt.Errorf("decode engine reports KV %q, want pulled", res.kv)
	case !strings.HasPrefix(text, want):
		res.err = fmt.Errorf("answer %q is not for this prompt (want prefix %q)", text, want)
	}
	return res
}

// readCompletion returns the generated text of a JSON or SSE answer, or the
// raw body of anything else (an error).
func readCompletion(r io.Reader, stream bool) (string, error) {
	type choice struct {
		Text    string `json:"text"`
		Message struct {
			Content string `json:"content"`
		} `json:"message"`
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
	}
	type answer struct {
		Choices []choice `json:"choices"`
	}
	raw, err := io.ReadAll(r)
	if err != nil {
		return "", err
	}
	if !stream || !bytes.HasPrefix(raw, []byte("data:")) {
		var a answer
		if json.Unmarshal(raw, &a) != nil || len(a.Choices) == 0 {
			return string(raw), nil
		}
		return a.Choices[0].Text + a.Choices[0].Message.Content, nil
	}
	var out strings.Builder
	sc := bufio.NewScanner(bytes.NewReader(raw))
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var a answer
		if err := json.Unmarshal([]byte(data), &a); err != nil {
			return "", fmt.Errorf("bad SSE chunk %q: %w", data, err)
		}
		for _, c := range a.Choices {
			out.WriteString(c.Text + c.Delta.Content)
		}
	}
	return out.String(), sc.Err()
}

func printResults(w io.Writer, results []demoResult) (failed int) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "#\trequest\tprefill endpoint\tdecode endpoint\tKV hand-off (checked by decode engine)\tstatus\tlatency")
	for i, r := range results {
		handoff := "verified: own prompt's KV pulled"
		if r.err != nil {
			failed++
			handoff = "FAILED: " + r.err.Error()
			if len(handoff) > 90 {
				handoff = handoff[:90] + "..."
			}
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%d\t%s\n", i+1, r.kind, orDash(r.prefill), orDash(r.decode),
			handoff, r.status, r.latency.Round(100*time.Microsecond))
	}
	tw.Flush()
	return failed
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
