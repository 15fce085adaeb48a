#!/bin/bash
# A real single-node Kubernetes cluster on this machine, for the Kubernetes sandbox backend (issue #37).
#
#   scripts/k8s_cluster.sh build   build the server programs from Debian's `kubernetes` source package
#   scripts/k8s_cluster.sh up      build if needed, start the cluster, wait for the node to be Ready
#   scripts/k8s_cluster.sh down    stop every process it started (by pid) and remove their containers
#   scripts/k8s_cluster.sh status  what runs
#   scripts/k8s_cluster.sh env     the variables that reach it (KUBECONFIG, its Docker engine, the Pods'
#                                  address of this host), as shell exports
#
# Nothing is downloaded but Debian packages: kube-apiserver, kube-controller-manager, kube-scheduler and
# kubelet are compiled from the source package (1.20.2, vendor/ included) with golang-1.19 in GOPATH mode;
# etcd is Debian's etcd-server, kubectl comes from Debian's kubernetes-client .deb (unpacked here, since
# another package may own /usr/bin/kubectl), the pause image is build/pause/linux/pause.c compiled with
# gcc. The kubelet drives a Docker engine of the cluster's own (Debian's dockerd, no bridge, no iptables;
# dockershim). The apiserver listens on 127.0.0.1 only, with token authentication and RBAC.
# Everything lives in $OPENFORGE_K8S_DIR (default ~/.cache/openforgerl/k8s); the kubeconfig an admin
# uses is written to $OPENFORGE_K8S_DIR/kubeconfig. As root (the kubelet and dockerd need it).
set -euo pipefail

K8S_DIR=${OPENFORGE_K8S_DIR:-$HOME/.cache/openforgerl/k8s}
SRC_DIR=$K8S_DIR/gopath/src/k8s.io/kubernetes
BIN_DIR=$K8S_DIR/bin
RUN_DIR=$K8S_DIR/run            # pids, logs, certificates, state of one cluster; removed by `down`
PORT=${OPENFORGE_K8S_PORT:-6443}
GO=/usr/lib/go-1.19/bin/go
PROGRAMS=(kube-apiserver kube-controller-manager kube-scheduler kubelet)
PAUSE_IMAGE=openforgerl/pause:3.4
NODE=${OPENFORGE_K8S_NODE:-openforge-node}

log() { echo "k8s: $*" >&2; }
die() { echo "k8s: error: $*" >&2; exit 1; }

need_root() { [ "$(id -u)" = 0 ] || die "run as root: the kubelet and its Docker engine need it"; }

apt_install() {
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing Debian packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

# The source package needs a deb-src line; bookworm's is added beside the system's sources when absent.
fetch_source() {
  [ -f "$SRC_DIR/cmd/kubelet/kubelet.go" ] && return 0
  apt_install dpkg-dev
  if ! apt-cache showsrc kubernetes 2>/dev/null | grep -q '^Version:'; then
    local suite
    # shellcheck disable=SC1091
    suite=$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")
    local uri
    # The same archive the system's binary packages come from (its first deb source).
    uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null)
    [ -n "$uri" ] || uri=$(awk '$1 == "deb" {print ($2 ~ /^\[/ ? $3 : $2); exit}' /etc/apt/sources.list 2>/dev/null)
    [ -n "$uri" ] || die "no Debian archive found in the apt sources to add a deb-src line for"
    log "adding a deb-src line for $suite (/etc/apt/sources.list.d/openforgerl-k8s-src.sources)"
    printf 'Types: deb-src\nURIs: %s\nSuites: %s\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      "$uri" "$suite" >/etc/apt/sources.list.d/openforgerl-k8s-src.sources
    apt-get update -qq
  fi
  local tmp=$K8S_DIR/src.tmp
  rm -rf "$tmp" && mkdir -p "$tmp"
  (cd "$tmp" && apt-get source -qq kubernetes >/dev/null 2>"$tmp/apt-source.log") ||
    { cat "$tmp/apt-source.log" >&2; die "apt-get source kubernetes failed"; }
  mkdir -p "$(dirname "$SRC_DIR")"
  rm -rf "$SRC_DIR"
  mv "$tmp"/kubernetes-*/ "$SRC_DIR"
  rm -rf "$tmp"
}

