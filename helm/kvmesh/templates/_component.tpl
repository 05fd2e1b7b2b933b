{{/*
One kvmesh service = Deployment + Service (+ PodDisruptionBudget, + HorizontalPodAutoscaler).
Every component template calls these with a context dict:

  root       the chart root context ($)
  component  name suffix and app.kubernetes.io/component label: gateway, tokenizer, decode, ...
  service    the `kvmesh <service>` subcommand: gateway | tokenizer | scheduler | prefix-cache | worker
  values     the component's values (for worker pools: `worker` merged with the pool)
  http       true for the HTTP gateway (HTTP probes on /health and /ready), false for gRPC services
  model      true to mount the model volume (tokenizer, workers, a gateway with textInGateway)
  role       worker role (prefill | decode | mixed), empty for other services
  stateful   true for a worker pool with a persistent disk KV tier: a StatefulSet with a volume
             claim per pod (kvOffload.disk.persistent), else a Deployment

Pods carry `kvmesh.io/service: <service>`, the label the NetworkPolicies and the trust Secret
(`<prefix>-trust-<service>`) go by: every worker pool is the worker role.
*/}}

{{- define "kvmesh.deployment" -}}
{{- $root := .root }}
{{- $v := .values }}
{{- $portName := ternary "http" "grpc" .http }}
{{- $autoscaled := or (dig "autoscaling" "enabled" false $v) (dig "keda" "enabled" false $v) .plannerScaled }}
{{- $disk := and .role (dig "kvOffload" "disk" "enabled" false $v) }}
{{- $shared := and .role (include "kvmesh.kvSharedTier" (dict "values" $v "pool" .role "insecure" $root.Values.security.insecureInternalPlanes)) }}
{{- /* the container's ports, as declared below: two alike would make its second bind fail in the pod */}}
{{- $ports := list (int $v.port) }}
{{- if not .http }}{{ $ports = concat $ports (list (int $v.healthPort) (int $root.Values.metrics.port)) }}{{ end }}
{{- if not (kindIs "invalid" $v.zmqPort) }}{{ $ports = append $ports (int $v.zmqPort) }}{{ end }}
{{- if .role }}{{ $ports = concat $ports (list (int $v.kvEventsPort) (int $v.kvSnapshotPort)) }}{{ end }}
{{- if or (eq .role "decode") (eq .role "mixed") }}{{ $ports = append $ports (int $v.kvTransferPort) }}{{ end }}
{{- range $v.extraPorts }}{{ $ports = append $ports (int .port) }}{{ end }}
{{- include "kvmesh.fleetSettings" (dict "values" $v "where" (ternary (printf "workerPools.%s" .component) (.component | camelcase | untitle) (not (empty .role)))) }}
{{- $seen := list }}
{{- range $port := $ports }}
{{- if has $port $seen }}
{{- fail (printf "%s binds port %d twice (its ports: %v): give each of its ports, metrics.port and extraPorts their own number" (ternary (printf "workerPools.%s" $.component) $.component (not (empty $.role))) $port $ports) }}
{{- end }}
{{- $seen = append $seen $port }}
{{- end }}
apiVersion: apps/v1
kind: {{ ternary "StatefulSet" "Deployment" (default false .stateful) }}
metadata:
  name: {{ include "kvmesh.componentName" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "kvmesh.componentLabels" . | nindent 4 }}
    {{- if .role }}
    kvmesh.io/worker-role: {{ .role }}
    {{- end }}
