"""One request through P/D, on the path ``kvpush.router.ask`` chose for it, cleaned up
whatever way it ends.

    first_token  Reserve ──▶ prefill (max_tokens=1, pushes KV) ──▶ first token to the client
                                   └──▶ decode: prompt + that token, loads the KV ──▶ the rest
    push         Reserve ──▶ prefill (pushes KV) and, at once, decode (loads it, computes every token)
    prefill_only the prefill engine alone (max_tokens=1)
    decode_only  a decode engine alone (n > 1, prompt lists, ...)

Conditional disaggregation (``--local-prefill-tokens``): the Reserve of a first_token or
push request may answer ``decode_alone`` instead of a reservation when the decode engine it
chose lacks only a short rest of the prompt (it holds the rest in its prefix cache, or the
prompt is short); that engine then serves the request alone, computing the rest itself,
and a prefill request sent ahead of the answer is taken back. A turn extending one this
router sent by a short rest (``kvpush.router.kv_aware``) goes beside its Reserve to the decode
engine that served that turn, which computes it at once if it still holds the prefix;
the Reserve's answer keeps it or takes it back.

No reservation (no room, quota, control plane down or slow) never fails the
request: it goes to a decode engine without kvpush params and decode prefills it
itself (counted as a fallback), and so does a first-token request whose prefill
engine failed. Every answer that is not a success, a prefill token that ends the
request, and a client that goes away before decode has finished release the
reservation at once: nothing waits for its deadline.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import aiohttp
from aiohttp import web

from kvpush.client.registries import Registries
from kvpush import log
from kvpush.contract.states import DECODE, PREFILL
from kvpush.contract.transfer_params import AwaitParams, PushParams, read_push_report
from kvpush.router import ask as asks
from kvpush.router import metrics
from kvpush.router.config import RouterConfig
from kvpush.router.fleet import Fleet
from kvpush.router.model_limits import ModelLimits
from kvpush.router.alone_path import AlonePath
from kvpush.router.push_path import PushPath
from kvpush.router.reserving import Reserving
from kvpush.router.errors import ApiError, json_error
from kvpush.router.failover import Failover, with_reservation
from kvpush.router.relay import Passthrough, Relay
from kvpush.router.streams import DONE, DecodeStreamError, EventStream, end_with_error, sse_response
from kvpush.router.upstream import Answering, Upstream
from kvpush.router.first_token import (BadHead, Chunks, Tail, decode_body, final_answer, parse_head, prefill_body,
                                resume_body)
from kvpush.router.kv_aware import KvAware
from kvpush.router.tokens import TokenCounter

_log = log.get("router")
ENGINES_WAIT_S = 5.0
# A request's timings once decode has streamed a token (the first-token path's second
# token, the push path's first bytes, the end): decode has the KV by then.
_DECODE_STREAMED = frozenset(("second_token", "first_chunk", "decode_done"))


class Dispatcher(PushPath, AlonePath, Reserving):
    def __init__(self, cfg: RouterConfig, counter: TokenCounter, registries: Registries,
                 session: aiohttp.ClientSession) -> None:
        self.cfg = cfg
        self.counter = counter
        # Each registry's Reserves go over one ReserveStream for all requests: cheaper than a
        # call each, for the router and the control plane, and concurrent requests share messages.
        self.registries = registries
        self.session = session
        self.up = Upstream(session, cfg.write_timeout_s)
        self.outstanding = self.up.outstanding  # engine URL -> requests the router has on it
        self.engines = Fleet(cfg, registries, self.outstanding)
        # How long a prefill engine holds a request for its reservation: past the
        # Reserve's own timeout the router has given up on it (and taken the request back).
        self.await_ms = int(cfg.reserve_timeout_s * 1000) + 250
        self.kv_aware = KvAware(cfg, self.await_ms)
        self.limits = ModelLimits(cfg, counter, session, self.engines)
        self.failover = Failover(registries, self.engines, self.release, cfg.relocate, cfg.reserve_timeout_s + 0.5,
                                 self.keep_s)

    async def close(self) -> None:
        await self.up.close()
        await self.engines.close()

    async def handle(self, endpoint: str, body: dict, request: web.Request) -> web.StreamResponse:
        if body.get("model") not in (None, self.cfg.model):
            raise ApiError(f"The model `{body.get('model')}` does not exist. Valid aliases: {self.cfg.model}.", 404,
                           "model")
        started, received_unix = time.perf_counter(), time.time()
        if not self.engines.ready.is_set():  # just started: the registry's first answer is on its way
            await self.engines.wait_ready(ENGINES_WAIT_S)
        ask = asks.parse(endpoint, body, self.counter, await self.limits.get())
        metrics.PATHS.labels(path=ask.path, reason=ask.why or "-").inc()
        if ask.path != asks.DECODE_ONLY and not self.engines.prefill_urls():
            metrics.FALLBACKS.labels(reason="no_prefill_engine").inc()
            return await self._decode_alone(endpoint, body, request)
        if ask.path == asks.PREFILL_ONLY:
            return await self.up.proxy(self._least_loaded(self.engines.prefill_urls()), endpoint, body, request,
                                     "prefill_only")
        if ask.path == asks.DECODE_ONLY:
            return await self._decode_alone(endpoint, body, request, "decode_only")
        timings = {"counted": time.perf_counter()}
        request_id = f"rt-{uuid.uuid4().hex}"  # 128 random bits: also the prefill handover's key
        keys = self.kv_aware.keys(ask.prompt_ids, ask.cache_salt)
        # Over several registries: the one the conversation's previous turn went to, else the
        # least loaded; the prefill engine is one of its own.
        hint = self.kv_aware.guess(keys, ask.num_tokens) if len(self.registries.all) > 1 else None
        reg = self.engines.choose(hint.engine_id if hint else "")
        prefill_url = self._least_loaded(self.engines.prefill_urls(reg))
        prefill_id = self.engines.prefill_id(prefill_url)
        held: list = []  # the reservation once granted: released if anything below fails
        # (A prompt shorter than --local-prefill-tokens goes to a decode engine alone
        # whatever it holds, and one extending a turn this router sent by a short rest
        # likely will: no prefill request ahead of the Reserve's answer.)
        early = bool(ask.path == asks.FIRST_TOKEN and prefill_id and ask.num_tokens >= self.cfg.local_prefill_tokens)
        guess = (hint or self.kv_aware.guess(keys, ask.num_tokens)) if early else None
        # Sent ahead only to an engine of the chosen registry: another would not know it.
        ahead = (self.engines.decode_url(guess.engine_id)
                 if guess and guess.alone and guess.engine_id
                 and self.engines.registry_of_engine(guess.engine_id) is reg else None)
        self.kv_aware.sent(keys, ask.num_tokens, ask.max_tokens)
        sent = None  # a guessed decode-alone turn sent ahead of its Reserve: withdrawn if anything below fails
        try:
            if early and not (guess and guess.alone):
                # The Reserve and the prefill request's HTTP, tokenization and scheduling
                # run at once: the reservation names the prefill engine, whose sidecar
                # hears it by watch while its connector holds the request.
                reserving = asyncio.create_task(self.reserve(request_id, ask, prefill_url, keys, reg=reg,
                                                             timeout=self.first_share_s(reg)))
                response = await self._first_token(ask, request_id, prefill_url, request, timings, held,
                                                   reserving=reserving, reg=reg, keys=keys)
            else:
                # Named on the push path too: its sidecar then holds the staged KV for a
                # failover (and frees it at CONSUMED), and the layouts are checked now.
                # A turn guessed decode alone goes at once, beside the Reserve, to the decode
                # engine that served the turn it extends (``_send_ahead``); only an answer of
                # decode_alone on that engine keeps it, any other takes it back.
                sent = self._send_ahead(ask, ahead) if ahead is not None else None
                # (A turn sent ahead stays with its engine's registry; any other may move on.)
                res, why, prefill_url = await self.reserve(request_id, ask, prefill_url, keys,
                                                           guess.engine_id if sent is not None else "", reg,
                                                           move_on=sent is None)
                if sent is not None and not (res is not None and res.decode_alone
                                             and res.engine_id == guess.engine_id):
                    await sent.withdraw()
                    sent = None
                if res is None:
                    metrics.FALLBACKS.labels(reason=why).inc()
                    _log.info("serving without push", request_id=request_id, reason=why, num_tokens=ask.num_tokens)
                    return await self._decode_alone(endpoint, body, request)
                timings["reserved"] = time.perf_counter()
                if res.decode_alone:
                    response = await self._local_prefill(ask, res, request, timings, sent)
                else:
                    held.append(res)
                    if ask.path == asks.PUSH:
                        response = await self._push(ask, prefill_url, self.engines.decode_url(res.engine_id),
                                                    request, timings, held)
                    else:
                        response = await self._first_token(ask, request_id, prefill_url, request, timings, held)
        except BaseException:
            # Client gone or an engine failed: give the blocks back now, not at the deadline.
            if sent is not None:
                await asyncio.shield(sent.withdraw())
            # (Not once decode has streamed a token: it loaded the KV before its first step, so
            # its sidecar ends the reservation CONSUMED, and a release would race that report,
            # held 50 ms before it is sent: a release that won would end a consumed reservation
            # RELEASED and keep its blocks out of use for the quarantine. Clients often go away
            # mid-stream; once, in CI, one that closed on [DONE] won that race.)
            if held and not _DECODE_STREAMED.intersection(timings):
                await asyncio.shield(self.release(held[0].id, "client disconnected or an engine failed"))
            raise
        if guess is not None:
            metrics.TURN_GUESSES.labels(guess="decode_alone" if guess.alone else "prefill",
                                        answer="decode_alone" if "local_decided" in timings else "pd").inc()
        # One line per request with where its time went: the first place to look
        # when TTFT is above the prefill's own time.
        _log.info("served", request_id=request_id, reservation_id=held[0].id if held else "",
                  num_tokens=ask.num_tokens, path="local_prefill" if "local_decided" in timings else ask.path,
                  received_unix=round(received_unix, 6),
                  **{f"{k}_ms": round((v - started) * 1e3, 2) for k, v in timings.items()})
        return response

    # -- first token: prefill's token goes out at once, decode continues from it -----------------
    async def _first_token(self, ask: asks.Ask, request_id: str, prefill_url: str, request: web.Request,
                           timings: dict, held: list, reserving: asyncio.Task | None = None, reg=None,
                           keys=()) -> web.StreamResponse:
        """``held`` has the reservation when it was granted before; with ``reserving`` (the
        Reserve still running, in registry ``reg``, for the prompt of block ``keys``) the prefill
        request goes now and waits for it on the engine."""
        if reserving is not None:
            kv = AwaitParams(request_id, self.await_ms).as_kv_transfer_params()
        else:
            kv = PushParams.from_reservation(held[0], PREFILL).as_kv_transfer_params()
        prefill = asyncio.create_task(self.up.post(prefill_url, ask.endpoint, prefill_body(ask.body, kv, True), timings))
        alone = None  # a Reserve answered decode_alone
        try:
            if reserving is not None:
                res, why, _ = await reserving
                timings["reserved"] = time.perf_counter()
                if res is not None and res.decode_alone:
                    # Decode lacks only a short rest: the prefill engine, holding the request
                    # for a reservation that will not come, gives it back unstarted.
                    alone = res
                    prefill.cancel()
                    await asyncio.gather(prefill, return_exceptions=True)
                elif res is not None:
                    held.append(res)
                else:
                    # Refused (or slow): the prefill engine is holding the request for a
                    # reservation that will not come. Take it back; another registry may
                    # have room (then its prefill engine computes it, pushing), else it is
                    # computed plain and decode computes the prompt itself (the local fallback).
                    prefill.cancel()
                    await asyncio.gather(prefill, return_exceptions=True)
                    kv = None
                    left = self.cfg.reserve_timeout_s - (time.perf_counter() - timings["counted"])
                    other = await self.reserve_elsewhere(request_id, ask, keys, reg, why, left)
                    if other is not None and other[0] is not None:
                        res, _, prefill_url = other
                        if res.decode_alone:
                            alone = res
                        else:
                            held.append(res)
                            kv = PushParams.from_reservation(res, PREFILL).as_kv_transfer_params()
                    else:
                        why = other[1] if other is not None else why
                        metrics.FALLBACKS.labels(reason=why).inc()
                        _log.info("first token without push", request_id=request_id, reason=why)
                    if alone is None:
                        prefill = asyncio.create_task(self.up.post(prefill_url, ask.endpoint,
                                                                 prefill_body(ask.body, kv, True), timings))
            if alone is None:
                status, payload = await prefill
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            status, payload = 502, str(exc).encode()
        finally:
            if not prefill.done():
                prefill.cancel()
            if reserving is not None and not reserving.done():
                # The client went away first: the reserver releases a grant nobody waits for.
                reserving.cancel()
        if alone is not None:
            return await self._local_prefill(ask, alone, request, timings)
        res = held[0] if held else None
        if status != 200:
            if res is not None:
                await self.release(res.id, f"prefill answered {status}")
            if 400 <= status < 500:  # the client's request: decode would refuse it too
                return web.Response(body=payload, status=status, content_type="application/json")
            metrics.FALLBACKS.labels(reason="prefill_failed").inc()
            _log.warning("prefill failed; serving on decode alone", status=status, error=payload[:200])
            return await self._decode_alone(ask.endpoint, ask.body, request)
        try:
            answer = json.loads(payload)
            head = parse_head(ask.endpoint, answer, payload)
        except (BadHead, ValueError) as exc:
            if res is not None:
                await self.release(res.id, "prefill's answer had no token ids")
            metrics.FALLBACKS.labels(reason="bad_prefill_answer").inc()
            _log.warning("prefill answer unusable; serving on decode alone", error=str(exc))
            return await self._decode_alone(ask.endpoint, ask.body, request)
        metrics.TTFT.labels(path="first_token").observe(timings["prefill_answered"] - timings["counted"])
        if head.finished:
            if res is not None:
                await self.release(res.id, "the first token ended the request")
            return await self._head_only(ask, head, request)
        if res is not None and read_push_report(answer.get("kv_transfer_params")) != (res.id, True):
            # The prefill engine computed without pushing (no reservation reached it in
            # time, or it could not push): decode must not wait for KV that will not land.
            metrics.FALLBACKS.labels(reason="not_pushed").inc()
            await self.release(res.id, "the prefill engine did not push")
            res = None
        decode_url = self.engines.decode_url(res.engine_id) if res is not None else self._alone_url()
        moved = None
        if res is not None and decode_url is None:
            moved = await self.failover.relocate(res, f"decode engine {res.engine_id} went away")
        if moved is not None:  # its decode engine went away while prefill ran: the KV follows
            res, decode_url = moved
        elif res is not None and decode_url is None:
            # ... or cannot: the KV is lost to this request, and another engine computes the prompt.
            decode_url = self._alone_url()
            await self._decode_failed(res.id, f"decode engine {res.engine_id} went away", decode_url or "-")
            res = None
        if decode_url is None:
            raise ApiError(f"no engine is available for model {self.cfg.model!r}", 503)
        kv = PushParams.from_reservation(res, DECODE).as_kv_transfer_params() if res is not None else None
        skip = ask.body.get("skip_special_tokens", True)
        # Decode's text is passed on past the boundary (first_token.Tail), unless the
        # answer needs every token's event made here: logprobs (their text offsets) and
        # usage in every event; or stop strings when decode's first text is not to be
        # trusted (it would match them in the prompt's text).
        partial = self.counter.ends_partial(head.prompt_ids, head.token_id, skip)
        relay = Relay(ask.endpoint, head.raw, ask.return_token_ids) \
            if ask.logprobs is None and not ask.continuous_usage and not (partial and ask.body.get("stop")) else None
        d_body = decode_body(ask, head, self.cfg.model, kv, stop=relay is not None)
        tail = Tail(ask, head, self.counter.output_text(head.prompt_ids, skip), relay, partial)
        held[:] = [res] if res is not None else []
        return await self._continue(ask, head, tail, decode_url, d_body, request, timings, held)

    async def _head_only(self, ask: asks.Ask, head, request: web.Request) -> web.StreamResponse:
        if not ask.stream:
            return web.json_response(final_answer(ask, head, None))
        chunks = Chunks(ask, head)
        out = await sse_response(request, self.cfg.write_timeout_s)
        usage = head.usage
        await out.write(chunks.head_events(usage, head.text) + chunks.usage_event(usage) + DONE)
        await out.write_eof()
        return out

    async def _continue(self, ask: asks.Ask, head, tail: Tail, decode_url: str, d_body: dict, request: web.Request,
                        timings: dict, held: list) -> web.StreamResponse:
        """``held``: the reservation decode loads ([] if none), kept current through moves
        so that a client gone away releases the right one."""
        res = held[0] if held else None
        chunks = Chunks(ask, head)
        answering = self.up.answering(decode_url)
        call = asyncio.ensure_future(self._continuation(answering, d_body, res))
        out = None

        async def failed(message: str, whole: web.Response | None = None) -> web.StreamResponse:
            """Decode failed after the first token: release; a stream already begun ends
            with an error event, a whole answer is ``whole`` or a 502 error object."""
            if res is not None:
                await self.release(res.id, message)
            if out is None:
                return whole if whole is not None else json_error(message, 502)
            return await end_with_error(request, out, message)
        try:
            if ask.stream:
                out = await sse_response(request, self.cfg.write_timeout_s)
                await out.write(chunks.head_events(tail.usage(), tail.head_text()))
            try:
                resp, res = await call
                held[:] = [res] if res is not None else held
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                if out is None:
                    if res is not None:
                        await self.release(res.id, f"decode unreachable: {exc}")
                    raise
                return await failed(f"decode unreachable: {exc}")
            streamed = False  # decode's answer read to its [DONE]: its connection is reused
            direct = None     # decode's steady events relayed from its connection's callback
            try:
                if resp.status != 200:
                    payload = await resp.read()
                    return await failed(f"decode answered {resp.status}: {payload[:200]!r}",
                                        web.Response(body=payload, status=resp.status if resp.status < 500 else 502,
                                                     content_type="application/json"))
                resumes = 0
                while True:
                    events = EventStream(resp)
                    try:
                        async for batch in events:
                            wire = []
                            try:
                                for payload in batch:
                                    got = tail.take(payload)
                                    if got is None:
                                        continue
                                    if out is not None:
                                        wire.append(got if isinstance(got, bytes) else chunks.piece(
                                            got, tail.usage() if ask.continuous_usage else None))
                                    if tail.stopped_here:
                                        break
                            except DecodeStreamError:
                                if wire:  # what came before the error is the client's: a resume goes on after it
                                    await out.write(b"".join(wire))
                                raise
                            if "second_token" not in timings and (wire or tail.received):
                                timings["second_token"] = time.perf_counter()
                                metrics.TOKEN2.observe(timings["second_token"] - timings["prefill_answered"])
                            if wire:
                                await out.write(b"".join(wire))
                            if tail.stopped_here:
                                resp.close()  # a stop string ended it: decode's request is aborted
                                break
                            if direct is None and tail.passing and out is not None and not events.pending:
                                direct = Passthrough.begin(resp, request, out, tail)
                        break
                    except DecodeStreamError as exc:
                        if direct is not None:
                            direct.stop()
                            direct = None
                        # Decode died part way: once, another engine goes on from the tokens
                        # received, so the client's answer is whole (not a 502 or a cut stream).
                        moved = None if resumes or tail.received else await self.failover.relocate(res, str(exc))
                        if moved is not None:  # it failed before loading the KV: the KV follows
                            resumes += 1
                            resp.release()
                            res, new_url = moved
                            held[:] = [res]
                            resp = await self.up.continuation(answering, new_url, with_reservation(d_body, res))
                            if resp.status != 200:
                                payload = await resp.read()
                                return await failed(f"decode answered {resp.status}: {payload[:200]!r}")
                            continue
                        other = self._alone_url(answering.url) if not resumes and tail.finish_reason is None else None
                        body = resume_body(d_body, tail) if other is not None else None
                        if body is None:
                            if other is not None:  # every token came; only the last event was lost
                                tail.finish_reason = "length"
                                break
                            raise
                        resumes += 1
                        resp.release()
                        await self._decode_failed(res.id if res is not None else None, str(exc), other)
                        res = None
                        resp = await self.up.continuation(answering, other, body)
                        if resp.status != 200:
                            payload = await resp.read()
                            return await failed(f"decode answered {resp.status}: {payload[:200]!r}")
                streamed = True
            finally:
                if direct is not None:
                    direct.stop()
                if not streamed:
                    resp.release()
            timings["decode_done"] = time.perf_counter()
            try:
                if out is None:
                    return web.json_response(final_answer(ask, head, tail))
                # (The last events and the end of the chunked body in one write: one system
                # call, and one wakeup of the client, fewer per request.)
                await out.write_eof(chunks.usage_event(tail.usage()) + DONE)
                return out
            finally:
                self.up.reuse(resp)
        except DecodeStreamError as exc:
            return await failed(f"decode failed: {exc}")
        finally:
            if not call.done():
                call.cancel()
            answering.done()
            metrics.CONTINUATION_EVENTS.labels(how="passed").inc(tail.passed_events)
            metrics.CONTINUATION_EVENTS.labels(how="made").inc(tail.made_events)

    async def _continuation(self, answering: Answering, d_body: dict, res):
        """POST the continuation to ``answering.url``; (response, reservation still in use),
        ``answering`` left on the engine that answers. A decode engine that cannot be
        reached, or answers 5xx, before sending anything is replaced once: by another
        engine the reservation moves to (the KV is pushed again), else by one that
        computes the prompt itself (the KV landed on the first: its reservation is released)."""
        decode_url = answering.url
        other = self._alone_url(decode_url)
        try:
            resp = await self.up.continuation(answering, decode_url, d_body)
            if resp.status < 500 or other is None:
                return resp, res
            why = f"decode answered {resp.status}"
            resp.release()
        except aiohttp.ClientError as exc:  # unreachable, or gone before its answer began
            if other is None:
                raise
            why = f"decode unreachable: {type(exc).__name__}: {exc}"
        moved = await self.failover.relocate(res, why)
        if moved is not None:  # the KV is pushed again into another engine: continue there
            res, url = moved
            try:
                resp = await self.up.continuation(answering, url, with_reservation(d_body, res))
                if resp.status < 500:
                    return resp, res
                why = f"decode answered {resp.status}"
                resp.release()
            except aiohttp.ClientError as exc:
                why = f"decode unreachable: {type(exc).__name__}: {exc}"
            other = self._alone_url(decode_url, url)
            if other is None:
                await self.release(res.id, why)
                raise ApiError(f"no engine is available for model {self.cfg.model!r}", 503)
        await self._decode_failed(res.id if res is not None else None, why, other)
        body = {k: v for k, v in d_body.items() if k != "kv_transfer_params"}
        return await self.up.continuation(answering, other, body), None
