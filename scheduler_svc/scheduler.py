"""Request lifecycle and continuous batching.

One asyncio task turns the waiting queue and the running set into StepPlans,
sends them to the worker, and applies the journals: each sampled row goes to
its request's event queue, stops and budgets finish requests, and finished,
aborted or retracted requests are released on the worker in the next plan.

KV: every row of a request lives in one slot. A prefix may come from the
radix cache (locked while the request runs); the rest is the request's own,
allocated a page at a time as it grows. When a decode step cannot get a page,
the cache is evicted first, then requests are retracted (fewest frames first):
their rows go back to the cache, and they re-prefill prompt + output later and
resume at the same frame. Seeded sampling depends only on (seed, frame,
channel), so none of this changes a request's frames.

Lookahead: with it on, up to `lookahead_depth` plans are in flight: the next
plans are sent before the previous journals return; a request that stopped in
step N may still be decoded in the steps already sent (the worker skips it
once it knows), and those late results are discarded here.
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

from chorus.v1 import worker_pb2
from chorus.wire import rows_matrix
from scheduler_svc import metrics
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.kv_allocator import KVSlotAllocator
from scheduler_svc.radix_cache import RadixCache, RadixNode
from scheduler_svc.row_keys import prompt_row_key, prompt_row_keys
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


@dataclass(eq=False)  # identity: requests are compared as objects, never by value
class Request:
    prompt_rows: np.ndarray            # [T, 1 + n_vq] int32
    sampling: worker_pb2.SamplingConfig
    max_frames: int
    id: int = 0
    phase: Phase = Phase.WAITING
    frames: list[np.ndarray] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)  # radix key of every row: prompt, then frames
    # KV of the current admission
    kv_slots: list[int] = field(default_factory=list)  # slot of row p at index p (+ spare tail)
    prefix_node: RadixNode | None = None  # locked radix match
    cached_len: int = 0                # rows served by the cache (slots owned by the cache)
    prefill_len: int = 0               # rows to prefill in this admission
    rows_sent: int = 0                 # rows whose KV write has been planned
    rows_written: int = 0              # rows whose KV write has been journaled
    frames_planned: int = 0            # frames the worker will have sampled once in-flight steps land
    holds_worker_state: bool = False
    # reporting
    cached_prompt_rows: int = 0
    retractions: int = 0
    finish_reason: str | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    t_accepted: float = field(default_factory=time.monotonic)
    t_scheduled: float | None = None

    @property
    def prompt_len(self) -> int:
        return self.prompt_rows.shape[0]

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of the sequence prompt + frames."""
        t = self.prompt_len
        parts = []
        if start < t:
            parts.append(self.prompt_rows[start:min(stop, t)])
        if stop > t:
            parts.append(np.stack(self.frames[max(start, t) - t:stop - t]))
        return np.concatenate(parts) if len(parts) > 1 else parts[0]


class EventSink:
    """Where the scheduler's request events go. This one puts them on each request's own
    queue (in-process consumers: tests, benchmarks); the core's FrontendLink batches them
    into one message per frontend per step, sent at flush()."""

    def emit(self, req: Request, event: FrameEvent | FinishEvent | ErrorEvent) -> None:
        req.events.put_nowait(event)

    def flush(self) -> None:
        pass


@dataclass
class _InFlight:
    plan: worker_pb2.StepPlan
    future: asyncio.Future
    writes: dict[int, int]         # request id -> rows whose KV this plan writes


class _NeedsDrain(Exception):
    """KV is short and only retraction would help: wait for in-flight steps first."""


