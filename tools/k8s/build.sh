#!/usr/bin/env bash
# Build the Kubernetes test binaries (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, etcd, helm, kwok) from their official Go modules into a cache
# directory outside the repo, and copy the Gateway API Inference Extension's InferencePool
# CRD and KWOK's default Stage manifests out of their Go modules.
#
#   tools/k8s/build.sh --crds       only the CRD and KWOK Stage steps (seconds; no compiler run)
#
#   tools/k8s/build.sh              build what is missing, verify every --version
#   tools/k8s/build.sh --print-bin  print the cache directory and exit
#   tools/k8s/build.sh --regen      rewrite the tools modules' go.mod/go.sum for the
#                                   versions in K8S_VERSION / ETCD_VERSION / HELM_VERSION /
#                                   KWOK_VERSION
#
# The versions are read from the committed go.mod files of the tools modules
# (tools/k8s/{kube,etcd,helm,kwok}); k8s, etcd and helm key the cache directory:
#   ${PHASEWISE_K8S_BIN:-$HOME/.cache/phasewise/k8s/<k8s>-etcd<etcd>-helm<helm>}
# kwok's binary sits in the same directory and is checked by its version like the others
# (so a new kwok version rebuilds kwok alone); its Stage manifests are cached as
# kwok-stages-v<kwok>/ there, the InferencePool CRD as crds/gie-v<gie>/.
# Idempotent: a binary that exists and reports the expected version is not rebuilt.
# Each binary is built into a temporary name and renamed, so an interrupted build never
# leaves a half-written binary behind. A lock serialises concurrent runs.
# Uses only the Go module proxy (GOPROXY/GOSUMDB/GOFLAGS are left as the machine has them).
# See docs/k8s-testing.md for what was measured.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)

gomod_version() {  # gomod_version DIR MODULE -> version required in DIR/go.mod (no leading v)
  (cd "$1" && go mod edit -json) | python3 -c '
import json, sys
mod = sys.argv[1]
for r in json.load(sys.stdin).get("Require") or []:
    if r["Path"] == mod:
        print(r["Version"].lstrip("v")); break
else:
    sys.exit(f"{mod} not required in go.mod")' "$2"
}

regen() {
  local k8s=${K8S_VERSION:-1.37.2} etcd=${ETCD_VERSION:-3.7.3} helm=${HELM_VERSION:-3.22.0}
  local kwok=${KWOK_VERSION:-0.8.0} staging=0.${k8s#1.} up m
  # go 1.26.0, not the local toolchain's patch release that `go mod init` would write,
  # so any Go 1.26.x builds it; `go get` raises it if a dependency needs more.
  echo "regenerating tools modules: k8s v$k8s (staging v$staging), etcd v$etcd, helm v$helm, kwok v$kwok"
  # kube: k8s.io/kubernetes requires every staging module at v0.0.0 and resolves them with
  # replace => ./staging/...; a consumer must replace each with its published version.
  rm -f "$HERE/kube/go.mod" "$HERE/kube/go.sum"
  (cd "$HERE/kube" && go mod init local.invalid/phasewise-k8s-tools >/dev/null 2>&1 &&
    go mod edit -go=1.26.0 &&
    up=$(go mod download -json "k8s.io/kubernetes@v$k8s" |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])') &&
    for m in $(sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._-]*\) => \./staging/.*#\1#p' "$up"); do
      go mod edit -replace="${m}=${m}@v${staging}"
    done &&
    go mod edit -godebug=default=go1.26 &&
    go get -tool "k8s.io/kubernetes/cmd/kube-apiserver@v$k8s" \
      "k8s.io/kubernetes/cmd/kube-controller-manager@v$k8s" \
      "k8s.io/kubernetes/cmd/kube-scheduler@v$k8s" \
      "k8s.io/kubernetes/cmd/kubectl@v$k8s" &&
    go mod tidy)
  # etcd: its own module (MVS would otherwise mix its server with k8s's etcd client).
  rm -f "$HERE/etcd/go.mod" "$HERE/etcd/go.sum"
  (cd "$HERE/etcd" && go mod init local.invalid/phasewise-etcd-tools >/dev/null 2>&1 &&
    go mod edit -go=1.26.0 &&
    go get -tool "go.etcd.io/etcd/server/v3@v$etcd" && go mod tidy)
  # helm: its own module too (it pins its own client-go).
  rm -f "$HERE/helm/go.mod" "$HERE/helm/go.sum"
  (cd "$HERE/helm" && go mod init local.invalid/phasewise-helm-tools >/dev/null 2>&1 &&
    go mod edit -go=1.26.0 &&
    go get -tool "helm.sh/helm/v3/cmd/helm@v$helm" && go mod tidy)
  # kwok: its own module too (it is built against its own k8s.io/* versions, not 1.37's).
  rm -f "$HERE/kwok/go.mod" "$HERE/kwok/go.sum"
  (cd "$HERE/kwok" && go mod init local.invalid/phasewise-kwok-tools >/dev/null 2>&1 &&
    go mod edit -go=1.26.0 &&
    go get -tool "sigs.k8s.io/kwok/cmd/kwok@v$kwok" && go mod tidy)
}

