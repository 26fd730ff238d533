"""Request failures with one meaning on both transports (HTTP status and gRPC status code)."""

from __future__ import annotations

import grpc


class EngineError(Exception):
    """A request the engine refuses; the message is safe and meant for the client."""

    http_status = 500
    grpc_code = grpc.StatusCode.INTERNAL
    # Short label for the failures metric.
    reason = "internal"


class NotFound(EngineError):
    http_status = 404
    grpc_code = grpc.StatusCode.NOT_FOUND
    reason = "not_found"


class InvalidInput(EngineError):
    http_status = 400
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "invalid_argument"


class TooLarge(EngineError):
    http_status = 413
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "too_large"


class QueueFull(EngineError):
    http_status = 503
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "queue_full"


class Unavailable(EngineError):
    """The engine is shutting down and takes no new requests."""

    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE
    reason = "unavailable"


class QueueTimeout(EngineError):
    """A request waited in its model's queue past its timeout (Triton's queue policy, REJECT)."""

    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE
    reason = "queue_timeout"
