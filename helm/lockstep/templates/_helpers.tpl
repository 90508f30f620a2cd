{{- define "lockstep.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "lockstep.operatorName" -}}{{ include "lockstep.fullname" . }}-operator{{- end -}}

{{- define "lockstep.deploymentName" -}}{{ .Values.deployment.name | default .Release.Name }}{{- end -}}

{{- define "lockstep.image" -}}{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}{{- end -}}

{{- define "lockstep.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}{{ .Values.serviceAccount.name | default (include "lockstep.operatorName" .) }}
{{- else -}}{{ .Values.serviceAccount.name | default "default" }}{{- end -}}
{{- end -}}

{{- define "lockstep.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: lockstep
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "lockstep.operatorSelector" -}}
app.kubernetes.io/name: lockstep
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- /*
The coordinators' LOCKSTEP_API_KEY as an env list (one entry) for a client pod (the `helm test` hook), or nothing
when no key is configured: the deployment's own spec.env entry when it sets one (that is what the
coordinators check), else the operator's `operator.coordinatorApiKeySecret`.
*/ -}}
{{- define "lockstep.apiKeyEnv" -}}
{{- $found := dict }}
{{- range (dig "env" (list) .Values.deployment.spec) }}
{{- if and (kindIs "map" .) (eq (toString .name) "LOCKSTEP_API_KEY") (or .value .valueFrom) }}{{ $found = . }}{{ end }}
{{- end }}
{{- if $found }}
{{- toYaml (list $found) }}
{{- else if .Values.operator.coordinatorApiKeySecret.name }}
{{- toYaml (list (dict "name" "LOCKSTEP_API_KEY" "valueFrom" (dict "secretKeyRef" (dict "name" .Values.operator.coordinatorApiKeySecret.name "key" .Values.operator.coordinatorApiKeySecret.key)))) }}
{{- end }}
{{- end -}}