class Scheduler:
    def __init__(self, worker: WorkerClient, hello: worker_pb2.Hello, config: SchedulerConfig,
                 sink: EventSink | None = None):
        self.worker = worker
        self.sink = sink or EventSink()
        self.hello = hello
        self.config = config
        worker_page = max(hello.page_size, 1)
        page_size = config.page_size or worker_page
        if page_size % worker_page:
            raise ValueError(f"page size {page_size} is not a multiple of the worker's page size {worker_page}: "
                             f"its attention reads whole pages (leave --page-size at 0 to use the worker's)")
        self.kv = KVSlotAllocator(hello.kv_slots, page_size)
        self.cache = RadixCache(self.kv)
        self.max_running = min(config.max_running or hello.max_batch, hello.max_batch)  # 0: the worker's
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.pending_release: list[int] = []
        self.inflight: deque[_InFlight] = deque()
        self._journal_at: float | None = None  # when the last journal arrived, until the next plan is sent
        self._ids = itertools.count(1)
        self._step_ids = itertools.count(1)
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._steps_since_prefill = 0

    # ---- public --------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()

    def submit(self, req: Request) -> Request:
        if len(self.waiting) >= self.config.max_queue:
            raise QueueFull(f"the waiting queue is full ({self.config.max_queue} requests); retry later")
        req.id = next(self._ids)
        req.keys = prompt_row_keys(req.prompt_rows).tolist()
        self.waiting.append(req)
        self._update_gauges()
        self._wakeup.set()
        return req

    def abort(self, req: Request) -> None:
        """The client went away: drop the request wherever it is. Idempotent."""
        if req.phase is Phase.DONE:
            return
        if req.phase is Phase.WAITING:
            self.waiting.remove(req)
            req.phase = Phase.DONE
            self._update_gauges()
            return
        self._finish(req, None)
        metrics.ABORTED.inc()

    def fits(self, prompt_len: int) -> bool:
        """Whether a prompt could ever be admitted (with the whole cache free)."""
        return self.kv.pages_for(prompt_len + 1) <= self.kv.num_pages

    # ---- the loop --------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            try:
                await self._iterate()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a scheduler bug must not silently hang every client
                log.exception("scheduler loop failed; failing the running requests")
                for req in list(self.running.values()):
                    self._finish(req, None)
                    self.sink.emit(req, ErrorEvent("internal scheduler error; see the scheduler log"))
                self.sink.flush()
                await asyncio.sleep(0.1)

    async def _iterate(self) -> None:
        """One turn: send a plan if the pipeline has room, then wait for a journal or for work."""
        depth = max(1, self.config.lookahead_depth) if self.config.lookahead else 1
        sent = False
        if len(self.inflight) < depth:
            try:
                sent = self._send(self._build_plan())
            except _NeedsDrain:
                pass
        if sent and len(self.inflight) < depth and self._lookahead_eligible():
            return  # overlap: build step N+1 while step N runs
        if self.inflight:
            await self._receive(self.inflight.popleft())
        elif not sent:
            self._wakeup.clear()
            await self._wakeup.wait()

    def _lookahead_eligible(self) -> bool:
        last = self.inflight[-1].plan
        return len(last.decode) + len(last.prefill) <= self.config.lookahead_max_batch and bool(self.running)

    def _send(self, built: tuple[worker_pb2.StepPlan, dict[int, int]] | None) -> bool:
        if built is None:
            return False
        plan, writes = built
        if self.inflight:
            metrics.LOOKAHEAD_STEPS.inc()
        fut = asyncio.ensure_future(self.worker.step(plan, timeout=self.config.step_timeout))
        self.inflight.append(_InFlight(plan, fut, writes))
        if self._journal_at is not None:
            metrics.TURNAROUND_MS.observe((time.monotonic() - self._journal_at) * 1e3)
            self._journal_at = None
        return True

    async def _await_journal(self, step: _InFlight) -> worker_pb2.Journal | None:
        """The step's journal. Every worker_probe seconds without it the worker is asked hello; if a new
        worker process answers, the old one died with this step: None, after _worker_restarted. An old
        process that is alive answers only once its pending step is done, or not within the probe."""
        probe = self.config.worker_probe
        asked = False
        while probe > 0:
            done, _ = await asyncio.wait({step.future}, timeout=probe)
            if done:
                break
            if not asked:
                log.warning("step %d has no journal after %.0f s: asking the worker whether it restarted",
                            step.plan.step_id, probe)
                asked = True
            # no answer (busy or gone) or the same process: the step's own timeout decides
            if await self._worker_came_back(probe):
                step.future.cancel()
                return None
        return await step.future

    async def _receive(self, step: _InFlight) -> None:
        t0 = time.monotonic()
        try:
            journal = await self._await_journal(step)
            if journal is None:  # the worker restarted: everything running re-prefills
                self.sink.flush()
                return
        except Exception as e:  # noqa: BLE001 - the worker is gone: fail what it held
            log.error("worker step failed: %s", e)
            if not await self._worker_came_back(self.config.restart_wait):
                log.error("no new worker process answered hello (waited up to %.0f s)", self.config.restart_wait)
                self._fail_step(step, f"worker unavailable: {e}")
            self.sink.flush()
            return
        self._journal_at = time.monotonic()
        if self._is_new_worker(journal.incarnation):
            self._worker_restarted(journal.incarnation)  # this journal was computed without the old KV
            self.sink.flush()
            return
        metrics.STEP_SECONDS.observe(self._journal_at - t0)
        (metrics.WORKER_MIXED_STEP_MS if step.plan.prefill else metrics.WORKER_DECODE_STEP_MS).observe(journal.step_ms)
        if journal.error:
            log.error("step %d failed on the worker: %s", step.plan.step_id, journal.error)
            self._fail_step(step, f"worker step failed: {journal.error}")
        else:
            self._apply(journal, step.writes)
        self.sink.flush()

    # ---- planning --------------------------------------------------------------
    def _build_plan(self) -> tuple[worker_pb2.StepPlan, dict[int, int]] | None:
        decoders = [r for r in self.running.values()
                    if r.phase is Phase.DECODE or (r.phase is Phase.PREFILL and r.rows_sent == r.prefill_len)]
        decoders = [r for r in decoders if 0 < r.frames_planned < r.max_frames]
        self._reserve_decode_pages(decoders)
        plan = worker_pb2.StepPlan(step_id=next(self._step_ids))
        writes: dict[int, int] = {}
        for req in decoders:
            pos = req.rows_sent
            if pos >= len(req.kv_slots):
                req.kv_slots += self.kv.alloc(1)
            plan.decode.add(request_id=req.id, kv_slot=req.kv_slots[pos])
            req.rows_sent += 1
            req.frames_planned += 1
            writes[req.id] = 1
        interval = self._prefill_interval(len(plan.decode))
        prefill_now = self._steps_since_prefill + 1 >= interval
        if prefill_now:
            self._admit()
        # A step that prefills for `interval` steps takes their rows: gathering must not cut the rate
        # at which requests get in (a burst of arrivals under load would drain at a chunk per interval).
        budget = (self.config.prefill_chunk * interval or 1 << 30) if prefill_now else 0
        for req in self.running.values():
            if req.phase is not Phase.PREFILL or req.rows_sent >= req.prefill_len or budget <= 0:
                continue
            start = req.rows_sent
            n = min(budget, req.prefill_len - start)
            first = start == req.cached_len
            item = plan.prefill.add(request_id=req.id, first_chunk=first, last_chunk=start + n == req.prefill_len,
                                    generation_step=len(req.frames))
            item.rows.CopyFrom(rows_matrix(req.rows(start, start + n)))
            item.kv_slots.extend(req.kv_slots[start:start + n])
            if first:
                item.prefix_slots.extend(req.kv_slots[:start])
                item.sampling.CopyFrom(req.sampling)
                item.prompt_length = req.prompt_len
            req.rows_sent += n
            writes[req.id] = n
            metrics.PREFILL_ROWS.inc(n)
            if item.last_chunk:
                req.frames_planned += 1
            budget -= n
            if req.t_scheduled is None:
                req.t_scheduled = time.monotonic()
        plan.release.extend(self.pending_release)
        self.pending_release = []
        self._steps_since_prefill = 0 if plan.prefill else self._steps_since_prefill + 1
        self._update_gauges()
        if not (plan.prefill or plan.decode or plan.release):
            return None
        return plan, writes

    def _reserve_decode_pages(self, decoders: list[Request]) -> None:
        """Make room for every decoder that needs a new page this step: evict the
        cache, then (with nothing in flight) retract the requests with fewest frames."""
        need = sum(1 for r in decoders if r.rows_sent >= len(r.kv_slots)) * self.kv.page_size
        if self.kv.free_slots >= need or self.cache.ensure_free(need):
            return
        if self.inflight:
            raise _NeedsDrain
        victims = sorted(self.running.values(), key=lambda r: (len(r.frames), -r.id))
        while self.kv.free_slots < need and victims:
            victim = victims.pop(0)
            if victim in decoders and victim.rows_sent >= len(victim.kv_slots):
                need -= self.kv.page_size
            if victim in decoders:
                decoders.remove(victim)
            self._retract(victim)
            self.cache.ensure_free(need)

    @property
    def loaded(self) -> bool:
        """Whether the scheduler runs under load (loaded_batch or more requests admitted): the frontends
        then start new streams with their loaded first-chunk size (--first-chunk-frames-loaded)."""
        return 0 < self.config.loaded_batch <= len(self.running)

    def _prefill_interval(self, decoding: int) -> int:
        """Prefill work is admitted and prefilled every n-th step (n returned here). While requests
        decode it is gathered (each step that carries prefill pays a fixed cost in the worker, folded or
        not): n = prefill_interval, or under load (loaded_batch or more decoding) at least
        loaded_prefill_interval; with nothing decoding, 1."""
        if not decoding:
            return 1
        interval = max(1, self.config.prefill_interval)
        if self.config.loaded_batch and decoding >= self.config.loaded_batch:
            interval = max(interval, self.config.loaded_prefill_interval)
        return interval

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            total = req.prompt_len + len(req.frames)
            match = None
            if self.config.radix_cache:
                # Never match the last row: its hidden state is what samples the next frame.
                match = self.cache.match_prefix(req.keys[:total - 1], self.config.cache_key)
                self.cache.lock(match.node)  # before any eviction below can take it
            cached = match.length if match else 0
            # Keep a page per running request in reserve so admission never starves decodes.
            reserve = len(self.running) * self.kv.page_size
            fits = self.cache.ensure_free(total - cached + reserve) or (
                not self.running and not self.inflight and self.cache.ensure_free(total - cached))
            if not fits:
                if match:
                    self.cache.unlock(match.node)
                break  # FIFO: wait for running requests to finish or be retracted
            self.waiting.popleft()
            req.prefix_node = match.node if match else None
            req.kv_slots = (match.slots if match else []) + self.kv.alloc(total - cached)
            req.cached_len = req.rows_sent = req.rows_written = cached
            req.prefill_len = total
            req.frames_planned = len(req.frames)
            if req.retractions == 0:
                req.cached_prompt_rows = cached
                metrics.RADIX_HIT_ROWS.inc(cached)
            req.phase = Phase.PREFILL
            req.holds_worker_state = True
            self.running[req.id] = req

    # ---- journals --------------------------------------------------------------
    def _apply(self, journal: worker_pb2.Journal, writes: dict[int, int]) -> None:
        for rid, n in writes.items():
            req = self.running.get(rid)
            if req is not None:
                req.rows_written += n
        if journal.request_ids:
            rows = np.frombuffer(journal.rows.data, dtype="<i4").reshape(journal.rows.rows, journal.rows.cols)
        for i, rid in enumerate(journal.request_ids):
            req = self.running.get(rid)
            if req is None or journal.generation_steps[i] != len(req.frames):
                continue  # finished or aborted while the step ran, or a frame past its end
            if journal.stopped[i]:
                self._finish(req, "stop")
                continue
            req.phase = Phase.DECODE
            row = rows[i].copy()
            req.frames.append(row)
            req.keys.append(prompt_row_key(row))
            self.sink.emit(req, FrameEvent(len(req.frames) - 1, row))
            metrics.FRAMES.inc()
            if len(req.frames) >= req.max_frames:
                self._finish(req, "max_frames")

    # ---- ending ----------------------------------------------------------------
    def _release_kv(self, req: Request) -> None:
        """Give the request's KV back: written rows to the radix cache (so a
        re-prefill or a request with the same prefix can reuse them), the rest
        to the allocator; then unlock its matched prefix."""
        m, n = req.cached_len, req.rows_written
        own = req.kv_slots[m:]
        if self.config.radix_cache and n > m:
            p = self.cache.insert(req.keys[:n], req.kv_slots[:n], self.config.cache_key)
            whole = n - n % self.kv.page_size
            if p > m:
                self.kv.free(req.kv_slots[m:p])  # someone cached these rows first: ours are duplicates
            own = req.kv_slots[max(whole, m):]
        if own:
            self.kv.free(own)
        if req.prefix_node is not None:
            self.cache.unlock(req.prefix_node)
        req.kv_slots, req.prefix_node = [], None
        req.cached_len = req.rows_sent = req.rows_written = 0

    def _drop_from_worker(self, req: Request) -> None:
        self.running.pop(req.id, None)
        if req.holds_worker_state:
            self.pending_release.append(req.id)
            req.holds_worker_state = False
        self._release_kv(req)
        self._wakeup.set()

    def _finish(self, req: Request, reason: str | None) -> None:
        req.phase = Phase.DONE
        self._drop_from_worker(req)
        self._update_gauges()
        if reason is not None:
            req.finish_reason = reason
            self.sink.emit(req, FinishEvent(reason))

    def _retract(self, req: Request, why: str = "KV full") -> None:
        """Free a running request's KV and queue it first to re-prefill prompt + output."""
        log.info("retracting request %d at frame %d (%s)", req.id, len(req.frames), why)
        metrics.RETRACTIONS.inc()
        req.retractions += 1
        self._drop_from_worker(req)
        req.phase = Phase.WAITING
        req.frames_planned = len(req.frames)
        self.waiting.appendleft(req)

    def _is_new_worker(self, incarnation: int) -> bool:
        """Does this incarnation (from a Hello or a Journal) belong to another worker process than the
        one the scheduler knows? (0: a worker that does not say.)"""
        return bool(incarnation and self.hello.incarnation and incarnation != self.hello.incarnation)

    async def _worker_came_back(self, timeout: float) -> bool:
        """Is a new worker process answering hello within `timeout` (the old one died and was restarted,
        e.g. by its stall watchdog or its supervisor)? Then every running request re-prefills on it
        (_worker_restarted) and True. No answer, or the same process answering (alive, busy or stuck):
        False, and nothing changes."""
        try:
            hello = await self.worker.hello(timeout=timeout)
        except Exception:  # noqa: BLE001 - no answer
            return False
        if not self._is_new_worker(hello.incarnation):
            return False
        self._worker_restarted(hello.incarnation)
        return True

    def _worker_restarted(self, incarnation: int) -> None:
        """A journal from another worker process than the one that said hello: the worker restarted,
        and its KV and decode state are gone. The steps in flight are dropped, every running request
        is queued again to re-prefill its prompt and the frames it has (the determinism contract
        makes its audio go on exactly), and the KV bookkeeping and the radix cache start empty: a
        cached prefix would point at rows the new worker never wrote."""
        running = sorted(self.running.values(), key=lambda r: r.id, reverse=True)  # appendleft: keep order
        log.error("the worker restarted (incarnation %x, was %x): its KV and decode state are gone; re-prefilling "
                  "%d running requests and emptying the radix cache", incarnation, self.hello.incarnation,
                  len(running))
        for step in self.inflight:
            step.future.cancel()
        self.inflight.clear()
        for req in running:
            self._retract(req, "the worker restarted")
        self.cache.reset()
        self.kv.reset()
        # Plans lost on the way may have left decode state for these in the new worker: release it
        # (the next plan's releases run before its prefills; an unknown id is a no-op).
        self.pending_release = [req.id for req in running]
        self.hello.incarnation = incarnation
        metrics.WORKER_RESTARTS.inc()
        self._update_gauges()

    def _fail_step(self, step: _InFlight, message: str) -> None:
        ids = [i.request_id for i in step.plan.prefill] + [i.request_id for i in step.plan.decode]
        for rid in ids:
            req = self.running.get(rid)
            if req is not None:
                self._finish(req, None)
                self.sink.emit(req, ErrorEvent(message))

    def _update_gauges(self) -> None:
        metrics.QUEUE_DEPTH.set(len(self.waiting))
        metrics.RUNNING.set(len(self.running))
        metrics.KV_USED.set(self.kv.used_slots - self.cache.cached_slots)
        metrics.KV_CACHED.set(self.cache.cached_slots)
        metrics.KV_FREE.set(self.kv.free_slots)
        metrics.RADIX_HIT_RATE.set(self.cache.hit_rate)
