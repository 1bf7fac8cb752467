{{/*
Helpers shared by every template. Role-scoped helpers take a dict:
  root   the top-level context ($)
  role   gateway | prefill | decode | blockstore
  values the role's block of .Values
*/}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.fullname" -}}
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

{{/* "<fullname>-<role>", the name of a role's Deployment, Service and PDB. */}}
{{- define "pdserve.roleName" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .root) .role | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" . }}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end }}

{{- define "pdserve.roleLabels" -}}
{{ include "pdserve.labels" .root }}
app.kubernetes.io/component: {{ .role }}
{{- end }}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* "<name>.<namespace>.svc.<clusterDomain>" for a Service name given as .name. */}}
{{- define "pdserve.serviceHost" -}}
{{- printf "%s.%s.svc.%s" .name .root.Release.Namespace .root.Values.clusterDomain }}
{{- end }}

{{/* The address of a role's Service, host:port. */}}
{{- define "pdserve.roleAddress" -}}
{{- $host := include "pdserve.serviceHost" (dict "root" .root "name" (include "pdserve.roleName" .)) }}
{{- printf "%s:%v" $host (index .root.Values .role "port") }}
{{- end }}

{{/* The pdserve image; .gpu selects the CUDA variant. Mutable tags are refused. */}}
{{- define "pdserve.image" -}}
{{- $tag := default .root.Chart.AppVersion .root.Values.image.tag | toString }}
{{- if eq $tag "latest" }}
{{- fail "image.tag must name a release, not \"latest\"" }}
{{- end }}
{{- if .gpu }}
{{- $tag = printf "%s%s" $tag .root.Values.gpu.imageTagSuffix }}
{{- end }}
{{- printf "%s:%s" .root.Values.image.repository $tag }}
{{- end }}

{{- define "pdserve.redisImage" -}}
{{- $tag := .Values.redis.image.tag | toString }}
{{- if or (eq $tag "") (eq $tag "latest") }}
{{- fail "redis.image.tag must name a release, not \"latest\"" }}
{{- end }}
{{- printf "%s:%s" .Values.redis.image.repository $tag }}
{{- end }}

{{- define "pdserve.modelPath" -}}
{{- printf "%s/%s" (.Values.model.mountPath | trimSuffix "/") .Values.model.directory }}
{{- end }}

{{- define "pdserve.redisSecretName" -}}
{{- default (printf "%s-redis" (include "pdserve.fullname" .)) .Values.redis.auth.existingSecret }}
{{- end }}

{{/*
The Redis URL as env vars: the password only ever comes from a Secret (secretKeyRef), and
PDSERVE_REDIS_URL refers to it as $(REDIS_PASSWORD), which Kubernetes expands when the
container starts, so no credential is written into a manifest.
*/}}
{{- define "pdserve.redisEnv" -}}
{{- $redis := .Values.redis }}
{{- if $redis.enabled }}
{{- $host := include "pdserve.serviceHost" (dict "root" . "name" (printf "%s-redis" (include "pdserve.fullname" .))) }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.redisSecretName" . }}
      key: {{ $redis.auth.existingSecretPasswordKey }}
- name: PDSERVE_REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:%v/%v" $host $redis.port $redis.db | quote }}
{{- else if $redis.external.existingUrlSecret }}
- name: PDSERVE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $redis.external.existingUrlSecret }}
      key: {{ $redis.external.existingUrlSecretKey }}
{{- else if $redis.external.host }}
{{- $ext := $redis.external }}
{{- $scheme := ternary "rediss" "redis" $ext.tls }}
{{- $userinfo := "" }}
{{- if $ext.existingSecret }}
{{- $userinfo = printf "%s:$(REDIS_PASSWORD)@" $ext.username }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $ext.existingSecret }}
      key: {{ $ext.existingSecretPasswordKey }}
{{- else if $ext.username }}
{{- $userinfo = printf "%s@" $ext.username }}
{{- end }}
- name: PDSERVE_REDIS_URL
  value: {{ printf "%s://%s%s:%v/%v" $scheme $userinfo $ext.host $ext.port $ext.db | quote }}
{{- else }}
{{- fail "redis: set redis.enabled=true, or redis.external.host, or redis.external.existingUrlSecret" }}
{{- end }}
{{- end }}

{{/* OTEL_* variables for one role, when tracing is on. */}}
{{- define "pdserve.otelEnv" -}}
{{- $tracing := .root.Values.tracing }}
{{- if $tracing.enabled }}
{{- if not $tracing.endpoint }}
{{- fail "tracing.enabled needs tracing.endpoint (the OTLP collector)" }}
{{- end }}
{{- $attributes := list "k8s.namespace.name=$(POD_NAMESPACE)" "k8s.pod.name=$(POD_NAME)" "k8s.node.name=$(NODE_NAME)" (printf "service.instance.id=$(POD_NAME)") }}
{{- range $key, $value := $tracing.resourceAttributes }}
{{- $attributes = append $attributes (printf "%s=%v" $key $value) }}
{{- end }}
- name: OTEL_SERVICE_NAME
  value: {{ printf "%s-%s" $tracing.serviceNamePrefix .role | quote }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $tracing.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $tracing.protocol | quote }}
