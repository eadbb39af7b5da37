"""Graceful drain on SIGTERM, as every serving process does it (rolling updates, scale-down).

One Drain per process holds the state: `begin()` flips it (readiness reads NOT_SERVING, new calls
are refused UNAVAILABLE with a retry hint so that clients go to another replica), the calls already
in flight run on, and the process exits 0 once none is left or `seconds` have passed; a call still
running at that deadline ends UNAVAILABLE with a message that says so, never a hang.

For a gRPC server: `interceptor(methods)` refuses and counts the calls of those methods, and
`close(server)` runs the shutdown: while calls are in flight the port answers for up to
ANNOUNCE_SECONDS more (health NOT_SERVING, a refusal with the hint for a call that still
arrives), then `server.stop` sends GOAWAY, so a client holding a connection to this process
(a gRPC channel keeps one for its life) opens its next call elsewhere, while the open streams
finish until the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time

import grpc

from chorus.retry_hint import set_retry_hint

log = logging.getLogger("chorus.drain")

RETRY_HINT_S = 1.0       # what a refused caller is told to wait: another replica serves it meanwhile
ANNOUNCE_SECONDS = 3.0   # a probe and the calls already on their way hear NOT_SERVING before GOAWAY
CUT_MARGIN_S = 1.0       # after the deadline, the time the ending streams get to send their status


class Drain:
    def __init__(self, seconds: float, what: str = "this server"):
        """seconds: how long the calls in flight may run on after begin(); what: named in refusals."""
        self.seconds = seconds
        self.what = what
        self.draining = False
        self.deadline: float | None = None      # time.monotonic() at which the last calls are ended
        self.started = asyncio.Event()          # set by begin()
        self.expired = asyncio.Event()          # set at the deadline
        self.active = 0                         # calls in flight
        self._idle = asyncio.Event()
        self._idle.set()
        self._on_begin: list = []
        self._closing: asyncio.Task | None = None

    def on_begin(self, fn) -> None:
        """Call fn() (or await it, if it is a coroutine function) when the drain begins."""
        self._on_begin.append(fn)

    def begin(self, why: str = "SIGTERM", seconds: float | None = None) -> None:
        """Start draining (idempotent); seconds: this drain's length, if not the configured one."""
        if self.draining:
            return
        self.draining = True
        self.seconds = self.seconds if seconds is None else seconds
        self.deadline = time.monotonic() + self.seconds
        log.info("draining (%s): %d calls in flight get up to %g s", why, self.active, self.seconds)
        loop = asyncio.get_running_loop()
        loop.call_later(self.seconds, self.expired.set)
        self.started.set()
        for fn in self._on_begin:
            result = fn()
            if inspect.isawaitable(result):
                loop.create_task(result)

    @property
    def remaining(self) -> float:
        return self.seconds if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    @property
    def refusal(self) -> str:
        return (f"{self.what} is draining (shutting down for a restart or scale-down); retry: another "
                "replica takes the call")

    @property
    def cut(self) -> str:
        return (f"{self.what} is shutting down and its drain time ({self.seconds:g} s) ran out before this "
                "stream ended; retry the request")

    @contextlib.contextmanager
    def track(self):
        """Count one call in flight for the length of the block."""
        self.active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.active -= 1
            if self.active == 0:
                self._idle.set()

    async def wait(self, limit: float | None = None) -> bool:
        """Wait until no call is in flight (True) or the deadline or `limit` seconds pass (False)."""
        timeout = self.remaining if limit is None else min(limit, self.remaining)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # ---- gRPC ------------------------------------------------------------------------------------
    def interceptor(self, methods: tuple[str, ...]) -> grpc.aio.ServerInterceptor:
        """Refuses (UNAVAILABLE + retry hint) and counts the calls of these full method names
        (`/package.Service/Method`), or of every method of a service given as `/package.Service/`."""
        return _DrainInterceptor(self, methods)

    def health(self, servicer) -> None:
        """Flip a grpc_health aio HealthServicer to NOT_SERVING for good when the drain begins."""
        self.on_begin(servicer.enter_graceful_shutdown)

    def close(self, server: grpc.aio.Server, why: str = "SIGTERM", seconds: float | None = None) -> asyncio.Task:
        """Stop `server` the drain's way (begins the drain); one shared task however often called."""
        self.begin(why, seconds)
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self._close(server))
        return self._closing

    async def _close(self, server: grpc.aio.Server) -> None:
        await self.wait(ANNOUNCE_SECONDS)
        await server.stop(self.remaining + CUT_MARGIN_S)


class _DrainInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, drain: Drain, methods: tuple[str, ...]):
        self.drain = drain
        self.methods = methods

    def _covers(self, method: str) -> bool:
        return any(method == m or (m.endswith("/") and method.startswith(m)) for m in self.methods)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not self._covers(details.method):
            return handler
        drain = self.drain
        kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_unary or handler.stream_unary:
            inner = handler.unary_unary or handler.stream_unary

            async def unary(request, context):
                if drain.draining:
                    await _refuse(context, drain.refusal)
                with drain.track():
                    return await inner(request, context)

            make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
            return make(unary, **kw)
        inner = handler.unary_stream or handler.stream_stream

        async def stream(request, context):
            if drain.draining:
                await _refuse(context, drain.refusal)
            with drain.track():
                replies = inner(request, context)
                if not inspect.isasyncgen(replies):  # a handler that writes with context.write
                    await replies
                    return
                async for reply in _until_expired(replies, drain):
                    yield reply
                if drain.expired.is_set():
                    await _refuse(context, drain.cut)

        make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
        return make(stream, **kw)


async def _refuse(context, message: str) -> None:
    set_retry_hint(context, RETRY_HINT_S)
    await context.abort(grpc.StatusCode.UNAVAILABLE, message)


async def _until_expired(replies, drain: Drain):
    """The handler's replies until it ends or the drain's deadline passes (then it is closed). The
    race costs a task per reply, so it runs only while draining."""
    step = None
    try:
        while True:
            if not drain.draining:
                try:
                    reply = await replies.__anext__()
                except StopAsyncIteration:
                    return
            else:
                if drain.expired.is_set():
                    return
                step = asyncio.ensure_future(replies.__anext__())
                expired = asyncio.ensure_future(drain.expired.wait())
                try:
                    await asyncio.wait({step, expired}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    expired.cancel()
                if not step.done():
                    return
                try:
                    reply = step.result()
                except StopAsyncIteration:
                    return
                step = None
            yield reply
    finally:
        if step is not None and not step.done():
            step.cancel()
            with contextlib.suppress(BaseException):
                await step
        await replies.aclose()
