#!/usr/bin/env bash
# Set up kvpush in ./.venv: pinned dependencies, NIXL (without its torch/CUDA
# dependencies), the generated gRPC stubs and the `kvpush` command. Idempotent.
#
#   scripts/setup.sh                 # control plane, sidecar, router, tests
#   PYTHON=python3.11 scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${KVPUSH_VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
stamp="$VENV/.kvpush-deps-$(cat requirements/*.txt | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "==> installing dependencies (requirements/*.txt)"
  $PIP install -q -r requirements/base.txt -r requirements/dev.txt
  # nixl's meta package would pull torch + CUDA (~6 GB); the cu12 build runs on CPU too.
  $PIP install -q --no-deps -r requirements/nixl.txt
  rm -f "$VENV"/.kvpush-deps-*
  touch "$stamp"
fi
echo "==> generating gRPC stubs from proto/"
"$VENV/bin/python" -m kvpush.protogen
if [ ! -x "$VENV/bin/kvpush" ]; then
  $PIP install -q --no-deps -e .
fi
echo "==> ready: $VENV/bin/kvpush"
