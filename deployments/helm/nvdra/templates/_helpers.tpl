{{/* Whether DRA is served: every mode but device-plugin. */}}
{{- define "nvdra.dra" -}}
{{- if ne .Values.mode "device-plugin" }}true{{ end -}}
{{- end }}

{{/* The device-plugin config the chart renders (devicePluginConfig with `sharing` merged in), as YAML; empty when there is none. */}}
{{- define "nvdra.devicePluginConfig" -}}
{{- $config := deepCopy .Values.devicePluginConfig }}
{{- if .Values.sharing }}
{{- if hasKey $config "sharing" }}
{{- fail "sharing: set it or devicePluginConfig.sharing, not both" }}
{{- end }}
{{- $_ := set $config "sharing" .Values.sharing }}
{{- end }}
{{- if $config }}
{{- if .Values.devicePluginConfigMap }}
{{- fail "devicePluginConfigMap: set it or devicePluginConfig/sharing, not both" }}
{{- end }}
{{- if not (hasKey $config "version") }}
{{- $_ := set $config "version" "v1" }}
{{- end }}
{{- toYaml $config }}
{{- end }}
{{- end }}

{{/* The ConfigMap the daemon reads its device-plugin config from; empty when none. */}}
{{- define "nvdra.devicePluginConfigMap" -}}
{{- if include "nvdra.devicePluginConfig" . }}nvdra-device-plugin{{ else }}{{ .Values.devicePluginConfigMap }}{{ end -}}
{{- end }}

{{/* The service account's user name, as the admission policy matches it. */}}
{{- define "nvdra.user" -}}
system:serviceaccount:{{ .Release.Namespace }}:nvdra
{{- end }}

{{/* The image: repository:tag, the tag the chart's appVersion unless set, and @digest when set. */}}
{{- define "nvdra.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- with .Values.image.digest }}@{{ . }}{{ end }}
{{- end }}

{{/* Whether nvdra's container gets SYS_ADMIN and the host's cgroup root (MIG, shares). */}}
{{- define "nvdra.migAndShares" -}}
{{- if or .Values.migAndShares .Values.sharedCapacity (not (eq (toString .Values.consumableShares) "")) }}true{{ end -}}
{{- end }}
