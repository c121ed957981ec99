"""Errors of the emulated engine; the HTTP layer maps them to vLLM-shaped responses."""

from __future__ import annotations

from http import HTTPStatus


class EngineError(Exception):
    """Base of errors a request can end with; ``status`` is the HTTP status."""

    status: HTTPStatus = HTTPStatus.INTERNAL_SERVER_ERROR


class InvalidRequest(EngineError):
    """Bad input: malformed body, unknown fields values, too long a prompt."""

    status = HTTPStatus.BAD_REQUEST


class ModelNotFound(EngineError):
    """The request names a model this engine does not serve."""

    status = HTTPStatus.NOT_FOUND


class KVLoadFailed(EngineError):
    """A remote KV pull failed under ``kv_load_failure_policy="fail"``."""

    status = HTTPStatus.INTERNAL_SERVER_ERROR


class CapacityExceeded(EngineError):
    """No KV blocks freed up in time for the request."""

    status = HTTPStatus.SERVICE_UNAVAILABLE


def error_type(status: HTTPStatus) -> str:
    """vLLM's ``error.type`` for a status, e.g. ``BadRequestError``."""
    return {
        HTTPStatus.BAD_REQUEST: "BadRequestError",
        HTTPStatus.NOT_FOUND: "NotFoundError",
        HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
    }.get(status, "InternalServerError")


def error_body(status: HTTPStatus, message: str) -> dict[str, dict[str, object]]:
    """vLLM's error response body."""
    return {
        "error": {
            "message": message,
            "type": error_type(status),
            "param": None,
            "code": int(status),
        }
    }
