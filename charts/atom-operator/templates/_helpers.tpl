{{/* Names and labels shared by every template. */}}

{{- define "atom-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-scoped name; the release name alone when it already contains the chart name. */}}
{{- define "atom-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "atom-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "atom-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of every object but the component, for objects that name their own. */}}
{{- define "atom-operator.commonLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "atom-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "atom-operator.labels" -}}
{{ include "atom-operator.commonLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "atom-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "atom-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "atom-operator.image" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) }}
{{- end }}

{{- define "atom-operator.runtimeImage" -}}
{{- printf "%s:%s" .Values.runtime.image.repository (default .Chart.AppVersion .Values.runtime.image.tag) }}
{{- end }}

{{/* Namespaces watched in namespaced scope: the list given, or the release namespace. */}}
{{- define "atom-operator.watchNamespaces" -}}
{{- if and (eq .Values.scope "cluster") .Values.watchNamespaces }}
{{- fail "watchNamespaces is only used with scope: namespaced (scope: cluster watches every namespace); set scope=namespaced or remove watchNamespaces" }}
{{- end }}
{{- if eq .Values.scope "namespaced" }}
{{- join "," (default (list .Release.Namespace) .Values.watchNamespaces) }}
{{- end }}
{{- end }}

{{/* Rules on namespaced resources: the same in a ClusterRole or a Role. */}}
{{- define "atom-operator.namespacedRules" -}}
- apiGroups: ["atom.dev"]
  resources: ["atomdeployments"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["atom.dev"]
  resources: ["atomdeployments/status"]
  verbs: ["get", "patch"]
- apiGroups: [""]
  resources: ["configmaps", "services", "persistentvolumeclaims"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
# A PodMonitor per AtomDeployment with spec.monitoring.enabled (when the CRD is installed).
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors"]
  verbs: ["get", "list", "create", "patch", "update", "delete"]
# A KEDA ScaledObject per autoscaled role, and a Gateway API Inference Extension
# InferencePool with spec.inferencePool (each when its CRD is installed).
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "list", "create", "patch", "update", "delete"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "create", "patch", "update", "delete"]
# The internal-token Secret is created once and never read back: create only.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
# To spot an HPA aimed at a child Deployment (it would fight the operator).
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["list"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}

{{/* Kopf discovers its resources through the CRDs, and follows namespaces (even in
     namespaced mode it lists them to learn which watched ones exist): read-only, cluster-scoped. */}}
{{- define "atom-operator.discoveryRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["get", "list", "watch"]
{{- end }}
