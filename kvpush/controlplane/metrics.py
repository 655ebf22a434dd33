"""Prometheus metrics of the control plane (served on --metrics-port)."""

from __future__ import annotations

import gc
import time

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

RESERVE_LATENCY = Histogram("kvpush_reserve_latency_seconds", "Reserve RPC latency (server side)",
                            buckets=_LATENCY_BUCKETS)
RESERVE_RESULTS = Counter("kvpush_reserve_total", "Reserve outcomes by gRPC status code", ["code"])
ETCD_TXN_LATENCY = Histogram("kvpush_etcd_txn_latency_seconds", "etcd transaction latency",
                             buckets=_LATENCY_BUCKETS)
BATCH_SIZE = Histogram("kvpush_reserve_batch_size", "Reservations per group-commit transaction",
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
END_BATCH_SIZE = Histogram("kvpush_transition_batch_size", "Lifecycle transitions per group-commit transaction",
                           buckets=(1, 2, 4, 8, 16, 32, 64, 100))
BATCH_CONFLICTS = Counter("kvpush_reserve_batch_conflicts_total",
                          "Group commits retried because another replica changed a fence")
DECODE_ALONE = Counter("kvpush_reserve_decode_alone_total",
                       "Reserves answered decode_alone (conditional disaggregation), nothing reserved: the decode "
                       "engine held all but a short rest of the prompt (cached_prefix) or the prompt is short "
                       "(short_prompt)", ["reason"])
TRANSITIONS = Counter("kvpush_transitions_total", "Lifecycle transitions written", ["to"])
RELOCATIONS = Counter("kvpush_relocations_total",
                      "Decode failovers asked (Scheduler.Relocate), by outcome (OK or the gRPC status code)", ["outcome"])

OWNED_SLOTS = Gauge("kvpush_owned_slots", "Engine slots this replica owns (of kvpush.controlplane.ownership.SLOTS)")
ETCD_DEFECTIVE_MEMBERS = Gauge("kvpush_etcd_defective_members",
                               "Members of --etcd whose etcd release can lose writes it acknowledged "
                               "(kvpush.controlplane.etcd_versions), as found at this replica's start")
LIVE_REPLICAS = Gauge("kvpush_live_replicas", "Control-plane replicas this replica sees live (itself included)")
RESERVE_OWNER = Counter("kvpush_reserve_engine_owner_total",
                        "Reservations committed by this replica, by who owns the engine chosen: this replica "
                        "(own) or another (other: its own scored more than OWN_SLACK below the best, counting free "
                        "blocks and the prompt share held, or none fitted, or the router preferred that engine)", ["owner"])
FOLLOWED_SLOTS = Gauge("kvpush_followed_slots", "Slots whose requests this replica's view follows (of "
                       "kvpush.controlplane.keys.SLOTS): those it owns and those its clients need")
RESERVE_WIDENED = Counter("kvpush_reserve_widened_total",
                          "Reserves planned again over more slots than this replica follows: its engines were not "
                          "the place (no room, clearly less than another's, not the one preferred) and the owner "
                          "could not be asked (kvpush/controlplane/elsewhere.py)")
RESERVE_IN_SHARE = Counter("kvpush_reserve_in_share_total",
                           "Reserves for a quota tenant committed within this replica's share of the quota, without "
                           "the tenant's usage fence (kvpush/controlplane/quota_shares.py)")
QUOTA_SHARES_SHRUNK = Counter("kvpush_quota_shares_shrunk_total",
                              "Shares of a tenant's quota this replica gave back, unused (quota_shares.py)")
RESERVE_FORWARDED = Counter("kvpush_reserve_forwarded_total",
                            "Reserves this replica sent on to the owner of the engine they should go to "
                            "(kvpush/controlplane/elsewhere.py), by the owner's answer: OK, or the gRPC code after "
                            "which this replica committed the Reserve itself", ["code"])
# (labels() takes a lock and builds a key: once, not per Reserve)
RESERVED_ON_OWN, RESERVED_ON_OTHER = RESERVE_OWNER.labels(owner="own"), RESERVE_OWNER.labels(owner="other")

_RESULT_CHILDREN: dict = {}


def forwarded(code: str) -> None:
    RESERVE_FORWARDED.labels(code=code).inc()  # (a detour, rare: no cached child)


def reserve_answered(seconds: float, code: str) -> None:
    """One Reserve answered (unary or over the stream): its latency and outcome."""
    RESERVE_LATENCY.observe(seconds)
    child = _RESULT_CHILDREN.get(code)
    if child is None:  # labels() takes a lock and builds a key: once per code, not per call
        child = _RESULT_CHILDREN[code] = RESERVE_RESULTS.labels(code=code)
    child.inc()


GC_PAUSE = Histogram("kvpush_gc_pause_seconds", "Garbage-collection pauses of this process (the event loop stops)",
                     ["generation"], buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25))


def watch_gc() -> None:
    """Time every collection: a full one walks every live reservation, so a replica
    holding many shows it here first, as tail latency of every call."""
    if any(getattr(cb, "__name__", "") == "_kvpush_on_gc" for cb in gc.callbacks):
        return
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            GC_PAUSE.labels(generation=str(info["generation"])).observe(time.perf_counter() - started[0])
    on_gc.__name__ = "_kvpush_on_gc"
    gc.callbacks.append(on_gc)
