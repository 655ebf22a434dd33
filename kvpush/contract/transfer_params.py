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

KEY = "kvpush"
ROLES = ("prefill", "decode")


class TransferParamsError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class PushParams:
    role: str                      # "prefill" or "decode"
    reservation_id: str
    engine_id: str                 # the decode engine holding the blocks
    engine_incarnation: str
    nixl_agent: str                # the decode sidecar's NIXL agent
    block_ids: tuple[int, ...]     # landing block ids, in token order
    block_size: int                # tokens per landing block
    num_tokens: int                # prompt tokens reserved for
    deadline_unix_ms: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise TransferParamsError(f"kvpush.role must be one of {ROLES}, got {self.role!r}")
        if not self.reservation_id or not self.engine_id:
            raise TransferParamsError("kvpush.reservation_id and kvpush.engine_id are required")
        if self.block_size <= 0 or self.num_tokens <= 0:
            raise TransferParamsError("kvpush.block_size and kvpush.num_tokens must be positive")
        if len(self.block_ids) * self.block_size < self.num_tokens:
            raise TransferParamsError(f"kvpush.block_ids: {len(self.block_ids)} blocks of {self.block_size} "
                                      f"cannot hold {self.num_tokens} tokens")

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["block_ids"] = list(self.block_ids)
        return data

    def as_kv_transfer_params(self) -> dict:
        return {KEY: self.to_dict()}

    def for_role(self, role: str) -> "PushParams":
        return dataclasses.replace(self, role=role)

    @classmethod
    def from_dict(cls, data: dict) -> "PushParams":
        if not isinstance(data, dict):
            raise TransferParamsError("kvpush transfer params must be an object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise TransferParamsError(f"kvpush transfer params have unknown fields {sorted(unknown)}")
        try:
            values = dict(data)
            values["block_ids"] = tuple(int(b) for b in data.get("block_ids", ()))
            for name in ("block_size", "num_tokens", "deadline_unix_ms"):
                if name in values:
                    values[name] = int(values[name])
            return cls(**values)
        except TypeError as exc:
            raise TransferParamsError(f"kvpush transfer params: {exc}") from None

    @classmethod
    def from_request(cls, kv_transfer_params: dict | None) -> "PushParams | None":
        """The params of a request, or None when it carries none (serve it normally)."""
        if not kv_transfer_params or KEY not in kv_transfer_params:
            return None
        return cls.from_dict(kv_transfer_params[KEY])

    @classmethod
    def from_reservation(cls, res, role: str) -> "PushParams":
        """From a kvpush.v1.Reservation message."""
        return cls(role=role, reservation_id=res.id, engine_id=res.engine_id,
                   engine_incarnation=res.engine_incarnation, nixl_agent=res.nixl_agent,
                   block_ids=tuple(res.block_ids), block_size=res.block_size, num_tokens=res.num_tokens,
                   deadline_unix_ms=res.deadline_unix_ms)


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
        data = (kv_transfer_params or {}).get(KEY)
        if not isinstance(data, dict) or "await" not in data:
            return None
        if data.get("role") != "prefill" or set(data) != {"role", "await"}:
            raise TransferParamsError("kvpush.await goes with role 'prefill' and nothing else")
        spec = data["await"]
        if not isinstance(spec, dict) or set(spec) != {"request_id", "wait_ms"}:
            raise TransferParamsError("kvpush.await must be {request_id, wait_ms}")
        try:
            return cls(str(spec["request_id"]), int(spec["wait_ms"]))
        except (TypeError, ValueError) as exc:
            raise TransferParamsError(f"kvpush.await: {exc}") from None


def push_report(reservation_id: str, pushed: bool) -> dict:
    """What the prefill engine's answer carries back (vLLM returns it as the response's
    ``kv_transfer_params``): whether every reserved token was handed to the push."""
    return {KEY: {"reservation_id": reservation_id, "pushed": pushed}}


def read_push_report(kv_transfer_params) -> tuple[str, bool] | None:
    data = (kv_transfer_params or {}).get(KEY) if isinstance(kv_transfer_params, dict) else None
    if not isinstance(data, dict) or "pushed" not in data:
        return None
    return str(data.get("reservation_id", "")), bool(data["pushed"])
