"""Every state vocabulary of kvpush, in one place.

* ``State``: the reservation lifecycle. It *is* the proto enum
  ``kvpush.v1.ReservationState`` (the members are built from the generated
  descriptor, so a state added to the proto appears here and nothing can drift);
  the control plane moves it (``kvpush/controlplane/lifecycle.py``), everything else reads it.
* ``PushState``: one push as the prefill sidecar runs it (local, never stored).
* ``LandingState``: one reservation as the decode sidecar sees it land (local);
  the decode connector reads it from the channel's events.
* ``reported``: the one mapping from those two local vocabularies to the lifecycle,
  i.e. which local outcome the sidecar reports to the control plane as what.
* Engine roles: ``PREFILL``/``DECODE`` as strings (CLI, channel, transfer params)
  and ``role_to_proto``/``role_from_proto`` at the proto edge.
"""

from __future__ import annotations

import enum

from kvpush.contract.v1 import types_pb2


class _Lifecycle(enum.IntEnum):
    @property
    def live(self) -> bool:
        return self in LIVE

    @property
    def terminal(self) -> bool:
        return not self.live


# The proto's values, less its UNSPECIFIED zero (never a state a reservation is in).
State = _Lifecycle("State", [(name, value) for name, value in types_pb2.ReservationState.items() if value],
                   module=__name__)

LIVE = frozenset({State.RESERVED, State.PUSHING, State.LANDED})
# Live and waiting for its pusher's bytes: the prefill engine's death ends these.
UNLANDED = frozenset({State.RESERVED, State.PUSHING})
TERMINAL = frozenset(State) - LIVE
# Ends the control plane decides (a release, the deadline, a dead engine), as opposed
# to CONSUMED, which the decode side reports.
ENDED_BY_CONTROL_PLANE = frozenset({State.RELEASED, State.EXPIRED, State.FAILED})


class PushState(str, enum.Enum):
    RESOLVING = "RESOLVING"  # waiting for the peer's record
    PUSHING = "PUSHING"
    FINALIZING = "FINALIZING"  # every piece posted; final write pending or in flight
    PUSHED = "PUSHED"  # terminal: LANDED notification delivered with the last write
    FAILED = "FAILED"  # terminal
    CANCELLED = "CANCELLED"  # terminal: cancelled locally or aborted by the engine

    @property
    def terminal(self) -> bool:
        return self in (PushState.PUSHED, PushState.FAILED, PushState.CANCELLED)


class LandingState(str, enum.Enum):
    UNKNOWN = "UNKNOWN"  # nothing heard of this reservation (yet)
    EXPECTED = "EXPECTED"  # the local engine is waiting for it
    PUSHING = "PUSHING"  # a pusher announced it
    LANDED = "LANDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    CONSUMED = "CONSUMED"

    @property
    def terminal(self) -> bool:
        """No more notifications change it (LANDED still moves, by consume or cancel)."""
        return self in (LandingState.LANDED, LandingState.FAILED, LandingState.CANCELLED, LandingState.CONSUMED)

    @property
    def ended(self) -> bool:
        """Its landing blocks hold nothing the engine may still load."""
        return self in (LandingState.FAILED, LandingState.CANCELLED, LandingState.CONSUMED)


# What the sidecar reports to the control plane for a local state. A push ends in LANDED
# on the decode side, which reports it; a prefill reports only its failures (a cancelled
# push that the control plane did not end itself is a failure too). Two tables, because
# the two enums share values ("FAILED" == "FAILED"), so one dict would merge their keys.
_PUSH_REPORTS = {PushState.FAILED: State.FAILED, PushState.CANCELLED: State.FAILED}
_LANDING_REPORTS = {LandingState.LANDED: State.LANDED, LandingState.CONSUMED: State.CONSUMED,
                    LandingState.FAILED: State.FAILED}


def reported(state: PushState | LandingState) -> State | None:
    """The lifecycle state a sidecar reports for a local one; None: nothing to report."""
    return (_PUSH_REPORTS if isinstance(state, PushState) else _LANDING_REPORTS).get(state)

PREFILL, DECODE = "prefill", "decode"
ROLES = (PREFILL, DECODE)
_ROLE_PROTO = {PREFILL: types_pb2.PREFILL, DECODE: types_pb2.DECODE}


def role_to_proto(role: str) -> int:
    try:
        return _ROLE_PROTO[role]
    except KeyError:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}") from None


def role_from_proto(value: int) -> str:
    for name, number in _ROLE_PROTO.items():
        if number == value:
            return name
    raise ValueError(f"engine role {value} is neither PREFILL nor DECODE")
