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
  value: {{ include "kvmesh.settingText" $value | quote }}
{{- end }}
{{- end }}

{{/*
A setting's value as the text a flag takes. Helm reads every number of the values as a float, and
prints large whole ones in exponent form (2147483648 as 2.147483648e+09), which an integer flag
refuses: whole numbers are printed as integers.
*/}}
{{- define "kvmesh.settingText" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) }}{{ int64 . }}{{ else }}{{ toString . }}{{ end }}
{{- end }}

{{/*
A worker pool's engine settings (`engine`, the pool's merged over `worker`'s) as KVMESH_* entries.
The same setting in `config` too would give the container one variable twice, with no telling
which wins: refused, as are the settings the chart sets elsewhere (`tensor-parallel-size` from
`gpus`, `device`, `model` from model.path) and `block-size`, which every worker and the prefix-cache
index must share (config.block-size).
Call with (dict "values" <the pool's merged values> "pool" "decode").
*/}}
{{- define "kvmesh.engineEnv" -}}
{{- $envName := dict }}
{{- range $key, $_ := .values.config }}
{{- $_ := set $envName ($key | replace "-" "_" | replace "." "_" | upper) $key }}
{{- end }}
{{- range $key, $_ := .values.engine }}
{{- $name := $key | replace "-" "_" | upper }}
{{- if eq $name "TENSOR_PARALLEL_SIZE" }}
{{- fail (printf "workerPools.%s: engine.tensor-parallel-size is set by `gpus` (one rank per GPU of the pod): set gpus instead" $.pool) }}
{{- else if eq $name "DEVICE" }}
{{- fail (printf "workerPools.%s: engine.device would give the container KVMESH_DEVICE twice (the chart sets it from `device`): set worker.device or workerPools.<pool>.device instead" $.pool) }}
{{- else if eq $name "MODEL" }}
{{- fail (printf "workerPools.%s: engine.model would make the workers load another model than the one model.* provides to every pod (and the tokenizers read): set model.path instead" $.pool) }}
{{- else if eq $name "BLOCK_SIZE" }}
{{- fail (printf "workerPools.%s: engine.block-size would differ from the prefix-cache index's, which ignores workers whose blocks are another size: set config.block-size instead (every service reads it)" $.pool) }}
{{- end }}
{{- if hasKey $envName $name }}
{{- fail (printf "workerPools.%s gets %s from both `engine` and `config` (worker.* or workerPools.%s.*): engine settings belong in `engine` only" $.pool $key $.pool) }}
{{- end }}
{{- end }}
{{- include "kvmesh.configEnv" .values.engine }}
{{- end }}

