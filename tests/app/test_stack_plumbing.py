"""The local stack's own plumbing, without vLLM (``StackSpec(engines=False)``): etcd, a
control plane and real ``kvpush sidecar`` processes. Each sidecar serves Prometheus on a
port of its own, ``kvpush status`` shows its engine unavailable and why, and the stack's
stop removes the pools a sidecar killed with -9 left in /dev/shm."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from kvpush.app.cli import main as kvpush
from kvpush.app.stack import Stack, StackSpec
from kvpush.channel.memory import SHM_DIR, SegmentName

pytestmark = pytest.mark.timeout(120)


def pools_of(pids: set[int]) -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if (name := SegmentName.parse(n)) and name.owner.pid in pids}


@pytest.fixture
def spec(tmp_path) -> StackSpec:
    model = tmp_path / "model"
    model.mkdir()  # the stack reads the KV layout from the model's config alone
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                                   "num_key_value_heads": 2, "hidden_size": 64}))
    return StackSpec(model_dir=str(model), log_dir=str(tmp_path / "logs"), engines=False, decode_blocks=16,
                     staging_units=16)


def test_sidecars_are_scraped_shown_unavailable_and_leave_no_pool_once_stopped(spec, capsys):
    stack = Stack(spec).start()
    try:
        assert sorted(stack.sidecars) == ["decode-0", "prefill-0"]
        assert len({s.metrics_port for s in stack.sidecars.values()}) == 2
        for sidecar in stack.sidecars.values():
            text = urllib.request.urlopen(sidecar.metrics_url, timeout=5).read().decode()
            assert "kvpush_sidecar_registered 1.0" in text and "kvpush_sidecar_engine_available 0.0" in text

        capsys.readouterr()
        kvpush(["status", "--controlplane", stack.controlplane, "--token", stack.admin_token])
        rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line}
        assert rows["engine"].endswith("available")
        assert rows["decode-0"].endswith("no: engine not connected yet"), rows
        assert rows["prefill-0"].endswith("no: engine not connected yet"), rows

        victim = stack.live(stack.sidecars["decode-0"].process)
        left = pools_of({victim.pid})
        assert left
        victim.kill()  # SIGKILL: it removes nothing
        assert pools_of({victim.pid}) == left
        pids = {p.pid for p in stack.procs if p.name.startswith("sidecar-")}
    finally:
        stack.stop()
    assert not pools_of(pids)
