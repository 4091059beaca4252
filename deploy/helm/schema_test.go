package helm

import (
	"testing"

	"github.com/stretchr/testify/require"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
)

// TestSchemaSaysWhatIsExpected: a value values.schema.json refuses gets a
// message, as `helm install --set` prints it, that says what the value
// should be, not only which schema keyword failed ("'not' failed", a
// regular expression).
func TestSchemaSaysWhatIsExpected(t *testing.T) {
	chrt, err := loader.Load("pdx")
	require.NoError(t, err)
	tests := []struct {
		name   string
		values map[string]any
		want   string
	}{
		{"image tag latest", map[string]any{"image": map[string]any{"tag": "latest"}},
			"at '/image/tag': value must be 'a release such as 0.1.0, not latest, which names a different image over time (or set image.digest)'"},
		{"image tag a number", map[string]any{"image": map[string]any{"tag": 0.1}},
			"at '/image/tag': value must be 'a release as a string, such as 0.1.0 (--set-string for one that reads as a number)'"},
		{"image digest", map[string]any{"image": map[string]any{"digest": "abc"}},
			"at '/image/digest': value must be 'empty, or sha256: and 64 hexadecimal digits'"},
		{"duration without a unit", map[string]any{"drainTimeout": "30"},
			"at '/drainTimeout': value must be 'a duration such as 30s, 1m30s or 250ms'"},
		{"duration a number", map[string]any{"drainTimeout": 30},
			"at '/drainTimeout': value must be 'a duration such as 30s, 1m30s or 250ms'"},
		{"port out of range", map[string]any{"ports": map[string]any{"grpc": 70000}},
			"at '/ports/grpc': value must be 'a port number from 1 to 65535'"},
		{"quantity with a space", map[string]any{"envoyGateway": map[string]any{"extProc": map[string]any{"initialStreamWindowSize": "16 MB"}}},
			"at '/envoyGateway/extProc/initialStreamWindowSize': value must be 'a size as a Kubernetes quantity string, such as 16Mi or 64Mi'"},
		{"no decode selector", map[string]any{"decodeEngines": map[string]any{"selector": map[string]any{"app.kubernetes.io/name": nil, "app.kubernetes.io/component": nil}}},
			"at '/decodeEngines/selector': value must be 'at least one label of the decode pods'"},
		// The validator's own messages where they say it already.
		{"pull policy", map[string]any{"image": map[string]any{"pullPolicy": "always"}},
			"at '/image/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'"},
		{"replicas a word", map[string]any{"replicaCount": "two"}, "at '/replicaCount': got string, want integer"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := chartutil.ToRenderValues(chrt, tt.values,
				chartutil.ReleaseOptions{Name: "pdx", Namespace: "pdx", IsInstall: true}, chartutil.DefaultCapabilities)
			require.Error(t, err)
			require.Equal(t, "values don't meet the specifications of the schema(s) in the following chart(s):\npdx:\n- "+tt.want+"\n", err.Error())
		})
	}
}
