#!/bin/sh
# Runs tests/sandbox/test_docker.py against a Docker engine of its own: Debian's dockerd, started here without
# networking (no bridge, no iptables: no registry is reachable, and containers get no network but what
# the backend gives them), and the base image made by scripts/docker_base.sh (debootstrap's minbase with
# python3, `docker import`ed).
# Usage: tests/docker_engine.sh STATE_DIR IMAGE PYTEST [PYTEST ARGS...]   (as root)
set -eu
dir=$1 image=$2
shift 2
mkdir -p "$dir"
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
fi
sock="unix://$dir/docker.sock"
started=
if ! docker -H "$sock" version >/dev/null 2>&1; then
  dockerd --iptables=false --ip6tables=false --bridge=none --data-root "$dir/data" --exec-root "$dir/exec" \
    --host "$sock" --pidfile "$dir/dockerd.pid" >"$dir/dockerd.log" 2>&1 &
  started=$!
  trap 'kill "$started" 2>/dev/null; wait "$started" 2>/dev/null' EXIT
  tries=0
  until docker -H "$sock" version >/dev/null 2>&1; do
    tries=$((tries + 1))
    [ "$tries" -lt 120 ] || { tail -20 "$dir/dockerd.log" >&2; exit 1; }
    sleep 0.5
  done
fi
DOCKER_HOST=$sock sh "$(dirname "$0")/../scripts/docker_base.sh" "$image" "$dir" >/dev/null
DOCKER_HOST=$sock OPENFORGE_DOCKER_IMAGE=$image "$@"
