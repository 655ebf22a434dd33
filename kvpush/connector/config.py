"""The connector's settings: ``kv_transfer_config.kv_connector_extra_config``.

    {"sidecar_socket": "/run/kvpush/P1.sock",   # required: the local sidecar's channel
     "stats_dir": "/var/lib/kvpush/stats",      # optional: counters as <engine>.json
     "engine_name": "P1",                        # optional: the stats file's name (default: sidecar's engine id)
     "load_timeout_s": 30,                       # decode: longest wait for a landing
     "deadline_grace_s": 0.5,                    # decode: wait this long past the reservation's deadline
     "connect_timeout_s": 60,                    # wait this long for the sidecar at engine start
     "channel_timeout_s": 5,                     # replies on the channel (hello, begin, subscribe, consumed)
     "idle_wait_s": 0.005}                       # decode: an idle engine waits this long for a landing

Unknown keys are refused, so a typo is an error at start-up rather than a
silently ignored setting.
"""

from __future__ import annotations

import dataclasses


class ConfigError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class ConnectorConfig:
    sidecar_socket: str
    stats_dir: str = ""
    engine_name: str = ""
    load_timeout_s: float = 30.0
    deadline_grace_s: float = 0.5
    connect_timeout_s: float = 60.0
    channel_timeout_s: float = 5.0
    # Decode, an engine whose last step ran nothing while requests wait for their KV:
    # the scheduler blocks this long for a landing instead of letting the engine spin
    # through empty steps. It bounds how late a request that arrives meanwhile is scheduled.
    idle_wait_s: float = 0.005

    def __post_init__(self) -> None:
        if not self.sidecar_socket:
            raise ConfigError("kv_connector_extra_config.sidecar_socket is required")
        for name in ("load_timeout_s", "connect_timeout_s", "channel_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"kv_connector_extra_config.{name} must be positive")
        for name in ("deadline_grace_s", "idle_wait_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"kv_connector_extra_config.{name} must not be negative")
        if self.idle_wait_s > 0.1:
            raise ConfigError("kv_connector_extra_config.idle_wait_s must be at most 0.1 (it delays new requests)")

    @classmethod
    def from_extra(cls, extra: dict | None) -> ConnectorConfig:
        extra = dict(extra or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config has unknown keys {unknown}; known: {sorted(known)}")
        if not extra.get("sidecar_socket"):
            raise ConfigError("kv_connector_extra_config.sidecar_socket is required")
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in extra:
                values[f.name] = float(extra[f.name]) if f.type in ("float", float) else str(extra[f.name])
        return cls(**values)
