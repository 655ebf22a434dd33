"""Reserve over one long-lived ReserveStream (``kvpush/client/tagged_stream.py``): the client
side of group commit. Under load a message carries many asks, and one answer message
comes back for each group commit; a lone ask still goes out at once.

Failures keep the unary call's meaning: a refused ask raises ``ReserveRefused``
with the status code the unary call would have ended with; a broken stream fails
every ask in flight with UNAVAILABLE (Reserve is idempotent per request_id, so a
caller may retry), and the next ask opens a new stream (never a retry loop of its own). An ask whose caller
stopped waiting (timeout, cancellation) is released if it is granted after all,
so giving up never leaks blocks until the deadline.
"""

from __future__ import annotations

import asyncio

import grpc

from kvpush.client.control_plane import ControlPlaneClient
from kvpush.client.tagged_stream import CODES, TaggedStream
from kvpush import log
from kvpush.contract.v1 import scheduler_pb2, types_pb2

_log = log.get("reserve_stream")


class ReserveRefused(Exception):
    """The control plane's answer to one ask was not a reservation."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class StreamReserver(TaggedStream):
    name = "reserver"

    def __init__(self, client: ControlPlaneClient) -> None:
        super().__init__()
        self._client = client
        self._releasing: set[asyncio.Task] = set()
        self.abandoned_released = 0

    async def reserve(self, request: scheduler_pb2.ReserveRequest, timeout: float | None = None
                      ) -> types_pb2.Reservation:
        """The reservation, or ReserveRefused with the code a unary Reserve would have had."""
        return await self.call(request, timeout)

    def _open_call(self):
        return self._client.scheduler.ReserveStream(metadata=self._client.metadata)

    def _item(self, tag: int, request):
        return scheduler_pb2.ReserveAsk(tag=tag, reserve=request)

    def _message(self, items: list):
        return scheduler_pb2.ReserveStreamRequest(asks=items)

    def _outcome(self, answer):
        if answer.code == 0:
            return answer.reservation
        raise ReserveRefused(CODES.get(answer.code, grpc.StatusCode.UNKNOWN), answer.message)

    def _failure(self, code: grpc.StatusCode, details: str) -> Exception:
        return ReserveRefused(code, details)

    def _unsent_note(self, unsent: bool) -> str:
        return "nothing was reserved" if unsent else "the outcome is unknown: retry with the same request_id"

    def _unclaimed(self, answer) -> None:
        """A grant nobody waits for any more is released at once, not at its deadline."""
        if answer.code == 0:
            self._dropped(answer.reservation)

    def _dropped(self, reservation) -> None:
        if not reservation.decode_alone:  # (decode_alone: nothing was held)
            task = asyncio.get_running_loop().create_task(self._release(reservation.id))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    async def _release(self, reservation_id: str) -> None:
        try:
            await self._client.scheduler.Release(
                scheduler_pb2.ReleaseRequest(reservation_id=reservation_id, reason="caller stopped waiting"),
                metadata=self._client.metadata, timeout=5)
            self.abandoned_released += 1
        except grpc.aio.AioRpcError as exc:
            _log.warning("release of an abandoned reservation failed", reservation_id=reservation_id,
                         code=exc.code().name)

    async def close(self) -> None:
        await super().close()
        await asyncio.gather(*self._releasing, return_exceptions=True)
