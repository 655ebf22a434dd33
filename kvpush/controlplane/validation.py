"""Checks every input at the edge; each failure names the field (INVALID_ARGUMENT)."""

from __future__ import annotations

import re

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from kvpush.controlplane.errors import invalid

TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
ENGINE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
POOL_NAME = ENGINE_ID
RESERVATION_ID = re.compile(r"^r-[0-9a-f]{24}$")
PRINTABLE = re.compile(r"^[\x21-\x7e]+$")
SERVING_URL = re.compile(r"^https?://[A-Za-z0-9.\[\]:_-]+(:[0-9]{1,5})?(/[\x21-\x7e]*)?$")
REASON = re.compile(r"^[\x20-\x7e]+$")

MAX_REQUEST_ID = 256
MAX_MODEL = 256
MAX_TOKENS = 4 * 1024 * 1024          # a 4M-token prompt is far past any model's context
MIN_DEADLINE_MS = 1_000               # etcd leases cannot be shorter
MAX_DEADLINE_MS = 3_600_000
MAX_BLOCKS_PER_ENGINE = 16 * 1024 * 1024
MAX_NIXL_METADATA = 1 << 20
MAX_QUOTA = 1 << 31


def no_unknown_fields(msg: Message, path: str = "", deep: bool = True) -> None:
    """Unknown fields mean a client speaks another API version: refuse, do not guess.
    ``deep=False`` checks ``msg``'s own fields only (its parts are checked one by one)."""
    unknown = UnknownFieldSet(msg)
    if len(unknown):
        raise invalid(f"unknown field number {unknown[0].field_number} in {path or msg.DESCRIPTOR.name}")
    if not deep:
        return
    for field, value in msg.ListFields():
        if field.message_type is None:
            continue
        if field.message_type.GetOptions().map_entry:
            continue
        items = value if field.is_repeated else [value]
        for item in items:
            no_unknown_fields(item, f"{path + '.' if path else ''}{field.name}")


def text(value: str, field: str, max_len: int, pattern: re.Pattern | None = None, required: bool = True) -> str:
    if not value:
        if required:
            raise invalid(f"{field} is required")
        return value
    if len(value) > max_len:
        raise invalid(f"{field} is longer than {max_len} characters")
    if pattern is not None and not pattern.match(value):
        raise invalid(f"{field} {value[:64]!r} has characters outside {pattern.pattern}")
    return value


def request_id(value: str) -> str:
    return text(value, "request_id", MAX_REQUEST_ID, PRINTABLE)


def reservation_id(value: str, field: str = "reservation_id") -> str:
    if not value:
        raise invalid(f"{field} is required")
    if not RESERVATION_ID.match(value):
        raise invalid(f"{field} {value[:64]!r} is not a reservation id")
    return value


def in_range(value: int, field: str, low: int, high: int) -> int:
    if not low <= value <= high:
        raise invalid(f"{field} must be in [{low}, {high}], got {value}")
    return value
