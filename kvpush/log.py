"""structlog set-up shared by every kvpush process: one JSON object per line on stderr.

Handlers bind ``tenant``, ``request_id`` and ``reservation_id`` so a reservation
can be followed across the control plane, sidecars and router with one grep.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


def configure(component: str, level: str | None = None) -> None:
    global _configured
    level_name = (level or os.environ.get("KVPUSH_LOG_LEVEL", "info")).upper()
    logging.basicConfig(stream=sys.stderr, level=level_name, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level_name)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(component=component, pid=os.getpid())
    _configured = True


def get(name: str | None = None) -> structlog.typing.FilteringBoundLogger:
    logger = structlog.get_logger(name) if name else structlog.get_logger()
    return logger
