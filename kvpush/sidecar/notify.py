"""The NIXL notifications a prefill sidecar sends to a decode sidecar.

Four kinds, all naming a reservation and the decode engine's incarnation:

* ``BEGIN``: sent (standalone) when the first write of a reservation is
  posted. It is a hint: the decode sidecar polls hot until the reservation
  ends, because on this transport the writes themselves only complete while
  the target progresses.
* ``FINAL``: sent (standalone) just before the final write is posted, with
  the pusher's estimate of how long that write takes (``eta_s``). Also a
  hint: the decode sidecar polls *fine* from a little before that estimate
  until the LANDED notification arrives, so seeing it costs a fraction of a
  millisecond, not half a hot period, without polling fine the whole push.
* ``LANDED``: carried by the *final* write, which is posted only after every
  earlier write of the reservation is DONE, so it is delivered after all
  bytes. It restates the block ids, block size and token count (the decode
  side checks them against its pool), the prefill engine's tensor-parallel
  ranks (with its own layout, how the decode side knows where each head landed:
  ``kvpush/channel/head_plan.py``) and, in checksum mode, one CRC32 per block.
* ``ABORT``: best effort, when a push fails or is cancelled, so a waiting
  decode connector learns it before the control plane's deadline.

Encoding: ``b"KVP1"`` + kind letter + compact JSON. A notification is one per
request, not per layer, so JSON costs nothing that matters; block ids travel
as runs ``[[first, count], ...]`` (a reservation is usually a few runs).
"""

from __future__ import annotations

import dataclasses
import json

MAGIC = b"KVP1"
BEGIN, FINAL, LANDED, ABORT = "B", "F", "L", "A"


class NotifError(ValueError):
    """A notification that is not ours or is malformed."""


@dataclasses.dataclass(frozen=True)
class PushNotice:
    """One notification. A LANDED notice repeats the target's blocks, block size and
    token count: the decode sidecar checks them against its own pool before it says
    LANDED, without having to trust (or have heard of) the reservation."""

    kind: str
    reservation_id: str
    incarnation: str
    block_ids: tuple[int, ...] = ()
    block_size: int = 0
    num_tokens: int = 0
    checksums: tuple[int, ...] | None = None
    reason: str = ""
    eta_s: float = 0.0  # FINAL: the pusher's estimate of its final write's duration
    src_tp: int = 1  # LANDED: the prefill engine's tensor-parallel ranks


def _runs(ids) -> list[list[int]]:
    runs: list[list[int]] = []
    for b in ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1][1] += 1
        else:
            runs.append([int(b), 1])
    return runs


def encode(notice: PushNotice) -> bytes:
    body: dict = {"r": notice.reservation_id, "i": notice.incarnation}
    if notice.kind == LANDED:
        body.update(b=_runs(notice.block_ids), s=notice.block_size, t=notice.num_tokens)
        if notice.checksums is not None:
            body["c"] = list(notice.checksums)
        if notice.src_tp != 1:
            body["p"] = notice.src_tp
    elif notice.kind == ABORT:
        body["why"] = notice.reason[:500]
    elif notice.kind == FINAL:
        body["eta"] = round(notice.eta_s * 1e6)  # microseconds
    elif notice.kind != BEGIN:
        raise NotifError(f"unknown notification kind {notice.kind!r}")
    return MAGIC + notice.kind.encode() + json.dumps(body, separators=(",", ":")).encode()


def decode(message: bytes) -> PushNotice:
    if not message.startswith(MAGIC) or len(message) < len(MAGIC) + 2:
        raise NotifError("not a kvpush notification")
    kind = chr(message[len(MAGIC)])
    try:
        body = json.loads(message[len(MAGIC) + 1:])
        rid, inc = str(body["r"]), str(body["i"])
        if kind == BEGIN:
            return PushNotice(BEGIN, rid, inc)
        if kind == FINAL:
            return PushNotice(FINAL, rid, inc, eta_s=max(0.0, min(float(body.get("eta", 0)) / 1e6, 10.0)))
        if kind == ABORT:
            return PushNotice(ABORT, rid, inc, reason=str(body.get("why", "")))
        if kind == LANDED:
            ids = tuple(first + k for first, count in body["b"] for k in range(int(count)))
            sums = tuple(int(c) for c in body["c"]) if "c" in body else None
            src_tp = int(body.get("p", 1))
            if not 1 <= src_tp <= 64:
                raise ValueError(f"src_tp {src_tp} outside [1, 64]")
            return PushNotice(LANDED, rid, inc, ids, int(body["s"]), int(body["t"]), sums, src_tp=src_tp)
    except (KeyError, TypeError, ValueError) as exc:
        raise NotifError(f"malformed {kind!r} notification: {exc}") from exc
    raise NotifError(f"unknown notification kind {kind!r}")
