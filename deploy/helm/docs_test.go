package helm_test

import (
	"fmt"
	"os"
	"strings"
	"testing"

	egv1a1 "github.com/envoyproxy/gateway/api/v1alpha1"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"
)

// kubernetesDoc is the page whose statements about the manifests and the
// chart TestKubernetesDocMatchesFiles checks.
const kubernetesDoc = "../../docs/kubernetes.md"

// facts are what the Kubernetes page says of one setup's files, each
// written as the page writes it, from the decoded objects.
type facts struct {
	ports, liveness, readiness, retries, balancing string
}

// factsOf reads the facts from a setup's objects: the pdx Deployment and
// its Service, and the Envoy Gateway BackendTrafficPolicy or InferencePool
// in front of it.
func factsOf(t *testing.T, objs []object) facts {
	t.Helper()
	deps := all[*appsv1.Deployment](objs)
	require.Len(t, deps, 1)
	c := deps[0].Spec.Template.Spec.Containers[0]
	svc := get[*corev1.Service](t, objs, deps[0].Name)
	var ports []string
	for _, sp := range svc.Spec.Ports {
		p := fmt.Sprintf("`%s` %d", sp.Name, sp.Port)
		if sp.AppProtocol != nil {
			p += fmt.Sprintf(" (`%s`)", *sp.AppProtocol)
		}
		ports = append(ports, p)
	}
	f := facts{ports: strings.Join(ports, ", "), liveness: probeFact(t, c.LivenessProbe, c), readiness: probeFact(t, c.ReadinessProbe, c)}

	btps := all[*egv1a1.BackendTrafficPolicy](objs)
	switch {
	case len(btps) > 0:
		require.Len(t, btps, 1)
		f.retries, f.balancing = retryFact(t, btps[0].Spec.Retry), balancingFact(t, btps[0].Spec.LoadBalancer)
	case len(all[*infv1.InferencePool](objs)) > 0:
		f.retries, f.balancing = "the gateway's", "the InferencePool's endpoint picker: pdx"
	default:
		f.retries, f.balancing = "no Gateway", "no Gateway"
	}
	return f
}

// probeFact: "HTTP GET `/healthz` on `admin` (9003)" or "gRPC health
// `liveness` on 9002".
func probeFact(t *testing.T, p *corev1.Probe, c corev1.Container) string {
	t.Helper()
	require.NotNil(t, p)
	switch {
	case p.HTTPGet != nil:
		port := fmt.Sprint(p.HTTPGet.Port.IntVal)
		if p.HTTPGet.Port.Type == intstr.String {
			port = fmt.Sprintf("`%s` (%d)", p.HTTPGet.Port.StrVal, resolvePort(t, p.HTTPGet.Port, c))
		}
		return fmt.Sprintf("HTTP GET `%s` on %s", p.HTTPGet.Path, port)
	case p.GRPC != nil:
		service := ""
		if p.GRPC.Service != nil {
			service = *p.GRPC.Service
		}
		return fmt.Sprintf("gRPC health `%s` on %d", service, p.GRPC.Port)
	}
	require.Fail(t, "a probe that is neither HTTP GET nor gRPC")
	return ""
}

// retryFact: "1 retry, on `connect-failure`, `5xx`, back-off 5ms to
// 50ms" (and the status codes retried, if any).
func retryFact(t *testing.T, r *egv1a1.Retry) string {
	t.Helper()
	if r == nil || r.NumRetries == nil || *r.NumRetries == 0 {
		return "none"
	}
	s := fmt.Sprintf("%d retries", *r.NumRetries)
	if *r.NumRetries == 1 {
		s = "1 retry"
	}
	require.NotNil(t, r.RetryOn)
	var on []string
	for _, tr := range r.RetryOn.Triggers {
		on = append(on, fmt.Sprintf("`%s`", tr))
	}
	for _, code := range r.RetryOn.HTTPStatusCodes {
		on = append(on, fmt.Sprintf("status %d", code))
	}
	s += ", on " + strings.Join(on, ", ")
	if r.PerRetry != nil && r.PerRetry.BackOff != nil {
		b := r.PerRetry.BackOff
		require.NotNil(t, b.BaseInterval)
		require.NotNil(t, b.MaxInterval)
		s += fmt.Sprintf(", back-off %s to %s", *b.BaseInterval, *b.MaxInterval)
	}
	return s
}