- name: OTEL_TRACES_EXPORTER
  value: otlp
- name: OTEL_TRACES_SAMPLER
  value: {{ $tracing.sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $tracing.samplerArg | toString | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attributes | quote }}
{{- end }}
{{- end }}

{{/* The env every pdserve container gets: pod identity first, as later entries refer to it. */}}
{{- define "pdserve.commonEnv" -}}
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
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: PDSERVE_LOG_LEVEL
  value: {{ .root.Values.logLevel | quote }}
{{- include "pdserve.redisEnv" .root }}
{{- include "pdserve.otelEnv" . }}
{{- with .values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Startup, readiness and liveness probes on the role's port: grpc.health.v1 where the port
serves plaintext. kubelet's gRPC probe speaks no TLS, so under mutual TLS the probe execs
`pdserve health` in the container, with the role's own certificate and the name its
certificate holds (the same health check: NOT_SERVING while draining fails readiness).
The gateway's public TLS port falls back to a TCP connect: its Secret need not hold the CA
that signed it. An exec probe starts Python, so it gets at least EXEC_TIMEOUT_S.
*/}}
{{- define "pdserve.probes" -}}
{{- $port := int .values.port -}}
{{- $check := dict "grpc" (dict "port" $port "service" "") }}
{{- $exec := false }}
{{- if include "pdserve.servesTls" . }}
{{- if and (ne .role "gateway") .root.Values.mtls.enabled }}
{{- $dir := include "pdserve.mtlsDir" . }}
{{- $command := list "pdserve" "health" (printf "--target=127.0.0.1:%d" $port)
      (printf "--server-name=%s" (include "pdserve.tlsProbeName" .))
      (printf "--tls-cert=%s/tls.crt" $dir) (printf "--tls-key=%s/tls.key" $dir)
      (printf "--tls-ca=%s/ca.crt" $dir) }}
{{- $check = dict "exec" (dict "command" $command) }}
{{- $exec = true }}
{{- else }}
{{- $check = dict "tcpSocket" (dict "port" $port) }}
{{- end }}
{{- end }}
{{- range $probe, $key := dict "startup" "startupProbe" "readiness" "readinessProbe" "liveness" "livenessProbe" }}
{{- $settings := deepCopy (index $.values.probes $probe) }}
{{- if $exec }}
{{- $_ := set $settings "timeoutSeconds" (max 5 (int (default 1 $settings.timeoutSeconds))) }}
{{- end }}
{{- $probeCheck := $check }}
{{- /* The gateway's HTTP API answers /health 503 while draining, as gRPC health does. */}}
{{- if and (eq $.role "gateway") (eq $probe "readiness") $.values.http $.values.http.enabled }}
{{- $scheme := ternary "HTTPS" "HTTP" (not (empty (include "pdserve.servesTls" $))) }}
{{- $probeCheck = dict "httpGet" (dict "path" "/health" "port" "http" "scheme" $scheme) }}
{{- end }}
{{ $key }}:
  {{- toYaml (merge (deepCopy $probeCheck) $settings) | nindent 2 }}
{{- end }}
{{- end }}

{{/*
The name a role's certificate holds, for a probe that dials 127.0.0.1: workers register
their pod's DNS name, which the wildcard SAN *.<service>.<namespace>.svc.<domain> covers
(any one label does); the block store is dialled by its Service name.
*/}}
{{- define "pdserve.tlsProbeName" -}}
{{- $service := include "pdserve.serviceHost" (dict "root" .root "name" (include "pdserve.roleName" .)) }}
{{- if eq .role "blockstore" }}{{ $service }}{{ else }}{{ printf "probe.%s" $service }}{{ end }}
{{- end }}

{{/* Refuses a grace period that would cut the drain short (SIGKILL before it ends). */}}
{{- define "pdserve.checkGrace" -}}
{{- $needed := add (int .drainSeconds) (int (default 0 .preStopSeconds)) }}
{{- if le (int .values.terminationGracePeriodSeconds) $needed }}
{{- fail (printf "%s.terminationGracePeriodSeconds (%v) must exceed its drain time (%v s)" .role .values.terminationGracePeriodSeconds $needed) }}
{{- end }}
{{- end }}

{{- define "pdserve.ports" -}}
- name: grpc
  containerPort: {{ .values.port }}
  protocol: TCP
{{- if .root.Values.metrics.enabled }}
- name: metrics
  containerPort: {{ .root.Values.metrics.port }}
  protocol: TCP
{{- end }}
{{- end }}

