#!/usr/bin/env bash
# Set up (first run only) and run the demo: embedded etcd, control plane, engines,
# a few requests, a summary; everything is shut down at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/kvpush demo "$@"
