"""One error type for everything the API refuses: a gRPC status code and a message
that names the offending field. Services turn it into ``context.abort``."""

from __future__ import annotations

import grpc


class ApiError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> ApiError:
    return ApiError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> ApiError:
    return ApiError(grpc.StatusCode.NOT_FOUND, message)


def failed_precondition(message: str) -> ApiError:
    return ApiError(grpc.StatusCode.FAILED_PRECONDITION, message)


def exhausted(message: str) -> ApiError:
    return ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def unavailable(message: str) -> ApiError:
    return ApiError(grpc.StatusCode.UNAVAILABLE, message)


class StateConflict(ApiError):
    """A transition the lifecycle does not allow from the reservation's current state."""

    def __init__(self, message: str, current, target) -> None:
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, message)
        self.current = current
        self.target = target
