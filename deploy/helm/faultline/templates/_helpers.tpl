{{/* The release's base name: the release's own when it contains the chart's ("faultline"). */}}
{{- define "faultline.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "faultline.agent" -}}{{ include "faultline.fullname" . }}-agent{{- end -}}
{{- define "faultline.aggregator" -}}{{ include "faultline.fullname" . }}-aggregator{{- end -}}

{{- define "faultline.serviceAccount" -}}
{{- default (include "faultline.aggregator" .) .Values.aggregator.serviceAccount.name -}}
{{- end -}}

{{/* Every object's labels: the kustomize base's part-of, and Helm's own. */}}
{{- define "faultline.labels" -}}
app.kubernetes.io/part-of: faultline
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "faultline.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{/* The vendor's node label: where the agents run and which Nodes the aggregator follows. */}}
{{- define "faultline.vendorNodeSelector" -}}
{{- if eq .Values.vendor "ascend" -}}
accelerator: huawei-Ascend910
{{- else -}}
nvidia.com/gpu.present: "true"
{{- end -}}
{{- end -}}

{{- define "faultline.nodeSelectorFlag" -}}
{{- if .Values.aggregator.nodeSelectorFlag -}}
{{- .Values.aggregator.nodeSelectorFlag -}}
{{- else if eq .Values.vendor "ascend" -}}
accelerator=huawei-Ascend910
{{- else -}}
nvidia.com/gpu.present=true
{{- end -}}
{{- end -}}

{{- define "faultline.remediation" -}}
{{- if not .Values.remediation.enabled -}}off{{- else if .Values.dryRun -}}dry-run{{- else -}}enforce{{- end -}}
{{- end -}}

{{- define "faultline.ascendDeviceInfo" -}}
{{- if kindIs "invalid" .Values.remediation.ascendDeviceInfo -}}
{{- eq .Values.vendor "ascend" -}}
{{- else -}}
{{- .Values.remediation.ascendDeviceInfo -}}
{{- end -}}
{{- end -}}

{{/* The shard ConfigMaps' names (common/src/fault.rs page_name), for the publisher Roles. */}}
{{- define "faultline.shardConfigMaps" -}}
{{- $name := include "faultline.fullname" . -}}
{{- $names := list -}}
{{- $pages := int (default 1 .Values.aggregator.pages) -}}
{{- range $shard := until (int .Values.aggregator.shards) -}}
{{- range $page := until $pages -}}
{{- if eq $page 0 -}}
{{- $names = append $names (printf "%s-shard-%d" $name $shard) -}}
{{- else -}}
{{- $names = append $names (printf "%s-shard-%d-page-%d" $name $shard $page) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toJson $names -}}
{{- end -}}

{{/*
Contradictions fail the render, each naming the values that disagree.
*/}}
{{- define "faultline.validate" -}}
{{- $r := .Values.remediation -}}
{{- if and $r.enabled (not .Values.dryRun) (not .Values.aggregator.enabled) -}}
{{- fail "remediation acts only through the aggregator: dryRun=false needs aggregator.enabled=true" -}}
{{- end -}}
{{- if and $r.enabled (not .Values.dryRun) (not (kindIs "invalid" $r.budget.maxQuarantined)) (lt (int $r.budget.maxQuarantined) 1) -}}
{{- fail "remediation.budget.maxQuarantined must be at least 1 when remediation acts (dryRun=false): a budget of 0 would quarantine nothing while claiming to heal" -}}
{{- end -}}
{{- if and $r.forceDeleteAfterDeadline (or (not $r.enabled) .Values.dryRun) -}}
{{- fail "remediation.forceDeleteAfterDeadline acts only with remediation.enabled=true and dryRun=false: it would grant pods delete for nothing" -}}
{{- end -}}
{{- if and (eq (include "faultline.ascendDeviceInfo" .) "true") (ne .Values.vendor "ascend") -}}
{{- fail "remediation.ascendDeviceInfo reads Huawei's device plugin's ConfigMaps: it needs vendor=ascend" -}}
{{- end -}}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.aggregator.enabled) -}}
{{- fail "metrics.serviceMonitor scrapes the aggregator: it needs aggregator.enabled=true" -}}
{{- end -}}
{{- if and .Values.metrics.podMonitor.enabled (not .Values.agent.enabled) -}}
{{- fail "metrics.podMonitor scrapes the agents: it needs agent.enabled=true" -}}
{{- end -}}
{{- end -}}
