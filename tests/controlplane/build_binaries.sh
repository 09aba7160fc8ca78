#!/usr/bin/env bash
# Build the binaries of the integration-test Kubernetes control plane from Go
# modules (the Go module proxy only), once per machine, into a cache OUTSIDE
# the repository:
#
#   ${RAYTPU_K8S_CACHE:-$HOME/.cache/airflow-provider-raytpu/k8s}/<version-key>/bin/
#       etcd  kube-apiserver  kube-scheduler  kube-controller-manager  kuberay-operator
#   .../<version-key>/crds/ray.io_*.yaml   (copied from the ray-operator module)
#   .../kuberay-samples-<version>/*.yaml   (KubeRay's TPU samples at that tag: --samples, no build)
#   .../kueue-<version>_<go>/bin/kueue, crds/, webhooks.yaml   (Kueue's manager, its CRDs and webhook
#       registrations from its module: --kueue; tests/controlplane/kueue.py runs it)
#
# Idempotent: each component is built to a temporary name, moved into place
# and only then given a marker (.done/<name>); a component without its marker
# (an interrupted build) is rebuilt. When every component is done the
# directory gets a .complete marker and later runs are a no-op.
#
# The last stdout line is the bin directory. Progress goes to stderr; the
# timings of each build are appended to <version-key>/build-times.log.
#
# Usage: build_binaries.sh            build what is missing, print bin dir
#        build_binaries.sh --check    print bin dir if complete, else exit 1
#        build_binaries.sh --key      print the version key
#        build_binaries.sh --samples  download KubeRay's TPU samples (no build), print their dir
#        build_binaries.sh --kueue    build Kueue's manager once, print its dir (--kueue-dir: print it if built)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
GODIR="$HERE/go"

# Versions are read from the go.mod files so there is one place to bump them.
K8S_VERSION="$(awk '$1 == "require" && $2 == "k8s.io/kubernetes" {print $3}' "$GODIR/kubernetes/go.mod")"
ETCD_VERSION="$(awk '$1 == "require" && $2 == "go.etcd.io/etcd/server/v3" {print $3}' "$GODIR/etcd/go.mod")"
KUBERAY_VERSION="v1.6.2"
KUBERAY_MODULE="github.com/ray-project/kuberay/ray-operator"
KUEUE_VERSION="v0.17.0"
KUEUE_MODULE="sigs.k8s.io/kueue"

# Never let the go command fetch another toolchain; build with the one here.
export GOTOOLCHAIN=local
export CGO_ENABLED=0

GOVERSION="$(go env GOVERSION)"
INPUT_HASH="$(cat "$GODIR/kubernetes/go.mod" "$GODIR/kubernetes/go.sum" "$GODIR/kubernetes/tools.go" \
    "$GODIR/etcd/go.mod" "$GODIR/etcd/go.sum" "$GODIR/etcd/main.go" \
    | sha256sum | cut -c1-10)"
KEY="k8s-${K8S_VERSION}_etcd-${ETCD_VERSION}_kuberay-${KUBERAY_VERSION}_${GOVERSION}_${INPUT_HASH}"
CACHE="${RAYTPU_K8S_CACHE:-$HOME/.cache/airflow-provider-raytpu/k8s}"
DIR="$CACHE/$KEY"
BIN="$DIR/bin"

SAMPLES="$CACHE/kuberay-samples-$KUBERAY_VERSION"

