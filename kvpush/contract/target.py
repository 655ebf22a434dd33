"""``PushTarget``: where one request's KV goes, the one shape of it inside kvpush.

It is the part of a reservation (``kvpush.v1.Reservation``) that moving bytes needs:
which decode engine and which life of it, its landing blocks in token order, their
size, and how many tokens. The router hands it to the engines inside ``PushParams``
(vLLM's ``kv_transfer_params``), the prefill connector sends it to its sidecar in BEGIN,
the pusher writes to it, the decode connector loads from it. The control plane's
``ReservationRecord`` is the stored reservation (tenant, state, deadline lease) and is
converted to the proto once, at its service edge.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PushTarget:
    reservation_id: str
    engine_id: str  # the decode engine holding the blocks
    incarnation: str  # the life of that engine the blocks belong to
    block_ids: tuple[int, ...]  # landing blocks, token order
    block_size: int  # tokens per landing block
    num_tokens: int  # tokens reserved (and pushed): prompt tokens [first_token, first_token + num_tokens)
    nixl_agent: str = ""  # the decode sidecar's NIXL agent (informational: peers are resolved by engine)
    deadline_unix_ms: int = 0
    tp_size: int = 1  # the decode engine's tensor-parallel ranks: the head plan's other half
    # The prompt token the landing's first token is: the decode engine held the ones before
    # it in its prefix cache when it was chosen (KV-aware routing; 0: the whole prompt).
    # Sidecars never see it: to them a push is num_tokens tokens from 0.
    first_token: int = 0
    # The life of the prefill engine named to push it ("" when none was named): the control
    # plane fails the reservation when that life ends, so a later life must not begin it.
    prefill_incarnation: str = ""

    @property
    def end_token(self) -> int:
        """The prompt token after the last one reserved."""
        return self.first_token + self.num_tokens

    @classmethod
    def from_proto(cls, reservation) -> "PushTarget":
        """From a ``kvpush.v1.Reservation``."""
        return cls(reservation.id, reservation.engine_id, reservation.engine_incarnation,
                   tuple(reservation.block_ids), reservation.block_size,
                   reservation.num_tokens - reservation.cached_tokens, reservation.nixl_agent,
                   reservation.deadline_unix_ms, reservation.decode_tp_size or 1, reservation.cached_tokens,
                   reservation.prefill_engine_incarnation)

    def problem(self) -> str:
        """What makes this target unusable before any byte moves ("" if nothing)."""
        if not self.reservation_id or not self.engine_id:
            return "reservation_id and engine_id are required"
        if self.block_size <= 0 or self.num_tokens <= 0:
            return "block_size and num_tokens must be positive"
        if not 1 <= self.tp_size <= 64:
            return f"tp_size must be in [1, 64], got {self.tp_size}"
        if self.first_token < 0 or self.first_token % self.block_size:
            return f"first_token {self.first_token} is not a multiple of block_size {self.block_size}"
        if len(self.block_ids) * self.block_size < self.num_tokens:
            return f"{len(self.block_ids)} blocks of {self.block_size} cannot hold {self.num_tokens} tokens"
        return ""
