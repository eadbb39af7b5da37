"""API keys on the public API: `authorization: Bearer KEY` in gRPC metadata.

The key file has one key a line, `OWNER KEY` (blank lines and `#` comments skipped). The owner
names who holds the key; voices belong to the owner that created them. The file is read again
when it changes (checked at most once a second) or on SIGHUP, so keys are added and revoked
without a restart. Health and reflection stay open: only the services named in `protected`
need a key. Keys are never logged or echoed.
"""

from __future__ import annotations

import contextvars
import hmac
import logging
import os
import time

import grpc

log = logging.getLogger("chorus.api_keys")

HOW = "send the metadata `authorization: Bearer <key>` (chorus say --api-key, or CHORUS_API_KEY)"

# The owner of the key of the call being served ("" when keys are off); set by the servicer.
caller: contextvars.ContextVar[str] = contextvars.ContextVar("caller", default="")


class KeyFileError(ValueError):
    """A key file that cannot be used; the message names the line (never the key)."""


def read_keys(path: str) -> dict[str, str]:
    """{key: owner} of a key file."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as e:
        raise KeyFileError(f"api_keys {path}: {e.strerror}") from None
    out: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) != 2:
            raise KeyFileError(f"api_keys {path} line {n}: expected `OWNER KEY`, got {len(words)} words")
        owner, key = words
        if len(key) < 16:
            raise KeyFileError(f"api_keys {path} line {n}: the key of {owner!r} is shorter than 16 characters")
        out[key] = owner
    return out


class ApiKeys:
    """The keys of a key file, kept current."""

    def __init__(self, path: str, check_interval: float = 1.0):
        self.path = path
        self.check_interval = check_interval
        self._keys = read_keys(path)
        self._stamp = self._file_stamp()
        self._checked = time.monotonic()
        log.info("API keys: %d keys of %d owners from %s", len(self._keys), len(set(self._keys.values())), path)

    def _file_stamp(self):
        try:
            st = os.stat(self.path)
            return st.st_mtime_ns, st.st_size, st.st_ino
        except OSError:
            return None

    def reload(self) -> None:
        """Reads the file again; a file that cannot be read leaves the current keys in force."""
        try:
            keys = read_keys(self.path)
        except KeyFileError as e:
            log.error("%s; keeping the %d keys in force", e, len(self._keys))
            return
        self._keys, self._stamp = keys, self._file_stamp()
        log.info("API keys reloaded: %d keys", len(keys))

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.check_interval:
            return
        self._checked = now
        if self._file_stamp() != self._stamp:
            self.reload()

    def owner(self, metadata) -> str | None:
        """The owner of the bearer key in metadata ((key, value) pairs), or None."""
        self._maybe_reload()
        for k, v in metadata or ():
            if k == "authorization" and isinstance(v, str) and v[:7].lower() == "bearer ":
                key = v[7:].strip()
                for known, owner in self._keys.items():  # constant time per key: no timing oracle
                    if hmac.compare_digest(known.encode(), key.encode()):
                        return owner
                return None
        return None

    def problem(self, metadata) -> str:
        """Why a call with this metadata has no owner (for UNAUTHENTICATED)."""
        has = any(k == "authorization" for k, _ in metadata or ())
        return ("the API key is not valid; " if has else "this API needs an API key; ") + HOW


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call to a protected service without a valid key."""

    def __init__(self, keys: ApiKeys, protected: tuple[str, ...]):
        self.keys = keys
        self.prefixes = tuple(f"/{s}/" for s in protected)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefixes):
            return handler
        if self.keys.owner(details.invocation_metadata) is not None:
            return handler
        message = self.keys.problem(details.invocation_metadata)

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # an async generator, as a server-streaming handler is

        kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(deny, **kw)
        return None  # no streaming-request RPCs in the protected services


# ---- the client side --------------------------------------------------------------------------------

def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def bearer_interceptors(key) -> list:
    """Interceptors for a grpc.aio channel that add `authorization: Bearer KEY` to every unary and
    server-streaming call; key: a string, or a callable giving the current call's key (None: send
    none), e.g. the gateway's HTTP caller's. (A channel files each interceptor under one kind only.)"""
    current = key if callable(key) else (lambda: key)

    def with_key(details):
        k = current()
        if not k:
            return details
        kept = [(m, v) for m, v in (details.metadata or ()) if m != "authorization"]
        return details._replace(metadata=grpc.aio.Metadata(*kept, *bearer(k)))

    class Unary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, details, request):
            return await continuation(with_key(details), request)

    class Streaming(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation, details, request):
            return await continuation(with_key(details), request)

    return [Unary(), Streaming()]
