"""Counters files: what readers outside the engine see must be the latest counts."""

from __future__ import annotations

import threading

import pytest

from kvpush.connector.config import ConfigError, ConnectorConfig
from kvpush.connector.stats import Counters, read_counters


def test_concurrent_flushes_never_leave_an_older_snapshot(tmp_path):
    path = str(tmp_path / "e.json")
    counters = Counters(path, {"engine_id": "e"})

    def work(name):
        for _ in range(300):
            counters.inc(name)
            counters.flush()

    threads = [threading.Thread(target=work, args=(f"c{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert read_counters(path) == counters.snapshot() == {f"c{i}": 300 for i in range(4)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.json"]  # no temporary files left


def test_config_refuses_unknown_and_bad_settings():
    assert ConnectorConfig.from_extra({"sidecar_socket": "/s", "load_timeout_s": "2.5"}).load_timeout_s == 2.5
    with pytest.raises(ConfigError, match="unknown keys"):
        ConnectorConfig.from_extra({"sidecar_socket": "/s", "load_timeout": 3})
    with pytest.raises(ConfigError, match="sidecar_socket"):
        ConnectorConfig.from_extra({})
    with pytest.raises(ConfigError, match="positive"):
        ConnectorConfig.from_extra({"sidecar_socket": "/s", "load_timeout_s": 0})
    assert ConnectorConfig.from_extra({"sidecar_socket": "/s", "idle_wait_s": 0}).idle_wait_s == 0  # off
    for bad, why in ((-0.001, "must not be negative"), (0.5, "must be at most 0.1")):
        with pytest.raises(ConfigError, match=f"idle_wait_s {why}"):
            ConnectorConfig.from_extra({"sidecar_socket": "/s", "idle_wait_s": bad})
