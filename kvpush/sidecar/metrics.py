"""The sidecar's Prometheus metrics (``kvpush sidecar --metrics-port``).

Events (a push's outcome, a landing's end) are counted as they happen. The state of the
moment (pool occupancy, transfers in flight, membership) is read from the sidecar when
scraped, so it cannot go stale. Failure reasons are free text naming ids; they are
counted by class (``reason_class``), so the label set stays small.

    kvpush_sidecar_pushes_total{outcome}          prefill: PUSHED, FAILED, CANCELLED
    kvpush_sidecar_push_bytes_total               prefill: bytes written into decode engines
    kvpush_sidecar_push_seconds                   prefill: first write to outcome
    kvpush_sidecar_push_exposed_seconds           prefill: last piece staged (prefill over) to last write done
    kvpush_sidecar_landings_total{state}          decode: LANDED, CONSUMED, FAILED, CANCELLED
    kvpush_sidecar_failures_total{role,reason}    both: by reason class
    kvpush_sidecar_pool_units{state}              prefill: staging units free, used (held included), held, total;
                                                  decode: landing blocks landed (not yet consumed), total
    kvpush_sidecar_transfers_in_flight            NIXL writes not yet done
    kvpush_sidecar_registered                     1 while the control plane has this engine
    kvpush_sidecar_recomputes_total{reason}       decode: requests whose engine computed the prompt itself
                                                  instead of loading it (failed, cancelled, timeout, restarted, ...)
    kvpush_sidecar_engine_available               1 while the engine is connected (engine_presence.py)
    kvpush_sidecar_engine_departures_total        times the engine's connections all went away
    kvpush_sidecar_staging_held                   prefill: requests whose staging is held for a decode failover
                                                  (counted in pool_units{state="used"} too)
    kvpush_sidecar_failover_total{event}          prefill: relocated (pushed again from staging into a moved
                                                  reservation), hold_expired, hold_evicted (room for a new push)
    kvpush_sidecar_prefix_blocks_held             decode, following its engine's KV events (--kv-events): the
                                                  prefix-cache blocks the engine holds, as KV-aware routing sees them
    kvpush_sidecar_prefix_blocks_total{change}    ... blocks the engine stored, removed
    kvpush_sidecar_prefix_stream_total{event}     ... its event stream: batches followed, gaps (batches lost: the
                                                  view was cleared), cleared, ignored
    kvpush_sidecar_prefix_checks_total{result}    ... stored blocks whose hash was recomputed: verified, unchecked
    kvpush_sidecar_prefix_usable                  ... 0 once the engine's hashes proved unmatchable (another hash
                                                  algorithm or seed): routing then ignores its cache
    kvpush_sidecar_prefix_reports_total{kind}     ... reports to the control plane: snapshots, deltas, failed
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvpush.contract.states import LandingState, PushState
from kvpush.sidecar.landing import LandingEvent
from kvpush.sidecar.push import PushOutcome

_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

# (class, words that put a reason in it), first match wins
_REASONS = (
    ("peer_gone", ("not registered", "gone", "dead", "disconnect", "incarnation")),
    ("timeout", ("timed out", "timeout", "deadline", "no landing")),
    ("staging_full", ("staging full", "stagingfull", "cannot hold")),
    ("layout", ("layout", "block size", "geometry")),
    ("checksum", ("checksum",)),
    ("aborted", ("abort",)),
    ("transfer", ("write", "transfer", "nixl", "post")),
    ("cancelled", ("cancel", "released", "ended")),
)


def reason_class(reason: str) -> str:
    text = reason.lower()
    for name, words in _REASONS:
        if any(w in text for w in words):
            return name
    return "other"


class SidecarMetrics:
    def __init__(self, role: str, state: Callable[[], dict]):
        """``state()``: the sidecar's stats of the moment (``SidecarService.stats``)."""
        self.role = role
        self.registry = r = CollectorRegistry()
        self.pushes = Counter("kvpush_sidecar_pushes_total", "Pushes by outcome (prefill)", ["outcome"], registry=r)
        self.push_bytes = Counter("kvpush_sidecar_push_bytes_total", "Bytes written into decode engines", registry=r)
        self.push_seconds = Histogram("kvpush_sidecar_push_seconds", "A push, first write to outcome",
                                      buckets=_SECONDS, registry=r)
        self.exposed = Histogram("kvpush_sidecar_push_exposed_seconds",
                                 "The last piece's PUSH (prefill over) to the last write done", buckets=_SECONDS,
                                 registry=r)
        self.landings = Counter("kvpush_sidecar_landings_total", "Reservations that landed or ended here, by state (decode)",
                                ["state"], registry=r)
        self.failures = Counter("kvpush_sidecar_failures_total", "Pushes and landings that failed, by reason class",
                                ["role", "reason"], registry=r)
        r.register(_StateCollector(role, state))

    def on_push(self, outcome: PushOutcome) -> None:
        self.pushes.labels(outcome.state.value).inc()
        self.push_bytes.inc(outcome.bytes_pushed)
        self.push_seconds.observe(outcome.elapsed_s)
        if outcome.state == PushState.PUSHED:
            self.exposed.observe(outcome.exposed_s)
        elif outcome.state == PushState.FAILED:
            self.failures.labels(self.role, reason_class(outcome.reason)).inc()

    def on_landing(self, event: LandingEvent) -> None:
        if not event.state.terminal:  # LANDED, FAILED, CANCELLED, CONSUMED: each counted once
            return
        self.landings.labels(event.state.value).inc()
        if event.state == LandingState.FAILED:
            self.failures.labels(self.role, reason_class(event.reason)).inc()

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (a thread of prometheus_client's); the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port


class _StateCollector:
    def __init__(self, role: str, state: Callable[[], dict]):
        self.role, self.state = role, state

    def collect(self):
        s = self.state()
        units = GaugeMetricFamily("kvpush_sidecar_pool_units", "Pool units (staging) or blocks (landing)",
                                  labels=["state"])
        failover = None
        if "staging_units" in s:
            units.add_metric(["free"], s["staging_free_units"])
            units.add_metric(["used"], s["staging_units"] - s["staging_free_units"])
            units.add_metric(["held"], s.get("staging_held_units", 0))  # of used: given up for any new push
            units.add_metric(["total"], s["staging_units"])
            failover = CounterMetricFamily("kvpush_sidecar_failover", "Decode failovers served from staging, and "
                                           "held staging let go", labels=["event"])
            for event in ("relocated", "hold_expired", "hold_evicted"):
                failover.add_metric([event], s.get(event, 0))
        elif "landing_blocks" in s:  # which blocks are reserved is the control plane's (kvpush_engine_free_blocks)
            units.add_metric(["landed"], s["landing_blocks_landed"])
            units.add_metric(["total"], s["landing_blocks"])
        yield units
        if failover is not None:
            yield failover
            yield GaugeMetricFamily("kvpush_sidecar_staging_held", "Requests whose staging is held for a decode "
                                    "failover", value=s.get("staging_held", 0))
        yield GaugeMetricFamily("kvpush_sidecar_transfers_in_flight", "NIXL writes not yet done",
                                value=s.get("inflight", 0))
        yield GaugeMetricFamily("kvpush_sidecar_registered", "1 while the control plane has this engine",
                                value=1 if s.get("connected") else 0)
        if "recomputes" in s:
            recomputes = CounterMetricFamily("kvpush_sidecar_recomputes", "Requests whose decode engine computed "
                                             "the prompt instead of loading it, by reason", labels=["reason"])
            for reason, n in sorted(s["recomputes"].items()):
                recomputes.add_metric([reason], n)
            yield recomputes
        if "prefix_blocks_held" in s:
            yield from _prefix_families(s)
        yield GaugeMetricFamily("kvpush_sidecar_engine_available", "1 while the engine beside the sidecar is connected",
                                value=0 if s.get("engine_unavailable") else 1)
        yield CounterMetricFamily("kvpush_sidecar_engine_departures", "Times the engine's connections all went away",
                                  value=s.get("engine_departures", 0))


# HeldBlocks' counters by what they count, so that no family mixes units: blocks; the event
# stream's batches and what happened to them; the hash checks of stored blocks.
_PREFIX_COUNTERS = (
    ("kvpush_sidecar_prefix_blocks", "Prefix-cache blocks the engine stored or removed, from its KV events",
     "change", ("stored", "removed")),
    ("kvpush_sidecar_prefix_stream", "The KV event stream: batches followed, gaps (batches lost: the view was "
     "cleared), clears (a gap or the engine's own), events or batches ignored", "event",
     ("batches", "gaps", "cleared", "ignored")),
    ("kvpush_sidecar_prefix_checks", "Stored blocks whose hash was recomputed and matched (verified), or could "
     "not be (unchecked: LoRA, multimodal, prompt embeddings)", "result", ("verified", "unchecked")),
)


def _prefix_families(s: dict):
    """A decode sidecar following its engine's KV events: what KV-aware routing knows of it."""
    yield GaugeMetricFamily("kvpush_sidecar_prefix_blocks_held", "Prefix-cache blocks the engine holds, from its "
                            "KV events", value=s["prefix_blocks_held"])
    counts = s.get("prefix_events", {})
    for name, doc, label, kinds in _PREFIX_COUNTERS:
        family = CounterMetricFamily(name, doc, labels=[label])
        for kind in kinds:
            family.add_metric([kind], counts.get(kind, 0))
        yield family
    yield GaugeMetricFamily("kvpush_sidecar_prefix_usable", "0 once the engine's block hashes proved unmatchable "
                            "(its cache is then ignored by routing)", value=0 if s.get("prefix_unusable") else 1)
    reports = CounterMetricFamily("kvpush_sidecar_prefix_reports", "Reports of the held blocks to the control "
                                  "plane, by kind", labels=["kind"])
    for kind, n in sorted(s.get("prefix_reports", {}).items()):
        reports.add_metric([kind], n)
    yield reports
