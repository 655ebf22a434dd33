"""One request through P/D: reserve, fan out to prefill and decode at once,
stream decode's answer back, and clean up whatever way it ends.

    client ──▶ router ──Reserve (one shared ReserveStream)──▶ control plane
                  ├──▶ prefill engine: max_tokens=1, kvpush role "prefill" (pushes KV)
                  └──▶ decode engine:  the request, kvpush role "decode" (loads KV) ──▶ client

No reservation (no room, quota, control plane down or slow) never fails the
request: it goes to a decode engine without kvpush params and decode prefills it
itself (counted as a fallback). A prefill failure aborts the reservation, so
decode stops waiting and recomputes. A client disconnect aborts both engine
requests and the reservation.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import aiohttp
import grpc
from aiohttp import web

from controlplane.client import ControlPlaneClient
from controlplane.reserve_stream import ReserveRefused, StreamReserver
from kvpush import log
from kvpush.transfer_params import PushParams
from kvpush.v1 import scheduler_pb2
from router import metrics
from router.config import RouterConfig
from router.tokens import TokenCounter

_log = log.get("router")


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Dispatcher:
    def __init__(self, cfg: RouterConfig, counter: TokenCounter, cp: ControlPlaneClient,
                 session: aiohttp.ClientSession) -> None:
        self.cfg = cfg
        self.counter = counter
        self.cp = cp
        self.session = session
        self.outstanding: dict[str, int] = {u: 0 for u in cfg.prefill_urls}
        self.outstanding.update({d.url: 0 for d in cfg.decode})
        # One ReserveStream for all requests: cheaper than a call each, for the
        # router and the control plane, and concurrent requests share messages.
        self.reserver = StreamReserver(cp)

    async def close(self) -> None:
        await self.reserver.close()

    def _least_loaded(self, urls) -> str:
        return min(urls, key=lambda u: self.outstanding.get(u, 0))

    def count_tokens(self, endpoint: str, body: dict) -> int:
        try:
            if endpoint == "chat":
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise BadRequest("messages must be a non-empty list")
                return self.counter.chat(messages)
            if "prompt" not in body:
                raise BadRequest("prompt is required")
            return self.counter.completion(body["prompt"])
        except BadRequest:
            raise
        except Exception as exc:
            raise BadRequest(f"cannot tokenize the prompt: {exc}") from None

    async def reserve(self, request_id: str, num_tokens: int):
        """The reservation, or (None, reason) when serving without push."""
        started = time.perf_counter()
        try:
            res = await self.reserver.reserve(
                scheduler_pb2.ReserveRequest(request_id=request_id, num_tokens=num_tokens, model=self.cfg.model,
                                             deadline_ms=self.cfg.deadline_ms),
                timeout=self.cfg.reserve_timeout_s)
            return res, ""
        except ReserveRefused as exc:
            return None, exc.code.name.lower()
        finally:
            metrics.RESERVE_LATENCY.observe(time.perf_counter() - started)

    async def release(self, res_id: str, reason: str) -> None:
        try:
            await self.cp.scheduler.Release(scheduler_pb2.ReleaseRequest(reservation_id=res_id, reason=reason),
                                            metadata=self.cp.metadata, timeout=5)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: it ended already
                _log.warning("release failed", reservation_id=res_id, code=exc.code().name)

    async def handle(self, endpoint: str, body: dict, request: web.Request) -> web.StreamResponse:
        if body.get("model") not in (None, self.cfg.model):
            raise BadRequest(f"model {body.get('model')!r} is not served here; try {self.cfg.model!r}", 404)
        started, received_unix = time.perf_counter(), time.time()
        num_tokens = self.count_tokens(endpoint, body)
        counted = time.perf_counter()
        request_id = f"rt-{uuid.uuid4().hex}"
        res, why = await self.reserve(request_id, num_tokens)
        decode_url = self.cfg.decode_url(res.engine_id) if res is not None else None
        if res is not None and decode_url is None:
            why = "unknown_decode_engine"
            await self.release(res.id, "router has no address for this decode engine")
            res = None
        if res is None:
            metrics.FALLBACKS.labels(reason=why).inc()
            _log.info("serving without push", request_id=request_id, reason=why, num_tokens=num_tokens)
            return await self._proxy(self._least_loaded([d.url for d in self.cfg.decode]), endpoint, body,
                                     request, "fallback")
        params = PushParams.from_reservation(res, "prefill")
        prefill_url = self._least_loaded(self.cfg.prefill_urls)
        p_body = prefill_body(body, params)
        d_body = dict(body, kv_transfer_params=params.for_role("decode").as_kv_transfer_params())
        timings = {"counted": counted, "reserved": time.perf_counter()}
        prefill = asyncio.create_task(self._prefill(prefill_url, endpoint, p_body, res.id, timings))
        try:
            response = await self._proxy(decode_url, endpoint, d_body, request, "push", timings)
            # One line per request with where its time went: the first place to look
            # when TTFT is above the prefill's own time.
            _log.info("served", request_id=request_id, reservation_id=res.id, num_tokens=num_tokens,
                      received_unix=round(received_unix, 6),
                      **{f"{k}_ms": round((v - started) * 1e3, 2) for k, v in timings.items()})
            return response
        except BaseException:
            # Client gone or decode failed: stop the prefill and give the blocks back.
            prefill.cancel()
            await asyncio.shield(self.release(res.id, "client disconnected or decode failed"))
            raise

    async def _prefill(self, url: str, endpoint: str, body: dict, res_id: str, timings: dict) -> None:
        self.outstanding[url] = self.outstanding.get(url, 0) + 1
        sent = time.perf_counter()
        try:
            async with self.session.post(f"{url}/v1/{path_of(endpoint)}", json=body) as resp:
                text = await resp.text()
                timings["prefill_done"] = time.perf_counter()
                metrics.PREFILL_LATENCY.observe(timings["prefill_done"] - sent)
                if resp.status != 200:
                    raise RuntimeError(f"prefill answered {resp.status}: {text[:200]}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Decode is waiting for KV that will not come: end the wait now.
            _log.warning("prefill failed; aborting its reservation", reservation_id=res_id, error=str(exc))
            await self.release(res_id, f"prefill failed: {exc}"[:500])
        finally:
            self.outstanding[url] -= 1

    async def _proxy(self, url: str, endpoint: str, body: dict, request: web.Request, path: str,
                     timings: dict | None = None):
        timings = {} if timings is None else timings
        started = time.perf_counter()
        self.outstanding[url] = self.outstanding.get(url, 0) + 1
        try:
            async with self.session.post(f"{url}/v1/{path_of(endpoint)}", json=body) as upstream:
                if not body.get("stream"):
                    payload = await upstream.read()
                    timings["decode_done"] = time.perf_counter()
                    metrics.TTFT.labels(path=path).observe(timings["decode_done"] - started)
                    return web.Response(body=payload, status=upstream.status,
                                        content_type=upstream.content_type or "application/json")
                out = web.StreamResponse(status=upstream.status)
                out.content_type = upstream.content_type or "text/event-stream"
                await out.prepare(request)
                first = True
                async for chunk in upstream.content.iter_any():
                    if first:
                        timings["first_chunk"] = time.perf_counter()
                        metrics.TTFT.labels(path=path).observe(timings["first_chunk"] - started)
                        first = False
                    await out.write(chunk)
                await out.write_eof()
                return out
        finally:
            self.outstanding[url] -= 1


def path_of(endpoint: str) -> str:
    return "chat/completions" if endpoint == "chat" else "completions"


def prefill_body(body: dict, params: PushParams) -> dict:
    """The request as the prefill engine gets it: one token, no streaming, push on."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens", "n")}
    out.update(max_tokens=1, stream=False, kv_transfer_params=params.as_kv_transfer_params())
    return out


def json_error(message: str, status: int) -> web.Response:
    return web.Response(status=status, content_type="application/json",
                        text=json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                                   "code": status}}))