spec:
  {{- if not $autoscaled }}
  replicas: {{ $v.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  {{- if .stateful }}
  # the pool's headless Service; pods start and stop together, as a Deployment's do (a scale-down
  # drains its pods at once, each within its grace period), and roll one at a time
  serviceName: {{ include "kvmesh.componentName" . }}
  podManagementPolicy: Parallel
  updateStrategy:
    type: RollingUpdate
  {{- else }}
  {{- with $v.strategy }}
  strategy:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "kvmesh.componentSelectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "kvmesh.componentLabels" . | nindent 8 }}
        kvmesh.io/service: {{ .service }}
        {{- if .role }}
        kvmesh.io/worker-role: {{ .role }}
        {{- end }}
        {{- with (merge (dict) $v.podLabels $root.Values.podLabels) }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
        {{- with (merge (dict) $v.podAnnotations $root.Values.podAnnotations) }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "kvmesh.serviceAccountName" $root }}
      automountServiceAccountToken: {{ $root.Values.serviceAccount.automountServiceAccountToken }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- with $v.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- with $v.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
      {{- if and .model (include "kvmesh.modelWritten" $root) }}
      initContainers:
        {{- include "kvmesh.modelInitContainer" $root | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ .service }}
          image: {{ include "kvmesh.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["kvmesh", {{ .service | quote }}]
          {{- with $v.extraArgs }}
          args:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          ports:
            - name: {{ $portName }}
              containerPort: {{ $v.port }}
              protocol: TCP
            {{- if not .http }}
            - name: health
              containerPort: {{ $v.healthPort }}
              protocol: TCP
            - name: metrics
              containerPort: {{ $root.Values.metrics.port }}
              protocol: TCP
            {{- end }}
            {{- if not (kindIs "invalid" $v.zmqPort) }}
            - name: zmq
              containerPort: {{ $v.zmqPort }}
              protocol: TCP
            {{- end }}
            {{- if .role }}
            - name: kv-events
              containerPort: {{ $v.kvEventsPort }}
              protocol: TCP
            - name: kv-snapshot
              containerPort: {{ $v.kvSnapshotPort }}
              protocol: TCP
            {{- if or (eq .role "decode") (eq .role "mixed") }}
            - name: kv-transfer
              containerPort: {{ $v.kvTransferPort }}
              protocol: TCP
            {{- end }}
            {{- end }}
            {{- range $v.extraPorts }}
            - name: {{ .name }}
              containerPort: {{ .port }}
              protocol: {{ default "TCP" .protocol }}
            {{- end }}
          envFrom:
            - configMapRef:
                name: {{ include "kvmesh.fullname" $root }}-config
          env:
            - name: POD_NAME
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            - name: POD_NAMESPACE
              valueFrom:
                fieldRef:
                  fieldPath: metadata.namespace
            - name: POD_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            - name: KVMESH_HOST
              value: {{ default "$(POD_IP)" $v.host | quote }}
            - name: KVMESH_ADVERTISE_HOST
              value: "$(POD_IP)"
            - name: KVMESH_PORT
              value: {{ $v.port | quote }}
            {{- include "kvmesh.redisEnv" $root | nindent 12 }}
            {{- include "kvmesh.trustEnv" $root | nindent 12 }}
            {{- if .http }}
            {{- include "kvmesh.apiKeyEnv" $root | nindent 12 }}
            {{- else }}
            - name: KVMESH_HEALTH_PORT
              value: {{ $v.healthPort | quote }}
            {{- end }}
            {{- if not (kindIs "invalid" $v.zmqPort) }}
            - name: KVMESH_ZMQ_PORT
              value: {{ $v.zmqPort | quote }}
            {{- end }}
            {{- if $v.textInGateway }}
            - name: KVMESH_TEXT_IN_GATEWAY
              value: "true"
            {{- end }}
            {{- if .role }}
            - name: KVMESH_ROLE
              value: {{ .role | quote }}
            - name: KVMESH_WORKER_ID
              value: "$(POD_NAME)"
            - name: KVMESH_DEVICE
              value: {{ $v.device | quote }}
            - name: KVMESH_KV_EVENTS_PORT
              value: {{ $v.kvEventsPort | quote }}
            - name: KVMESH_KV_SNAPSHOT_PORT
              value: {{ $v.kvSnapshotPort | quote }}
            {{- if or (eq .role "decode") (eq .role "mixed") }}
            - name: KVMESH_KV_TRANSFER_PORT
              value: {{ $v.kvTransferPort | quote }}
            {{- end }}
            {{- if $disk }}
            # the tier's own directory inside the volume: the worker creates it 0700 and owns it
            - name: KVMESH_KV_OFFLOAD_DIR
              value: {{ printf "%s/kv-tier" (trimSuffix "/" $v.kvOffload.disk.mountPath) | quote }}
            - name: KVMESH_KV_OFFLOAD_DISK_GB
              value: {{ int $v.kvOffload.disk.sizeGi | quote }}
            {{- end }}
            {{- if $shared }}
            # a directory every worker on the node uses at once: each creates it 0700 if missing
            - name: KVMESH_KV_OFFLOAD_SHARED_DIR
              value: {{ printf "%s/kv-shared" (trimSuffix "/" $v.kvOffload.shared.mountPath) | quote }}
            - name: KVMESH_KV_OFFLOAD_SHARED_GB
              value: {{ int $v.kvOffload.shared.sizeGi | quote }}
            {{- end }}
            {{- if gt (int $v.gpus) 1 }}
            # One tensor-parallel rank per GPU of the pod.
            - name: KVMESH_TENSOR_PARALLEL_SIZE
              value: {{ $v.gpus | quote }}
            {{- end }}
            {{- end }}
            {{- include "kvmesh.configEnv" $v.config | nindent 12 }}
            {{- if .role }}
            {{- include "kvmesh.engineEnv" (dict "values" $v "pool" .role) | nindent 12 }}
            {{- end }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- include "kvmesh.probes" (dict "v" $v "http" .http) | nindent 10 }}
          {{- with $v.lifecycle }}
          lifecycle:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- $res := deepCopy (default (dict) $v.resources) }}
          {{- if and .role (gt (int $v.gpus) 0) }}
          {{- $gpu := dict $v.gpuResourceName (int $v.gpus) }}
          {{- $_ := set $res "limits" (merge (deepCopy $gpu) (default (dict) $res.limits)) }}
          {{- $_ := set $res "requests" (merge (deepCopy $gpu) (default (dict) $res.requests)) }}
          {{- end }}
          {{- with $res }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- if not $root.Values.security.insecureInternalPlanes }}
            - name: trust
              mountPath: {{ $root.Values.security.trustDir }}
              readOnly: true
            {{- end }}
            {{- if .model }}
            - name: model
              mountPath: {{ $root.Values.model.volume.mountPath }}
              readOnly: true
            {{- end }}
            {{- if .role }}
            - name: dshm
              mountPath: /dev/shm
            {{- end }}
            {{- if $disk }}
            - name: kv-tier
              mountPath: {{ $v.kvOffload.disk.mountPath }}
            {{- end }}
            {{- if $shared }}
            - name: kv-shared
              mountPath: {{ $v.kvOffload.shared.mountPath }}
            {{- end }}
            {{- with $v.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: tmp
          emptyDir:
            sizeLimit: {{ $root.Values.tmpSizeLimit }}
        {{- include "kvmesh.trustVolume" (dict "root" $root "role" .service) | nindent 8 }}
        {{- if .model }}
        {{- include "kvmesh.modelVolume" $root | nindent 8 }}
        {{- end }}
        {{- if .role }}
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $v.shmSizeLimit }}
        {{- end }}
        {{- if and $disk (not .stateful) }}
        - name: kv-tier
          emptyDir:
            sizeLimit: {{ include "kvmesh.kvTierVolumeSize" $v.kvOffload.disk }}
        {{- end }}
        {{- if $shared }}
        - name: kv-shared
          {{- with $v.kvOffload.shared.existingClaim }}
          persistentVolumeClaim:
            claimName: {{ . }}
          {{- else }}
          hostPath:
            path: {{ $v.kvOffload.shared.hostPath }}
            type: Directory
          {{- end }}
        {{- end }}
        {{- with $v.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
  {{- if .stateful }}
  {{- $d := $v.kvOffload.disk }}
  # one claim per worker (<name>-kv-tier-<pod>), kept when the pool shrinks: a worker that comes
  # back under its name finds its blocks
  volumeClaimTemplates:
    - metadata:
        name: kv-tier
        labels:
          {{- include "kvmesh.componentSelectorLabels" . | nindent 10 }}
      spec:
        accessModes:
          {{- toYaml $d.accessModes | nindent 10 }}
        {{- with $d.storageClassName }}
        storageClassName: {{ . }}
        {{- end }}
        resources:
          requests:
            storage: {{ include "kvmesh.kvTierVolumeSize" $d }}
  {{- end }}
{{- end }}

{{/*
Probes. The gateway answers HTTP /health (alive) and /ready (can take traffic). Every other
service's gRPC port requires a client certificate, which the kubelet's `grpc:` probes cannot
present, so they go to the plaintext health port (KVMESH_HEALTH_PORT), which serves only
grpc.health.v1: the server's overall status (service name ""), NOT_SERVING until the service has
loaded and while it drains. A `grpc:` probe takes a port number, not a name.
*/}}
{{- define "kvmesh.probes" -}}
{{- $v := .v }}
{{- if .http }}
startupProbe:
  httpGet:
    path: /health
    port: http
  {{- toYaml $v.startupProbe | nindent 2 }}
livenessProbe:
  httpGet:
    path: /health
    port: http
  {{- toYaml $v.livenessProbe | nindent 2 }}
readinessProbe:
  httpGet:
    path: /ready
    port: http
  {{- toYaml $v.readinessProbe | nindent 2 }}
{{- else }}
startupProbe:
  grpc:
    port: {{ $v.healthPort }}
  {{- toYaml $v.startupProbe | nindent 2 }}
livenessProbe:
  grpc:
    port: {{ $v.healthPort }}
  {{- toYaml $v.livenessProbe | nindent 2 }}
readinessProbe:
  grpc:
    port: {{ $v.healthPort }}
  {{- toYaml $v.readinessProbe | nindent 2 }}
{{- end }}
{{- end }}

{{- define "kvmesh.service" -}}
{{- $root := .root }}
{{- $v := .values }}
{{- $portName := ternary "http" "grpc" .http }}
{{- $svc := default (dict) $v.service }}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "kvmesh.componentName" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "kvmesh.componentLabels" . | nindent 4 }}
  {{- with $svc.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- if .role }}
  # Workers are addressed one by one (the scheduler routes to a chosen pod), so no virtual IP.
  clusterIP: None
  {{- else }}
  type: {{ default "ClusterIP" $svc.type }}
  {{- if and (eq (default "ClusterIP" $svc.type) "LoadBalancer") $svc.loadBalancerSourceRanges }}
  loadBalancerSourceRanges:
    {{- toYaml $svc.loadBalancerSourceRanges | nindent 4 }}
  {{- end }}
  {{- end }}
  ports:
    - name: {{ $portName }}
      port: {{ default $v.port $svc.port }}
      targetPort: {{ $portName }}
      protocol: TCP
      {{- if .http }}
      appProtocol: http
      {{- else }}
      appProtocol: kubernetes.io/h2c
      {{- end }}
      {{- if and $svc.nodePort (has $svc.type (list "NodePort" "LoadBalancer")) }}
      nodePort: {{ $svc.nodePort }}
      {{- end }}
    {{- if not .http }}
    - name: metrics
      port: {{ $root.Values.metrics.port }}
      targetPort: metrics
      protocol: TCP
    {{- end }}
    {{- if not (kindIs "invalid" $v.zmqPort) }}
    - name: zmq
      port: {{ $v.zmqPort }}
      targetPort: zmq
      protocol: TCP
    {{- end }}
    {{- range $v.extraPorts }}
    - name: {{ .name }}
      port: {{ .port }}
      targetPort: {{ .name }}
      protocol: {{ default "TCP" .protocol }}
    {{- end }}
  selector:
    {{- include "kvmesh.componentSelectorLabels" . | nindent 4 }}
{{- end }}

{{- define "kvmesh.pdb" -}}
{{- $pdb := default (dict) .values.podDisruptionBudget }}
{{- if $pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "kvmesh.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "kvmesh.componentLabels" . | nindent 4 }}
spec:
  maxUnavailable: {{ $pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "kvmesh.componentSelectorLabels" . | nindent 6 }}
{{- end }}
{{- end }}

{{- define "kvmesh.hpa" -}}
{{- $hpa := default (dict) .values.autoscaling }}
{{- if $hpa.enabled }}
{{- $where := ternary (printf "workerPools.%s" .component) .component (not (empty .role)) }}
{{- /* the API server refuses min > max with a message that names no value */}}
{{- if gt (int $hpa.minReplicas) (int $hpa.maxReplicas) }}
{{- fail (printf "%s.autoscaling.minReplicas (%d) is above maxReplicas (%d)" $where (int $hpa.minReplicas) (int $hpa.maxReplicas)) }}
{{- end }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "kvmesh.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "kvmesh.componentLabels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: {{ ternary "StatefulSet" "Deployment" (default false .stateful) }}
    name: {{ include "kvmesh.componentName" . }}
  minReplicas: {{ $hpa.minReplicas }}
  maxReplicas: {{ $hpa.maxReplicas }}
  metrics:
    {{- toYaml $hpa.metrics | nindent 4 }}
  {{- with $hpa.behavior }}
  behavior:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}

{{/*
A KEDA ScaledObject (keda.sh/v1alpha1) scaling a pool on one Prometheus query. KEDA makes an HPA
of its own for the Deployment, so the pool's `autoscaling` HPA must be off: two controllers would
fight over `replicas`. `<<pool>>` in the query becomes the label matchers of this pool's series as
the chart's ServiceMonitor stores them (namespace and Service name).
*/}}
{{- define "kvmesh.scaledObject" -}}
{{- $k := default (dict) .values.keda }}
{{- if $k.enabled }}
{{- $where := printf "workerPools.%s" .component }}
{{- if dig "autoscaling" "enabled" false .values }}
{{- fail (printf "%s: keda.enabled and autoscaling.enabled both scale this Deployment (KEDA makes its own HPA): turn one off, e.g. --set %s.autoscaling.enabled=false" $where $where) }}
{{- end }}
{{- if not $k.serverAddress }}
{{- fail (printf "%s.keda.enabled needs keda.serverAddress: the Prometheus KEDA queries, e.g. http://prometheus-operated.monitoring:9090" $where) }}
{{- end }}
{{- if gt (int $k.minReplicaCount) (int $k.maxReplicaCount) }}
{{- fail (printf "%s.keda.minReplicaCount (%d) is above maxReplicaCount (%d)" $where (int $k.minReplicaCount) (int $k.maxReplicaCount)) }}
{{- end }}
{{- $selector := printf "namespace=%q,service=%q" .root.Release.Namespace (include "kvmesh.componentName" .) }}
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata:
  name: {{ include "kvmesh.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "kvmesh.componentLabels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: {{ ternary "StatefulSet" "Deployment" (default false .stateful) }}
    name: {{ include "kvmesh.componentName" . }}
  pollingInterval: {{ int $k.pollingInterval }}
  cooldownPeriod: {{ int $k.cooldownPeriod }}
  minReplicaCount: {{ int $k.minReplicaCount }}
  maxReplicaCount: {{ int $k.maxReplicaCount }}
  {{- with $k.behavior }}
  advanced:
    horizontalPodAutoscalerConfig:
      behavior:
        {{- toYaml . | nindent 8 }}
  {{- end }}
  triggers:
    - type: prometheus
      metricType: {{ $k.metricType }}
      metadata:
        serverAddress: {{ $k.serverAddress | quote }}
        query: {{ $k.query | replace "<<pool>>" $selector | quote }}
        threshold: {{ include "kvmesh.settingText" $k.threshold | quote }}
        {{- if not (kindIs "invalid" $k.activationThreshold) }}
        activationThreshold: {{ include "kvmesh.settingText" $k.activationThreshold | quote }}
        {{- end }}
      {{- with $k.authenticationRef }}
      authenticationRef:
        name: {{ . }}
      {{- end }}
{{- end }}
{{- end }}

{{/*
Everything for one component, separated by `---`.
*/}}
{{- define "kvmesh.component" -}}
{{ include "kvmesh.deployment" . }}
---
{{ include "kvmesh.service" . }}
{{- with (include "kvmesh.pdb" .) }}
---
{{ . }}
{{- end }}
{{- with (include "kvmesh.hpa" .) }}
---
{{ . }}
{{- end }}
{{- with (include "kvmesh.scaledObject" .) }}
---
{{ . }}
{{- end }}
{{- end }}
