"""The scheduler's driver: runs the policy (scheduler_svc/policy.py) against one worker.

One asyncio task asks the policy for a step, sends its plan to the worker, and hands the
journal back to the policy; the events the policy emits are flushed once per journal.

Lookahead: with it on, up to `lookahead_depth` plans are in flight: the next plans are sent
before the previous journals return, so the worker launches step N+1 while the core is still
applying step N.

Worker restarts: a step without its journal for `worker_probe` seconds, or one that failed,
asks the worker hello; a new worker process answering (another incarnation) lost the old one's
KV, so the steps in flight are dropped and every running request re-prefills on it.

A dead worker (scheduler_svc/heartbeat.py: its connection closed, or idle and silent) is given
`restart_wait` seconds for a new process to answer; then every request ends UNAVAILABLE, and
until a worker answers again new requests are refused at once and the frontends serve
NOT_SERVING health.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from chorus.v1 import worker_pb2
from scheduler_svc import metrics
from scheduler_svc.admission import Ewma, Rates
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.heartbeat import Heartbeat, is_new_worker
from scheduler_svc.kv_allocator import KVSlotAllocator
from scheduler_svc.policy import Counts, Policy, Step
from scheduler_svc.request import EventSink, Request, Unavailable
from scheduler_svc.row_keys import prompt_row_keys
from scheduler_svc.worker_client import WorkerClient, WorkerUnavailable

log = logging.getLogger("chorus.scheduler")

_COUNTERS = {"frames": metrics.FRAMES, "prefill_rows": metrics.PREFILL_ROWS, "radix_hit_rows": metrics.RADIX_HIT_ROWS,
             "retractions": metrics.RETRACTIONS, "aborted": metrics.ABORTED,
             "admitted": metrics.ADMISSIONS.labels("admit"), "queued": metrics.ADMISSIONS.labels("queue"),
             "refused": metrics.ADMISSIONS.labels("refuse")}
# A journal later than this after the previous one ended an idle spell: no step period sample.
_IDLE_GAP_S = 0.5


@dataclass
class _InFlight:
    step: Step
    future: asyncio.Future


class Scheduler:
    def __init__(self, worker: WorkerClient, hello: worker_pb2.Hello, config: SchedulerConfig,
                 sink: EventSink | None = None):
        self.worker = worker
        self.sink = sink or EventSink()
        self.hello = hello
        self.config = config
        self.policy = Policy(config, hello, self.sink)
        self.inflight: deque[_InFlight] = deque()
        self._journal_at: float | None = None  # when the last journal arrived, until the next plan is sent
        self._published = Counts()
        # Admission's measurements (scheduler_svc/admission.py): step period, prefill to first frame,
        # prefill to end.
        self._step_s, self._service_s, self._lifetime_s = Ewma(0.05), Ewma(0.1), Ewma(0.1)
        self._last_journal: float | None = None
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.heartbeat = Heartbeat(worker, hello.model_name, config.worker_heartbeat, config.worker_probe,
                                   busy=lambda: bool(self.inflight), changed=self._health_changed)

    @property
    def kv(self) -> KVSlotAllocator:
        return self.policy.kv

    @property
    def loaded(self) -> bool:
        return self.policy.loaded

    # ---- public --------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())
        self.heartbeat.start()

    async def stop(self) -> None:
        self.heartbeat.stop()
        if self._task:
            self._task.cancel()

    def submit(self, req: Request) -> Request:
        """Queue a request; QueueFull, or Unavailable while the worker is gone."""
        if not self.heartbeat.up:
            raise Unavailable(f"the {self.hello.model_name} worker is not answering; retry later")
        self.policy.add(req)
        self._publish()
        self._wakeup.set()
        return req

    @property
    def idle(self) -> bool:
        """No request running or waiting (a draining core may exit)."""
        return not self.policy.running and not self.policy.waiting

    def end_all(self, message: str) -> None:
        """End every request, running or waiting, UNAVAILABLE with `message` (the core is going away)."""
        self.policy.fail_all(message)
        self._publish()
        self.sink.flush()

    def abort(self, req: Request) -> None:
        """The client went away: drop the request wherever it is. Idempotent."""
        self.policy.abort(req)
        self._publish()
        self._wakeup.set()  # its release rides on the next plan

    def evict_prefix(self, rows: np.ndarray, shared_rows: int) -> int:
        """A prefix no request will ask for again (a deleted voice's): free the radix cache's unlocked
        rows of the sequences that start with it (RadixCache.drop_prefix). Returns the rows freed."""
        if not self.config.radix_cache:
            return 0
        freed = self.policy.cache.drop_prefix(prompt_row_keys(rows), self.config.cache_key, shared_rows)
        self._publish()
        return freed

    def pause(self, req: Request, paused: bool) -> None:
        """Its client stopped reading (paused) or reads again: no decode steps meanwhile; its KV stays."""
        req.paused = paused
        if not paused:
            self._wakeup.set()

    # ---- the loop --------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            try:
                await self._iterate()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a scheduler bug must not silently hang every client
                log.exception("scheduler loop failed; failing the running requests")
                self.policy.fail(list(self.policy.running), "internal scheduler error; see the scheduler log")
                self.sink.flush()
                await asyncio.sleep(0.1)

    async def _iterate(self) -> None:
        """One turn: send a plan if the pipeline has room, then wait for a journal or for work."""
        if not self.heartbeat.up and not self.inflight:
            await self._recover()
            return
        depth = max(1, self.config.lookahead_depth) if self.config.lookahead else 1
        sent = False
        if len(self.inflight) < depth:
            step = self.policy.schedule(len(self.inflight))
            self._publish()
            if step is not None:
                self._send(step)
                sent = True
            else:
                self._journal_at = None  # nothing to plan: the wait for new work is no turnaround
        if sent and len(self.inflight) < depth and self._lookahead_eligible():
            return  # overlap: build step N+1 while step N runs
        if self.inflight:
            await self._receive(self.inflight.popleft())
        elif not sent:
            self._wakeup.clear()
            await self.heartbeat.wake_or_down(self._wakeup)

    def _lookahead_eligible(self) -> bool:
        last = self.inflight[-1].step.plan
        return len(last.decode) + len(last.prefill) <= self.config.lookahead_max_batch and bool(self.policy.running)

    def _send(self, step: Step) -> None:
        now = time.monotonic()
        for item in step.plan.prefill:
            req = self.policy.running[item.request_id]
            if req.t_scheduled is None:
                req.t_scheduled = now
        if self.inflight:
            metrics.LOOKAHEAD_STEPS.inc()
        fut = asyncio.ensure_future(self.worker.step(step.plan, timeout=self.config.step_timeout))
        self.inflight.append(_InFlight(step, fut))
        if self._journal_at is not None:
            metrics.TURNAROUND_MS.observe((now - self._journal_at) * 1e3)
            self._journal_at = None

    async def _await_journal(self, inflight: _InFlight) -> worker_pb2.Journal | None:
        """The step's journal. Every worker_probe seconds without it the worker is asked hello; if a new
        worker process answers, the old one died with this step: None, after _worker_restarted. An old
        process that is alive answers only once its pending step is done, or not within the probe.
        WorkerUnavailable at once when the heartbeat finds the worker gone."""
        probe = self.config.worker_probe
        asked = False
        while True:
            gone = asyncio.ensure_future(self.heartbeat.down.wait())
            try:
                await asyncio.wait({inflight.future, gone}, timeout=probe or None,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
            if inflight.future.done():
                return inflight.future.result()
            if self.heartbeat.down.is_set():
                inflight.future.cancel()
                raise WorkerUnavailable(f"the worker at {self.worker.endpoint} is gone ({self.heartbeat.why})")
            if not asked:
                log.warning("step %d has no journal after %.0f s: asking the worker whether it restarted",
                            inflight.step.plan.step_id, probe)
                asked = True
            # no answer (busy or gone) or the same process: the step's own timeout decides
            if await self._worker_came_back(probe):
                inflight.future.cancel()
                return None

    async def _receive(self, inflight: _InFlight) -> None:
        t0 = time.monotonic()
        plan = inflight.step.plan
        try:
            journal = await self._await_journal(inflight)
            if journal is None:  # the worker restarted: everything running re-prefills
                self.sink.flush()
                return
        except Exception as e:  # noqa: BLE001 - the worker is gone: fail what it held
            log.error("worker step failed: %s", e)
            if not await self._worker_came_back(self.config.restart_wait):
                log.error("no new worker process answered hello (waited up to %.0f s)", self.config.restart_wait)
                self._fail_step(plan, f"worker unavailable: {e}")
                if self.heartbeat.down.is_set():  # the later steps in flight died with it
                    for later in self.inflight:
                        later.future.cancel()
                    self.inflight.clear()
                    self.policy.fail_all(self._gone_message())
                    self._publish()
            self.sink.flush()
            return
        self._journal_at = time.monotonic()
        if self._is_new_worker(journal.incarnation):
            self._worker_restarted(journal.incarnation)  # this journal was computed without the old KV
            self.sink.flush()
            return
        metrics.STEP_SECONDS.observe(self._journal_at - t0)
        (metrics.WORKER_MIXED_STEP_MS if plan.prefill else metrics.WORKER_DECODE_STEP_MS).observe(journal.step_ms)
        if journal.error:
            log.error("step %d failed on the worker: %s", plan.step_id, journal.error)
            self._fail_step(plan, f"worker step failed: {journal.error}")
        else:
            self.policy.apply(journal, inflight.step.writes)
            self._measure(plan, self._journal_at)
            self._publish()
        self.sink.flush()

    def _measure(self, plan: worker_pb2.StepPlan, now: float) -> None:
        """Fold this journal into admission's rates: the step period, the first frames of requests
        whose prefill this step ended, and the lifetimes of the requests that ended."""
        if self._last_journal is not None and now - self._last_journal < _IDLE_GAP_S:
            self._step_s.add(now - self._last_journal)
        self._last_journal = now
        for item in plan.prefill:
            req = self.policy.running.get(item.request_id)
            if item.last_chunk and req is not None and req.retractions == 0 and len(req.frames) == 1 \
                    and req.t_scheduled is not None:
                self._service_s.add(now - req.t_scheduled)
        for req in self.policy.finished:
            if req.t_scheduled is not None and req.retractions == 0:
                self._lifetime_s.add(now - req.t_scheduled)
        self.policy.finished.clear()
        self.policy.rates = Rates(lifetime_s=self._lifetime_s.value, step_s=self._step_s.value,
                                  service_s=self._service_s.value)

    def _fail_step(self, plan: worker_pb2.StepPlan, message: str) -> None:
        self.policy.fail([i.request_id for i in plan.prefill] + [i.request_id for i in plan.decode], message,
                         unavailable=message.startswith("worker unavailable"))
        self._publish()

    # ---- a dead worker -----------------------------------------------------------
    def _gone_message(self) -> str:
        return (f"worker unavailable: the {self.hello.model_name} worker at {self.worker.endpoint} is gone "
                f"({self.heartbeat.why}) and no new one answered within {self.config.restart_wait:g} s; retry later")

    def _health_changed(self, up: bool) -> None:
        self.sink.worker_health(self.hello.model_name, up)
        self._wakeup.set()

    async def _recover(self) -> None:
        """The worker is gone with no step out: wait restart_wait for a worker to answer (a new process:
        the running requests re-prefill on it); none: every request ends UNAVAILABLE, then wait for one."""
        if self.policy.running or self.policy.waiting:
            if await self._worker_came_back(self.config.restart_wait) or self.heartbeat.up:
                return
            log.error("no worker answered hello within %.0f s: failing %d running and %d waiting requests",
                      self.config.restart_wait, len(self.policy.running), len(self.policy.waiting))
            self.policy.fail_all(self._gone_message())
            self._publish()
            self.sink.flush()
        await self.heartbeat.alive.wait()
        hello = self.heartbeat.last_hello
        if hello is not None and self._is_new_worker(hello.incarnation):
            self._worker_restarted(hello.incarnation)

    # ---- worker restarts -------------------------------------------------------
    def _is_new_worker(self, incarnation: int) -> bool:
        return is_new_worker(self.hello.incarnation, incarnation)

    async def _worker_came_back(self, timeout: float) -> bool:
        """Is a new worker process answering hello within `timeout` (the old one died and was restarted,
        e.g. by its stall watchdog or its supervisor)? Then every running request re-prefills on it
        (_worker_restarted) and True; else nothing changes."""
        incarnation = await self.heartbeat.new_incarnation(self.hello.incarnation, timeout)
        if incarnation is None:
            return False
        self._worker_restarted(incarnation)
        return True

    def _worker_restarted(self, incarnation: int) -> None:
        """Another worker process than the one that said hello: its KV and decode state are gone. The
        steps in flight are dropped and the policy re-prefills every running request."""
        log.error("the worker restarted (incarnation %x, was %x): its KV and decode state are gone; re-prefilling "
                  "%d running requests and emptying the radix cache", incarnation, self.hello.incarnation,
                  len(self.policy.running))
        for inflight in self.inflight:
            inflight.future.cancel()
        self.inflight.clear()
        self.policy.forget_worker_state()
        self.hello.incarnation = incarnation
        metrics.WORKER_RESTARTS.inc()
        self._publish()

    # ---- metrics ---------------------------------------------------------------
    def _publish(self) -> None:
        """The policy's state as gauges, its counts as counters."""
        p = self.policy
        metrics.QUEUE_DEPTH.set(len(p.waiting))
        metrics.RUNNING.set(len(p.running))
        metrics.KV_USED.set(p.kv.used_slots - p.cache.cached_slots)
        metrics.KV_CACHED.set(p.cache.cached_slots)
        metrics.KV_FREE.set(p.kv.free_slots)
        metrics.RADIX_HIT_RATE.set(p.cache.hit_rate)
        wait = p.estimate().wait_s
        metrics.EXPECTED_WAIT.set(wait if wait != float("inf") else 0.0)
        for name, counter in _COUNTERS.items():
            delta = getattr(p.counts, name) - getattr(self._published, name)
            if delta:
                counter.inc(delta)
        self._published = dataclasses.replace(p.counts)
