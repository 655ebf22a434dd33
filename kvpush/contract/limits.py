"""Limits that both ends of the API must agree on (the server enforces, clients obey)."""

MAX_ASKS_PER_MESSAGE = 1024  # ReserveStream: asks in one client message
