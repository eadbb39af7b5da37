"""The OmniVoice scheduler's driver: runs the canvas policy (scheduler_svc/canvas_policy.py)
against one OmniVoice worker.

One asyncio task asks the policy for a plan, sends it, waits for its journal and hands the
results back; the canvases that ended go to the sink (the frontend link), each once.

Lookahead: with it on, up to `lookahead_depth` plans are in flight. On a GPU a step of a few
canvases takes about as long as the round trip around it (the journal over ZeroMQ, the core
applying it and planning, the plan back), and with one plan in flight the worker idles for that
round trip every step (docs/performance-notes.md, OmniVoice). The policy knows what a step leaves
(every canvas advances one index; one on its last step ends), so the next plan is built and sent
while the step runs, and the worker starts it as soon as the step is done. A cancelled canvas is
released by the next plan built; a plan already sent may still step it (wasted work, its result
dropped).

Worker trouble: a journal with an error fails the canvases of its plan (the worker dropped them
and skips their steps in the plans already sent); a worker that stops answering fails them after
the step timeout. A new worker process (another incarnation, seen on a journal or in answer to
the hello asked when a step is late or failed) has lost every canvas, which cannot be rebuilt
mid-unmasking: the running canvases fail with an "unavailable" error (the frontend maps it to
UNAVAILABLE, so clients retry), the plans still in flight are given up, and the waiting canvases
run on the new worker. Only a plan alone in flight keeps the canvases it started on the new
process: a later plan would name canvases the new process never held. A dead worker
(scheduler_svc/heartbeat.py) fails every canvas, running or waiting, as unavailable at once (none
could resume anyway), and new canvases are refused until a worker answers again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

from chorus.v1 import worker_pb2
from scheduler_svc import metrics
from scheduler_svc.canvas_policy import Canvas, CanvasPolicy
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.heartbeat import Heartbeat, is_new_worker
from scheduler_svc.request import Unavailable
from scheduler_svc.worker_client import WorkerClient, WorkerUnavailable

log = logging.getLogger("chorus.scheduler")

UNAVAILABLE = "OmniVoice worker unavailable"  # the prefix of errors a retry may cure
RESTARTED = f"{UNAVAILABLE}: the worker process restarted and lost this request's canvas; retry the request"


@dataclass
class _InFlight:
    plan: worker_pb2.StepPlan
    future: asyncio.Future


class CanvasSink:
    """Where ended canvases go (codes, or error, set). This one drops them; the core's
    FrontendLink sends each to the frontend that submitted it."""

    def canvas_done(self, canvas: Canvas) -> None:
        pass

    def worker_health(self, model: str, up: bool) -> None:
        """A worker of the model stopped answering (up False) or answers again."""


class CanvasScheduler:
    def __init__(self, worker: WorkerClient, hello: worker_pb2.Hello, config: SchedulerConfig,
                 sink: CanvasSink | None = None):
        self.worker = worker
        self.hello = hello
        self.config = config
        self.sink = sink or CanvasSink()
        self.policy = CanvasPolicy(config.max_queue, hello)
        self._labels = {"model": hello.model_name}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.inflight: deque[_InFlight] = deque()  # plans sent, oldest first
        self._journal_at: float | None = None  # when the last journal arrived, until the next plan is sent
        self.depth = max(1, config.lookahead_depth) if config.lookahead else 1
        self.heartbeat = Heartbeat(worker, hello.model_name, config.worker_heartbeat, config.worker_probe,
                                   busy=lambda: bool(self.inflight), changed=self._health_changed)

    @property
    def model_name(self) -> str:
        return self.hello.model_name

    @property
    def load(self) -> tuple[int, int]:
        """(canvases waiting, packed rows running): the smaller, the sooner a new canvas runs."""
        return len(self.policy.waiting), self.policy.used_rows

    # ---- public --------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())
        self.heartbeat.start()

    async def stop(self) -> None:
        self.heartbeat.stop()
        if self._task:
            self._task.cancel()
        self._abandon_inflight()

    def submit(self, start: worker_pb2.CanvasStart) -> Canvas:
        """Queue a canvas (request_id is assigned here). Raises InvalidCanvas, CanvasTooLarge, QueueFull, or
        Unavailable while the worker is gone."""
        if not self.heartbeat.up:
            raise Unavailable(f"{UNAVAILABLE}: the {self.model_name} worker at {self.worker.endpoint} is not "
                              "answering; retry later")
        canvas = self.policy.add(Canvas(start, t_accepted=time.monotonic()))
        self._publish()
        self._wakeup.set()
        return canvas

    @property
    def idle(self) -> bool:
        """No canvas running or waiting (a draining core may exit)."""
        return not self.policy.running and not self.policy.waiting

    def end_all(self, why: str) -> None:
        """End every canvas, running or waiting, UNAVAILABLE (the core is going away)."""
        message = f"{UNAVAILABLE}: {why}"
        self._ended(self.policy.forget_worker(message) + self.policy.fail_waiting(message))

    def cancel(self, canvas: Canvas) -> None:
        """The client went away: drop the canvas wherever it is; the sink hears nothing of it. Idempotent."""
        self.policy.cancel(canvas)
        if canvas.cancelled and canvas.t_finished is None:
            canvas.t_finished = time.monotonic()
            metrics.CANVASES.labels(outcome="cancelled", **self._labels).inc()
        self._publish()
        self._wakeup.set()  # its release rides on the next plan

    # ---- the loop --------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            try:
                await self._iterate()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a scheduler bug must not silently hang every client
                log.exception("OmniVoice scheduler loop failed; failing the running canvases")
                self._abandon_inflight()
                self._ended(self.policy.fail(list(self.policy.running), "internal scheduler error; see the "
                                             "scheduler log"))
                await asyncio.sleep(0.1)

    async def _iterate(self) -> None:
        """One turn: send a plan if the pipeline has room, then wait for the oldest journal or for work."""
        if not self.heartbeat.up and not self.inflight:
            await self._worker_gone()
            return
        sent = False
        if len(self.inflight) < self.depth and self.heartbeat.up:
            plan = self.policy.schedule()
            self._publish()
            if plan is not None:
                self._send(plan)
                sent = True
            else:
                self._journal_at = None  # nothing to plan: the wait for new work is no turnaround
        if sent and len(self.inflight) < self.depth:
            return  # build the next plan while this one runs
        self._wakeup.clear()
        if not self.inflight:
            if not sent:
                await self.heartbeat.wake_or_down(self._wakeup)
            return
        oldest = self.inflight[0]
        if len(self.inflight) < self.depth and self.heartbeat.up:  # room: a new canvas need not wait for it
            wake = asyncio.ensure_future(self._wakeup.wait())
            try:
                await asyncio.wait({oldest.future, wake}, timeout=self.config.worker_probe or None,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                wake.cancel()
            if not oldest.future.done() and self._wakeup.is_set():
                return
        self.inflight.popleft()
        await self._receive(oldest)

    def _send(self, plan: worker_pb2.StepPlan) -> None:
        now = time.monotonic()
        for start in plan.canvas_start:
            self.policy.running[start.request_id].t_started = now
        if plan.canvas_step:
            rows = sum(self.policy.running[s.request_id].cost for s in plan.canvas_step)
            metrics.CANVAS_PACKED_ROWS.labels(**self._labels).observe(rows)
            metrics.CANVAS_STEPS.labels(**self._labels).inc()
        if self.inflight:
            metrics.CANVAS_LOOKAHEAD_STEPS.labels(**self._labels).inc()
        future = asyncio.ensure_future(self.worker.step(plan, timeout=self.config.step_timeout))
        self.inflight.append(_InFlight(plan, future))
        if self._journal_at is not None:
            metrics.CANVAS_TURNAROUND_MS.labels(**self._labels).observe((now - self._journal_at) * 1e3)
            self._journal_at = None

    async def _receive(self, inflight: _InFlight) -> None:
        """Apply the oldest plan's journal, or fail its canvases when none will come."""
        plan = inflight.plan
        try:
            journal = await self._await_journal(inflight)
        except Exception as e:  # noqa: BLE001 - the worker is gone: fail what the step held
            log.error("OmniVoice worker step failed: %s", e)
            if self.heartbeat.down.is_set() or not await self._worker_came_back(self.config.restart_wait):
                self._fail_step(plan, f"{UNAVAILABLE}: {e}")
            return
        if journal is None:  # a new worker process answered: _worker_restarted handled it
            return
        if self._is_new_worker(journal.incarnation):
            # the new process ran this plan: it holds the canvases the plan started, unless a later
            # plan in flight names canvases it never held (that plan fails there, dropping them)
            keep = set() if self.inflight else {s.request_id for s in plan.canvas_start}
            self._worker_restarted(journal.incarnation, keep=keep)
        if journal.error:
            log.error("OmniVoice step %d failed on the worker: %s", plan.step_id, journal.error)
            self._fail_step(plan, f"OmniVoice worker step failed: {journal.error}")
        else:
            self._journal_at = time.monotonic()
            metrics.CANVAS_STEP_MS.labels(**self._labels).observe(journal.step_ms)
            self._ended(self.policy.apply(journal))

    async def _await_journal(self, inflight: _InFlight) -> worker_pb2.Journal | None:
        """The plan's journal; None when it will not come because a new worker process answered
        (_worker_restarted ran). Every worker_probe seconds without it the worker is asked hello.
        WorkerUnavailable at once when the heartbeat finds the worker gone."""
        future = inflight.future
        probe = self.config.worker_probe
        try:
            while True:
                gone = asyncio.ensure_future(self.heartbeat.down.wait())
                try:
                    await asyncio.wait({future, gone}, timeout=probe or None, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    gone.cancel()
                if future.done():
                    return future.result()
                if self.heartbeat.down.is_set():
                    raise WorkerUnavailable(f"the worker is gone ({self.heartbeat.why})")
                log.warning("OmniVoice step %d has no journal after %.0f s: asking the worker whether it restarted",
                            inflight.plan.step_id, probe)
                if await self._worker_came_back(probe):
                    return None
        finally:
            future.cancel()  # a no-op once done

    def _fail_step(self, plan: worker_pb2.StepPlan, message: str) -> None:
        named = [s.request_id for s in plan.canvas_start] + [s.request_id for s in plan.canvas_step]
        self._ended(self.policy.fail(named, message))  # each once: fail skips what is no longer running

    def _ended(self, canvases: list[Canvas]) -> None:
        now = time.monotonic()
        for canvas in canvases:
            canvas.t_finished = now
            metrics.CANVASES.labels(outcome="error" if canvas.error else "ok", **self._labels).inc()
            self.sink.canvas_done(canvas)
        self._publish()

    # ---- a dead worker -----------------------------------------------------------
    def _health_changed(self, up: bool) -> None:
        self.sink.worker_health(self.model_name, up)
        self._wakeup.set()

    async def _worker_gone(self) -> None:
        """Fail every canvas as unavailable, then wait for a worker to answer (a new process: its
        incarnation is the one journals must carry from now on)."""
        message = (f"{UNAVAILABLE}: the {self.model_name} worker at {self.worker.endpoint} is gone "
                   f"({self.heartbeat.why}); retry later")
        ended = self.policy.forget_worker(message) + self.policy.fail_waiting(message)
        if ended:
            log.error("failing %d OmniVoice canvases: %s", len(ended), message)
        self._ended(ended)
        await self.heartbeat.alive.wait()
        hello = self.heartbeat.last_hello
        if hello is not None and self._is_new_worker(hello.incarnation):
            self.hello.incarnation = hello.incarnation
            metrics.WORKER_RESTARTS.inc()

    # ---- worker restarts -------------------------------------------------------
    def _is_new_worker(self, incarnation: int) -> bool:
        return is_new_worker(self.hello.incarnation, incarnation)

    async def _worker_came_back(self, timeout: float) -> bool:
        """Is a new worker process answering hello within `timeout`? Then its running canvases fail
        (_worker_restarted) and True; else False."""
        incarnation = await self.heartbeat.new_incarnation(self.hello.incarnation, timeout)
        if incarnation is None:
            return False
        self._worker_restarted(incarnation)
        return True

    def _worker_restarted(self, incarnation: int, keep: set[int] = frozenset()) -> None:
        """Another worker process: every running canvas but `keep` (started on the new one) is lost,
        and the plans still in flight are given up (their journals describe canvases that failed)."""
        lost = [rid for rid in self.policy.running if rid not in keep]
        log.error("the OmniVoice worker %s restarted (incarnation %x, was %x): failing %d running canvases",
                  self.model_name, incarnation, self.hello.incarnation, len(lost))
        self.hello.incarnation = incarnation
        metrics.WORKER_RESTARTS.inc()
        self._abandon_inflight()
        self._ended(self.policy.forget_worker(RESTARTED, keep=keep))

    def _abandon_inflight(self) -> None:
        for inflight in self.inflight:
            inflight.future.cancel()
        self.inflight.clear()

    # ---- metrics ---------------------------------------------------------------
    def _publish(self) -> None:
        p = self.policy
        metrics.CANVAS_QUEUE_DEPTH.labels(**self._labels).set(len(p.waiting))
        metrics.CANVAS_RUNNING.labels(**self._labels).set(len(p.running))
        metrics.CANVAS_ROWS_USED.labels(**self._labels).set(p.used_rows)