case "${1:-}" in
  --regen) regen; exit 0 ;;
  --print-bin|--crds|"") ;;
  *) echo "usage: $0 [--print-bin|--crds|--regen]" >&2; exit 2 ;;
esac

command -v go >/dev/null || { echo "build.sh: go not found (Go >= 1.26 needed)" >&2; exit 1; }

K8S=$(gomod_version "$HERE/kube" k8s.io/kubernetes)
ETCD=$(gomod_version "$HERE/etcd" go.etcd.io/etcd/server/v3)
HELM=$(gomod_version "$HERE/helm" helm.sh/helm/v3)
BIN=${PHASEWISE_K8S_BIN:-$HOME/.cache/phasewise/k8s/$K8S-etcd$ETCD-helm$HELM}
if [ "${1:-}" = "--print-bin" ]; then echo "$BIN"; exit 0; fi

# The InferencePool CRD (inference.networking.k8s.io/v1) for tests/k8s, from the module pinned in
# tools/k8s/gie/go.mod and checked against its go.sum (nothing is compiled). Cached as
# $BIN/crds/gie-v<version>/<file>; a warm cache costs one stat.
GIE=$(gomod_version "$HERE/gie" sigs.k8s.io/gateway-api-inference-extension)
GIE_CRD="$BIN/crds/gie-v$GIE/inference.networking.k8s.io_inferencepools.yaml"
crds() {
  [ -s "$GIE_CRD" ] && return 0
  local dir
  dir=$(cd "$HERE/gie" && go mod download -json sigs.k8s.io/gateway-api-inference-extension |
    python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(d["Error"]) if d.get("Error") else print(d["Dir"])')
  mkdir -p "$(dirname "$GIE_CRD")"
  cp "$dir/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml" "$GIE_CRD.tmp"
  chmod 644 "$GIE_CRD.tmp"  # the module cache is read-only
  mv -f "$GIE_CRD.tmp" "$GIE_CRD"
  echo "build.sh: InferencePool CRD of gateway-api-inference-extension v$GIE in $GIE_CRD"
}

# KWOK's default Stage manifests (node initialize and heartbeat with lease, pod ready,
# complete and delete: the files its kustomize/stage/fast kustomization names), copied out
# of the module pinned in tools/k8s/kwok/go.mod for tests/k8s/harness.py's KWOK cluster.
KWOK=$(gomod_version "$HERE/kwok" sigs.k8s.io/kwok)
KWOK_STAGES="$BIN/kwok-stages-v$KWOK"
KWOK_STAGE_FILES="node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml
pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml"
kwok_stages() {
  local f dir ok=1
  for f in $KWOK_STAGE_FILES; do [ -s "$KWOK_STAGES/${f##*/}" ] || ok=0; done
  [ "$ok" = 1 ] && return 0
  dir=$(cd "$HERE/kwok" && go mod download -json sigs.k8s.io/kwok |
    python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(d["Error"]) if d.get("Error") else print(d["Dir"])')
  mkdir -p "$KWOK_STAGES"
  for f in $KWOK_STAGE_FILES; do
    cp "$dir/kustomize/stage/$f" "$KWOK_STAGES/${f##*/}.tmp"
    chmod 644 "$KWOK_STAGES/${f##*/}.tmp"  # the module cache is read-only
    mv -f "$KWOK_STAGES/${f##*/}.tmp" "$KWOK_STAGES/${f##*/}"
  done
  echo "build.sh: KWOK v$KWOK Stage manifests in $KWOK_STAGES"
}

mkdir -p "$BIN"
if [ "${1:-}" = "--crds" ]; then crds; kwok_stages; exit 0; fi
crds
kwok_stages
exec 9>"$BIN/.lock"
flock 9

# Expected first line of each binary's version output.
want() {
  case "$1" in
    kube-apiserver|kube-controller-manager|kube-scheduler) echo "Kubernetes v$K8S" ;;
    kubectl) echo "Client Version: v$K8S" ;;
    etcd) echo "etcd Version: $ETCD" ;;
    helm) echo "v$HELM" ;;
    kwok) echo "kwok version v$KWOK" ;;
  esac
}
got() {
  local b="$BIN/$1"
  [ -x "$b" ] || return 0
  case "$1" in
    kube-apiserver|kube-controller-manager|kube-scheduler) "$b" --version 2>/dev/null | head -n1 ;;
    kubectl) "$b" version --client 2>/dev/null | head -n1 ;;
    etcd) "$b" --version 2>/dev/null | head -n1 ;;
    helm) "$b" version --template '{{.Version}}' 2>/dev/null ;;
    kwok) "$b" --version 2>/dev/null | head -n1 | cut -d' ' -f1-3 ;;  # "kwok version vX goX.Y (os/arch)"
  esac
}
ok() { [ "$(got "$1")" = "$(want "$1")" ]; }

