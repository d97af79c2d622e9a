{{/* Chart name, truncated to the 63 characters of a label value. */}}
{{- define "phasewise.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name of the release's objects. */}}
{{- define "phasewise.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "phasewise.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "phasewise.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: phasewise
{{- end -}}

{{- define "phasewise.selectorLabels" -}}
app.kubernetes.io/name: {{ include "phasewise.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "phasewise.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "phasewise.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "phasewise.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) -}}
{{- end -}}

{{- define "phasewise.routerdImage" -}}
{{- printf "%s:%s" .Values.images.routerd.repository (default .Chart.AppVersion .Values.images.routerd.tag) -}}
{{- end -}}

{{- define "phasewise.trainerImage" -}}
{{- printf "%s:%s" .Values.images.trainer.repository (default (printf "%s-rl" .Chart.AppVersion) .Values.images.trainer.tag) -}}
{{- end -}}

{{/*
The operator's permissions in a namespace: exactly the calls it makes.
- its CRs: kopf watches and annotates them; the operator patches a pool's spec with a job's
  result and writes status; finalizers/update lets it set blockOwnerDeletion on children;
- children it server-side applies (create + patch; get to read them back);
- Deployments, EndpointSlices and batch Jobs it watches for status;
- pods: list, to show why a job's container failed;
- events: kopf reports handler failures as Events;
- roles/rolebindings it creates for routerd (read EndpointSlices) and job reporters (write one
  ConfigMap): RBAC lets it grant only what it holds, hence configmaps update and endpointslices;
- spec.gateway and podDisruptionBudget: the picker's Service and Envoy ConfigMap, PodDisruptionBudgets
  and the InferencePool (watched for the parents' status) are deleted when the spec drops them;
- services list: the per-group engine Services of a mixed-GPU pool (engine groups with their own
  hardwareProfile) are listed by label and deleted when no longer wanted.
*/}}
{{- define "phasewise.operatorRules" -}}
- apiGroups: ["phasewise.io"]
  resources: ["llmrouterpools", "llmrouterjobs"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["phasewise.io"]
  resources: ["llmrouterpools/status", "llmrouterjobs/status"]
  verbs: ["get", "patch"]
- apiGroups: ["phasewise.io"]
  resources: ["llmrouterpools/finalizers", "llmrouterjobs/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch", "update", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create", "patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools/status"]
  verbs: ["get"]
{{- end -}}

{{- define "phasewise.securityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}
