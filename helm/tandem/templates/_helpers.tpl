{{/*
Names. KubeRay derives the head service (<name>-head-svc) and pod names (<name>-<group>-worker-xxxxx)
from the RayCluster's name, so names stop at 40 characters to keep those within 63.
*/}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Selector labels of one component: (dict "root" $ "component" "router") */}}
{{- define "tandem.componentLabels" -}}
{{ include "tandem.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tandem.headService" -}}
{{- printf "%s-head-svc" (include "tandem.fullname" .) }}
{{- end }}

{{/* The Ray Client address of the RayCluster's head, which the router joins. */}}
{{- define "tandem.rayAddress" -}}
{{- printf "ray://%s.%s.svc:10001" (include "tandem.headService" .) .Release.Namespace }}
{{- end }}

{{- define "tandem.authSecretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" (include "tandem.fullname" .)) }}
{{- end }}

{{/* Ray head fault tolerance: the Redis the GCS keeps its tables in, and its password's Secret. */}}
{{- define "tandem.rayRedis" -}}
{{- printf "%s-ray-redis" (include "tandem.fullname" .) }}
{{- end }}

{{- define "tandem.rayRedisAddress" -}}
{{- .Values.rayHA.redisAddress | default (printf "%s.%s.svc:6379" (include "tandem.rayRedis" .) .Release.Namespace) }}
{{- end }}

{{- define "tandem.rayRedisSecretName" -}}
{{- .Values.rayHA.passwordSecret.name | default (include "tandem.rayRedis" .) }}
{{- end }}

{{- define "tandem.tlsSecretName" -}}
{{- .Values.tls.existingSecret | default (printf "%s-tls" (include "tandem.fullname" .)) }}
{{- end }}

{{/* The router serves /metrics on loopback only, at this port; a relay exposes it on router.metricsPort. */}}
{{- define "tandem.loopbackMetricsPort" -}}19090{{- end }}

{{/* image: (dict "root" $ "override" .Values.prefill.image) -> "repository:tag" */}}
{{- define "tandem.image" -}}
{{- $image := .root.Values.image }}
{{- $repository := .override.repository | default $image.repository }}
{{- $tag := .override.tag | default $image.tag | default .root.Chart.AppVersion }}
{{- printf "%s:%s" $repository $tag }}
{{- end }}

{{- define "tandem.pullPolicy" -}}
{{- .override.pullPolicy | default .root.Values.image.pullPolicy }}
{{- end }}

{{/*
Container resources from the values' shorthand {cpu, memory, gpu, gpuResourceName}: requests equal
limits, the shape Ray reads a node's CPUs, GPUs and memory from.
*/}}
{{- define "tandem.resources" -}}
{{- $r := . }}
requests:
  cpu: {{ $r.cpu | quote }}
  memory: {{ $r.memory | quote }}
  {{- if gt (int ($r.gpu | default 0)) 0 }}
  {{ $r.gpuResourceName }}: {{ int $r.gpu | quote }}
  {{- end }}
limits:
  cpu: {{ $r.cpu | quote }}
  memory: {{ $r.memory | quote }}
  {{- if gt (int ($r.gpu | default 0)) 0 }}
  {{ $r.gpuResourceName }}: {{ int $r.gpu | quote }}
  {{- end }}
{{- end }}

{{/* A Kubernetes CPU quantity ("2", "1500m", 2) as a float. */}}
{{- define "tandem.cpus" -}}
{{- $cpu := toString . }}
{{- if hasSuffix "m" $cpu }}
{{- divf (trimSuffix "m" $cpu | float64) 1000 }}
{{- else }}
{{- float64 $cpu }}
{{- end }}
{{- end }}

