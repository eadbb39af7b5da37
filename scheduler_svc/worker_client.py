"""The scheduler's end of the ZeroMQ link to one gpu_worker (DEALER → ROUTER).

Plans are sent in order and journals come back in the same order; a reader
task matches each journal to its plan's future by step id (a journal lost with
a worker that died must not shift every later one onto the wrong step), and
hello and stats replies to the oldest waiting future of their kind, so the
scheduler may have several plans in flight (lookahead)."""

from __future__ import annotations

import asyncio
from collections import deque

import zmq
import zmq.asyncio

from chorus import curve
from chorus.v1 import worker_pb2

MAX_REPLY_BYTES = 256 << 20  # a hello or journal larger than this drops the link (ZMQ_MAXMSGSIZE)


class WorkerUnavailable(RuntimeError):
    pass


class WorkerClient:
    def __init__(self, endpoint: str, ctx: zmq.asyncio.Context | None = None,
                 curve_keys: tuple[str, str] | None = None):
        """curve_keys: (this side's .key_secret file, the worker's public .key file) for a CURVE link."""
        self.endpoint = endpoint
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        curve.limit_size(self._sock, MAX_REPLY_BYTES)
        if curve_keys:
            curve.connect_as(self._sock, *curve_keys)
        self._sock.connect(endpoint)
        self._waiting: dict[str, deque[asyncio.Future]] = {"hello": deque(), "stats": deque()}
        self._journals: dict[int, asyncio.Future] = {}  # step id -> the future of its journal
        self._reader: asyncio.Task | None = None

    def _start_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        while True:
            payload = await self._sock.recv()
            event = worker_pb2.WorkerEvent.FromString(payload)
            kind = event.WhichOneof("kind")
            if kind == "error":  # a command we sent was rejected: fail the oldest waiter of any kind
                oldest = [q.popleft() for q in self._waiting.values() if q][:1] or (
                    [self._journals.pop(min(self._journals))] if self._journals else [])
                for fut in oldest:
                    if not fut.done():
                        fut.set_exception(WorkerUnavailable(event.error))
                continue
            if kind == "journal":
                fut = self._journals.pop(event.journal.step_id, None)
                if fut is not None and not fut.done():  # None: a step given up on (timed out)
                    fut.set_result(event.journal)
                continue
            queue = self._waiting.get(kind)
            if queue:
                fut = queue.popleft()
                if not fut.done():
                    fut.set_result(getattr(event, kind))

    async def _request(self, cmd: worker_pb2.WorkerCommand, kind: str, timeout: float | None):
        self._start_reader()
        fut = asyncio.get_running_loop().create_future()
        if kind == "journal":
            self._journals[cmd.step.step_id] = fut
        else:
            self._waiting[kind].append(fut)
        await self._sock.send(cmd.SerializeToString())
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            if kind == "journal":
                self._journals.pop(cmd.step.step_id, None)
            elif fut in self._waiting[kind]:
                self._waiting[kind].remove(fut)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise WorkerUnavailable(f"worker at {self.endpoint} did not answer {kind} within {timeout}s") from e

    async def hello(self, timeout: float = 60.0, release_all: bool = False) -> worker_pb2.Hello:
        """release_all: this scheduler is starting; the worker drops every request's state."""
        return await self._request(worker_pb2.WorkerCommand(hello=worker_pb2.HelloRequest(release_all=release_all)),
                                   "hello", timeout)

    async def stats(self, timeout: float = 10.0) -> worker_pb2.WorkerStats:
        return await self._request(worker_pb2.WorkerCommand(stats=worker_pb2.StatsRequest()), "stats", timeout)

    async def step(self, plan: worker_pb2.StepPlan, timeout: float | None = 300.0) -> worker_pb2.Journal:
        return await self._request(worker_pb2.WorkerCommand(step=plan), "journal", timeout)

    def monitor(self) -> zmq.asyncio.Socket:
        """A socket receiving this link's connection events (scheduler_svc/heartbeat.py reads it)."""
        return self._sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)

    async def close(self) -> None:
        if self._reader:
            self._reader.cancel()
        self._sock.close()
