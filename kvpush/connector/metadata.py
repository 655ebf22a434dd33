"""What the scheduler side tells the worker side each engine step.

Plain dataclasses (picklable: with a multi-process executor the metadata
crosses a process boundary inside ``SchedulerOutput``).
"""

from __future__ import annotations

import dataclasses

from kvpush.contract.target import PushTarget
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclasses.dataclass(frozen=True)
class PushSpec:
    """Prefill: push tokens ``[start, end)`` of every layer computed in this step."""

    req_id: str
    block_ids: tuple[int, ...]  # the request's vLLM blocks, token order
    start: int
    end: int
    final: bool  # ``end`` is the last token of the reservation: END after the last layer
    begin: PushTarget | None = None  # set on the request's first piece: BEGIN before staging


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    """Decode: tokens ``[start, end)`` of the request have LANDED in a reservation's
    landing blocks; copy them into ``block_ids`` (the request's vLLM blocks) before
    this step's forward pass, then CONSUMED."""

    req_id: str
    target: PushTarget  # the reservation: its landing blocks hold the tokens
    block_ids: tuple[int, ...]
    start: int
    end: int
    src_tp: int = 1  # the prefill engine's TP (the LANDED event's): where each head landed


@dataclasses.dataclass
class KVPushConnectorMetadata(KVConnectorMetadata):
    pushes: list[PushSpec] = dataclasses.field(default_factory=list)
    push_aborts: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (req_id, reason)
    loads: list[LoadSpec] = dataclasses.field(default_factory=list)  # synchronous: before this forward
    counts: dict[str, int] = dataclasses.field(default_factory=dict)  # scheduler-side counter increments
    maxima: dict[str, int] = dataclasses.field(default_factory=dict)  # scheduler-side running maxima
    scheduled_tokens: int = -1  # tokens the step runs (-1: not known)

    def empty(self) -> bool:
        return not (self.pushes or self.push_aborts or self.loads or self.counts or self.maxima)
