"""Errors the front doors return, in OpenAI's shape: status, message, type, param, code."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayTaskError


@dataclass
class ApiError(Exception):  # not frozen: raising sets __cause__ / __traceback__ on it
    status: int  # HTTP status (the gRPC service maps it to a status code)
    message: str  # what is wrong, naming the field and the limit
    type: str = "invalid_request_error"  # OpenAI's error type
    param: str | None = None  # the request field at fault, when one is
    code: str | None = None  # machine-readable reason (e.g. "model_not_found")
    # how long to wait before retrying, sent with a 429 / 503 (``retry_headers``)
    retry_after_s: float | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def retry_headers(retry_after_s: float) -> dict[str, str]:
    """HTTP's Retry-After (whole seconds, at least 1) and the exact wait in milliseconds as
    ``retry-after-ms``, which the OpenAI SDK reads first (a wait predicted at 0.3 s is retried
    after 0.3 s, not 1); the gRPC door sends both as trailing metadata."""
    return {
        "retry-after": str(max(1, math.ceil(retry_after_s))),
        "retry-after-ms": str(max(1, round(retry_after_s * 1000))),
    }


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 for a request that breaks a rule; ``message`` names the field and the limit."""
    return ApiError(400, message, param=param, code=code)


def overloaded(message: str, retry_after_s: int = 1) -> ApiError:
    return ApiError(
        429, message, "rate_limit_error", code="overloaded", retry_after_s=retry_after_s
    )


def unavailable(message: str, retry_after_s: int = 5) -> ApiError:
    return ApiError(503, message, "service_unavailable", retry_after_s=retry_after_s)


def cluster_failed(error: Exception) -> ApiError:
    """A 503 for a request the cluster failed (a worker died, a KV transfer failed): worth
    retrying at once, as both front doors tell their clients."""
    return ApiError(503, str(error), "service_unavailable", retry_after_s=1)


def internal_error(error: Exception) -> ApiError:
    """A 500 for a bug: as an ApiError, so uvicorn keeps the connection open."""
    return ApiError(500, f"internal error: {error}", "internal_error")


def refused(error: ValueError) -> ApiError:
    """A 400 for a request the workers refuse (``n`` above their max_num_seqs, more tokens than
    the KV cache holds). A refusal raised in a Ray actor arrives as a task error that is also a
    ValueError; its message is the traceback, so the worker's own message is used."""
    cause = error.cause if isinstance(error, RayTaskError) else error
    return invalid(str(cause))
