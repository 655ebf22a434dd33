"""Decode side: which prefix-cache blocks the local engine holds, from its KV events.

vLLM publishes every change to its prefix cache (``--kv-events-config``, publisher
``zmq``; ``vllm/distributed/kv_events.py``): multipart messages ``(topic, seq,
msgpack(KVEventBatch))``, each batch a list of ``BlockStored`` (block hashes, their
parent, the token ids), ``BlockRemoved`` and ``AllBlocksCleared``. The sidecar beside
the engine follows them here and keeps the set of 64-bit block keys the engine holds
(``kvpush/contract/block_hash.py``), which the control plane routes by.

The set must never claim a block the engine dropped (a Reserve would then count on
KV that is not there; correct still, the engine recomputes, but a wasted choice),
while missing a block it holds costs only a missed overlap. So:

* joining a running engine's stream late is fine: blocks stored before are unknown;
* a gap in the sequence numbers (the publisher's high-water mark dropped batches, a
  restart) may have hidden removals: the set is **cleared**, and ``on_reset`` tells
  whoever mirrors it; the engine's blocks come back as it stores them again;
* a stream that goes silent while the engine has been told to publish is not a gap
  (an idle engine publishes nothing);
* each stored block is checked against the hasher when its parent is known in full:
  an engine hashing differently (another ``--prefix-caching-hash-algo``, another
  ``PYTHONHASHSEED``) would never match a router's keys, so the follower stops and
  says so once, loudly, instead of publishing keys nobody can match. A block whose
  hash has extra keys is checked with them where they can be rebuilt from the event
  (a ``cache_salt``); a LoRA's, multimodal or prompt-embeds block is held unchecked
  (its keys are the engine's own: a router's plain keys never equal them), so no
  client's request can switch prefix-aware routing off.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Callable, Iterable, Sequence

import msgspec

from kvpush.contract.block_hash import DEFAULT_SEED, BlockHasher, block_key, leading_held, salted
from kvpush.contract.prefixes import MAX_KEYS

log = logging.getLogger(__name__)

PRIMARY_MEDIA = (None, "GPU")  # vLLM names its own KV cache "GPU" whatever the device; other tiers are offloads


@dataclasses.dataclass(frozen=True)
class KvEventsSource:
    """Where the engine publishes its KV events and how it hashes blocks (its
    ``--kv-events-config`` endpoint and topic, ``--prefix-caching-hash-algo``, and its
    ``PYTHONHASHSEED`` if set)."""
    endpoint: str
    topic: str = ""
    algorithm: str = "sha256"
    seed: str = DEFAULT_SEED


def add_arguments(p) -> None:
    """The command-line flags of a decode sidecar that follows its engine's KV events."""
    p.add_argument("--kv-events", default="", metavar="ENDPOINT",
                   help="the engine's KV event publisher (its --kv-events-config endpoint, e.g. "
                        "ipc:///run/kvpush/D1.kvevents): follow its prefix cache for KV-aware routing")
    p.add_argument("--kv-events-topic", default="", help="the publisher's topic")
    p.add_argument("--prefix-hash", default="sha256", help="the engine's --prefix-caching-hash-algo")
    p.add_argument("--prefix-hash-seed", default=os.environ.get("PYTHONHASHSEED") or DEFAULT_SEED,
                   help="the engine's PYTHONHASHSEED, when it sets one")


def source_from_args(args) -> KvEventsSource | None:
    if not args.kv_events:
        return None
    BlockHasher(1, args.prefix_hash, args.prefix_hash_seed)  # a setting kvpush cannot reproduce: refused now
    return KvEventsSource(args.kv_events, args.kv_events_topic, args.prefix_hash, args.prefix_hash_seed)


@dataclasses.dataclass(frozen=True)
class HeldChange:
    """What one batch changed: keys now held, keys no longer held (in event order)."""
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    cleared: bool = False