{{- define "pdserve.metricsArgs" -}}
{{- if .Values.metrics.enabled -}}
- --metrics-port={{ .Values.metrics.port }}
{{- end }}
{{- end }}

{{- define "pdserve.scratchMounts" -}}
- name: cache
  mountPath: /cache
- name: tmp
  mountPath: /tmp
{{- end }}

{{- define "pdserve.scratchVolumes" -}}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.scratch.cacheSizeLimit }}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.scratch.tmpSizeLimit }}
{{- end }}

{{- define "pdserve.modelVolume" -}}
- name: model
{{- if .Values.model.volume.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.volume.existingClaim }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.volume.emptyDirSizeLimit }}
{{- end }}
{{- end }}

{{/* Converts the bundled default model into the model volume (a no-op once converted). */}}
{{- define "pdserve.modelInitContainers" -}}
{{- $root := .root }}
{{- if $root.Values.model.convert.enabled -}}
initContainers:
  - name: convert-model
    image: {{ include "pdserve.image" (dict "root" $root "gpu" .gpu) }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    args:
      - convert
      - --output={{ include "pdserve.modelPath" $root }}
    env:
      - name: PDSERVE_LOG_LEVEL
        value: {{ $root.Values.logLevel | quote }}
    resources:
      {{- toYaml $root.Values.model.convert.resources | nindent 6 }}
    securityContext:
      {{- toYaml $root.Values.securityContext | nindent 6 }}
    volumeMounts:
      - name: model
        mountPath: {{ $root.Values.model.mountPath }}
      {{- include "pdserve.scratchMounts" $root | nindent 6 }}
{{- end }}
{{- end }}

{{/* Pod-level settings shared by the pdserve Deployments. A role with a ServiceAccount of its
own (the planner) passes .serviceAccountName and .automountToken. */}}
{{- define "pdserve.podSpecCommon" -}}
{{- $root := .root -}}
serviceAccountName: {{ .serviceAccountName | default (include "pdserve.serviceAccountName" $root) }}
automountServiceAccountToken: {{ ternary .automountToken $root.Values.automountServiceAccountToken (hasKey . "automountToken") }}
enableServiceLinks: false
terminationGracePeriodSeconds: {{ .values.terminationGracePeriodSeconds }}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $nodeSelector := deepCopy (default dict .values.nodeSelector) }}
{{- $tolerations := default list .values.tolerations }}
{{- if .gpu }}
{{- $nodeSelector = merge $nodeSelector (deepCopy (default dict $root.Values.gpu.nodeSelector)) }}
{{- $tolerations = concat $tolerations (default list $root.Values.gpu.tolerations) }}
{{- end }}
{{- with $nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- else }}
{{- $spread := default "none" .values.podAntiAffinity }}
{{- if ne $spread "none" }}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (include "pdserve.selectorLabels" . | fromYaml)) }}
affinity:
  podAntiAffinity:
    {{- if eq $spread "hard" }}
    requiredDuringSchedulingIgnoredDuringExecution:
      - {{- toYaml $term | nindent 8 }}
    {{- else }}
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          {{- toYaml $term | nindent 10 }}
    {{- end }}
{{- end }}
{{- end }}
{{- with .values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "pdserve.podMetadata" -}}
metadata:
  labels:
    {{- include "pdserve.selectorLabels" . | nindent 4 }}
    app.kubernetes.io/part-of: pdserve
    {{- with .values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .values.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* The role's resources, plus the GPU request when .gpu. */}}
{{- define "pdserve.resources" -}}
{{- $resources := deepCopy (default dict .values.resources) }}
{{- if .gpu }}
{{- $gpu := .root.Values.gpu }}
{{- $count := int $gpu.count }}
{{- $_ := set $resources "limits" (merge (dict $gpu.resourceName $count) (default dict $resources.limits)) }}
{{- $_ := set $resources "requests" (merge (dict $gpu.resourceName $count) (default dict $resources.requests)) }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/* A worker's torch CPU threads: .values.threads, or when 0 the whole cores of its CPU
limit (at least 1); empty without a limit. */}}
{{- define "pdserve.threads" -}}
{{- $threads := int (default 0 .values.threads) }}
{{- $cpu := toString (dig "limits" "cpu" "" (default dict .values.resources)) }}
{{- if and (eq $threads 0) $cpu }}
{{- if hasSuffix "m" $cpu }}
{{- $threads = div (atoi (trimSuffix "m" $cpu)) 1000 }}
{{- else }}
{{- $threads = int (floor (float64 $cpu)) }}
{{- end }}
{{- $threads = max $threads 1 }}
{{- end }}
{{- if gt $threads 0 }}{{ $threads }}{{ end }}
{{- end }}
