"""Lifecycle reports over one long-lived ``Registry.ReportStates`` stream
(``kvpush/client/tagged_stream.py``): what a sidecar sends instead of one ``ReportState``
call each. Many reports share a message, and the control plane commits their
transitions together. A refused report raises the ``grpc.aio.AioRpcError`` the
unary call would have raised (same code, same details), so a caller handles both
alike; a broken stream fails the reports in flight with UNAVAILABLE. A report sent
again after it applied is refused (FAILED_PRECONDITION) as the unary call refuses it,
and the sidecar's reporter then reads the reservation's state."""

from __future__ import annotations

import grpc

from kvpush.client.control_plane import ControlPlaneClient
from kvpush.client.tagged_stream import CODES, TaggedStream
from kvpush.contract.v1 import registry_pb2, types_pb2


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class StreamReporter(TaggedStream):
    name = "reporter"

    def __init__(self, client: ControlPlaneClient) -> None:
        super().__init__()
        self.client = client

    async def report(self, request: registry_pb2.ReportStateRequest, timeout: float | None = None
                     ) -> types_pb2.Reservation:
        return await self.call(request, timeout)

    def _open_call(self):
        return self.client.registry.ReportStates(metadata=self.client.metadata)

    def _item(self, tag: int, request):
        return registry_pb2.TaggedReport(tag=tag, report=request)

    def _message(self, items: list):
        return registry_pb2.ReportStatesRequest(reports=items)

    def _outcome(self, answer):
        if answer.code == 0:
            return answer.reservation
        raise rpc_error(CODES.get(answer.code, grpc.StatusCode.UNKNOWN), answer.message)

    def _failure(self, code: grpc.StatusCode, details: str) -> Exception:
        return rpc_error(code, details)
