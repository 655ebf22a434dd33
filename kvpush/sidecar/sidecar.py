"""A sidecar for one engine: ``make_sidecar`` picks the role's class, and this module's
main runs one alone, for local use, tests and benchmarks.

``python -m kvpush.sidecar.sidecar`` writes its ``EngineRecord`` as JSON to ``--record-out``
once serving; peers are added through the channel's ADMIN ``add_peer``. ``kvpush
sidecar`` (``kvpush/sidecar/service.py``) is the same sidecar wired to the control plane.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Callable

from kvpush.channel.device_memory import parse_device
from kvpush.channel.memory import PoolMapError
from kvpush.aio import stop_on_signals, write_ready_file
from kvpush.contract.layout import KvLayout
from kvpush.contract.states import DECODE, PREFILL
from kvpush.sidecar import kv_events
from kvpush.sidecar.base import SidecarBase, SidecarConfig
from kvpush.sidecar.decode import DecodeSidecar
from kvpush.sidecar.landing import LandingEvent
from kvpush.sidecar.peers import Resolver
from kvpush.sidecar.prefill import PrefillSidecar
from kvpush.sidecar.progress import PollPolicy
from kvpush.sidecar.push import PushConfig, PushOutcome
from kvpush.sidecar.transport.base import Transport, TransportUnavailable
from kvpush.sidecar.transport.nixl import parse_backends


def make_sidecar(config: SidecarConfig,
                 on_push_outcome: Callable[[PushOutcome], None] | None = None,
                 on_landing_event: Callable[[LandingEvent], None] | None = None,
                 resolver: Resolver | None = None,
                 on_push_start: Callable[[str, str], None] | None = None,
                 transport_factory: Callable[[SidecarConfig], Transport] | None = None) -> SidecarBase:
    """The sidecar of ``config.role``; the other role's hooks are not used. The transport
    is NIXL unless ``transport_factory`` makes another (``kvpush/sidecar/transport/``)."""
    if config.role == PREFILL:
        return PrefillSidecar(config, on_push_outcome, resolver, on_push_start, transport_factory)
    return DecodeSidecar(config, on_landing_event, transport_factory)


# -- process main for local runs and tests ---------------------------------------------------------
def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="kvpush sidecar (local run: peers added over the channel)")
    p.add_argument("--role", choices=[PREFILL, DECODE], required=True)
    p.add_argument("--engine-id", required=True)
    p.add_argument("--layout", required=True, help="layers=32,block=16,heads=8,dim=128,dtype=bfloat16")
    p.add_argument("--blocks", type=int, required=True, help="landing blocks / staging units")
    p.add_argument("--socket", required=True)
    p.add_argument("--record-out", help="write this engine's record (JSON) here once serving")
    p.add_argument("--incarnation", default=None)
    p.add_argument("--backends", default="UCX", help="NIXL backends, comma-separated (UCX, LIBFABRIC)")
    p.add_argument("--pool-device", default="cpu", help="cpu (shared memory) or cuda:N (VRAM on the engine's GPU)")
    p.add_argument("--checksums", action="store_true", help="send per-block CRC32 with each push")
    p.add_argument("--transfer-timeout", type=float, default=2.0)
    p.add_argument("--idle-interval", type=float, default=PollPolicy.idle_interval_s)
    p.add_argument("--hot-interval", type=float, default=PollPolicy.hot_interval_s)
    p.add_argument("--log-level", default="WARNING")
    kv_events.add_arguments(p)
    return p.parse_args(argv)


async def _serve(args: argparse.Namespace, factory=make_sidecar) -> None:
    extra = {"incarnation": args.incarnation} if args.incarnation else {}
    config = SidecarConfig(args.engine_id, args.role, KvLayout.parse(args.layout), args.blocks, args.socket,
                           parse_device(args.pool_device),
                           poll=PollPolicy(hot_interval_s=args.hot_interval, idle_interval_s=args.idle_interval),
                           push=PushConfig(transfer_timeout_s=args.transfer_timeout, checksums=args.checksums),
                           backends=parse_backends(args.backends), kv_events=kv_events.source_from_args(args),
                           **extra)
    sidecar = factory(config)
    stop = stop_on_signals()
    await sidecar.start()
    try:
        write_ready_file(args.record_out, json.dumps(sidecar.engine_record().to_dict()))
        await stop.wait()
    finally:
        await sidecar.stop()


def main(argv=None, factory=make_sidecar) -> None:
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        asyncio.run(_serve(args, factory))
    except (PoolMapError, MemoryError, TransportUnavailable, ValueError) as exc:  # a setting: say which, exit 2
        print(f"sidecar: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