{{/*
Checks that span several values (the schema checks each value alone). Rendering stops with the
message of the first that fails.
*/}}
{{- define "tandem.validate" -}}
{{- $v := .Values }}
{{- range $role := list "prefill" "decode" }}
{{- $g := index $v $role }}
{{- if not (and (le (int $g.minReplicas) (int $g.replicas)) (le (int $g.replicas) (int $g.maxReplicas))) }}
{{- fail (printf "%s: replicas (%d) must lie within minReplicas (%d) and maxReplicas (%d)" $role (int $g.replicas) (int $g.minReplicas) (int $g.maxReplicas)) }}
{{- end }}
{{- $cpusWanted := mulf $g.worker.numCpus $g.workersPerNode }}
{{- if gt $cpusWanted (include "tandem.cpus" $g.resources.cpu | float64) }}
{{- fail (printf "%s: workersPerNode (%d) x worker.numCpus (%v) exceeds resources.cpu (%v)" $role (int $g.workersPerNode) $g.worker.numCpus $g.resources.cpu) }}
{{- end }}
{{- if gt (mulf $g.worker.numGpus $g.workersPerNode) (float64 $g.resources.gpu) }}
{{- fail (printf "%s: workersPerNode (%d) x worker.numGpus (%v) exceeds resources.gpu (%d)" $role (int $g.workersPerNode) $g.worker.numGpus (int $g.resources.gpu)) }}
{{- end }}
{{- if and (eq $v.model.device "cuda") (eq (float64 $g.worker.numGpus) 0.0) }}
{{- fail (printf "model.device is cuda: %s.worker.numGpus must be above 0 (and %s.resources.gpu set)" $role $role) }}
{{- end }}
{{- end }}
{{- $volume := $v.model.volume }}
{{- if and (eq $volume.type "pvc") (not $volume.claimName) }}
{{- fail "model.volume.type is pvc: set model.volume.claimName" }}
{{- end }}
{{- if and (eq $volume.type "hostPath") (not $volume.hostPath) }}
{{- fail "model.volume.type is hostPath: set model.volume.hostPath" }}
{{- end }}
{{- if and (ne $volume.type "none") (not (hasPrefix (printf "%s/" (trimSuffix "/" $volume.mountPath)) $v.model.path)) }}
{{- fail (printf "model.path (%s) must lie under model.volume.mountPath (%s)" $v.model.path $volume.mountPath) }}
{{- end }}
{{- if and $v.rayHA.enabled $v.rayHA.redisAddress (not $v.rayHA.passwordSecret.name) }}
{{- fail "rayHA.redisAddress names an external Redis: set rayHA.passwordSecret.name (and .key) to its password's Secret" }}
{{- end }}
{{- if and $v.tls.enabled (not $v.tls.existingSecret) (not (and $v.tls.cert $v.tls.key $v.tls.ca)) }}
{{- fail "tls.enabled: set tls.existingSecret, or tls.cert, tls.key and tls.ca" }}
{{- end }}
{{- $ports := list (int $v.router.port) (int $v.router.metricsPort) (int (include "tandem.loopbackMetricsPort" .)) }}
{{- if not (kindIs "invalid" $v.router.httpPort) }}
{{- $ports = append $ports (int $v.router.httpPort) }}
{{- end }}
{{- if ne (len $ports) (len (uniq $ports)) }}
{{- fail (printf "router.port, router.httpPort and router.metricsPort must differ from each other and from %s" (include "tandem.loopbackMetricsPort" .)) }}
{{- end }}
{{- end }}

{{/*
Tandem's cluster config (cluster.config.ClusterConfig): the `config` value, overridden by what the
chart derives from the other values. API keys and the cluster secret are added at start-up from
the Secret, never written here.
*/}}
{{- define "tandem.config" -}}
{{- $v := .Values }}
{{- $model := dict "path" $v.model.path "dtype" $v.model.dtype "device" $v.model.device }}
{{- with $v.model.name }}{{ $_ := set $model "name" . }}{{ end }}
{{- if not (kindIs "invalid" $v.model.maxModelLen) }}{{ $_ := set $model "max_model_len" (int $v.model.maxModelLen) }}{{ end }}
{{- $router := dict "host" "0.0.0.0" "port" (int $v.router.port) "shutdown_timeout_s" (int $v.router.shutdownTimeoutSeconds) }}
{{- if not (kindIs "invalid" $v.router.httpPort) }}{{ $_ := set $router "http_port" (int $v.router.httpPort) }}{{ end }}
{{- $telemetry := dict "exporter" $v.telemetry.exporter "sample_ratio" $v.telemetry.sampleRatio "metrics_port" (int (include "tandem.loopbackMetricsPort" .)) }}
{{- with $v.telemetry.endpoint }}{{ $_ := set $telemetry "endpoint" . }}{{ end }}
{{- $auth := dict }}
{{- if $v.tls.enabled }}
{{- $auth = dict "tls_cert" "/var/run/tandem/tls/tls.crt" "tls_key" "/var/run/tandem/tls/tls.key" "tls_ca" "/var/run/tandem/tls/ca.crt" }}
{{- end }}
{{- $generated := dict "ray_address" (include "tandem.rayAddress" .) "model" $model "router" $router "telemetry" $telemetry "auth" $auth }}
{{- if $v.rayHA.enabled }}{{ $_ := set $generated "ray_ha" (dict "fault_tolerant" true) }}{{ end }}
{{- range $role := list "prefill" "decode" }}
{{- $g := index $v $role }}
{{- $n := int $g.workersPerNode }}
{{- $replicas := mul (int $g.replicas) $n }}
{{- $min := $replicas }}
{{- $max := $replicas }}
{{- if $v.autoscaling.enabled }}
{{- $min = mul (int $g.minReplicas) $n }}
{{- $max = mul (int $g.maxReplicas) $n }}
{{- end }}
{{- $pool := dict "replicas" $replicas "num_cpus" $g.worker.numCpus "num_gpus" $g.worker.numGpus "resource" $role "placement_strategy" $g.placementStrategy "autoscaling" (dict "min_replicas" $min "max_replicas" $max) }}
{{- $_ := set $generated $role $pool }}
{{- end }}
{{- mergeOverwrite (deepCopy $v.config) $generated | toYaml }}
{{- end }}