// balancingFact: "the host pdx named in `x-gateway-destination-endpoint`
// (`endpointOverride`), else `RoundRobin`".
func balancingFact(t *testing.T, lb *egv1a1.LoadBalancer) string {
	t.Helper()
	require.NotNil(t, lb)
	if lb.EndpointOverride == nil {
		return fmt.Sprintf("`%s`", lb.Type)
	}
	var from []string
	for _, e := range lb.EndpointOverride.ExtractFrom {
		require.NotNil(t, e.Header)
		from = append(from, fmt.Sprintf("`%s`", *e.Header))
	}
	return fmt.Sprintf("the host pdx named in %s (`endpointOverride`), else `%s`", strings.Join(from, ", "), lb.Type)
}

// TestKubernetesDocMatchesFiles: what docs/kubernetes.md says about the
// pdx Service's ports, the probes, the decode retries and load balancing
// is what the manifests and the chart's renders hold: its table "What the
// files set" is this test's output, and the lines that describe the files
// (the rows of the manifests' table, the Helm modes) say the same words.
func TestKubernetesDocMatchesFiles(t *testing.T) {
	raw, err := os.ReadFile(kubernetesDoc)
	require.NoError(t, err)
	doc := string(raw)

	setups := []struct {
		name string
		objs []object
	}{
		{"`base/` + `envoy-gateway/`", loadRaw(t, "base", "envoy-gateway")},
		{"`base/` + `inferencepool/`", loadRaw(t, "base", "inferencepool")},
		{"chart", mustRender(t, nil).objs},
		{"chart, `envoyGateway.enabled`", mustRender(t, envoyGatewayValues).objs},
		{"chart, `inferencePool.enabled`", mustRender(t, inferencePoolValues).objs},
	}
	var table strings.Builder
	table.WriteString("| files | pdx Service ports | liveness probe | readiness probe | decode retries | decode load balancing |\n")
	table.WriteString("|---|---|---|---|---|---|\n")
	of := map[string]facts{}
	for _, s := range setups {
		f := factsOf(t, s.objs)
		of[s.name] = f
		fmt.Fprintf(&table, "| %s | %s | %s | %s | %s | %s |\n", s.name, f.ports, f.liveness, f.readiness, f.retries, f.balancing)
	}
	got := tableAt(doc, "| files | pdx Service ports |")
	require.Equal(t, table.String(), got, "%s's table of what the files set differs from the files; the table they give:\n\n%s", kubernetesDoc, table.String())

	egRaw, egChart := of["`base/` + `envoy-gateway/`"], of["chart, `envoyGateway.enabled`"]
	for _, claim := range []struct {
		where string // a line of the page that starts so, up to the next blank line or list item
		says  []string
	}{
		{"| `base/30-pdx-deployment.yaml` |", []string{egRaw.liveness, egRaw.readiness}},
		{"| `base/40-pdx-service.yaml` |", []string{egRaw.ports}},
		{"| `envoy-gateway/50-backendtrafficpolicy.yaml` |", []string{egRaw.retries, egRaw.balancing}},
		{"- **`envoyGateway.enabled=true`**", []string{egChart.retries, egChart.balancing}},
	} {
		text := paragraphAt(t, doc, claim.where)
		for _, want := range claim.says {
			require.Contains(t, text, want, "%s, at %q, does not say what the files do", kubernetesDoc, claim.where)
		}
	}
}

// tableAt returns the table of doc whose first line starts with start, or
// "" without one.
func tableAt(doc, start string) string {
	i := strings.Index(doc, "\n"+start)
	if i < 0 {
		return ""
	}
	var rows []string
	for line := range strings.Lines(doc[i+1:]) {
		if !strings.HasPrefix(line, "|") {
			break
		}
		rows = append(rows, line)
	}
	return strings.Join(rows, "")
}

// paragraphAt returns the line of doc that starts with start, with the
// lines that continue it (up to a blank line, a table row or a list item),
// joined by spaces.
func paragraphAt(t *testing.T, doc, start string) string {
	t.Helper()
	i := strings.Index(doc, "\n"+start)
	require.GreaterOrEqual(t, i, 0, "%s has no line starting %q", kubernetesDoc, start)
	var lines []string
	for line := range strings.Lines(doc[i+1:]) {
		line = strings.TrimSpace(line)
		if len(lines) > 0 && (line == "" || strings.HasPrefix(line, "|") || strings.HasPrefix(line, "- ")) {
			break
		}
		lines = append(lines, line)
	}
	return strings.Join(lines, " ")
}
