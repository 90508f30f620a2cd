{{- define "lockstep.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "lockstep.operatorName" -}}{{ include "lockstep.fullname" . }}-operator{{- end -}}

{{- /*
The LockstepDeployment's name: deployment.name, else the release name. The operator refuses (InvalidSpec)
a name that is not a DNS label starting with a letter, or longer than 47 characters (its rank pods' names
and labels are built from it): operator/lockstep_operator/resource.py, check_name and MAX_NAME_LENGTH,
mirrored here (tests/test_chart.py checks both against it) so that such a release fails at install.
*/ -}}
{{- define "lockstep.deploymentName" -}}
{{- $name := .Values.deployment.name | default .Release.Name -}}
{{- $from := ternary "deployment.name" "the release name" (ne .Values.deployment.name "") -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name) -}}
{{- fail (printf "the LockstepDeployment would be named %q (%s), which the operator refuses: it must be a DNS label (lower-case letters, digits, '-') starting with a letter. Set deployment.name to such a name (--set deployment.name=...)" $name $from) -}}
{{- else if gt (len $name) 47 -}}
{{- fail (printf "the LockstepDeployment would be named %q (%s), which the operator refuses: it is %d characters, and at most 47 fit the names of its pods. Set deployment.name to a shorter name (--set deployment.name=...)" $name $from (len $name)) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

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

{{/*
The chart's labels with extra ones (a list: the root context, then a dict): one key each, an extra label
overriding the chart's of the same name (a duplicate key is refused by Flux and kustomize).
*/}}
{{- define "lockstep.labelsWith" -}}
{{- $base := include "lockstep.labels" (index . 0) | fromYaml -}}
{{- toYaml (merge (deepCopy (index . 1 | default dict)) $base) -}}
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
