#!/bin/sh
# Runs tests/sandbox/test_k8s_cluster.py against the real single-node cluster of scripts/k8s_cluster.sh: starts
# it when it is not up (and stops it again on the way out), makes the base image in the cluster's Docker
# engine (scripts/docker_base.sh), and hands the tests the kubeconfig, kubectl, the engine and the
# address at which Pods reach this host.
# Usage: tests/k8s_cluster.sh BASE_IMAGE DOCKER_STATE PYTEST [PYTEST ARGS...]   (as root)
set -eu
image=$1 state=$2
shift 2
cluster="$(dirname "$0")/../scripts/k8s_cluster.sh"
if ! bash "$cluster" status 2>/dev/null | grep -q '^kube-apiserver: running'; then
  trap 'bash "$cluster" down' EXIT
  bash "$cluster" up
fi
eval "$(bash "$cluster" env)"
export OPENFORGE_K8S_KUBECONFIG="$KUBECONFIG"
unset KUBECONFIG  # the tests name the kubeconfig they mean; nothing else picks up the admin's
DOCKER_HOST=$OPENFORGE_K8S_DOCKER_HOST sh "$(dirname "$0")/../scripts/docker_base.sh" "$image" "$state" >/dev/null
# Not the script's last command: the shell would exec it, and the EXIT trap would not run.
rc=0
OPENFORGE_DOCKER_IMAGE=$image "$@" || rc=$?
exit $rc
