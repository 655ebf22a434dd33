"""The server side of a tagged stream (``kvpush/client/tagged_stream.py``): items read from
the stream are started at once, each answered by tag as it completes, and every answer
ready goes out in one message. Reads and answers overlap, so a client's next message
is taken in while earlier items are still being committed (which is what lets group
commit gather them). Used by ``ReserveStream`` and ``ReportStates``."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import AsyncIterator, Callable, Iterable

from kvpush.controlplane import errors
from kvpush.controlplane.api import check_parsed
from kvpush.controlplane.validation import no_unknown_fields
from kvpush.contract.limits import MAX_ASKS_PER_MESSAGE


async def serve_tagged(request_iterator, items: Callable[[object], Iterable], field: str,
                       start: Callable[[object, int], asyncio.Future],
                       answer: Callable[[object, asyncio.Future, float], object],
                       respond: Callable[[list], object]) -> AsyncIterator:
    """``items(message)``: its tagged items (named ``field`` in errors); ``start(item, i)``:
    a future of its outcome; ``answer(item, future, started)``: the answer message once it
    is done (``started``: when its message was read, perf_counter);
    ``respond(answers)``: the response message carrying them."""
    ready: list = []
    wake = asyncio.Event()
    in_flight = 0
    reading = True

    def done(item, started: float, fut: asyncio.Future) -> None:
        ready.append(answer(item, fut, started))
        wake.set()

    async def read() -> None:
        nonlocal in_flight, reading
        try:
            async for msg in request_iterator:
                started = time.perf_counter()
                check_parsed(msg)
                no_unknown_fields(msg, deep=False)
                batch = list(items(msg))
                if len(batch) > MAX_ASKS_PER_MESSAGE:
                    raise errors.invalid(f"{field}: at most {MAX_ASKS_PER_MESSAGE} per message, got {len(batch)}")
                for i, item in enumerate(batch):
                    in_flight += 1
                    try:
                        no_unknown_fields(item, f"{field}[{i}]")
                        fut = start(item, i)
                    except errors.ApiError as exc:
                        fut = asyncio.get_running_loop().create_future()
                        fut.set_exception(exc)
                    fut.add_done_callback(functools.partial(done, item, started))
        finally:
            reading = False
            wake.set()

    reader = asyncio.create_task(read())
    try:
        while reading or in_flight:
            await wake.wait()
            wake.clear()
            if reader.done() and reader.exception() is not None:
                raise reader.exception()
            if ready:
                batch, ready[:] = list(ready), []
                in_flight -= len(batch)
                yield respond(batch)
    finally:
        reader.cancel()


def outcome(fut: asyncio.Future):
    """(result, None) or (None, the ApiError to answer with)."""
    exc = fut.exception() if not fut.cancelled() else errors.unavailable("cancelled")
    if exc is None:
        return fut.result(), None
    return None, exc if isinstance(exc, errors.ApiError) else errors.unavailable(str(exc))