{{/*
Settings one pod must not set for itself: every service and the prefix-cache index hash prompts
in blocks of `config.block-size`, and every pod serves `model.path`. A component's `config`,
`extraArgs` or `extraEnv` naming one would give that pod a value the rest of the fleet does not
share: refused, naming where the value was set and where it belongs.
Call with (dict "values" <the component's values> "where" "workerPools.decode").
*/}}
{{- define "kvmesh.fleetSettings" -}}
{{- $where := ternary (printf "%s (worker.* under the pool's own)" .where) .where (hasPrefix "workerPools." .where) }}
{{- range $key, $home := dict "block-size" "config.block-size (every service reads it)" "model" "model.path" }}
{{- $env := printf "KVMESH_%s" ($key | replace "-" "_" | upper) }}
{{- range $name, $_ := $.values.config }}
{{- if eq (printf "KVMESH_%s" ($name | replace "-" "_" | replace "." "_" | upper)) $env }}
{{- fail (printf "%s: config.%s would differ from the rest of the fleet's %s: set %s instead" $where $name $key $home) }}
{{- end }}
{{- end }}
{{- range $arg := $.values.extraArgs }}
{{- if eq (regexReplaceAll "=.*" (toString $arg) "") (printf "--%s" $key) }}
{{- fail (printf "%s: extraArgs %s would differ from the rest of the fleet's %s: set %s instead" $where $arg $key $home) }}
{{- end }}
{{- end }}
{{- range $entry := $.values.extraEnv }}
{{- if eq (toString (get $entry "name")) $env }}
{{- fail (printf "%s: extraEnv %s would differ from the rest of the fleet's %s: set %s instead" $where $env $key $home) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A worker pool's value of one engine setting as its container gets it: a flag in `extraArgs` over
a variable in `extraEnv` over `config` over `engine`, else `default`.
Call with (dict "values" <the pool's merged values> "key" "kv-cache-dtype" "default" "auto").
*/}}
{{- define "kvmesh.poolSetting" -}}
{{- $env := printf "KVMESH_%s" (.key | replace "-" "_" | upper) }}
{{- $value := .default }}
{{- range $name, $v := .values.engine }}{{ if eq $name $.key }}{{ $value = $v }}{{ end }}{{ end }}
{{- range $name, $v := .values.config }}
{{- if eq (printf "KVMESH_%s" ($name | replace "-" "_" | replace "." "_" | upper)) $env }}{{ $value = $v }}{{ end }}
{{- end }}
{{- range $entry := .values.extraEnv }}
{{- if eq (toString (get $entry "name")) $env }}{{ $value = get $entry "value" }}{{ end }}
{{- end }}
{{- $flag := printf "--%s" .key }}
{{- $args := .values.extraArgs | default (list) }}
{{- range $i, $arg := $args }}
{{- if hasPrefix (printf "%s=" $flag) (toString $arg) }}{{ $value = trimPrefix (printf "%s=" $flag) (toString $arg) }}
{{- else if and (eq (toString $arg) $flag) (lt (add1 $i) (len $args)) }}{{ $value = index $args (add1 $i) }}{{ end }}
{{- end }}
{{- include "kvmesh.settingText" $value }}
{{- end }}

{{/*
The prefill and decode pools' KV layouts meet in every hand-off (gpu_worker/kv_transfer/layout.py):
their KV dtype, weights dtype and quantization must be equal, or no prefill worker finds a decode
worker to pair with (the scheduler pairs equal layouts only); and a worker of either pool runs on
one GPU (the transfer reads and writes one process's cache: a tensor-parallel worker would refuse
its role at start). Call with the root context.
*/}}
{{- define "kvmesh.handoffPools" -}}
{{- $pools := .Values.workerPools }}
{{- range $pool := list "prefill" "decode" }}
{{- $merged := mergeOverwrite (deepCopy $.Values.worker) (deepCopy (get $pools $pool | default (dict))) }}
{{- if and $merged.enabled (gt (int $merged.gpus) 1) }}
{{- fail (printf "workerPools.%s.gpus=%v: a prefill or decode worker hands KV over from one cache, a single GPU's (tensor parallelism is the mixed pool's: workerPools.mixed.gpus)" $pool $merged.gpus) }}
{{- end }}
{{- end }}
{{- if and (dig "prefill" "enabled" false $pools) (dig "decode" "enabled" false $pools) }}
{{- $prefill := mergeOverwrite (deepCopy .Values.worker) (deepCopy $pools.prefill) }}
{{- $decode := mergeOverwrite (deepCopy .Values.worker) (deepCopy $pools.decode) }}
{{- range $key, $default := dict "kv-cache-dtype" "auto" "dtype" "auto" "quantization" "none" }}
{{- $p := include "kvmesh.poolSetting" (dict "values" $prefill "key" $key "default" $default) }}
{{- $d := include "kvmesh.poolSetting" (dict "values" $decode "key" $key "default" $default) }}
{{- if ne $p $d }}
{{- fail (printf "workerPools.prefill and workerPools.decode get %s %s and %s (from engine, config, extraEnv or extraArgs, worker.* under each pool's own): a prefill worker hands KV only to a decode worker of its own KV layout; set worker.engine.%s for both" $key $p $d $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Name of the Secret the chart creates for an external Redis URL.
*/}}
{{- define "kvmesh.secretName" -}}
{{- printf "%s-secrets" (include "kvmesh.fullname" .) }}
{{- end }}

{{/*
Whether the chart creates that Secret at all.
*/}}
{{- define "kvmesh.createSecret" -}}
{{- if and (not .Values.redis.enabled) .Values.redis.url (not .Values.redis.existingSecret) }}true{{ end }}
{{- end }}

{{/*
KVMESH_REDIS_URL for every kvmesh container. The password is not in it: services read it from
their trust directory (`redis.password`).
*/}}
{{- define "kvmesh.redisEnv" -}}
{{- if .Values.redis.enabled }}
- name: KVMESH_REDIS_URL
  value: {{ printf "redis://%s-redis:%d/%d" (include "kvmesh.fullname" .) (int .Values.redis.port) (int .Values.redis.database) | quote }}
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
The API key Secret: the user's, or `<fullname>-api-key` made by the chart.
*/}}
{{- define "kvmesh.apiKeySecretName" -}}
{{- default (printf "%s-api-key" (include "kvmesh.fullname" .)) .Values.gateway.apiKey.existingSecret }}
{{- end }}

