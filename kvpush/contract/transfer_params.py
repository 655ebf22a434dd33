"""The contract between the router and the connectors: what a request carries in
vLLM's ``kv_transfer_params`` under the key ``"kvpush"``.

The router reserves decode blocks, then sends the request to the prefill engine
with ``role="prefill"`` (and ``max_tokens=1``): its connector pushes the prompt's KV
into the reservation. The decode engine gets ``role="decode"``: its connector waits
for the reservation to land and loads it instead of recomputing the prompt. On the
router's first-token path decode's prompt is the prompt plus the prefill engine's
sampled token, so the whole reserved prompt is loaded and decode computes one token;
on its push path decode gets the same prompt and computes the last prompt token
itself. Without these params a request is served normally (aggregated).
"""

from __future__ import annotations

import dataclasses

from kvpush.contract.states import ROLES
from kvpush.contract.target import PushTarget

KEY = "kvpush"


class TransferParamsError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class PushParams:
    """A role and the reservation it works on: a ``PushTarget``, not a shape of its own.
    On the wire (``to_dict``, JSON inside vLLM's ``kv_transfer_params``) the target's
    fields are flat beside ``role``, as the router has always sent them."""

    role: str  # "prefill" or "decode"
    target: PushTarget

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise TransferParamsError(f"kvpush.role must be one of {ROLES}, got {self.role!r}")
        problem = self.target.problem()
        if problem:
            raise TransferParamsError(f"kvpush: {problem}")

    def to_dict(self) -> dict:
        t = self.target
        return {"role": self.role, "reservation_id": t.reservation_id, "engine_id": t.engine_id,
                "engine_incarnation": t.incarnation, "nixl_agent": t.nixl_agent, "block_ids": list(t.block_ids),
                "block_size": t.block_size, "num_tokens": t.num_tokens, "deadline_unix_ms": t.deadline_unix_ms,
                **({"tp_size": t.tp_size} if t.tp_size != 1 else {}),
                **({"first_token": t.first_token} if t.first_token else {}),
                **({"prefill_incarnation": t.prefill_incarnation} if t.prefill_incarnation else {})}

    def as_kv_transfer_params(self) -> dict:
        return {KEY: self.to_dict()}

    def for_role(self, role: str) -> "PushParams":
        return dataclasses.replace(self, role=role)

    @classmethod
    def from_dict(cls, data: dict) -> "PushParams":
        if not isinstance(data, dict):
            raise TransferParamsError("kvpush transfer params must be an object")
        unknown = set(data) - _WIRE_FIELDS
        if unknown:
            raise TransferParamsError(f"kvpush transfer params have unknown fields {sorted(unknown)}")
        missing = (_WIRE_FIELDS - _OPTIONAL_FIELDS) - set(data)
        if missing:
            raise TransferParamsError(f"kvpush transfer params lack {sorted(missing)}")
        wrong = [name for name in (*_TEXT_FIELDS, "prefill_incarnation") if not isinstance(data.get(name, ""), str)]
        if wrong:
            raise TransferParamsError(f"kvpush transfer params: {', '.join(wrong)} must be strings")
        try:
            target = PushTarget(data["reservation_id"], data["engine_id"], data["engine_incarnation"],
                                tuple(int(b) for b in data["block_ids"]), int(data["block_size"]),
                                int(data["num_tokens"]), data["nixl_agent"], int(data.get("deadline_unix_ms", 0)),
                                int(data.get("tp_size", 1)), int(data.get("first_token", 0)),
                                data.get("prefill_incarnation", ""))
        except (TypeError, ValueError) as exc:
            raise TransferParamsError(f"kvpush transfer params: {exc}") from None
        return cls(data["role"], target)

    @classmethod
    def from_request(cls, kv_transfer_params: dict | None) -> "PushParams | None":
        """The params of a request, or None when it carries none (serve it normally)."""
        if not kv_transfer_params or KEY not in kv_transfer_params:
            return None
        return cls.from_dict(kv_transfer_params[KEY])

    @classmethod
    def from_reservation(cls, res, role: str) -> "PushParams":
        """From a kvpush.v1.Reservation message."""
        return cls(role, PushTarget.from_proto(res))


_OPTIONAL_FIELDS = {"deadline_unix_ms", "tp_size", "first_token", "prefill_incarnation"}
_WIRE_FIELDS = {"role", "reservation_id", "engine_id", "engine_incarnation", "nixl_agent", "block_ids", "block_size",
                "num_tokens"} | _OPTIONAL_FIELDS
