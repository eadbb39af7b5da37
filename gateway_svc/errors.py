"""Errors as OpenAI shapes them: `{"error": {"message", "type", "param", "code"}}` with the HTTP
status that the gRPC status (or the gateway's own check) calls for."""

from __future__ import annotations

import re

import grpc
from starlette.responses import JSONResponse

from chorus.retry_hint import retry_after_header, retry_hint

# gRPC status -> (HTTP status, OpenAI error type)
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}
# The gRPC request's field names -> the HTTP body's, so that `param` names what the client sent.
_PARAMS = {"text": "input", "references": "voice", "sampling.seed": "seed", "sampling": None,
           "omnivoice": "omnivoice", "streaming.first_chunk_frames": "first_chunk_frames",
           "streaming.chunk_frames": "chunk_frames", "audio": "audio", "voice_id": "voice_id"}
_FIELD = re.compile(r"^([a-z_]+(?:\[\d+\])?(?:\.[a-z_]+)*)")


class GatewayError(Exception):
    """An answer the gateway gives instead of audio (status, OpenAI-style body)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 429 else
                              "rate_limit_error" if status == 429 else "server_error")
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


SHOWN_CHARS = 32  # the most of a field name the client made up that an answer repeats


def invalid(param: str, message: str) -> GatewayError:
    """400 for a body field the gateway itself rejects; the message starts with the field's name."""
    if len(param) > SHOWN_CHARS:
        param = param[:SHOWN_CHARS] + "..."
    return GatewayError(400, f"{param}: {message}", param=param, code="invalid_value")


def param_of(details: str) -> str | None:
    """The HTTP field a scheduler's INVALID_ARGUMENT message is about (it starts with the gRPC field)."""
    m = _FIELD.match(re.sub(r"^config(\.|: )", "", details or ""))  # SynthesizeStream's config.*
    if not m:
        return None
    field = m.group(1)
    root = re.sub(r"\[\d+\]", "", field)
    for grpc_name, http_name in _PARAMS.items():
        if root == grpc_name or root.startswith(grpc_name + "."):
            return http_name or root.rsplit(".", 1)[-1]
    return root


def from_rpc(e: grpc.RpcError, retry_after: int) -> GatewayError:
    """The HTTP answer for a failed gRPC call; the scheduler's message passes through unchanged."""
    code, details = e.code(), e.details() or ""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
        return GatewayError(413, details, code="request_too_large")
    status, type_ = _STATUS.get(code, (500, "server_error"))
    param = param_of(details) if status in (400, 404) else None
    hint = retry_hint(e)  # the scheduler's own, where it gave one
    wait = (int(retry_after_header(hint)) if hint is not None else retry_after) if status in (429, 503) else None
    code_name = {401: "invalid_api_key", 404: "voice_not_found" if "voice" in (param or "") else "not_found",
                 429: "rate_limit_exceeded", 503: "unavailable"}.get(status, code.name.lower())
    return GatewayError(status, details, param=param, code=code_name, type_=type_, retry_after=wait)