{{- define "kvmesh.apiKeySecretKey" -}}
{{- ternary .Values.gateway.apiKey.existingSecretKey "api-key" (not (empty .Values.gateway.apiKey.existingSecret)) }}
{{- end }}

{{/*
KVMESH_API_KEY for the gateway, unless authentication is explicitly disabled.
*/}}
{{- define "kvmesh.apiKeyEnv" -}}
{{- if not .Values.gateway.apiKey.disabled }}
- name: KVMESH_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "kvmesh.apiKeySecretName" . }}
      key: {{ include "kvmesh.apiKeySecretKey" . }}
{{- end }}
{{- end }}

{{/*
Trust Secrets (services/security/bundle.py): `<prefix>-trust-<role>` per role, `<prefix>-trust-redis`
for the Redis server. The prefix is the fullname, whose Secrets the hook Job makes, or
`security.existingSecretPrefix`.
*/}}
{{- define "kvmesh.trustPrefix" -}}
{{- default (include "kvmesh.fullname" .) .Values.security.existingSecretPrefix }}
{{- end }}

{{- define "kvmesh.trustRoles" -}}
{{- list "gateway" "scheduler" "tokenizer" "prefix-cache" "worker" | toJson }}
{{- end }}

{{/*
Volume `items:` of one role's trust Secret: flat Secret keys (`curve-worker.secret`) back to the
bundle's paths (`curve/worker.secret`). Only this role's secret keys; every role's public key.
Call with (dict "root" $ "role" "worker").
*/}}
{{- define "kvmesh.trustItems" -}}
{{- range $r := include "kvmesh.trustRoles" .root | fromJsonArray }}
- key: curve-{{ $r }}.public
  path: curve/{{ $r }}.public
{{- end }}
- key: curve-{{ .role }}.secret
  path: curve/{{ .role }}.secret
- key: tls-ca.crt
  path: tls/ca.crt
- key: tls-{{ .role }}.crt
  path: tls/{{ .role }}.crt
- key: tls-{{ .role }}.key
  path: tls/{{ .role }}.key
- key: redis.password
  path: redis.password
{{- end }}

{{/*
Trust environment of a kvmesh container: the mounted directory, or the explicit insecure mode.
*/}}
{{- define "kvmesh.trustEnv" -}}
{{- if .Values.security.insecureInternalPlanes }}
- name: KVMESH_INSECURE_INTERNAL_PLANES
  value: "true"
{{- else }}
- name: KVMESH_TRUST_DIR
  value: {{ .Values.security.trustDir | quote }}
{{- end }}
{{- end }}

{{/*
The trust volume of one role's pods (nothing in insecure mode). 0400: kubelet adds group read
for the pod's fsGroup, so only the service's own user reads the keys.
*/}}
{{- define "kvmesh.trustVolume" -}}
{{- if not .root.Values.security.insecureInternalPlanes }}
- name: trust
  secret:
    secretName: {{ printf "%s-trust-%s" (include "kvmesh.trustPrefix" .root) .role }}
    defaultMode: 0400
    items:
      {{- include "kvmesh.trustItems" . | nindent 6 }}
{{- end }}
{{- end }}

{{/*
Whether an init container writes the model volume.
*/}}
{{- define "kvmesh.modelWritten" -}}
{{- if or .Values.model.download.enabled .Values.model.init.enabled }}true{{ end }}
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
    {{- if not (include "kvmesh.modelWritten" .) }}
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
The download script of the `model-download` init container. A marker file naming repo@revision
is written last, so an interrupted download is resumed by the next pod, and a finished one is not
fetched again.
*/}}
{{- define "kvmesh.modelDownloadScript" -}}
import json, os, pathlib, sys
from huggingface_hub import HfApi, snapshot_download
dest = pathlib.Path(os.environ["MODEL_DIR"])
repo, revision = os.environ["MODEL_REPO"], os.environ["MODEL_REVISION"]
want = f"{repo}@{revision}"
marker = dest / ".kvmesh-download"
if marker.is_file() and marker.read_text() == want:
    print(f"{want} is already in {dest}")
    sys.exit(0)
print(f"downloading {want} into {dest}", flush=True)
# Resolve the revision first: snapshot_download alone answers an unreachable Hub with whatever
# the directory holds, which would mark a partial model as complete.
commit = HfApi().repo_info(repo, revision=revision).sha
snapshot_download(repo, revision=commit, local_dir=dest,
                  allow_patterns=json.loads(os.environ["MODEL_ALLOW_PATTERNS"]) or None)
if not (dest / "config.json").is_file():
    sys.exit(f"{want} has no config.json: not a model kvmesh can load")
