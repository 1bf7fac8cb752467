{{/*
Credentials mounted as files from Secrets of the user's: the chart only names a Secret, so no
key or certificate is ever written into a manifest or a value. Files are mode 0440: the
pods' fsGroup owns them, so the non-root user reads them and no one else.
*/}}

{{- define "pdserve.apiKeysDir" -}}/etc/pdserve/api-keys{{- end }}
{{- define "pdserve.publicTlsDir" -}}/etc/pdserve/public-tls{{- end }}

{{/* The Secret holding the gateway's keys file; refuses auth without one. */}}
{{- define "pdserve.apiKeysSecret" -}}
{{- $auth := .Values.gateway.auth }}
{{- if not $auth.existingSecret }}
{{- fail "gateway.auth.enabled needs gateway.auth.existingSecret: a Secret of yours holding the API keys file (lines 'KEY TENANT') under gateway.auth.existingSecretKey" }}
{{- end }}
{{- $auth.existingSecret }}
{{- end }}

{{/* The Secret holding the public port's certificate; refuses public TLS without one. */}}
{{- define "pdserve.publicTlsSecret" -}}
{{- if not .Values.gateway.publicTls.existingSecret }}
{{- fail "gateway.publicTls.enabled needs gateway.publicTls.existingSecret: a kubernetes.io/tls Secret holding tls.crt and tls.key" }}
{{- end }}
{{- .Values.gateway.publicTls.existingSecret }}
{{- end }}

{{/* The gateway's security flags, mounts and volumes (API keys; public TLS). */}}
{{- define "pdserve.gatewaySecurityArgs" -}}
{{- if .Values.gateway.auth.enabled }}
- --api-keys-file={{ include "pdserve.apiKeysDir" . }}/api-keys
{{- end }}
{{- if .Values.gateway.publicTls.enabled }}
- --public-tls-cert={{ include "pdserve.publicTlsDir" . }}/tls.crt
- --public-tls-key={{ include "pdserve.publicTlsDir" . }}/tls.key
{{- end }}
{{- end }}

{{- define "pdserve.gatewaySecurityMounts" -}}
{{- if .Values.gateway.auth.enabled }}
- name: api-keys
  mountPath: {{ include "pdserve.apiKeysDir" . }}
  readOnly: true
{{- end }}
{{- if .Values.gateway.publicTls.enabled }}
- name: public-tls
  mountPath: {{ include "pdserve.publicTlsDir" . }}
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
{{- if .Values.gateway.publicTls.enabled }}
- name: public-tls
  secret:
    secretName: {{ include "pdserve.publicTlsSecret" . }}
    defaultMode: 0440
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
{{- end }}
{{- end }}

{{/*
The helm test's way to trust the public port: the ca.crt of the same Secret (cert-manager
writes it for CA and self-signed issuers), passed as --tls-ca.
*/}}
{{- define "pdserve.testGatewayCaArgs" -}}
{{- if .Values.gateway.publicTls.enabled }}
- --tls-ca={{ include "pdserve.publicTlsDir" . }}/ca.crt
{{- end }}
{{- end }}

{{- define "pdserve.testGatewayCaMounts" -}}
{{- if .Values.gateway.publicTls.enabled }}
- name: gateway-ca
  mountPath: {{ include "pdserve.publicTlsDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "pdserve.testGatewayCaVolumes" -}}
{{- if .Values.gateway.publicTls.enabled }}
- name: gateway-ca
  secret:
    secretName: {{ include "pdserve.publicTlsSecret" . }}
    defaultMode: 0440
    items:
      - {key: ca.crt, path: ca.crt}
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

{{- define "pdserve.mtlsDir" -}}/etc/pdserve/mtls{{- end }}

{{/* The role's mutual-TLS Secret: mtls.secrets.<role>, else mtls.existingSecret. */}}
{{- define "pdserve.mtlsSecret" -}}
{{- $mtls := .root.Values.mtls }}
{{- $name := default $mtls.existingSecret (index (default dict $mtls.secrets) .role) }}
{{- if not $name }}
{{- fail (printf "mtls.enabled needs mtls.existingSecret or mtls.secrets.%s: a kubernetes.io/tls Secret holding tls.crt, tls.key and ca.crt" .role) }}
{{- end }}
{{- $name }}
{{- end }}

{{/* --tls-cert, --tls-key, --tls-ca (all three or none), and their Secret volume. */}}
{{- define "pdserve.mtlsArgs" -}}
{{- if .root.Values.mtls.enabled }}
{{- $dir := include "pdserve.mtlsDir" . }}
- --tls-cert={{ $dir }}/tls.crt
- --tls-key={{ $dir }}/tls.key
- --tls-ca={{ $dir }}/ca.crt
{{- end }}
{{- end }}

{{- define "pdserve.mtlsMounts" -}}
{{- if .root.Values.mtls.enabled }}
- name: mtls
  mountPath: {{ include "pdserve.mtlsDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "pdserve.mtlsVolumes" -}}
{{- if .root.Values.mtls.enabled }}
- name: mtls
  secret:
    secretName: {{ include "pdserve.mtlsSecret" . }}
    defaultMode: 0440
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      - {key: ca.crt, path: ca.crt}
{{- end }}
{{- end }}

{{/*
The address a worker registers for its peers. Plaintext: its pod IP. With mutual TLS its
peers check the name they dial against its certificate, and a certificate in a Secret cannot
name pod IPs; so it registers its pod's DNS name under the role's headless Service
(<pod>.<service>.<namespace>.svc.<clusterDomain>, the pod's spec.subdomain), which a
wildcard SAN *.<service>.<namespace>.svc.<clusterDomain> covers.
*/}}
{{- define "pdserve.workerAdvertise" -}}
{{- if .root.Values.mtls.enabled }}
{{- $service := include "pdserve.serviceHost" (dict "root" .root "name" (include "pdserve.roleName" .)) }}
{{- printf "$(POD_NAME).%s:%v" $service .values.port }}
{{- else }}
{{- printf "$(POD_IP):%v" .values.port }}
{{- end }}
{{- end }}

{{/* Whether the role's gRPC port serves TLS, which kubelet's gRPC probe cannot speak. */}}
{{- define "pdserve.servesTls" -}}
{{- if eq .role "gateway" }}
{{- if .root.Values.gateway.publicTls.enabled }}true{{ end }}
{{- else if .root.Values.mtls.enabled }}true{{ end }}
{{- end }}
