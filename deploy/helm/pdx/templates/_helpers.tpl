{{/* The chart's name, for the app.kubernetes.io/name label. */}}
{{- define "pdx.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name every object is named after: the release name, prefixed to
the chart's name unless it already contains it ("pdx" for release pdx).
*/}}
{{- define "pdx.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdx.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "pdx.labels" -}}
helm.sh/chart: {{ include "pdx.chart" . }}
app.kubernetes.io/name: {{ include "pdx.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdx
{{- end }}

{{/* The pdx pods' labels that selectors use. */}}
{{- define "pdx.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdx.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end }}

{{- define "pdx.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdx.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pdx.configMapName" -}}
{{- printf "%s-config" (include "pdx.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdx.decodeServiceName" -}}
{{- default (printf "%s-decode" (include "pdx.fullname" .) | trunc 63 | trimSuffix "-") .Values.decodeEngines.service.name }}
{{- end }}

{{- define "pdx.inferencePoolName" -}}
{{- default (printf "%s-decode" (include "pdx.fullname" .) | trunc 63 | trimSuffix "-") .Values.inferencePool.name }}
{{- end }}

{{- define "pdx.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
The modes: at most one Gateway in front of pdx. Every template includes
this, so that any render of the chart fails on both.
*/}}
{{- define "pdx.checkModes" -}}
{{- if and .Values.envoyGateway.enabled .Values.inferencePool.enabled }}
{{- fail "envoyGateway.enabled and inferencePool.enabled cannot both be true: choose one Gateway in front of pdx" }}
{{- end }}
{{- end }}

{{/*
The GatewayClass a mode's Gateway names: the chart's own when
gatewayClass.create (default name: .default), else an existing one, which
must be named. Called with (dict "mode" "envoyGateway" "values" $eg
"default" name).
*/}}
{{- define "pdx.gatewayClassName" -}}
{{- if .values.gatewayClass.create }}
{{- default .default .values.gatewayClass.name }}
{{- else }}
{{- required (printf "%s.gatewayClass.name is required: name an existing GatewayClass of your gateway (kubectl get gatewayclass), or set %s.gatewayClass.create=true to have the chart create one (cluster-scoped)" .mode .mode) .values.gatewayClass.name }}
{{- end }}
{{- end }}

{{/* pdx serves TLS: the InferencePool's gateway connects with TLS. */}}
{{- define "pdx.tls" -}}
{{- if .Values.inferencePool.enabled }}true{{ end }}
{{- end }}

{{/*
pdx's config as YAML: .Values.config with the listen addresses from
.Values.ports, the release namespace for pools that name none, and
self-signed TLS in inferencePool mode.
*/}}
{{- define "pdx.config" -}}
{{- $cfg := deepCopy .Values.config }}
{{- range $field := list "grpc_address" "admin_address" "tls" }}
{{- if hasKey $cfg $field }}
{{- fail (printf "config.%s is set by the chart: set ports (listen addresses) or inferencePool.enabled (tls) instead" $field) }}
{{- end }}
{{- end }}
{{- $_ := set $cfg "grpc_address" (printf "0.0.0.0:%d" (int .Values.ports.grpc)) }}
{{- $_ = set $cfg "admin_address" (printf "0.0.0.0:%d" (int .Values.ports.admin)) }}
{{- if and .Values.peers.enabled (not (hasKey $cfg "peers")) }}
{{- $_ = set $cfg "peers" (dict "addresses" (list (printf "%s-peers.%s.svc:%d" (include "pdx.fullname" .) .Release.Namespace (int .Values.ports.admin)))) }}
{{- end }}
{{- if include "pdx.tls" . }}
{{- $_ = set $cfg "tls" (dict "self_signed" true) }}
{{- end }}
{{- range $pool := dig "pools" (list) $cfg }}
{{- if and (kindIs "map" $pool) (kindIs "map" (dig "kubernetes" "" $pool)) }}
{{- if not (dig "kubernetes" "namespace" "" $pool) }}
{{- $_ = set $pool.kubernetes "namespace" $.Release.Namespace }}
{{- end }}
{{- end }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/*
The namespaces pdx's pools discover engines or read InferenceObjectives
in, comma-separated: pdx's Role is needed in each.
*/}}
{{- define "pdx.discoveryNamespaces" -}}
{{- $ns := list }}
{{- range $pool := dig "pools" (list) .Values.config }}
{{- if and (kindIs "map" $pool) (kindIs "map" (dig "kubernetes" "" $pool)) }}
{{- $ns = append $ns (default $.Release.Namespace (dig "kubernetes" "namespace" "" $pool)) }}
{{- end }}
{{- if and (kindIs "map" $pool) (kindIs "map" (dig "flow_control" "kubernetes_objectives" "" $pool)) }}
{{- $ns = append $ns (default $.Release.Namespace (dig "flow_control" "kubernetes_objectives" "namespace" "" $pool)) }}
{{- end }}
{{- end }}
{{- $ns | uniq | sortAlpha | join "," }}
{{- end }}

{{/* max_body_bytes as pdx reads it (unset: pdx's default, 16 MiB). */}}
{{- define "pdx.maxBodyBytes" -}}
{{- int64 (dig "max_body_bytes" 16777216 .Values.config) }}
{{- end }}

{{/*
The Gateway's client buffer limit: max_body_bytes plus 512 KiB (Envoy's
headroom, envoy.BufferHeadroom), so that pdx answers an oversized body with
its own JSON 413 and Envoy still holds pdx's largest messages.
*/}}
{{- define "pdx.clientBufferLimit" -}}
{{- printf "%dKi" (div (add (include "pdx.maxBodyBytes" . | int64) 524288) 1024) }}
{{- end }}

{{/*
The buffer of Envoy's connection to pdx: max_body_bytes plus 1 MiB, pdx's
gRPC message limit.
*/}}
{{- define "pdx.extProcBufferLimit" -}}
{{- printf "%dKi" (div (add (include "pdx.maxBodyBytes" . | int64) 1048576) 1024) }}
{{- end }}
