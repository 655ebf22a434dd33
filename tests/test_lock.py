"""requirements/base.txt is the services' lock: the services image installs it with
--no-deps, so a distribution it misses is missing there (before this test, jinja2 for
the router's chat templates, pyzmq for the sidecar's KV events and cbor2 for engines
hashing blocks with it were missing, though the dev venv had them through vLLM). It must
be this venv's closure of kvpush[all], every version the one the tests run with."""

from __future__ import annotations

import subprocess
import sys

from tests.test_packaging import ROOT


def test_the_lock_is_the_closure_of_kvpush_all_this_venv_runs():
    done = subprocess.run([sys.executable, "scripts/lock.py", "--check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    pinned = {line.split("==")[0] for line in (ROOT / "requirements" / "base.txt").read_text().splitlines()
              if line and not line.startswith("#")}
    # What the services import only on some paths (so an import of the package does not show it).
    assert {"jinja2", "pyzmq", "cbor2", "transformers", "tokenizers", "grpcio-tools"} <= pinned, pinned
