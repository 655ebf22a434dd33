"""What a decode engine's prefix cache holds, as its sidecar reports it to the control plane.

The sidecar follows the engine's KV events (``kvpush/sidecar/kv_events.py``) and sends, at
most every report interval and only when something changed, one ``PrefixReport``:

* a **snapshot** (``seq == 0``): every block key the engine holds, starting a new
  ``epoch`` (at start, after the sidecar's view was cleared, and every so often so a
  control-plane replica that joined late, or lost its watch, catches up);
* a **delta** (``seq = n > 0``): keys stored and removed since report ``n - 1`` of
  the same epoch.

A reader applies a delta only on top of report ``seq - 1`` of its epoch; anything
else (a gap, a delta of an epoch it has no snapshot of) makes it forget the engine's
keys until the next snapshot: knowing less never routes wrong, knowing stale keys
does. Keys are 64-bit block keys (``kvpush/contract/block_hash.py``).

The report is stored in etcd as one value per engine, bound to the engine's lease
(it goes with the engine), in the compact binary form of ``encode``: a JSON header
line, then the stored and removed keys as little-endian uint64 arrays.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

# Per report, and what a sidecar keeps (its newest): 800 KB of keys, within etcd's default
# 1.5 MiB request limit and gRPC's 4 MiB message limit.
MAX_KEYS = 100_000


class PrefixReportError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class PrefixReport:
    engine_id: str
    incarnation: str
    epoch: int
    seq: int  # 0: a snapshot (``stored`` is everything held); n: the n-th delta of the epoch
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    block_size: int = 0  # tokens per block the keys were hashed over

    @property
    def snapshot(self) -> bool:
        return self.seq == 0

    def check(self) -> None:
        """``PrefixReportError`` naming the field that is wrong."""
        if not self.engine_id:
            raise PrefixReportError("engine_id is required")
        if not self.incarnation:
            raise PrefixReportError("incarnation is required")
        if self.epoch < 0 or self.seq < 0:
            raise PrefixReportError("epoch and seq must not be negative")
        if self.block_size <= 0:
            raise PrefixReportError("block_size must be positive")
        if len(self.stored) + len(self.removed) > MAX_KEYS:
            raise PrefixReportError(f"stored and removed hold {len(self.stored) + len(self.removed)} keys; "
                                    f"at most {MAX_KEYS} per report")
        if self.snapshot and self.removed:
            raise PrefixReportError("a snapshot (seq 0) removes nothing")

    # -- the RPC (ReportPrefixesRequest) --------------------------------------------------------
    @classmethod
    def from_proto(cls, msg) -> PrefixReport:
        return cls(msg.engine_id, msg.incarnation, msg.epoch, msg.seq, tuple(msg.stored), tuple(msg.removed),
                   msg.block_size)

    def to_proto(self):
        from kvpush.contract.v1 import registry_pb2
        return registry_pb2.ReportPrefixesRequest(engine_id=self.engine_id, incarnation=self.incarnation,
                                                  epoch=self.epoch, seq=self.seq, stored=self.stored,
                                                  removed=self.removed, block_size=self.block_size)

    # -- etcd value --------------------------------------------------------------------------
    def encode(self) -> bytes:
        head = json.dumps({"e": self.engine_id, "i": self.incarnation, "ep": self.epoch, "s": self.seq,
                           "n": len(self.stored), "r": len(self.removed), "b": self.block_size},
                          separators=(",", ":")).encode()
        return b"".join([head, b"\n", np.asarray(self.stored, dtype="<u8").tobytes(),
                         np.asarray(self.removed, dtype="<u8").tobytes()])

    @classmethod
    def decode(cls, data: bytes) -> PrefixReport:
        try:
            head_end = data.index(b"\n")
            head = json.loads(data[:head_end])
            body = np.frombuffer(data, dtype="<u8", offset=head_end + 1)
            n, r = int(head["n"]), int(head["r"])
            if len(body) != n + r:
                raise ValueError(f"{len(body)} keys for {n} stored and {r} removed")
            return cls(head["e"], head["i"], int(head["ep"]), int(head["s"]), tuple(body[:n].tolist()),
                       tuple(body[n:].tolist()), int(head["b"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise PrefixReportError(f"unreadable prefix report: {exc}") from exc
