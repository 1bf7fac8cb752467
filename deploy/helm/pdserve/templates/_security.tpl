{{/*
Credentials mounted as files from Secrets of the user's: the chart only names a Secret, so no
key or certificate is ever written into a manifest or a value. Files are mode 0440: the
pods' fsGroup owns them, so the non-root user reads them and no one else.
*/}}

{{- define "pdserve.apiKeysDir" -}}/etc/pdserve/api-keys{{- end }}

{{/* The Secret holding the gateway's keys file; refuses auth without one. */}}
{{- define "pdserve.apiKeysSecret" -}}
{{- $auth := .Values.gateway.auth }}
{{- if not $auth.existingSecret }}
{{- fail "gateway.auth.enabled needs gateway.auth.existingSecret: a Secret of yours holding the API keys file (lines 'KEY TENANT') under gateway.auth.existingSecretKey" }}
{{- end }}
{{- $auth.existingSecret }}
{{- end }}

{{/* The gateway's security flags, mounts and volumes (API keys; public TLS). */}}
{{- define "pdserve.gatewaySecurityArgs" -}}
{{- if .Values.gateway.auth.enabled }}
- --api-keys-file={{ include "pdserve.apiKeysDir" . }}/api-keys
{{- end }}
{{- end }}

{{- define "pdserve.gatewaySecurityMounts" -}}
{{- if .Values.gateway.auth.enabled }}
- name: api-keys
  mountPath: {{ include "pdserve.apiKeysDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "pdserve.gatewaySecurityVolumes" -}}
{{- if .Values.gateway.auth.enabled }}
- name: api-keys
  secret:
    secretName: {{ include "pdserve.apiKeysSecret" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.gateway.auth.existingSecretKey }}
        path: api-keys
{{- end }}
{{- end }}

{{/*
The helm test's API key, as PDSERVE_API_KEY (which `pdserve generate` sends as a bearer
token): one key alone, from tests.apiKey or else the gateway's own Secret.
*/}}
{{- define "pdserve.testApiKeyEnv" -}}
{{- if .Values.gateway.auth.enabled }}
- name: PDSERVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ default (include "pdserve.apiKeysSecret" .) .Values.tests.apiKey.existingSecret }}
      key: {{ .Values.tests.apiKey.existingSecretKey }}
{{- end }}
{{- end }}
