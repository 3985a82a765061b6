{{/* Names and labels shared by every template. */}}

{{- define "rlplane.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels that select this release's Ray pods (head and workers). */}}
{{- define "rlplane.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rlplane.labels" -}}
{{ include "rlplane.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The Secret holding the API token (key "token"). */}}
{{- define "rlplane.secretName" -}}
{{- default (printf "%s-token" (include "rlplane.fullname" .)) .Values.existingSecret -}}
{{- end -}}

{{- define "rlplane.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* RLPLANE_* env of every Ray container: the replica and the store read them wherever Ray places them. */}}
{{- define "rlplane.env" -}}
- name: RLPLANE_API_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "rlplane.secretName" . }}
      key: token
- name: RLPLANE_BACKEND
  value: {{ .Values.service.backend | quote }}
{{- if .Values.tokensSecret }}
- name: RLPLANE_TOKENS_FILE
  value: /etc/rlplane/tokens/tokens.yaml
{{- end }}
{{- $d := .Values.durability }}
{{- if $d.volume.enabled }}
- name: RLPLANE_SNAPSHOT_DIR
  value: {{ printf "%s/snapshots" $d.volume.mountPath | quote }}
{{- if .Values.service.snapshotIntervalS }}
- name: RLPLANE_SNAPSHOT_INTERVAL_S
  value: {{ .Values.service.snapshotIntervalS | quote }}
- name: RLPLANE_SNAPSHOT_KEEP
  value: {{ .Values.service.snapshotKeep | quote }}
{{- end }}
{{- if $d.journal }}
- name: RLPLANE_JOURNAL_DIR
  value: {{ printf "%s/journal" $d.volume.mountPath | quote }}
- name: RLPLANE_JOURNAL_FLUSH_MS
  value: {{ $d.journalFlushMs | quote }}
{{- end }}
{{- if $d.restoreFrom }}
- name: RLPLANE_RESTORE_FROM
  value: {{ $d.restoreFrom | quote }}
{{- end }}
{{- end }}
{{- if eq .Values.service.backend "mooncake" }}
- name: RLPLANE_MOONCAKE_PROTOCOL
  value: {{ .Values.mooncake.protocol | quote }}
- name: RLPLANE_MOONCAKE_DEVICE_NAME
  value: {{ .Values.mooncake.deviceName | quote }}
- name: RLPLANE_MOONCAKE_HOSTNAME   # the address other pods reach this one at
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: RLPLANE_MOONCAKE_MASTER_PORT
  value: {{ .Values.mooncake.masterPort | quote }}
- name: RLPLANE_MOONCAKE_METADATA_PORT
  value: {{ .Values.mooncake.metadataPort | quote }}
- name: RLPLANE_MOONCAKE_METRICS_PORT
  value: {{ .Values.mooncake.metricsPort | quote }}
- name: RLPLANE_MOONCAKE_SEGMENT_BYTES
  value: {{ .Values.mooncake.segmentBytes | int64 | quote }}
- name: RLPLANE_MOONCAKE_BUFFER_BYTES
  value: {{ .Values.mooncake.bufferBytes | int64 | quote }}
{{- end }}
{{- end -}}

{{/* The NetworkPolicy peer of the client pods (rollout and trainer workers):
     networkPolicy.clientSelector, in clientNamespaceSelector's namespaces (null: the
     release's own). */}}
{{- define "rlplane.clientPeer" -}}
{{- $np := .Values.networkPolicy -}}
podSelector:
  matchLabels:
    {{- toYaml $np.clientSelector | nindent 4 }}
{{- if not (kindIs "invalid" $np.clientNamespaceSelector) }}
namespaceSelector:
  matchLabels:
    {{- toYaml $np.clientNamespaceSelector | nindent 4 }}
{{- end }}
{{- end -}}

{{/* Pod-level settings shared by head and workers. */}}
{{- define "rlplane.podSpecCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .Values.hostNetwork }}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ .Values.shm.sizeLimit }}
  {{- if .Values.durability.volume.enabled }}
  - name: durable
    persistentVolumeClaim:
      claimName: {{ .Values.durability.volume.existingClaim | default (printf "%s-durable" (include "rlplane.fullname" .)) }}
  {{- end }}
  {{- if .Values.tokensSecret }}
  - name: tokens
    secret:
      secretName: {{ .Values.tokensSecret }}
      items: [{key: tokens.yaml, path: tokens.yaml}]
  {{- end }}
{{- end -}}

{{/* Ray's own ports, pinned so the NetworkPolicy can keep clients off them: the raylet
     (node manager), object manager, worker processes, dashboard agent, runtime-env agent
     and metrics export. Clients never need any of them. */}}
{{- define "rlplane.rayPorts" -}}
node-manager-port: "6380"
object-manager-port: "6381"
min-worker-port: "10002"
max-worker-port: "10999"
dashboard-agent-listen-port: "52365"
dashboard-agent-grpc-port: "52366"
runtime-env-agent-port: "52367"
metrics-export-port: "8080"
{{- end -}}
