"""The reservation lifecycle as data: the legal moves between its states
(``kvpush.contract.states.State``, the proto's enum).

``kvpush.controlplane.lifecycle`` is the only module that *performs* transitions (by
compare-and-swap in etcd); this one only says which are legal, so it can be
tested exhaustively without etcd.

    RESERVED -> PUSHING -> LANDED -> CONSUMED
    RESERVED -> LANDED            (the decode report can overtake the prefill one)
    live     -> RELEASED | EXPIRED | FAILED
"""

from __future__ import annotations

import enum

from kvpush.contract.states import ENDED_BY_CONTROL_PLANE as _ENDINGS, State

LEGAL: dict[State, frozenset[State]] = {
    State.RESERVED: frozenset({State.PUSHING, State.LANDED} | _ENDINGS),
    State.PUSHING: frozenset({State.LANDED} | _ENDINGS),
    State.LANDED: frozenset({State.CONSUMED} | _ENDINGS),
    State.CONSUMED: frozenset(),
    State.RELEASED: frozenset(),
    State.EXPIRED: frozenset(),
    State.FAILED: frozenset(),
}

# Progress order of the live states: a report that is behind the current state
# (PUSHING arriving after LANDED) is stale and changes nothing.
_PROGRESS = {State.RESERVED: 0, State.PUSHING: 1, State.LANDED: 2}


class IllegalTransition(Exception):
    def __init__(self, current: State, target: State) -> None:
        super().__init__(f"reservation is {current.name}; it cannot become {target.name}")
        self.current = current
        self.target = target


class Move(enum.Enum):
    APPLY = "apply"   # write the new state
    STALE = "stale"   # already there or past it: nothing to write


def decide(current: State, target: State) -> Move:
    """What moving ``current`` to ``target`` means; raises IllegalTransition."""
    if target in LEGAL[current]:
        return Move.APPLY
    if current == target and current.live:
        return Move.STALE
    if current.live and target.live and _PROGRESS[target] < _PROGRESS[current]:
        return Move.STALE
    raise IllegalTransition(current, target)
