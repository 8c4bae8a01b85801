{{/* Names: <release>-pdcluster (or the release name when it contains the chart's), then -<component>. Kept short
enough for a StatefulSet's pods and their controller-revision-hash label. */}}
{{- define "pdcluster.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdcluster.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* (dict "root" $ "component" "prefill") -> <fullname>-prefill */}}
{{- define "pdcluster.componentName" -}}
{{- printf "%s-%s" (include "pdcluster.fullname" .root) .component -}}
{{- end -}}

{{- define "pdcluster.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdcluster.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdcluster.labels" -}}
{{ include "pdcluster.selectorLabels" . }}
app.kubernetes.io/part-of: pdcluster
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "pdcluster.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdcluster.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "pdcluster.secretName" -}}
{{- default (include "pdcluster.componentName" (dict "root" . "component" "secrets")) .Values.secrets.existingSecret -}}
{{- end -}}

{{/* (dict "root" $ "component" "router") -> repository:tag */}}
{{- define "pdcluster.image" -}}
{{- $image := (index .root.Values .component).image -}}
{{- printf "%s:%s" (default .root.Values.image.repository $image.repository) $image.tag -}}
{{- end -}}

{{- define "pdcluster.bootstrapURL" -}}
{{- printf "http://%s.%s.svc:%d" (include "pdcluster.componentName" (dict "root" . "component" "bootstrap")) .Release.Namespace (int (include "pdcluster.bootstrapConfig" . | fromYaml).port) -}}
{{- end -}}

{{/* Each component's config file: the values' `config`, over what the chart needs (the user's keys win), as YAML. */}}
{{- define "pdcluster.bootstrapConfig" -}}
{{- toYaml (merge (deepCopy (.Values.bootstrap.config | default dict)) (dict "host" "0.0.0.0" "port" 8998)) -}}
{{- end -}}

{{- define "pdcluster.routerConfig" -}}
{{- /* No store unless router.config.store names one: the replicas would each keep their own, on a read-only root */ -}}
{{- $defaults := dict "host" "0.0.0.0" "port" 8000 "bootstrap_url" (include "pdcluster.bootstrapURL" .) "store" (dict "backend" "none") -}}
{{- toYaml (merge (deepCopy (.Values.router.config | default dict)) $defaults) -}}
{{- end -}}

{{/* The planner reads every router through a headless Service (one DNS answer per ready router pod: each counts its
own requests) and the registry through the bootstrap Service. */}}
{{- define "pdcluster.plannerConfig" -}}
{{- $routers := printf "http://%s.%s.svc:%d" (include "pdcluster.componentName" (dict "root" . "component" "router-pods")) .Release.Namespace (int (include "pdcluster.routerConfig" . | fromYaml).port) -}}
{{- $defaults := dict "host" "0.0.0.0" "port" 9300 "router_url" $routers "bootstrap_url" (include "pdcluster.bootstrapURL" .) -}}
{{- toYaml (merge (deepCopy (.Values.planner.config | default dict)) $defaults) -}}
{{- end -}}

{{/* Whether KEDA or an HPA owns the workers' replica counts. */}}
{{- define "pdcluster.autoscaled" -}}
{{- if and .Values.planner.enabled .Values.planner.autoscaling.enabled -}}true{{- end -}}
{{- end -}}

{{/* (dict "root" $ "role" "prefill") -> the worker's config file. rdma.enabled selects Mooncake's RDMA transport.
With workers.pool on, the prefill and decode workers are the pool's fixed ones: started without the role switch, so
that none is ever flipped (unless "flexible": the pool's own config, pdcluster.poolConfig, starts from this), and
without a kv_store like the pool's (it sets a page size of its own, and workers of two page sizes do not pair). */}}
{{- define "pdcluster.workerConfig" -}}
{{- $root := .root -}}
{{- $defaults := dict "host" "0.0.0.0" "port" (ternary 30100 30200 (eq .role "prefill")) "cluster" (dict "bootstrap_url" (include "pdcluster.bootstrapURL" $root)) -}}
{{- if eq .role "prefill" -}}
{{- $_ := set $defaults "disaggregation-bootstrap-port" 8999 -}}
{{- end -}}
{{- $config := merge (deepCopy ((index $root.Values .role).config | default dict)) $defaults -}}
{{- if and $root.Values.workers.pool.enabled (not .flexible) -}}
{{- if index $config "enable-pd-role-switch" -}}
{{- fail (printf "%s.config.enable-pd-role-switch: with workers.pool on, the %s workers are the pool's fixed ones and must not flip" .role .role) -}}
{{- end -}}
{{- $_ := set $config.cluster "role_switch" false -}}
{{- $_ := unset $config.cluster "kv_store" -}}
{{- end -}}
{{- if $root.Values.rdma.enabled -}}
{{- $_ := set $config "disaggregation-transfer-backend" "mooncake" -}}
{{- if $root.Values.rdma.device -}}
{{- $_ := set $config "disaggregation-ib-device" $root.Values.rdma.device -}}
{{- end -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/* workers.pool's config file, one for either role: the startAs role's config made switch-enabled (the role switch
on; no kv_store: a flip clears SGLang's HiCache storage; no fixed KV bootstrap port: a switch-enabled worker runs its
KV bootstrap server in either role, on the first free port from cluster.kv_bootstrap_port_base, and its KV-events
publisher likewise), then workers.pool.config over it. */}}
{{- define "pdcluster.poolConfig" -}}
{{- $pool := .Values.workers.pool -}}
{{- $config := include "pdcluster.workerConfig" (dict "root" . "role" $pool.startAs "flexible" true) | fromYaml -}}
{{- $_ := unset $config "disaggregation-bootstrap-port" -}}
{{- $_ := unset $config.cluster "kv_store" -}}
{{- $_ := set $config.cluster "role_switch" true -}}
{{- $config = mergeOverwrite $config (deepCopy ($pool.config | default dict)) -}}
{{- if or $config.cluster.kv_store (eq (toString $config.cluster.role_switch) "false") (eq (toString (index $config "enable-pd-role-switch")) "false") -}}
{{- fail "workers.pool.config: the pool's workers flip roles, so they need the role switch and cannot have a kv_store (a flip clears SGLang's HiCache storage)" -}}
{{- end -}}
{{- if not (has (index $config "disaggregation-transfer-backend" | default "mooncake") (list "mooncake" "mooncake_tcp")) -}}
{{- fail "workers.pool: role switching needs a Mooncake transfer backend (mooncake or mooncake_tcp)" -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/* (the worker config as a dict) -> where its cluster.kv_store.dir is in the container (the image's WORKDIR is
/app), or "" without a kv_store. */}}
{{- define "pdcluster.kvStorePath" -}}
{{- $kv := (.cluster | default dict).kv_store -}}
{{- if $kv -}}
{{- $dir := "kv-cache" -}}
{{- if kindIs "string" $kv -}}
{{- $dir = $kv -}}
{{- else if kindIs "map" $kv -}}
{{- $dir = $kv.dir | default "kv-cache" -}}
{{- end -}}
{{- if isAbs $dir -}}{{ clean $dir }}{{- else -}}{{ clean (printf "/app/%s" $dir) }}{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdcluster.workerKind" -}}
{{- if and .Values.persistence.enabled (eq .Values.persistence.mode "perPod") -}}StatefulSet{{- else -}}Deployment{{- end -}}
{{- end -}}

{{- define "pdcluster.kvAccessModes" -}}
{{- if .Values.persistence.accessModes -}}
{{- toYaml .Values.persistence.accessModes -}}
{{- else -}}
{{- toYaml (list (ternary "ReadWriteOnce" "ReadWriteMany" (eq .Values.persistence.mode "perPod"))) -}}
{{- end -}}
{{- end -}}

{{/* Whether clients outside the cluster can reach the router. */}}
{{- define "pdcluster.routerExposed" -}}
{{- if or .Values.router.ingress.enabled (has .Values.router.service.type (list "NodePort" "LoadBalancer")) -}}true{{- end -}}
{{- end -}}

{{/* Pod annotations every component shares: a changed secret value restarts every pod that reads it. */}}
{{- define "pdcluster.secretChecksum" -}}
checksum/secrets: {{ toJson .Values.secrets | sha256sum }}
{{- end -}}

{{/* The tracing switch and where spans go (values tracing.*), for every component's container. */}}
{{- define "pdcluster.tracingEnv" -}}
- name: PDCLUSTER_TRACING
  value: {{ ternary "1" "0" .Values.tracing.enabled | quote }}
{{- if .Values.tracing.enabled }}
{{- with .Values.tracing.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ .Values.tracing.protocol | quote }}
- name: OTEL_TRACES_SAMPLER
  value: parentbased_traceidratio
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .Values.tracing.sampleRatio | quote }}
{{- end }}
{{- end }}
