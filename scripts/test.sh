#!/usr/bin/env bash
# Run the whole test suite (sets everything up first; tests start their own etcd,
# control planes and sidecars on loopback). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
