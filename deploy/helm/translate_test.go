//go:build egctl

// This test needs Envoy Gateway's egctl (at the go.mod's version of
// github.com/envoyproxy/gateway); `make k8s-translate` installs it and runs
// this test with deploy/kubernetes' own:
//
//	EGCTL=$PWD/.tools/egctl/egctl go test -tags egctl -run TestChartEnvoyGatewayTranslation ./deploy/helm/

package helm_test

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	egv1a1 "github.com/envoyproxy/gateway/api/v1alpha1"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/pdx-router/pdx/processor"
)

// egStatus is a resource of egctl's translation with its status.
type egStatus struct {
	Metadata metav1.ObjectMeta `json:"metadata"`
	Status   struct {
		// Routes report per parent, policies per ancestor.
		Parents   []struct{ Conditions []metav1.Condition } `json:"parents"`
		Ancestors []struct{ Conditions []metav1.Condition } `json:"ancestors"`
	} `json:"status"`
}

// TestChartEnvoyGatewayTranslation runs Envoy Gateway's own translator on
// the chart's envoyGateway mode: the route and every policy are accepted,
// and the Envoy config it generates sends the decode request to the
// endpoint pdx names (override_host on x-gateway-destination-endpoint) and
// retries it as the BackendTrafficPolicy says.
func TestChartEnvoyGatewayTranslation(t *testing.T) {
	egctl := os.Getenv("EGCTL")
	require.NotEmpty(t, egctl, "set EGCTL to Envoy Gateway's egctl (make k8s-translate installs it)")
	r := mustRender(t, envoyGatewayOwnClassValues) // egctl translates the Gateways of the GatewayClass it is given
	var in bytes.Buffer
	for _, o := range r.objs {
		// As written, without the empty status a typed object marshals
		// (egctl validates against the CRDs, which require its fields).
		j, err := json.Marshal(o.obj)
		require.NoError(t, err)
		var m map[string]any
		require.NoError(t, json.Unmarshal(j, &m))
		delete(m, "status")
		doc, err := yaml.Marshal(m)
		require.NoError(t, err)
		in.WriteString("---\n")
		in.Write(doc)
	}
	inFile := filepath.Join(t.TempDir(), "in.yaml")
	require.NoError(t, os.WriteFile(inFile, in.Bytes(), 0o600))
	cmd := exec.CommandContext(t.Context(), egctl, "x", "translate", "--from", "gateway-api", "--to", "gateway-api,xds",
		"--type", "all", "--output", "json", "--add-missing-resources", "--file", inFile)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "egctl: %s", stderr.String())
	var tr struct {
		HTTPRoutes             []egStatus `json:"httpRoutes"`
		EnvoyExtensionPolicies []egStatus `json:"envoyExtensionPolicies"`
		ClientTrafficPolicies  []egStatus `json:"clientTrafficPolicies"`
		BackendTrafficPolicies []egStatus `json:"backendTrafficPolicies"`
		XDS                    map[string]struct {
			Configs []map[string]any `json:"configs"`
		} `json:"xds"`
	}
	require.NoError(t, json.Unmarshal(out, &tr))

	accepted := func(what string, conds []metav1.Condition) {
		t.Helper()
		require.NotEmpty(t, conds, what)
		for _, c := range conds {
			require.Equal(t, metav1.ConditionTrue, c.Status, "%s: %s %s: %s", what, c.Type, c.Reason, c.Message)
		}
		require.True(t, slices.ContainsFunc(conds, func(c metav1.Condition) bool { return c.Type == "Accepted" }), what)
	}
	for kind, list := range map[string][]egStatus{
		"HTTPRoute": tr.HTTPRoutes, "EnvoyExtensionPolicy": tr.EnvoyExtensionPolicies,
		"ClientTrafficPolicy": tr.ClientTrafficPolicies, "BackendTrafficPolicy": tr.BackendTrafficPolicies,
	} {
		require.Len(t, list, 1, kind)
		s := list[0]
		what := kind + " " + s.Metadata.Name
		if kind == "HTTPRoute" {
			require.NotEmpty(t, s.Status.Parents, what)
			for _, p := range s.Status.Parents {
				accepted(what, p.Conditions)
			}
			continue
		}
		require.NotEmpty(t, s.Status.Ancestors, what)
		for _, a := range s.Status.Ancestors {
			accepted(what, a.Conditions)
		}
	}

	// The generated clusters and routes, as JSON.
	require.Len(t, tr.XDS, 1, "one Gateway")
	var clusters, routes []map[string]any
	for _, x := range tr.XDS {
		for _, c := range x.Configs {
			typ, _ := c["@type"].(string)
			switch {
			case strings.HasSuffix(typ, ".ClustersConfigDump"):
				for _, e := range c["dynamicActiveClusters"].([]any) {
					clusters = append(clusters, e.(map[string]any)["cluster"].(map[string]any))
				}
			case strings.HasSuffix(typ, ".RoutesConfigDump"):
				for _, e := range c["dynamicRouteConfigs"].([]any) {
					rc := e.(map[string]any)["routeConfig"].(map[string]any)
					for _, vh := range rc["virtualHosts"].([]any) {
						for _, rt := range vh.(map[string]any)["routes"].([]any) {
							routes = append(routes, rt.(map[string]any))
						}
					}
				}
			}
		}
	}
	const ruleCluster = "httproute/pdx/pdx-openai/rule/0"
	i := slices.IndexFunc(clusters, func(c map[string]any) bool { return c["name"] == ruleCluster })
	require.GreaterOrEqual(t, i, 0, "no cluster %s", ruleCluster)
	lb, err := json.Marshal(clusters[i]["loadBalancingPolicy"])
	require.NoError(t, err)
	require.Contains(t, string(lb), "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost", "the decode cluster overrides the host: %s", lb)
	require.Contains(t, string(lb), `"`+processor.DestinationHeader+`"`, "from pdx's header: %s", lb)
	// The fallback is the BackendTrafficPolicy's type.
	btp := all[*egv1a1.BackendTrafficPolicy](r.objs)
	require.Len(t, btp, 1)
	fallback := map[egv1a1.LoadBalancerType]string{
		egv1a1.RoundRobinLoadBalancerType:   "load_balancing_policies.round_robin.v3.RoundRobin",
		egv1a1.LeastRequestLoadBalancerType: "load_balancing_policies.least_request.v3.LeastRequest",
		egv1a1.RandomLoadBalancerType:       "load_balancing_policies.random.v3.Random",
	}[btp[0].Spec.LoadBalancer.Type]
	require.NotEmpty(t, fallback, "load balancer type %s", btp[0].Spec.LoadBalancer.Type)
	require.Contains(t, string(lb), fallback, "the override_host fallback: %s", lb)

	t.Logf("decode cluster load balancing: %s", lb)
	require.Len(t, routes, 1, "one route, every path")
	rt := routes[0]["route"].(map[string]any)
	require.Equal(t, ruleCluster, rt["cluster"])
	retry := rt["retryPolicy"].(map[string]any)
	t.Logf("decode route retry policy: %v", retry)
	require.ElementsMatch(t, []string{"connect-failure", "refused-stream", "reset-before-request", "5xx"}, strings.Split(retry["retryOn"].(string), ","))
	require.EqualValues(t, 1, retry["numRetries"])
}
