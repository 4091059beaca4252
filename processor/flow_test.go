package processor

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/flowcontrol"
)

func TestFlowHeaders(t *testing.T) {
	start := time.Unix(1000, 0)
	for _, tt := range []struct {
		name    string
		headers []string
		want    flowcontrol.Request
		wantErr string
	}{
		{name: "none"},
		{name: "llm-d's", headers: []string{ObjectiveHeader, "critical", FairnessHeader, "tenant-a", SLOTTFTHeader, "250"},
			want: flowcontrol.Request{Objective: "critical", Flow: "tenant-a", Deadline: start.Add(250 * time.Millisecond)}},
		{name: "the older spellings", headers: []string{objectiveHeaderOld, "batch", fairnessHeaderOld, "tenant-b"},
			want: flowcontrol.Request{Objective: "batch", Flow: "tenant-b"}},
		{name: "the newer wins", headers: []string{objectiveHeaderOld, "old", ObjectiveHeader, "new", FairnessHeader, "f", fairnessHeaderOld, "g"},
			want: flowcontrol.Request{Objective: "new", Flow: "f"}},
		{name: "an SLO that is no number", headers: []string{SLOTTFTHeader, "soon"}, wantErr: "x-llm-d-slo-ttft-ms must be a positive whole number"},
		{name: "an SLO of 0", headers: []string{SLOTTFTHeader, "0"}, wantErr: "x-llm-d-slo-ttft-ms must be a positive whole number"},
		{name: "a negative SLO", headers: []string{SLOTTFTHeader, "-5"}, wantErr: "x-llm-d-slo-ttft-ms must be a positive whole number"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := &request{start: start}
			err := r.flowHeaders(headers("POST", "/v1/chat/completions", false, tt.headers...).GetRequestHeaders())
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				require.Equal(t, 400, toAPIError(err).status)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tt.want, r.flow)
		})
	}
}

// The flow-control headers are pdx's to read: the engines never see them.
func TestFlowHeadersRemoved(t *testing.T) {
	for _, h := range []string{ObjectiveHeader, objectiveHeaderOld, FairnessHeader, fairnessHeaderOld, SLOTTFTHeader} {
		require.Contains(t, clientRoutingHeaders, h)
	}
}
