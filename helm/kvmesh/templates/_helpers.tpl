{{/*
Chart name, truncated to the 63 characters Kubernetes allows in a name.
*/}}
{{- define "kvmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name: `<release>-kvmesh`, or just the release name when it already contains
the chart name. Component suffixes are appended to it, so it leaves room for them.
*/}}
{{- define "kvmesh.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 48 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "kvmesh.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels. Call with the root context.
*/}}
{{- define "kvmesh.labels" -}}
helm.sh/chart: {{ include "kvmesh.chart" . }}
{{ include "kvmesh.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvmesh
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Selector labels shared by every resource of the release.
*/}}
{{- define "kvmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvmesh.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Labels and selector labels of one component. Call with (dict "root" $ "component" "decode").
*/}}
{{- define "kvmesh.componentLabels" -}}
{{ include "kvmesh.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvmesh.componentSelectorLabels" -}}
{{ include "kvmesh.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Name of a component's resources: `<fullname>-<component>`.
*/}}
{{- define "kvmesh.componentName" -}}
{{- printf "%s-%s" (include "kvmesh.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
ServiceAccount name.
*/}}
{{- define "kvmesh.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvmesh.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The kvmesh image reference.
*/}}
{{- define "kvmesh.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
KVMESH_* environment entries from a settings map: `{max-num-seqs: 8}` -> KVMESH_MAX_NUM_SEQS="8".
*/}}
{{- define "kvmesh.configEnv" -}}
{{- range $key, $value := . }}
- name: {{ printf "KVMESH_%s" ($key | replace "-" "_" | replace "." "_" | upper) }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end }}

{{/*
Name of the Secret the chart creates for the API key and the external Redis URL.
*/}}
{{- define "kvmesh.secretName" -}}
{{- printf "%s-secrets" (include "kvmesh.fullname" .) }}
{{- end }}

{{/*
Whether the chart creates its Secret at all.
*/}}
{{- define "kvmesh.createSecret" -}}
{{- $api := and .Values.apiKey.value (not .Values.apiKey.existingSecret) }}
{{- $redisUrl := and (not .Values.redis.enabled) .Values.redis.url (not .Values.redis.existingSecret) }}
{{- $redisPw := and .Values.redis.enabled .Values.redis.auth.enabled .Values.redis.auth.password (not .Values.redis.auth.existingSecret) }}
{{- if or $api $redisUrl $redisPw }}true{{ end }}
{{- end }}

{{/*
KVMESH_REDIS_URL (and the password it splices in), for every kvmesh container.
*/}}
{{- define "kvmesh.redisEnv" -}}
{{- if .Values.redis.enabled }}
{{- $host := printf "%s-redis" (include "kvmesh.fullname" .) }}
{{- if .Values.redis.auth.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ default (include "kvmesh.secretName" .) .Values.redis.auth.existingSecret }}
      key: {{ ternary .Values.redis.auth.existingSecretKey "redis-password" (not (empty .Values.redis.auth.existingSecret)) }}
- name: KVMESH_REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:%d/%d" $host (int .Values.redis.port) (int .Values.redis.database) | quote }}
{{- else }}
- name: KVMESH_REDIS_URL
  value: {{ printf "redis://%s:%d/%d" $host (int .Values.redis.port) (int .Values.redis.database) | quote }}
{{- end }}
{{- else if .Values.redis.existingSecret }}
- name: KVMESH_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret }}
      key: {{ .Values.redis.existingSecretKey }}
{{- else if .Values.redis.url }}
- name: KVMESH_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "kvmesh.secretName" . }}
      key: redis-url
{{- else }}
{{- fail "redis: set redis.enabled=true for the bundled Redis, or give redis.url or redis.existingSecret for an external one" }}
{{- end }}
{{- end }}

{{/*
KVMESH_API_KEY for the gateway, when authentication is on.
*/}}
{{- define "kvmesh.apiKeyEnv" -}}
{{- if .Values.apiKey.existingSecret }}
- name: KVMESH_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKey.existingSecret }}
      key: {{ .Values.apiKey.existingSecretKey }}
{{- else if .Values.apiKey.value }}
- name: KVMESH_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "kvmesh.secretName" . }}
      key: api-key
{{- end }}
{{- end }}

{{/*
The model volume (pvc | hostPath | emptyDir).
*/}}
{{- define "kvmesh.modelVolume" -}}
{{- $v := .Values.model.volume }}
- name: model
{{- if eq $v.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ ternary (printf "%s-model" (include "kvmesh.fullname" .)) $v.pvc.claimName $v.pvc.create }}
    {{- if not .Values.model.init.enabled }}
    readOnly: true
    {{- end }}
{{- else if eq $v.type "hostPath" }}
  hostPath:
    path: {{ $v.hostPath.path }}
    type: {{ $v.hostPath.type }}
{{- else }}
  emptyDir:
    sizeLimit: {{ $v.emptyDir.sizeLimit }}
{{- end }}
{{- end }}

{{/*
The init container that fills the model volume.
*/}}
{{- define "kvmesh.modelInitContainer" -}}
{{- if .Values.model.init.enabled }}
- name: model-init
  image: {{ default (include "kvmesh.image" .) .Values.model.init.image }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    {{- toYaml .Values.model.init.command | nindent 4 }}
  env:
    - name: HOME
      value: /tmp
    {{- with .Values.model.init.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  {{- with .Values.model.init.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: model
      mountPath: {{ .Values.model.volume.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}
