"""The scheduler's end of the ZeroMQ link to one gpu_worker (DEALER → ROUTER).

Plans are sent in order and journals come back in the same order; a reader
task matches each event to the oldest waiting future of its kind, so the
scheduler may have several plans in flight (lookahead)."""

from __future__ import annotations

import asyncio
from collections import deque

import zmq
import zmq.asyncio

from chorus.v1 import worker_pb2


class WorkerUnavailable(RuntimeError):
    pass


class WorkerClient:
    def __init__(self, endpoint: str, ctx: zmq.asyncio.Context | None = None):
        self.endpoint = endpoint
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._waiting: dict[str, deque[asyncio.Future]] = {"hello": deque(), "journal": deque(),
                                                            "stats": deque()}
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
                for q in self._waiting.values():
                    if q:
                        q.popleft().set_exception(WorkerUnavailable(event.error))
                        break
                continue
            queue = self._waiting.get(kind)
            if queue:
                fut = queue.popleft()
                if not fut.done():
                    fut.set_result(getattr(event, kind))

    async def _request(self, cmd: worker_pb2.WorkerCommand, kind: str, timeout: float | None):
        self._start_reader()
        fut = asyncio.get_running_loop().create_future()
        self._waiting[kind].append(fut)
        await self._sock.send(cmd.SerializeToString())
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError as e:
            raise WorkerUnavailable(f"worker at {self.endpoint} did not answer {kind} within {timeout}s") from e

    async def hello(self, timeout: float = 60.0) -> worker_pb2.Hello:
        return await self._request(worker_pb2.WorkerCommand(hello=worker_pb2.HelloRequest()), "hello", timeout)

    async def stats(self, timeout: float = 10.0) -> worker_pb2.WorkerStats:
        return await self._request(worker_pb2.WorkerCommand(stats=worker_pb2.StatsRequest()), "stats", timeout)

    async def step(self, plan: worker_pb2.StepPlan, timeout: float | None = 300.0) -> worker_pb2.Journal:
        return await self._request(worker_pb2.WorkerCommand(step=plan), "journal", timeout)

    async def close(self) -> None:
        if self._reader:
            self._reader.cancel()
        self._sock.close()