gobuild() {
  (cd "$SRC_DIR" && GOPATH=$K8S_DIR/gopath GO111MODULE=off CGO_ENABLED=0 GOFLAGS='' GOCACHE=$K8S_DIR/gocache \
    nice -n 19 "$GO" build "$@")
}

# The API server's OpenAPI definitions are generated code the source package does not ship (upstream's
# `make` generates them: Makefile.generated_files' gen_openapi); the same generator, on the same inputs.
gen_openapi() {
  local out=$SRC_DIR/pkg/generated/openapi/zz_generated.openapi.go
  [ -f "$out" ] && return 0
  log "generating pkg/generated/openapi (openapi-gen, as upstream's make does)"
  gobuild -o "$K8S_DIR/openapi-gen" ./vendor/k8s.io/kube-openapi/cmd/openapi-gen || die "building openapi-gen failed"
  local inputs
  # Every package with a +k8s:openapi-gen tag, staging/ named as vendor/ (hack/make-rules/helpers/cache_go_dirs.sh).
  inputs=$(cd "$SRC_DIR" && find -H . \( -path ./_\* -o -path ./.\* -o -path ./vendor -o -path ./debian \) -prune \
      -o -type f -name '*.go' -print0 | xargs -0 grep -l '^// *+k8s:' | xargs grep -l '+k8s:openapi-gen=' |
    sed 's|^./staging/src|vendor|; s|^./||; s|/[^/]*$||' | grep -v -e '^vendor/k8s.io/code-generator/' \
      -e '^vendor/k8s.io/sample-apiserver/' | LC_ALL=C sort -u | sed 's|^|k8s.io/kubernetes/|' | paste -sd,)
  (cd "$SRC_DIR" && GOPATH=$K8S_DIR/gopath GO111MODULE=off nice -n 19 "$K8S_DIR/openapi-gen" --logtostderr \
    -i "$inputs" -p k8s.io/kubernetes/pkg/generated/openapi -O zz_generated.openapi \
    -h vendor/k8s.io/code-generator/hack/boilerplate.go.txt -r "$K8S_DIR/openapi-violations.report" \
    >"$K8S_DIR/openapi-gen.log" 2>&1) || { tail -20 "$K8S_DIR/openapi-gen.log" >&2; die "openapi-gen failed"; }
  [ -f "$out" ] || die "openapi-gen wrote no $out (log: $K8S_DIR/openapi-gen.log)"
}

