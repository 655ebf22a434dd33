"""The router's one error type and its one wire shape: vLLM's OpenAI error object
(``{"error": {"message", "type", "param", "code"}}``), so a client sees the same
errors through the router as from an engine."""

from __future__ import annotations

import json

from aiohttp import web

_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError",
          413: "RequestTooLargeError", 500: "InternalServerError", 502: "BadGatewayError",
          503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param

    def response(self) -> web.Response:
        return json_error(str(self), self.status, self.param)


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """The error object itself: a response's body, or an event in a stream already begun."""
    return {"error": {"message": message, "type": _TYPES.get(status, "Error"), "param": param, "code": status}}


def silent_engine(seconds: float) -> str:
    """Why an engine's answer failed that sent nothing for the read timeout (a 504's message,
    as a whole answer or as a stream's error event)."""
    return f"the engine sent nothing for {seconds:g} s (--upstream-timeout)"


def error_event(message: str, status: int) -> bytes:
    """The error object as a server-sent event: how a stream already begun says it failed
    (vLLM's server writes one, then ``[DONE]``, when its engine fails mid-answer)."""
    return b"data: " + json.dumps(error_body(message, status), ensure_ascii=False,
                                  separators=(",", ":")).encode() + b"\n\n"


def json_error(message: str, status: int, param: str | None = None) -> web.Response:
    return web.Response(status=status, content_type="application/json",
                        text=json.dumps(error_body(message, status, param)))
