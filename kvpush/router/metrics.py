"""Prometheus metrics of the router (served at /metrics). With several workers
(``--workers``) each writes its values to prometheus_client's multiprocess directory and
/metrics on any of them adds them up (``collect``); each gauge says how."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REGISTRY = CollectorRegistry()
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

REQUESTS = Counter("kvpush_router_requests_total", "Answers on the OpenAI endpoints by endpoint and outcome: ok, "
                   "bad_request (a 4xx of the router's), unavailable (its 503), upstream_error (an engine unreachable or "
                   "late, or a stream that began and ended with an error event), client_gone, client_too_slow, error (a "
                   "failure nobody foresaw: a 500, logged)",
                   ["endpoint", "outcome"], registry=REGISTRY)
FALLBACKS = Counter("kvpush_router_fallbacks_total", "Requests served without push (decode prefilled itself)",
                    ["reason"], registry=REGISTRY)
RELOCATIONS = Counter("kvpush_router_relocations_total",
                      "Decode failovers: reservations moved to another decode engine (moved) or why not",
                      ["outcome"], registry=REGISTRY)
TTFT = Histogram("kvpush_router_ttft_seconds", "Time to first token as the router sees it", ["path"],
                 buckets=_BUCKETS, registry=REGISTRY)
RESERVE_LATENCY = Histogram("kvpush_router_reserve_seconds", "Reserve round trip", buckets=_BUCKETS,
                            registry=REGISTRY)
PREFILL_LATENCY = Histogram("kvpush_router_prefill_seconds", "Prefill engine's answer (max_tokens=1) as the router "
                            "sees it", buckets=_BUCKETS, registry=REGISTRY)
PATHS = Counter("kvpush_router_paths_total", "Requests by path (first_token, push, prefill_only, decode_only) and "
                "why a request is not on the first-token path", ["path", "reason"], registry=REGISTRY)
TOKEN2 = Histogram("kvpush_router_token2_seconds", "First-token path: the prefill engine's answer to decode's first "
                   "token (the second token)", buckets=_BUCKETS, registry=REGISTRY)
IN_FLIGHT = Gauge("kvpush_router_in_flight", "Requests being served", registry=REGISTRY, multiprocess_mode="livesum")
PREFIX_TOKENS = Counter("kvpush_router_prefix_tokens_total", "KV-aware routing: prompt tokens of reservations "
                        "(asked), and of those the chosen decode engine held in its prefix cache (cached)",
                        ["kind"], registry=REGISTRY)
CHAT_TOKENS = Counter("kvpush_router_chat_tokens_total", "Chat prompts' tokens as the router counts them: tokenized, "
                      "or reused from the conversation's earlier turn (a kept prefix of its template's text)", ["how"],
                      registry=REGISTRY)
LOCAL_PREFILL = Counter("kvpush_router_local_prefill_total", "Conditional disaggregation: requests a decode engine "
                        "served alone, no prefill engine involved, because it lacked fewer than --local-prefill-tokens "
                        "of the prompt: it held all but a short rest (cached_prefix) or the prompt is short "
                        "(short_prompt)", ["reason"], registry=REGISTRY)
TURN_GUESSES = Counter("kvpush_router_turn_guesses_total", "KV-aware routing: long prompts whose prefill request "
                       "waited for the Reserve's answer because they extend a turn this router sent (guess="
                       "decode_alone; sent beside the Reserve to the decode engine that served that turn, where known) "
                       "or left with it (guess=prefill), by what the Reserve answered (decode_alone, or pd for anything "
                       "else: a request sent ahead is then taken back)", ["guess", "answer"], registry=REGISTRY)
GUESS_HOLD = Gauge("kvpush_router_guess_hold_seconds", "KV-aware routing: how long a decode engine holds a turn "
                   "guessed decode alone that lacks its prefix before computing it anyway (twice the p99 of the "
                   "router's recent Reserve round trips, bounded): what a stale view of that engine's cache costs "
                   "such a turn (the longest of the workers')", registry=REGISTRY, multiprocess_mode="livemax")
CONNECTIONS_SHED = Counter("kvpush_router_connections_shed_total", "Client connections closed for sending no request "
                           "in time: its headers not whole within --header-timeout (header_timeout), or nothing sent "
                           "for --keepalive-timeout between requests (idle)", ["reason"], registry=REGISTRY)
OPEN_CONNECTIONS = Gauge("kvpush_router_open_connections", "Client connections open now (each holds a file "
                         "descriptor)", registry=REGISTRY, multiprocess_mode="livesum")
ENGINE_ID_CONFLICTS = Gauge("kvpush_router_engine_id_conflicts", "Engine ids registered in more than one of the "
                            "router's registries (--controlplane given more than once): not served until one holds "
                            "each", registry=REGISTRY, multiprocess_mode="livemax")
REGISTRY_RESERVES = Counter("kvpush_router_registry_reserves_total", "Reserves by registry (its control-plane "
                            "address) and outcome: granted, or the refusal's status (with several registries a "
                            "refusal for room or an unanswered ask moves on to the next)", ["registry", "outcome"],
                            registry=REGISTRY)
CONTINUATION_EVENTS = Counter("kvpush_router_continuation_events_total", "First-token path: decode's events, passed on "
                              "as bytes past the first-token boundary (passed) or made again in the router (made: the "
                              "boundary, the last event, and answers with logprobs or usage in every event)", ["how"],
                              registry=REGISTRY)
DIRECT_RELAYS = Counter("kvpush_router_direct_relays_total", "Engine streams written on to the client from the "
                        "engine connection's callback, no coroutine woken per event, by kind: passthrough (the "
                        "first-token path's steady events), whole (whole events: the push path, decode alone)",
                        ["kind"], registry=REGISTRY)
DIRECT_DECLINED = Counter("kvpush_router_direct_relay_declined_total", "Reads of an engine's stream that could not be "
                          "written on from the connection's callback because aiohttp's writer or reader is not the "
                          "kind this router knows (another aiohttp 3.x) or the answer is compressed: the answers are "
                          "the same bytes, at more CPU per event; above zero, pin aiohttp to the lock's version",
                          registry=REGISTRY)


def collect() -> bytes:
    """The exposition: this process's metrics, or every worker's added up."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
    return generate_latest(REGISTRY)