# samples: KubeRay's TPU samples at this tag, from its Go module (a download, nothing built), for the
# manifest parity test (tests/unit/test_kuberay_samples.py).
samples() {
  [[ -f "$SAMPLES/.done" ]] && return 0
  local moddir
  moddir="$(GOFLAGS=-mod=mod go mod download -json "$KUBERAY_MODULE@$KUBERAY_VERSION" \
    | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
  [[ -d "$moddir/config/samples" ]] || { echo "no samples under $moddir" >&2; return 1; }
  mkdir -p "$SAMPLES"
  (cd "$moddir/config/samples" && cp -f ray-cluster.tpu-*.yaml ray-service.tpu-*.yaml \
    vllm/ray-service.vllm-tpu-v6e-singlehost.yaml "$SAMPLES/")
  chmod 0644 "$SAMPLES"/*.yaml
  echo "$KUBERAY_MODULE@$KUBERAY_VERSION config/samples" >"$SAMPLES/SOURCE"
  touch "$SAMPLES/.done"
}

KUEUE="$CACHE/kueue-${KUEUE_VERSION}_${GOVERSION}"

# kueue: Kueue's manager (go install of its cmd/kueue: no replace directives in its go.mod), and from the
# same module its CRDs and webhook registrations, for the queueing tests (tests/controlplane/test_kueue.py).
kueue() {
  [[ -f "$KUEUE/.done" ]] && return 0
  mkdir -p "$KUEUE/bin" "$KUEUE/crds"
  local gobin moddir start
  gobin="$(mktemp -d "$KUEUE/gobin.XXXXXX")"
  start=$SECONDS
  echo "[build_binaries] building kueue $KUEUE_VERSION ..." >&2
  GOBIN="$gobin" GOFLAGS="-buildvcs=false" go install -trimpath -ldflags="-s -w" "$KUEUE_MODULE/cmd/kueue@$KUEUE_VERSION" >&2
  mv -f "$gobin/kueue" "$KUEUE/bin/kueue"
  rmdir "$gobin"
  moddir="$(GOFLAGS=-mod=mod go mod download -json "$KUEUE_MODULE@$KUEUE_VERSION" \
    | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
  cp -f "$moddir"/config/components/crd/bases/*.yaml "$KUEUE/crds/"
  cp -f "$moddir/config/components/webhook/manifests.yaml" "$KUEUE/webhooks.yaml"
  chmod 0644 "$KUEUE"/crds/*.yaml "$KUEUE/webhooks.yaml"
  printf '%s kueue %ss (%s, %s cores)\n' "$(date -u +%FT%TZ)" "$((SECONDS - start))" "$GOVERSION" "$(nproc)" \
    >>"$KUEUE/build-times.log"
  echo "$KUEUE_MODULE@$KUEUE_VERSION" >"$KUEUE/SOURCE"
  touch "$KUEUE/.done"
}

case "${1:-}" in
  --key) echo "$KEY"; exit 0 ;;
  --kueue) kueue && echo "$KUEUE"; exit $? ;;
  --kueue-dir)
    if [[ -f "$KUEUE/.done" ]]; then echo "$KUEUE"; exit 0; fi
    echo "Kueue not built: run tests/controlplane/build_binaries.sh --kueue" >&2
    exit 1 ;;
  --samples) samples && echo "$SAMPLES"; exit $? ;;
  --samples-dir)
    if [[ -f "$SAMPLES/.done" ]]; then echo "$SAMPLES"; exit 0; fi
    echo "KubeRay's samples not downloaded: run tests/controlplane/build_binaries.sh --samples" >&2
    exit 1 ;;
  --check)
    if [[ -f "$DIR/.complete" ]]; then echo "$BIN"; exit 0; fi
    echo "control-plane binaries not built: run tests/controlplane/build_binaries.sh (cache: $DIR)" >&2
    exit 1 ;;
  "") ;;
  *) echo "usage: $0 [--check|--key|--samples|--samples-dir|--kueue|--kueue-dir]" >&2; exit 2 ;;
esac

if [[ -f "$DIR/.complete" ]]; then
  echo "$BIN"
  exit 0
fi

mkdir -p "$BIN" "$DIR/.done" "$DIR/crds"
# One builder at a time per version key (parallel test runners, two shells).
exec 9>"$DIR/.lock"
if command -v flock >/dev/null 2>&1; then
  flock 9
fi

log() { echo "[build_binaries] $*" >&2; }
TIMES="$DIR/build-times.log"
TIMEFORMAT='%R'

# run_timed NAME CMD...: run CMD, append "NAME <seconds>s" to build-times.log.
run_timed() {
  local name="$1"; shift
  local tfile; tfile="$(mktemp)"
  log "building $name ..."
  if ! { time "$@" >&2 ; } 2>"$tfile.err"; then
    head -n -1 "$tfile.err" >&2
    log "FAILED building $name: $*"
    rm -f "$tfile" "$tfile.err"
    return 1
  fi
  # `time` writes its report as the last line of stderr.
  local secs; secs="$(tail -n 1 "$tfile.err")"
  head -n -1 "$tfile.err" >&2 || true
  rm -f "$tfile" "$tfile.err"
  printf '%s %s %ss (%s, %s cores)\n' "$(date -u +%FT%TZ)" "$name" "$secs" "$GOVERSION" "$(nproc)" >>"$TIMES"
  log "built $name in ${secs}s"
}

done_marker() { [[ -f "$DIR/.done/$1" && -x "$BIN/$1" ]]; }

# reuse NAME: take an etcd or Kubernetes binary already built for another KubeRay version with the
# same Kubernetes, etcd, Go and inputs (a KubeRay bump then builds KubeRay alone).
reuse() {
  local name="$1" other
  for other in "$CACHE"/k8s-"${K8S_VERSION}"_etcd-"${ETCD_VERSION}"_kuberay-*_"${GOVERSION}"_"${INPUT_HASH}"; do
    [[ "$other" != "$DIR" && -f "$other/.done/$name" && -x "$other/bin/$name" ]] || continue
    cp -f "$other/bin/$name" "$BIN/$name.tmp" && mv -f "$BIN/$name.tmp" "$BIN/$name"
    touch "$DIR/.done/$name"
    log "reused $name from $other"
    return 0
  done
  return 1
}

# --- kube-apiserver, kube-scheduler, kube-controller-manager ----------------
VERSION_PKG="k8s.io/component-base/version"
CLIENT_VERSION_PKG="k8s.io/client-go/pkg/version"
K8S_MINOR="$(echo "$K8S_VERSION" | cut -d. -f2)"
K8S_LDFLAGS="-s -w"
for pkg in "$VERSION_PKG" "$CLIENT_VERSION_PKG"; do
  K8S_LDFLAGS+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$K8S_MINOR"
  K8S_LDFLAGS+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

build_k8s() {
  local name="$1"
  done_marker "$name" && return 0
  reuse "$name" && return 0
  rm -f "$DIR/.done/$name" "$BIN/$name.tmp"
  GOFLAGS="-mod=readonly -buildvcs=false" run_timed "$name" \
    go build -C "$GODIR/kubernetes" -trimpath -ldflags="$K8S_LDFLAGS" \
      -o "$BIN/$name.tmp" "k8s.io/kubernetes/cmd/$name"
  mv -f "$BIN/$name.tmp" "$BIN/$name"
  touch "$DIR/.done/$name"
}

# --- etcd -------------------------------------------------------------------
build_etcd() {
  done_marker etcd && return 0
  reuse etcd && return 0
  rm -f "$DIR/.done/etcd" "$BIN/etcd.tmp"
  GOFLAGS="-mod=readonly -buildvcs=false" run_timed etcd \
    go build -C "$GODIR/etcd" -trimpath -ldflags="-s -w" -o "$BIN/etcd.tmp" .
  mv -f "$BIN/etcd.tmp" "$BIN/etcd"
  touch "$DIR/.done/etcd"
}

# --- KubeRay operator + its CRDs ----------------------------------------------
build_kuberay() {
  if ! done_marker kuberay-operator; then
    rm -f "$DIR/.done/kuberay-operator"
    local gobin; gobin="$(mktemp -d "$DIR/gobin.XXXXXX")"
    # No replace directives in ray-operator's go.mod: plain `go install @version`.
    GOBIN="$gobin" GOFLAGS="-buildvcs=false" run_timed kuberay-operator \
      go install -trimpath -ldflags="-s -w" "$KUBERAY_MODULE@$KUBERAY_VERSION"
    mv -f "$gobin/ray-operator" "$BIN/kuberay-operator"
    rmdir "$gobin"
    touch "$DIR/.done/kuberay-operator"
  fi
  if [[ ! -f "$DIR/.done/crds" ]]; then
    local moddir
    moddir="$(GOFLAGS=-mod=mod go mod download -json "$KUBERAY_MODULE@$KUBERAY_VERSION" \
      | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
    [[ -d "$moddir/config/crd/bases" ]] || { log "no CRDs under $moddir"; return 1; }
    cp -f "$moddir"/config/crd/bases/ray.io_*.yaml "$DIR/crds/"
    chmod 0644 "$DIR"/crds/*.yaml
    touch "$DIR/.done/crds"
  fi
}

log "cache dir: $DIR"
build_etcd
build_kuberay
build_k8s kube-apiserver
build_k8s kube-scheduler
build_k8s kube-controller-manager

for c in etcd kube-apiserver kube-scheduler kube-controller-manager kuberay-operator crds; do
  [[ -f "$DIR/.done/$c" ]] || { log "component $c missing"; exit 1; }
done
cat >"$DIR/VERSIONS" <<EOF
k8s.io/kubernetes $K8S_VERSION
go.etcd.io/etcd/server/v3 $ETCD_VERSION
$KUBERAY_MODULE $KUBERAY_VERSION
$GOVERSION
EOF
touch "$DIR/.complete"
log "all components built"
echo "$BIN"
