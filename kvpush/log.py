"""structlog set-up shared by every kvpush process: one JSON object per line on stderr.

Handlers bind ``tenant``, ``request_id`` and ``reservation_id`` so a reservation
can be followed across the control plane, sidecars and router with one grep. Records of
the standard ``logging`` module (the sidecar's modules, gRPC's, aiohttp's) are written
as the same JSON lines (``JsonLines``), with those fields where a call passes them in
``extra``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys

import structlog

_configured = False


def configure(component: str, level: str | None = None) -> None:
    global _configured
    level_name = (level or os.environ.get("KVPUSH_LOG_LEVEL", "info")).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level_name)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level_name)),
        # (WriteLogger writes a line and its newline in one call, so one system call a
        # line: PrintLogger's print makes two on a non-interactive stderr.)
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(component=component, pid=os.getpid())
    _configured = True


class JsonLines(logging.Formatter):
    """A ``logging`` record as one JSON object, with the keys structlog's lines have."""

    FIELDS = ("tenant", "request_id", "reservation_id", "engine_id")

    def format(self, record: logging.LogRecord) -> str:
        out = {"event": record.getMessage(), "level": record.levelname.lower(), "logger": record.name,
               "timestamp": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
               .isoformat().replace("+00:00", "Z"),
               **structlog.contextvars.get_contextvars()}
        for field in self.FIELDS:
            value = getattr(record, field, None)
            if value is not None:
                out[field] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def get(name: str | None = None) -> structlog.typing.FilteringBoundLogger:
    logger = structlog.get_logger(name) if name else structlog.get_logger()
    return logger