marker.write_text(want)
print(f"{want} ({commit}) is in {dest}")
{{- end }}

{{/*
The init container that fills the model volume: the Hugging Face download, or the user's own.
*/}}
{{- define "kvmesh.modelInitContainer" -}}
{{- $m := .Values.model }}
{{- if and $m.download.enabled $m.init.enabled }}
{{- fail "model.download.enabled and model.init.enabled both fill the model volume: turn one off" }}
{{- end }}
{{- if $m.download.enabled }}
{{- if not $m.download.repo }}
{{- fail "model.download.enabled needs model.download.repo (a Hugging Face repo id, e.g. meta-llama/Llama-3.1-8B-Instruct)" }}
{{- end }}
- name: model-download
  image: {{ include "kvmesh.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["python", "-c", {{ include "kvmesh.modelDownloadScript" . | quote }}]
  env:
    - name: HOME
      value: /tmp
    - name: HF_HOME
      value: /tmp/.cache/huggingface
    - name: HF_HUB_DISABLE_TELEMETRY
      value: "1"
    - name: MODEL_DIR
      value: {{ $m.path | quote }}
    - name: MODEL_REPO
      value: {{ $m.download.repo | quote }}
    - name: MODEL_REVISION
      value: {{ $m.download.revision | quote }}
    - name: MODEL_ALLOW_PATTERNS
      value: {{ $m.download.allowPatterns | toJson | quote }}
    {{- with $m.download.endpoint }}
    - name: HF_ENDPOINT
      value: {{ . | quote }}
    {{- end }}
    {{- with $m.download.tokenSecret }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $m.download.tokenSecretKey }}
    {{- end }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  {{- with $m.download.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: model
      mountPath: {{ $m.volume.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- else if $m.init.enabled }}
- name: model-init
  image: {{ default (include "kvmesh.image" .) $m.init.image }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    {{- toYaml $m.init.command | nindent 4 }}
  env:
    - name: HOME
      value: /tmp
    {{- with $m.init.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  {{- with $m.init.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: model
      mountPath: {{ $m.volume.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{/*
NetworkPolicy ports from a list of numbers, as JSON (callers `fromJsonArray` it): [{port, protocol: TCP}].
*/}}
{{- define "kvmesh.tcpPorts" -}}
{{- $out := list }}
{{- range . }}{{ $out = append $out (dict "port" (int .) "protocol" "TCP") }}{{ end }}
{{- toJson $out }}
{{- end }}

{{/*
A worker pool's disk KV tier (kvOffload.disk): "true" when the pool is a StatefulSet (a claim per
worker), else empty; fails on settings that cannot work together.
*/}}
{{- define "kvmesh.kvTierStateful" -}}
{{- $d := .values.kvOffload.disk }}
{{- if $d.enabled }}
{{- range $key := list "kv-offload-dir" "kv-offload-disk-gb" }}
{{- if hasKey (default (dict) $.values.engine) $key }}
{{- fail (printf "workerPools.%s: engine.%s and kvOffload.disk both set the disk KV tier: use kvOffload.disk only" $.pool $key) }}
{{- end }}
{{- end }}
{{- if $d.persistent }}true{{ end }}
{{- end }}
{{- end }}

{{/*
A worker pool's shared KV tier (kvOffload.shared): "true" when on; fails on settings that cannot
work together (its files' MAC key comes from the worker trust Secret, which every pool mounts,
so not with security.insecureInternalPlanes).
Call with (dict "values" $v "pool" <role> "insecure" <security.insecureInternalPlanes>).
*/}}
{{- define "kvmesh.kvSharedTier" -}}
{{- $s := dig "kvOffload" "shared" (dict) .values }}
{{- if dig "enabled" false $s }}
{{- range $key := list "kv-offload-shared-dir" "kv-offload-shared-gb" }}
{{- if hasKey (default (dict) $.values.engine) $key }}
{{- fail (printf "workerPools.%s: engine.%s and kvOffload.shared both set the shared KV tier: use kvOffload.shared only" $.pool $key) }}
{{- end }}
{{- end }}
{{- if .insecure }}
{{- fail (printf "workerPools.%s: kvOffload.shared needs the trust Secrets (its files are authenticated with a key derived from the worker's): unset security.insecureInternalPlanes" $.pool) }}
{{- end }}
true
{{- end }}
{{- end }}

{{/*
The disk KV tier's volume size: the tier's files plus 5% (headers, the lock file).
*/}}
{{- define "kvmesh.kvTierVolumeSize" -}}
{{- $gi := int .sizeGi }}{{ add $gi (div (add $gi 19) 20) }}Gi
{{- end }}