build() {
  local p missing=()
  for p in "${PROGRAMS[@]}" kubectl; do [ -x "$BIN_DIR/$p" ] || missing+=("$p"); done
  [ -f "$BIN_DIR/pause" ] || missing+=(pause)
  [ ${#missing[@]} -eq 0 ] && return 0
  apt_install golang-1.19 gcc etcd-server
  fetch_source
  mkdir -p "$BIN_DIR"
  local version
  version=$(sed -n 's/^kubernetes (\([^)]*\)).*/\1/p;q' "$SRC_DIR/debian/changelog")
  version=v${version#*really}
  version=${version%%-*}
  # The version the programs report (/version, the node's kubeletVersion), as hack/lib/version.sh sets it.
  local pkg ldflags="-s -w"
  for pkg in client-go/pkg/version component-base/version; do
    pkg=k8s.io/kubernetes/vendor/k8s.io/$pkg
    ldflags+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=${version:1:1} -X $pkg.gitTreeState=clean"
    ldflags+=" -X $pkg.gitMinor=$(echo "$version" | cut -d. -f2)"
  done
  local started=$SECONDS todo=()
  for p in "${PROGRAMS[@]}"; do [ -x "$BIN_DIR/$p" ] || todo+=("./cmd/$p"); done
  if [ ${#todo[@]} -gt 0 ]; then
    gen_openapi
    log "building ${todo[*]} ($version) with $($GO version | cut -d' ' -f3) in GOPATH mode; several minutes on 2 cores"
    # GOPATH mode: the tree's go.mod pins module versions golang-1.19 refuses, its vendor/ has all it needs.
    gobuild -ldflags "$ldflags" -o "$BIN_DIR/" "${todo[@]}" || die "the Go build failed"
  fi
  if [ ! -x "$BIN_DIR/kubectl" ]; then
    # Debian's kubectl of the same version, unpacked rather than installed: /usr/bin/kubectl may belong
    # to another package (Google's cloud SDK ships one).
    local tmp=$K8S_DIR/kubectl.tmp
    rm -rf "$tmp" && mkdir -p "$tmp"
    (cd "$tmp" && { apt-get download -qq kubernetes-client >/dev/null 2>&1 ||
      { apt-get update -qq && apt-get download -qq kubernetes-client >/dev/null; }; }) ||
      die "apt-get download kubernetes-client failed"
    dpkg-deb -x "$tmp"/kubernetes-client_*.deb "$tmp/root"
    cp "$tmp/root/usr/bin/kubectl" "$BIN_DIR/kubectl"
    rm -rf "$tmp"
  fi
  if [ ! -f "$BIN_DIR/pause" ]; then
    gcc -Os -static -o "$BIN_DIR/pause" "$SRC_DIR/build/pause/linux/pause.c" ||
      gcc -Os -o "$BIN_DIR/pause" "$SRC_DIR/build/pause/linux/pause.c"
  fi
  log "built in $((SECONDS - started)) s into $BIN_DIR"
}

# -- the cluster -----------------------------------------------------------------------------------

PKI=$RUN_DIR/pki
DOCKER_DIR=$K8S_DIR/docker       # the cluster's Docker engine: its images outlive `down`
DOCKER_SOCK=unix://$DOCKER_DIR/docker.sock
ETCD_PORT=${OPENFORGE_K8S_ETCD_PORT:-23790}
# Pods get addresses on a bridge of their own (CNI bridge plugin, no masquerade, no default route):
# they reach this host at POD_GATEWAY (where a gateway for them listens) and nothing beyond the bridge.
POD_BRIDGE=ofk8s0
POD_SUBNET=${OPENFORGE_K8S_POD_SUBNET:-10.217.0.0/24}
POD_GATEWAY=${POD_SUBNET%.*}.1
SERVICE_RANGE=10.217.1.0/24
KUBECONFIG_OUT=$K8S_DIR/kubeconfig

dockerc() { docker -H "$DOCKER_SOCK" "$@"; }
kubectl_admin() { "$BIN_DIR/kubectl" --kubeconfig "$KUBECONFIG_OUT" "$@"; }

# Starts a program in the background, its pid in $RUN_DIR/NAME.pid and its output in $RUN_DIR/NAME.log.
start() {
  local name=$1
  shift
  "$@" >"$RUN_DIR/$name.log" 2>&1 &
  echo $! >"$RUN_DIR/$name.pid"
}

alive() { [ -f "$RUN_DIR/$1.pid" ] && kill -0 "$(cat "$RUN_DIR/$1.pid")" 2>/dev/null; }

# Waits up to $2 seconds for command $3... to succeed while process $1 lives; its log on failure.
wait_for() {
  local name=$1 limit=$2 t=0
  shift 2
  until "$@" >/dev/null 2>&1; do
    alive "$name" || { tail -30 "$RUN_DIR/$name.log" >&2; die "$name exited (log: $RUN_DIR/$name.log)"; }
    t=$((t + 1))
    [ "$t" -le $((limit * 2)) ] || { tail -30 "$RUN_DIR/$name.log" >&2; die "$name not ready after $limit s"; }
    sleep 0.5
  done
}

kubeconfig() {
  cat <<EOF
apiVersion: v1
kind: Config
clusters:
- name: openforge-local
  cluster:
    server: https://127.0.0.1:$PORT
    certificate-authority-data: $(base64 -w0 <"$PKI/ca.crt")
users:
- name: $2
  user:
    token: $1
contexts:
- name: openforge-local
  context: {cluster: openforge-local, user: $2, namespace: default}
current-context: openforge-local
EOF
}

make_pki() {
  mkdir -p "$PKI"
  (
    cd "$PKI"
    openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 3650 -subj /CN=openforge-k8s-ca 2>/dev/null
    # The API server's serving certificate: loopback, and the names in-cluster clients would use.
    openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj /CN=kube-apiserver 2>/dev/null
    printf 'subjectAltName=IP:127.0.0.1,IP:%s,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc\n' \
      "${SERVICE_RANGE%.*}.1" >apiserver.ext
    openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out apiserver.crt -days 3650 \
      -extfile apiserver.ext 2>/dev/null
    # The API server's identity towards the kubelet (exec, logs): a client certificate in system:masters.
    openssl req -newkey rsa:2048 -nodes -keyout kubelet-client.key -out kubelet-client.csr \
      -subj "/O=system:masters/CN=kube-apiserver-kubelet-client" 2>/dev/null
    printf 'extendedKeyUsage=clientAuth\n' >client.ext
    openssl x509 -req -in kubelet-client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out kubelet-client.crt \
      -days 3650 -extfile client.ext 2>/dev/null
    openssl genrsa -out sa.key 2048 2>/dev/null
    openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
    chmod 600 ./*.key
  )
  # Static bearer tokens: the admin (system:masters) and each component under its built-in RBAC name.
  local admin kubelet cm sched
  admin=$(openssl rand -hex 24) kubelet=$(openssl rand -hex 24) cm=$(openssl rand -hex 24) sched=$(openssl rand -hex 24)
  {
    echo "$admin,openforge-admin,openforge-admin,system:masters"
    echo "$kubelet,system:node:$NODE,system:node:$NODE,system:nodes"
    echo "$cm,system:kube-controller-manager,system:kube-controller-manager"
    echo "$sched,system:kube-scheduler,system:kube-scheduler"
  } >"$PKI/tokens.csv"
  chmod 600 "$PKI/tokens.csv"
  (umask 077 && kubeconfig "$admin" openforge-admin >"$KUBECONFIG_OUT.tmp")
  mv "$KUBECONFIG_OUT.tmp" "$KUBECONFIG_OUT"
  kubeconfig "$kubelet" "system:node:$NODE" >"$PKI/kubelet.kubeconfig"
  kubeconfig "$cm" system:kube-controller-manager >"$PKI/controller-manager.kubeconfig"
  kubeconfig "$sched" system:kube-scheduler >"$PKI/scheduler.kubeconfig"
}

# The kubelet gives pause containers and Guaranteed Pods' containers oom_score_adj -998, which needs
# CAP_SYS_RESOURCE; where root lacks it (some VMs and containers), runc fails ("can't get final
# child's PID from pipe"). There the engine runs runc through this wrapper, which raises a negative
# oom_score_adj to 0 and changes nothing else: the kernel's OOM killer then prefers those processes
# no less than any other, which is all that is lost.
write_runc_wrapper() {
  cat >"$DOCKER_DIR/runc-oom-clamp" <<'EOF'
#!/bin/sh
prev=
for a in "$@"; do
  case "$prev" in --bundle | -b) spec=$a/config.json ;; --process | -p) spec=$a ;; esac
  case "$a" in --bundle=*) spec=${a#--bundle=}/config.json ;; --process=*) spec=${a#--process=} ;; esac
  prev=$a
done
if [ -n "${spec:-}" ] && [ -f "$spec" ]; then
  python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
proc = d.get("process", d)
if proc.get("oomScoreAdj", 0) < 0:
    proc["oomScoreAdj"] = 0
    json.dump(d, open(sys.argv[1], "w"))
' "$spec"
fi
exec runc "$@"
EOF
  chmod 755 "$DOCKER_DIR/runc-oom-clamp"
}

start_docker() {
  mkdir -p "$DOCKER_DIR"
  if ! dockerc version >/dev/null 2>&1; then
    command -v dockerd >/dev/null || apt_install docker.io
    local runtime=()
    if ! sh -c 'echo -1 >/proc/self/oom_score_adj' 2>/dev/null; then
      log "no CAP_SYS_RESOURCE here: runc runs with negative oom_score_adj raised to 0 (runc-oom-clamp)"
      write_runc_wrapper
      runtime=(--add-runtime "oom-clamp=$DOCKER_DIR/runc-oom-clamp" --default-runtime oom-clamp)
    fi
    start dockerd dockerd --iptables=false --ip6tables=false --bridge=none --data-root "$DOCKER_DIR/data" \
      --exec-root "$DOCKER_DIR/exec" --host "$DOCKER_SOCK" --pidfile "$DOCKER_DIR/dockerd.pid" "${runtime[@]}"
    wait_for dockerd 60 dockerc version
  fi
  if ! dockerc image inspect "$PAUSE_IMAGE" >/dev/null 2>&1; then
    local tmp=$K8S_DIR/pause.tmp
    rm -rf "$tmp" && mkdir -p "$tmp"
    cp "$BIN_DIR/pause" "$tmp/pause"
    tar -C "$tmp" -c pause | dockerc import --change 'ENTRYPOINT ["/pause"]' - "$PAUSE_IMAGE" >/dev/null
    rm -rf "$tmp"
  fi
}

write_cni() {
  mkdir -p "$RUN_DIR/cni" "$RUN_DIR/cni-ipam"
  cat >"$RUN_DIR/cni/10-openforge.conflist" <<EOF
{
  "cniVersion": "0.3.1",
  "name": "openforge",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$POD_BRIDGE",
      "isGateway": true,
      "isDefaultGateway": false,
      "ipMasq": false,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$POD_SUBNET", "gateway": "$POD_GATEWAY"}]],
        "dataDir": "$RUN_DIR/cni-ipam"
      }
    }
  ]
}
EOF
}

node_ready() {
  [ "$(kubectl_admin get node "$NODE" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}')" = True ]
}

up() {
  need_root
  if alive kube-apiserver && kubectl_admin get --raw /readyz >/dev/null 2>&1; then
    log "already up (kubeconfig: $KUBECONFIG_OUT)"
    return 0
  fi
  local t0=$SECONDS
  build
  apt_install containernetworking-plugins openssl curl
  down quiet
  mkdir -p "$RUN_DIR"
  make_pki
  start_docker

  start etcd etcd --name openforge --data-dir "$RUN_DIR/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
    --initial-cluster "openforge=http://127.0.0.1:$((ETCD_PORT + 1))"
  wait_for etcd 30 curl -sf "http://127.0.0.1:$ETCD_PORT/health"

  start kube-apiserver "$BIN_DIR/kube-apiserver" \
    --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$PORT" --insecure-port=0 \
    --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
    --client-ca-file="$PKI/ca.crt" --token-auth-file="$PKI/tokens.csv" --anonymous-auth=false \
    --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction --allow-privileged=false \
    --service-cluster-ip-range="$SERVICE_RANGE" --endpoint-reconciler-type=none \
    --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
    --service-account-issuer=https://kubernetes.default.svc \
    --kubelet-client-certificate="$PKI/kubelet-client.crt" --kubelet-client-key="$PKI/kubelet-client.key" \
    --kubelet-preferred-address-types=InternalIP
  wait_for kube-apiserver 120 kubectl_admin get --raw /readyz

  start kube-controller-manager "$BIN_DIR/kube-controller-manager" \
    --kubeconfig="$PKI/controller-manager.kubeconfig" --bind-address=127.0.0.1 --port=0 \
    --leader-elect=false --use-service-account-credentials=true \
    --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
    --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key"
  start kube-scheduler "$BIN_DIR/kube-scheduler" \
    --kubeconfig="$PKI/scheduler.kubeconfig" --bind-address=127.0.0.1 --port=0 --leader-elect=false

  write_cni
  # The bridge, made now rather than by the first Pod, so a gateway can listen on POD_GATEWAY at once.
  ip link show "$POD_BRIDGE" >/dev/null 2>&1 || ip link add "$POD_BRIDGE" type bridge
  ip addr replace "$POD_GATEWAY/${POD_SUBNET#*/}" dev "$POD_BRIDGE"
  ip link set "$POD_BRIDGE" up
  mkdir -p "$RUN_DIR/kubelet"
  # On the Pods' bridge (a node's address may not be loopback; the API server reaches the kubelet
  # there for exec), with client certificates or tokens only; no iptables rules of its own; image GC
  # and disk evictions off, so that a full disk elsewhere on a shared machine neither deletes task
  # images nor taints the node.
  start kubelet "$BIN_DIR/kubelet" \
    --kubeconfig="$PKI/kubelet.kubeconfig" --hostname-override="$NODE" --node-ip="$POD_GATEWAY" \
    --address="$POD_GATEWAY" --read-only-port=0 --healthz-bind-address=127.0.0.1 \
    --client-ca-file="$PKI/ca.crt" --anonymous-auth=false --authorization-mode=Webhook \
    --root-dir="$RUN_DIR/kubelet" --cert-dir="$RUN_DIR/kubelet/pki" \
    --container-runtime=docker --docker-endpoint="$DOCKER_SOCK" --pod-infra-container-image="$PAUSE_IMAGE" \
    --network-plugin=cni --cni-bin-dir=/usr/lib/cni --cni-conf-dir="$RUN_DIR/cni" --cni-cache-dir="$RUN_DIR/cni-cache" \
    --cgroup-driver=cgroupfs --fail-swap-on=false --make-iptables-util-chains=false \
    --image-gc-high-threshold=100 --image-gc-low-threshold=99 \
    --eviction-hard="memory.available<100Mi,nodefs.available<1%,imagefs.available<1%" \
    --resolv-conf=/etc/resolv.conf --register-node=true
  wait_for kubelet 120 node_ready
  log "up in $((SECONDS - t0)) s: node $NODE Ready; KUBECONFIG=$KUBECONFIG_OUT; Pods reach this host at $POD_GATEWAY"
}

# Stops what `up` started, each by its pid (dockerd last, after the Pods' containers), and removes the
# cluster's state but the build and the Docker engine's images.
down() {
  local quiet=${1:-}
  [ -d "$RUN_DIR" ] || { [ -n "$quiet" ] || log "not up"; return 0; }
  local name pid
  for name in kubelet kube-scheduler kube-controller-manager kube-apiserver etcd; do
    if alive "$name"; then
      pid=$(cat "$RUN_DIR/$name.pid")
      kill "$pid"
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
      kill -9 "$pid" 2>/dev/null || true
    fi
  done
  if alive dockerd; then
    # The kubelet's containers (Pods and their pause containers) go with the cluster.
    local ids
    ids=$(dockerc ps -aq --filter label=io.kubernetes.pod.name 2>/dev/null || true)
    # shellcheck disable=SC2086
    [ -z "$ids" ] || dockerc rm -f $ids >/dev/null 2>&1 || true
    pid=$(cat "$RUN_DIR/dockerd.pid")
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  # The kubelet's volume mounts (emptyDirs, secrets), then the Pods' bridge.
  grep -o " $RUN_DIR/[^ ]*" /proc/mounts | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
  ip link del "$POD_BRIDGE" 2>/dev/null || true
  rm -rf "$RUN_DIR" "$KUBECONFIG_OUT"
  [ -n "$quiet" ] || log "down: every process stopped, state removed (the build stays in $BIN_DIR)"
}

status() {
  local name
  for name in etcd kube-apiserver kube-controller-manager kube-scheduler kubelet dockerd; do
    if alive "$name"; then echo "$name: running (pid $(cat "$RUN_DIR/$name.pid"))"; else echo "$name: stopped"; fi
  done
  if alive kube-apiserver; then kubectl_admin get nodes; fi
}

# What a user (or tests/k8s_cluster.sh) needs to reach the cluster: `eval "$(scripts/k8s_cluster.sh env)"`.
env_vars() {
  echo "export KUBECONFIG=$KUBECONFIG_OUT"
  echo "export OPENFORGE_K8S_KUBECTL=$BIN_DIR/kubectl"
  echo "export OPENFORGE_K8S_DOCKER_HOST=$DOCKER_SOCK"
  echo "export OPENFORGE_K8S_POD_GATEWAY=$POD_GATEWAY"
}

case "${1:-}" in
  build) build ;;
  env) env_vars ;;
  up) up ;;
  down) need_root; down ;;
  status) status ;;
  *) echo "usage: $0 build|up|down|status|env" >&2; exit 2 ;;
esac