timed() {  # timed LABEL CMD... : run CMD, print its wall time
  local label=$1 t0=$SECONDS
  shift
  "$@" || return  # (set -e does not apply inside the && lists below)
  echo "build.sh: $label built in $((SECONDS - t0)) s"
}

tmp=$(mktemp -d "$BIN/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
export CGO_ENABLED=0

# k8s: the flags upstream's hack/lib/golang.sh uses (static, -trimpath, -s -w, tags), plus
# the version stamp of hack/lib/version.sh: without it /version says v0.0.0-master, which
# breaks helm's .Capabilities.KubeVersion and kubeVersion: constraints.
kube=()
for b in kube-apiserver kube-controller-manager kube-scheduler kubectl; do ok "$b" || kube+=("k8s.io/kubernetes/cmd/$b"); done
if [ ${#kube[@]} -gt 0 ]; then
  minor=$(echo "$K8S" | cut -d. -f2)
  ldf="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldf+=" -X $p.gitVersion=v$K8S -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
  done
  echo "build.sh: building ${kube[*]##*/} v$K8S into $BIN"
  (cd "$HERE/kube" && timed "${kube[*]##*/}" go build -trimpath -tags=selinux,notest,grpcnotrace \
    -ldflags="$ldf" -o "$tmp/" "${kube[@]}")
  for p in "${kube[@]}"; do mv -f "$tmp/${p##*/}" "$BIN/${p##*/}"; done
fi

# etcd: the module root of go.etcd.io/etcd/server/v3 is its main package; -o names the
# binary (Go would call it "server"). Its version is a source constant: no -X needed.
if ! ok etcd; then
  echo "build.sh: building etcd v$ETCD into $BIN"
  (cd "$HERE/etcd" && timed etcd go build -trimpath -ldflags="-s -w" -o "$tmp/etcd" go.etcd.io/etcd/server/v3)
  mv -f "$tmp/etcd" "$BIN/etcd"
fi

# helm: stamp the version (the source default has no patch number) and, as helm's
# Makefile does, the Kubernetes version `helm template`/`helm lint` assume offline
# (k8s.io/client-go v0.X.Y -> 1.X).
if ! ok helm; then
  cg=$(gomod_version "$HERE/helm" k8s.io/client-go)
  hmaj=$(( ${cg%%.*} + 1 )); hmin=$(echo "$cg" | cut -d. -f2)
  ldf="-s -w -X helm.sh/helm/v3/internal/version.version=v$HELM -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  for p in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    ldf+=" -X $p.k8sVersionMajor=$hmaj -X $p.k8sVersionMinor=$hmin"
  done
  echo "build.sh: building helm v$HELM into $BIN"
  (cd "$HERE/helm" && timed helm go build -trimpath -ldflags="$ldf" -o "$tmp/helm" helm.sh/helm/v3/cmd/helm)
  mv -f "$tmp/helm" "$BIN/helm"
fi

# kwok: KWOK's controller (simulated nodes and pod lifecycles), run against the harness's
# API server. Its own module, plain build flags as its install docs give them; the version
# is a source constant (pkg/consts), so no -X is needed.
if ! ok kwok; then
  echo "build.sh: building kwok v$KWOK into $BIN"
  (cd "$HERE/kwok" && timed kwok go build -trimpath -ldflags="-s -w" -o "$tmp/kwok" sigs.k8s.io/kwok/cmd/kwok)
  mv -f "$tmp/kwok" "$BIN/kwok"
fi

fail=0
for b in kube-apiserver kube-controller-manager kube-scheduler kubectl etcd helm kwok; do
  if ok "$b"; then
    printf 'build.sh: %-24s %-28s %s\n' "$b" "$(got "$b")" "$(du -h "$BIN/$b" | cut -f1)"
  else
    echo "build.sh: $b: expected '$(want "$b")', got '$(got "$b")'" >&2; fail=1
  fi
done
[ -s "$GIE_CRD" ] || { echo "build.sh: InferencePool CRD missing: $GIE_CRD" >&2; fail=1; }
for f in $KWOK_STAGE_FILES; do
  [ -s "$KWOK_STAGES/${f##*/}" ] || { echo "build.sh: KWOK stage missing: $KWOK_STAGES/${f##*/}" >&2; fail=1; }
done
[ "$fail" = 0 ] && echo "build.sh: binaries ready in $BIN"
exit "$fail"
