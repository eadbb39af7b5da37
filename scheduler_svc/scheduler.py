"""Request lifecycle and continuous batching.

One asyncio task turns the waiting queue and the running set into a
StepPlan per step, sends it to the worker, and applies the journal: each
sampled row goes to its request's event queue, stops and budgets finish
requests, and finished or aborted requests are released on the worker in
the next plan. Every generated row is kept on the request until it ends.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from chorus.v1 import common_pb2, worker_pb2
from scheduler_svc import metrics
from scheduler_svc.kv_allocator import KVSlotAllocator
from scheduler_svc.worker_client import WorkerClient

log = logging.getLogger("chorus.scheduler")


class QueueFull(RuntimeError):
    pass


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass
class FrameEvent:
    index: int
    row: np.ndarray  # [1 + n_vq] int32


@dataclass
class FinishEvent:
    reason: str  # "stop" | "max_frames"


@dataclass
class ErrorEvent:
    message: str


@dataclass
class Request:
    prompt_rows: np.ndarray            # [T, 1 + n_vq] int32
    sampling: worker_pb2.SamplingConfig
    max_frames: int
    id: int = 0
    phase: Phase = Phase.WAITING
    kv_slots: list[int] = field(default_factory=list)
    prefilled: int = 0                 # prompt rows sent to the worker so far
    frames: list[np.ndarray] = field(default_factory=list)
    holds_worker_state: bool = False
    finish_reason: str | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    t_accepted: float = field(default_factory=time.monotonic)
    t_scheduled: float | None = None

    @property
    def prompt_len(self) -> int:
        return self.prompt_rows.shape[0]


def rows_matrix(rows: np.ndarray) -> common_pb2.IntMatrix:
    arr = np.ascontiguousarray(rows, dtype="<i4")
    return common_pb2.IntMatrix(rows=arr.shape[0], cols=arr.shape[1], data=arr.tobytes())


class Scheduler:
    def __init__(self, worker: WorkerClient, hello: worker_pb2.Hello, *, max_queue: int = 256,
                 max_running: int | None = None, prefill_chunk: int = 512):
        self.worker = worker
        self.hello = hello
        self.kv = KVSlotAllocator(hello.kv_slots)
        self.max_queue = max_queue
        self.max_running = min(max_running or hello.max_batch, hello.max_batch)
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}   # admitted: prefilling or decoding
        self.pending_release: list[int] = []
        self._ids = itertools.count(1)
        self._step_ids = itertools.count(1)
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None

    # ---- public --------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()

    def submit(self, req: Request) -> Request:
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"the waiting queue is full ({self.max_queue} requests); retry later")
        req.id = next(self._ids)
        self.waiting.append(req)
        metrics.QUEUE_DEPTH.set(len(self.waiting))
        self._wakeup.set()
        return req

    def abort(self, req: Request) -> None:
        """Client went away: drop the request wherever it is; idempotent."""
        if req.phase is Phase.DONE:
            return
        if req.phase is Phase.WAITING:
            self.waiting.remove(req)
            req.phase = Phase.DONE
            metrics.QUEUE_DEPTH.set(len(self.waiting))
            return
        self._finish(req, None)
        metrics.ABORTED.inc()

    def kv_budget(self, prompt_len: int, max_frames: int) -> int:
        """Rows a request occupies at most: the prompt plus every fed-back frame."""
        return prompt_len + max_frames - 1

    # ---- the loop --------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            plan = self._build_plan()
            if not (plan.prefill or plan.decode or plan.release):
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            in_plan = [self.running[i.request_id] for i in plan.prefill if i.request_id in self.running]
            in_plan += [self.running[i.request_id] for i in plan.decode if i.request_id in self.running]
            t0 = time.monotonic()
            try:
                journal = await self.worker.step(plan)
            except Exception as e:  # noqa: BLE001 - the worker is gone: fail what it held
                log.error("worker step failed: %s", e)
                for req in in_plan:
                    self._fail(req, f"worker unavailable: {e}")
                continue
            metrics.STEP_SECONDS.observe(time.monotonic() - t0)
            if journal.error:
                log.error("step %d failed on the worker: %s", plan.step_id, journal.error)
                for req in in_plan:
                    self._fail(req, f"worker step failed: {journal.error}", released=True)
                continue
            self._apply(journal)

    def _build_plan(self) -> worker_pb2.StepPlan:
        plan = worker_pb2.StepPlan(step_id=next(self._step_ids), release=self.pending_release)
        self.pending_release = []
        for req in self.running.values():
            if req.phase is Phase.DECODE:
                slot = req.kv_slots[req.prompt_len + len(req.frames) - 1]
                plan.decode.add(request_id=req.id, kv_slot=slot)
        self._admit()
        budget = self.prefill_chunk
        for req in self.running.values():
            if req.phase is not Phase.PREFILL or budget <= 0 or req.prefilled >= req.prompt_len:
                continue
            start = req.prefilled
            n = min(budget, req.prompt_len - start)
            item = plan.prefill.add(request_id=req.id, first_chunk=start == 0,
                                    last_chunk=start + n == req.prompt_len,
                                    generation_step=len(req.frames))
            item.rows.CopyFrom(rows_matrix(req.prompt_rows[start:start + n]))
            item.kv_slots.extend(req.kv_slots[start:start + n])
            if start == 0:
                item.sampling.CopyFrom(req.sampling)
                item.prompt_length = req.prompt_len
            req.prefilled += n
            budget -= n
            if req.t_scheduled is None:
                req.t_scheduled = time.monotonic()
        return plan

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            need = self.kv_budget(req.prompt_len, req.max_frames)
            if need > self.kv.free_slots:
                break  # FIFO: wait for running requests to free slots
            self.waiting.popleft()
            req.kv_slots = self.kv.alloc(need)
            req.phase = Phase.PREFILL
            req.holds_worker_state = True
            self.running[req.id] = req
        metrics.QUEUE_DEPTH.set(len(self.waiting))
        metrics.RUNNING.set(len(self.running))
        metrics.KV_USED.set(self.kv.used_slots)

    def _apply(self, journal: worker_pb2.Journal) -> None:
        if journal.request_ids:
            rows = np.frombuffer(journal.rows.data, dtype="<i4").reshape(journal.rows.rows, journal.rows.cols)
        for i, rid in enumerate(journal.request_ids):
            req = self.running.get(rid)
            if req is None or req.phase is Phase.DONE:
                continue  # aborted while the step ran
            if journal.stopped[i]:
                self._finish(req, "stop")
                continue
            req.phase = Phase.DECODE
            row = rows[i].copy()
            req.frames.append(row)
            req.events.put_nowait(FrameEvent(len(req.frames) - 1, row))
            metrics.FRAMES.inc()
            if len(req.frames) >= req.max_frames:
                self._finish(req, "max_frames")

    def _finish(self, req: Request, reason: str | None) -> None:
        req.phase = Phase.DONE
        self.running.pop(req.id, None)
        if req.holds_worker_state:
            self.pending_release.append(req.id)
            req.holds_worker_state = False
            self._wakeup.set()
        if req.kv_slots:
            self.kv.free(req.kv_slots)
            req.kv_slots = []
        metrics.RUNNING.set(len(self.running))
        metrics.KV_USED.set(self.kv.used_slots)
        if reason is not None:
            req.finish_reason = reason
            req.events.put_nowait(FinishEvent(reason))
        self._wakeup.set()

    def _fail(self, req: Request, message: str, released: bool = False) -> None:
        if released:
            req.holds_worker_state = False
        self._finish(req, None)
        req.events.put_nowait(ErrorEvent(message))