_TEXT_FIELDS = ("role", "reservation_id", "engine_id", "engine_incarnation", "nixl_agent")


@dataclasses.dataclass(frozen=True)
class AwaitParams:
    """A prefill request sent before its Reserve answered: ``{"kvpush": {"role": "prefill",
    "await": {"request_id", "wait_ms"}}}``. The router reserved under ``request_id``
    naming this prefill engine, so the engine's sidecar hears the reservation through
    its watch; the connector holds the request ("not yet") until it has, and computes
    it without a push if nothing came within ``wait_ms``. The request id is the
    handover's key: the router's are 128 random bits, never shown to other tenants."""

    request_id: str
    wait_ms: int

    def __post_init__(self) -> None:
        if not self.request_id or len(self.request_id) > 256:
            raise TransferParamsError("kvpush.await.request_id must be 1..256 characters")
        if not 0 < self.wait_ms <= 60_000:
            raise TransferParamsError("kvpush.await.wait_ms must be in 1..60000")

    def as_kv_transfer_params(self) -> dict:
        return {KEY: {"role": "prefill", "await": {"request_id": self.request_id, "wait_ms": self.wait_ms}}}

    @classmethod
    def from_request(cls, kv_transfer_params: dict | None) -> "AwaitParams | None":
        spec = _nested(kv_transfer_params, "await", "prefill", ("request_id", "wait_ms"))
        if spec is None:
            return None
        try:
            return cls(str(spec["request_id"]), int(spec["wait_ms"]))
        except (TypeError, ValueError) as exc:
            raise TransferParamsError(f"kvpush.await: {exc}") from None


@dataclasses.dataclass(frozen=True)
class AloneParams:
    """A decode request the router sent before its Reserve answered, guessing that this
    engine holds all but a short rest of the prompt: ``{"kvpush": {"role": "decode",
    "alone": {"min_cached_tokens", "hold_ms"}}}``. If the engine's own prefix cache holds
    at least ``min_cached_tokens`` of the prompt the connector lets it compute the rest at
    once; otherwise it holds the request ("not yet", nothing computed) for the router to
    take back once the Reserve has answered otherwise, and computes it after ``hold_ms``
    if nobody did."""

    min_cached_tokens: int
    hold_ms: int

    def __post_init__(self) -> None:
        if self.min_cached_tokens < 1:
            raise TransferParamsError("kvpush.alone.min_cached_tokens must be at least 1")
        if not 0 < self.hold_ms <= 60_000:
            raise TransferParamsError("kvpush.alone.hold_ms must be in 1..60000")

    def as_kv_transfer_params(self) -> dict:
        return {KEY: {"role": "decode", "alone": {"min_cached_tokens": self.min_cached_tokens,
                                                  "hold_ms": self.hold_ms}}}

    @classmethod
    def from_request(cls, kv_transfer_params: dict | None) -> "AloneParams | None":
        spec = _nested(kv_transfer_params, "alone", "decode", ("min_cached_tokens", "hold_ms"))
        if spec is None:
            return None
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in spec.values()):
            raise TransferParamsError("kvpush.alone: min_cached_tokens and hold_ms must be integers")
        return cls(spec["min_cached_tokens"], spec["hold_ms"])


def _nested(kv_transfer_params: dict | None, name: str, role: str, fields: tuple[str, ...]) -> dict | None:
    """The object ``{"kvpush": {"role": role, name: {fields...}}}`` of a request holds under
    ``name``; None when it has no ``name``; refused when anything else is beside it or in it."""
    data = (kv_transfer_params or {}).get(KEY)
    if not isinstance(data, dict) or name not in data:
        return None
    if data.get("role") != role or set(data) != {"role", name}:
        raise TransferParamsError(f"kvpush.{name} goes with role {role!r} and nothing else")
    spec = data[name]
    if not isinstance(spec, dict) or set(spec) != set(fields):
        raise TransferParamsError(f"kvpush.{name} must be {{{', '.join(fields)}}}")
    return spec


def push_report(reservation_id: str, pushed: bool) -> dict:
    """What the prefill engine's answer carries back (vLLM returns it as the response's
    ``kv_transfer_params``): whether every reserved token was handed to the push."""
    return {KEY: {"reservation_id": reservation_id, "pushed": pushed}}


def read_push_report(kv_transfer_params) -> tuple[str, bool] | None:
    data = (kv_transfer_params or {}).get(KEY) if isinstance(kv_transfer_params, dict) else None
    if not isinstance(data, dict) or "pushed" not in data:
        return None
    return str(data.get("reservation_id", "")), bool(data["pushed"])