{{/*
The value of a Ray resources start parameter: a JSON object in quotes with its inner quotes
escaped, as KubeRay passes it to `ray start --resources` and Ray's autoscaler reads it back.
*/}}
{{- define "tandem.rayResources" -}}
{{- printf "\"%s\"" (toJson . | replace "\"" "\\\"") }}
{{- end }}

{{/* Pod-level settings shared by every Tandem pod: (dict "root" $ "group" .Values.prefill) */}}
{{- define "tandem.podSettings" -}}
{{- with .root.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Volumes for the model folder, TLS files and the pod helper, as the values ask for them. */}}
{{- define "tandem.volumes" -}}
{{- $v := .Values }}
{{- if eq $v.model.volume.type "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $v.model.volume.claimName }}
    readOnly: true
{{- else if eq $v.model.volume.type "hostPath" }}
- name: model
  hostPath:
    path: {{ $v.model.volume.hostPath }}
    type: Directory
{{- end }}
{{- if $v.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "tandem.tlsSecretName" . }}
{{- end }}
- name: scripts
  configMap:
    name: {{ include "tandem.fullname" . }}-scripts
{{- end }}

{{- define "tandem.volumeMounts" -}}
{{- $v := .Values }}
{{- if ne $v.model.volume.type "none" }}
- name: model
  mountPath: {{ $v.model.volume.mountPath }}
  readOnly: true
{{- end }}
{{- if $v.tls.enabled }}
- name: tls
  mountPath: /var/run/tandem/tls
  readOnly: true
{{- end }}
{{- end }}

{{/* The init container that checks the model folder: (dict "root" $ "image" "..." "pullPolicy" "...") */}}
{{- define "tandem.checkModel" -}}
{{- if .root.Values.model.check }}
- name: check-model
  image: {{ .image }}
  imagePullPolicy: {{ .pullPolicy }}
  command: ["python", "/etc/tandem/scripts/pod_helper.py", "check-model", {{ .root.Values.model.path | quote }}]
  resources:
    requests:
      cpu: 100m
      memory: 512Mi
    limits:
      cpu: "1"
      memory: 1Gi
  volumeMounts:
    {{- with include "tandem.volumeMounts" .root | trim }}
    {{- . | nindent 4 }}
    {{- end }}
    - name: scripts
      mountPath: /etc/tandem/scripts
      readOnly: true
{{- end }}
{{- end }}

{{/*
The init container that composes the config the Tandem command reads at /run/tandem/config.json:
the ConfigMap's file, the API keys and the cluster secret, validated by Tandem's config schema.
(dict "root" $ "image" "..." "pullPolicy" "...")
*/}}
{{- define "tandem.configInit" -}}
{{- $v := .root.Values }}
- name: config
  image: {{ .image }}
  imagePullPolicy: {{ .pullPolicy }}
  command:
    - python
    - /etc/tandem/scripts/pod_helper.py
    - config
    - --in=/etc/tandem/config/config.yaml
    - --secrets=/var/run/tandem/secrets
    - --api-keys-key={{ $v.auth.apiKeysKey }}
    - --cluster-secret-key={{ $v.auth.clusterSecretKey }}
    - --out=/run/tandem/config.json
  resources:
    requests:
      cpu: 100m
      memory: 256Mi
    limits:
      cpu: "1"
      memory: 512Mi
  volumeMounts:
    - {name: config, mountPath: /etc/tandem/config, readOnly: true}
    - {name: scripts, mountPath: /etc/tandem/scripts, readOnly: true}
    - {name: secrets, mountPath: /var/run/tandem/secrets, readOnly: true}
    - {name: run, mountPath: /run/tandem}
{{- end }}

{{/* The volumes of a pod that runs a Tandem command on the composed config (controller, router). */}}
{{- define "tandem.commandVolumes" -}}
- name: config
  configMap:
    name: {{ include "tandem.fullname" . }}-config
- name: secrets
  secret:
    secretName: {{ include "tandem.authSecretName" . }}
- name: run
  emptyDir:
    medium: Memory
    sizeLimit: 1Mi
{{ include "tandem.volumes" . | trim }}
{{- end }}