class HeldBlocks:
    """The block keys an engine holds, kept from its event batches in sequence order."""

    def __init__(self, hasher: BlockHasher | None = None, max_blocks: int = MAX_KEYS):
        self.hasher = hasher
        self.max_blocks = max_blocks  # a bound on memory whatever the engine says
        self._keys: dict[int, None] = {}  # insertion-ordered: the oldest go first past max_blocks
        self.last_seq: int | None = None
        self.unusable = ""  # why the engine's hashes cannot be matched (then nothing is held)
        self.counters = {"batches": 0, "stored": 0, "removed": 0, "cleared": 0, "gaps": 0, "ignored": 0,
                         "verified": 0, "unchecked": 0}

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def overlap(self, keys: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its keys, in order) the engine holds."""
        return leading_held(keys, self._keys)

    def keys(self) -> list[int]:
        return list(self._keys)

    def clear(self) -> HeldChange:
        self._keys.clear()
        self.counters["cleared"] += 1
        return HeldChange(cleared=True)

    def apply(self, seq: int, events: Iterable[dict]) -> HeldChange:
        """One batch; a gap in ``seq`` first clears what may have gone stale."""
        if self.unusable:
            return HeldChange()
        cleared = False
        if self.last_seq is not None and seq != self.last_seq + 1:
            self.counters["gaps"] += 1
            log.warning("KV event stream jumped from %d to %d: removals may be lost; forgetting %d held blocks",
                        self.last_seq, seq, len(self._keys))
            self.clear()
            cleared = True
        self.last_seq = seq
        self.counters["batches"] += 1
        stored: list[int] = []
        removed: list[int] = []
        for event in events:
            kind = event.get("type") if isinstance(event, dict) else None
            if kind == "AllBlocksCleared":
                self.clear()
                stored.clear()
                removed.clear()
                cleared = True
            elif kind not in ("BlockStored", "BlockRemoved") or event.get("medium") not in PRIMARY_MEDIA \
                    or event.get("group_idx") not in (None, 0):
                self.counters["ignored"] += 1
            elif kind == "BlockStored":
                problem = self._check(event)
                if problem:
                    self.unusable = problem
                    log.error("engine's prefix-cache hashes do not match kvpush's (%s): prefix-aware routing "
                              "to this engine is off", problem)
                    self._keys.clear()
                    return HeldChange(cleared=True)
                for h in event.get("block_hashes") or ():
                    key = block_key(h)
                    self._keys.pop(key, None)  # re-stored: the newest again
                    self._keys[key] = None
                    stored.append(key)
                self.counters["stored"] += len(event.get("block_hashes") or ())
            else:
                for h in event.get("block_hashes") or ():
                    key = block_key(h)
                    if self._keys.pop(key, 0) is None:
                        removed.append(key)
                self.counters["removed"] += len(event.get("block_hashes") or ())
        while len(self._keys) > self.max_blocks:
            oldest = next(iter(self._keys))
            del self._keys[oldest]
            removed.append(oldest)
        return HeldChange(tuple(stored), tuple(removed), cleared)

    def _check(self, event: dict) -> str:
        """The first block's hash recomputed from its tokens, where the parent is known
        in full (bytes, or no parent); integer hashes are checked by their key."""
        if self.hasher is None:
            return ""
        hashes, tokens = event.get("block_hashes") or [], event.get("token_ids") or []
        bs = event.get("block_size")
        if bs != self.hasher.block_size:
            return f"block_size {bs} != {self.hasher.block_size}"
        parent = event.get("parent_block_hash")
        if not hashes or len(tokens) < bs or isinstance(parent, int):
            return ""
        extra = first_block_extra_keys(event)
        if extra is UNCHECKABLE:  # a LoRA's, media's or prompt embeddings' block: held, not checked
            self.counters["unchecked"] += 1
            return ""
        mine = self.hasher.chain(parent, tokens[:bs], extra)
        if block_key(mine) != block_key(hashes[0]):
            return (f"block of tokens {tokens[:4]}... hashes to {block_key(mine):#x} here, {block_key(hashes[0]):#x} "
                    f"in the engine (algorithm {self.hasher.algorithm!r}, seed {self.hasher.seed!r})")
        self.counters["verified"] += 1
        return ""


UNCHECKABLE = object()


def first_block_extra_keys(event: dict):
    """The extra keys (tagged, as vLLM hashes them) of a ``BlockStored`` event's first block:
    None for a plain block, a salted first block's for a ``cache_salt``, else UNCHECKABLE.
    The event publishes them untagged (``to_event_extra_keys``): a bare string is a salt
    unless the event names a LoRA; a LoRA's hash also covers its adapter path, which the
    event does not carry."""
    per_block = event.get("extra_keys") or ()
    first = per_block[0] if per_block else None
    if first is None:
        return None
    lora = event.get("lora_name") is not None or event.get("lora_id") is not None
    if not lora and len(first) == 1 and isinstance(first[0], str) and first[0]:
        return salted(first[0])
    return UNCHECKABLE


class KvEventFollower:
    """Subscribes to the engine's event publisher and keeps ``held`` current.

    ``on_change(HeldChange)`` hears each batch's effect (cleared first when it says so),
    on the sidecar's loop. The socket is a ZMQ SUB: it reconnects by itself when the
    engine restarts; a restarted engine's sequence starts again, which reads as a gap.
    """

    def __init__(self, endpoint: str, held: HeldBlocks, topic: str = "",
                 on_change: Callable[[HeldChange], None] | None = None):
        self.endpoint = endpoint
        self.topic = topic
        self.held = held
        self.on_change = on_change
        self._decoder = msgspec.msgpack.Decoder()
        self._task: asyncio.Task | None = None
        self._socket = None

    def start(self) -> None:
        import zmq
        import zmq.asyncio
        ctx = zmq.asyncio.Context.instance()
        self._socket = ctx.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        self._socket.connect(self.endpoint)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-events")

    async def _run(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            try:
                self._handle(frames)
            except Exception:  # one bad batch must not end the follower
                self.held.counters["ignored"] += 1
                log.exception("bad KV event batch from %s", self.endpoint)

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            raise ValueError(f"{len(frames)} frames, expected 3 (topic, seq, payload)")
        seq = int.from_bytes(frames[1], "big", signed=True)
        batch = self._decoder.decode(frames[2])
        events = batch[1] if isinstance(batch, (list, tuple)) and len(batch) > 1 else []
        change = self.held.apply(seq, events)
        if self.on_change is not None and (change.stored or change.removed or change.cleared):
            self.on_change(change)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    async def stop(self) -> None:
        task = self._task
        self.close()
        if task is not None:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
