#!/bin/sh
# Makes IMAGE, a Debian base image (bookworm minbase with python3, from Debian's packages by debootstrap,
# then `docker import`), in the Docker engine the docker CLI reaches ($DOCKER_HOST, else the local
# socket). No image registry is needed: it is the FROM of examples/harbor/images and the default
# --image of the container backends. The root file system is kept in STATE_DIR for the next time.
# Usage: scripts/docker_base.sh IMAGE STATE_DIR   (as root; installs debootstrap where missing)
set -eu
image=$1 dir=$2
docker version >/dev/null || { echo "no Docker engine reachable (start dockerd, or set DOCKER_HOST)" >&2; exit 1; }
docker image inspect "$image" >/dev/null 2>&1 && exit 0
if ! command -v debootstrap >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi
mkdir -p "$dir"
[ -x "$dir/rootfs/usr/bin/python3" ] || {
  rm -rf "$dir/rootfs"
  debootstrap --variant=minbase --include=python3 bookworm "$dir/rootfs" >"$dir/debootstrap.log"
}
tar -C "$dir/rootfs" -c . | docker import - "$image" >/dev/null
echo "made $image"
