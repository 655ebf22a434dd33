#!/usr/bin/env bash
# A/B of a change against an earlier commit, interleaved on this machine:
#     bench/ab_e2e.sh REV [ROUNDS] [e2e.py args...]     (default: 2 rounds, --configs kvpush --seq 12)
# Checks REV out in a temporary worktree (its stubs generated, the tiny model copied),
# then runs bench/e2e.py there and here in turn, ROUNDS times, and prints each run's
# table rows and the CPU each process used per request. Interleaving is what makes the two comparable on a shared VM, where
# back-to-back runs of the same code move by 20-50%.
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: bench/ab_e2e.sh REV [ROUNDS] [e2e.py args...]}
rounds=${2:-2}
shift $(( $# >= 2 ? 2 : 1 ))
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--configs kvpush --seq 12)
here=$(pwd)
there=$(mktemp -d)/ab-base
git worktree add -q "$there" "$rev"
trap 'git worktree remove --force "$there"; git worktree prune' EXIT
ln -s "$here/.venv" "$there/.venv"
mkdir -p "$there/.kvpush" && cp -r .kvpush/models "$there/.kvpush/"
gen=$( [ -f "$there/kvpush/contract/protogen.py" ] && echo kvpush.contract.protogen || echo kvpush.protogen )
(cd "$there" && PYTHONPATH="$there" .venv/bin/python -m "$gen" >/dev/null 2>&1)
for round in $(seq "$rounds"); do
  for side in base change; do
    dir=$([ $side = base ] && echo "$there" || echo "$here")
    echo "== round $round: $side ($(cd "$dir" && git rev-parse --short HEAD))"
    out=$(cd "$dir" && PYTHONPATH="$dir" .venv/bin/python bench/e2e.py "${args[@]}" 2>&1)
    grep '^| [a-z]' <<<"$out" | grep -v 'not selected'
    raw=$(grep -o 'raw results in [^;]*' <<<"$out" | awk '{print $4}')
    [ -n "$raw" ] && .venv/bin/python - "$raw" <<'PY'
import json, sys
for name, res in json.load(open(sys.argv[1])).items():
    if isinstance(res, dict) and res.get("cpu_s"):
        n = res.get("cpu_requests") or 1
        print(f"CPU ms/request, {name}: " + ", ".join(f"{p} {s * 1000 / n:.0f}" for p, s in res["cpu_s"].items()))
PY
  done
done
