"""How long a refused caller should wait before trying again, carried beside the status.

A server that refuses a call it could serve later (UNAVAILABLE while draining or without a
worker, RESOURCE_EXHAUSTED when its queue's expected wait is too long) sets the trailing
metadata key `retry-after-ms` to a whole number of milliseconds. The SDK waits at least that
long before its next attempt and the HTTP gateway turns it into a `Retry-After` header.
"""

from __future__ import annotations

import math

import grpc

KEY = "retry-after-ms"


def set_retry_hint(context, seconds: float) -> None:
    """Attach the hint to a servicer context's trailing metadata (call before aborting)."""
    context.set_trailing_metadata(((KEY, str(max(0, math.ceil(seconds * 1000)))),))


def retry_hint(error: grpc.RpcError) -> float | None:
    """The hint in seconds carried by a failed call, or None when it has none (or a bad one)."""
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == KEY:
            try:
                ms = int(value)
            except (TypeError, ValueError):
                return None
            return ms / 1000 if ms >= 0 else None
    return None


def retry_after_header(seconds: float) -> str:
    """The HTTP Retry-After value (whole seconds, at least 1) for a hint."""
    return str(max(1, math.ceil(seconds)))
