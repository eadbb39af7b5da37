"""The OmniVoice scheduler's driver: runs the canvas policy (scheduler_svc/canvas_policy.py)
against one OmniVoice worker.

One asyncio task asks the policy for a plan, sends it, waits for its journal and hands the
results back; the canvases that ended go to the sink (the frontend link), each once. One step
is in flight at a time: a step's forward is the whole batch's work (no per-frame core work to
overlap, unlike MOSS), so lookahead would only let plans run ahead of cancellations.

Worker trouble: a journal with an error fails the canvases of its step; a worker that stops
answering fails them after the step timeout. A new worker process (another incarnation, seen on
a journal or in answer to the hello asked when a step is late or failed) has lost every canvas,
which cannot be rebuilt mid-unmasking: the running canvases fail with an "unavailable" error
(the frontend maps it to UNAVAILABLE, so clients retry), the waiting ones run on the new worker.
A dead worker (scheduler_svc/heartbeat.py) fails every canvas, running or waiting, as unavailable at
once (none could resume anyway), and new canvases are refused until a worker answers again.
"""

from __future__ import annotations

import asyncio
import logging
import time

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
        self._stepping = False
        self.heartbeat = Heartbeat(worker, hello.model_name, config.worker_heartbeat, config.worker_probe,
                                   busy=lambda: self._stepping, changed=self._health_changed)

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
                self._ended(self.policy.fail(list(self.policy.running), "internal scheduler error; see the "
                                             "scheduler log"))
                await asyncio.sleep(0.1)

    async def _iterate(self) -> None:
        """One turn: plan, send, apply the journal; or wait for work."""
        if not self.heartbeat.up:
            await self._worker_gone()
            return
        plan = self.policy.schedule()
        self._publish()
        if plan is None:
            self._wakeup.clear()
            waits = [asyncio.ensure_future(self._wakeup.wait()), asyncio.ensure_future(self.heartbeat.down.wait())]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            return
        now = time.monotonic()
        for start in plan.canvas_start:
            self.policy.running[start.request_id].t_started = now
        if plan.canvas_step:
            metrics.CANVAS_PACKED_ROWS.labels(**self._labels).observe(self.policy.used_rows)
            metrics.CANVAS_STEPS.labels(**self._labels).inc()
        journal = await self._journal(plan)
        if journal is None:
            return
        if self._is_new_worker(journal.incarnation):
            started = {s.request_id for s in plan.canvas_start}  # these the new process did start
            self._worker_restarted(journal.incarnation, keep=started)
        if journal.error:
            log.error("OmniVoice step %d failed on the worker: %s", plan.step_id, journal.error)
            self._fail_step(plan, f"OmniVoice worker step failed: {journal.error}")
        else:
            metrics.CANVAS_STEP_MS.labels(**self._labels).observe(journal.step_ms)
            self._ended(self.policy.apply(journal))

    async def _journal(self, plan: worker_pb2.StepPlan) -> worker_pb2.Journal | None:
        """The plan's journal; None when it will not come (its canvases are failed here). Every
        worker_probe seconds without it the worker is asked hello: a new process means the step died."""
        future = asyncio.ensure_future(self.worker.step(plan, timeout=self.config.step_timeout))
        probe = self.config.worker_probe
        self._stepping = True
        try:
            while True:
                gone = asyncio.ensure_future(self.heartbeat.down.wait())
                try:
                    await asyncio.wait({future, gone}, timeout=probe or None, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    gone.cancel()
                if future.done():
                    break
                if self.heartbeat.down.is_set():
                    future.cancel()
                    raise WorkerUnavailable(f"the worker is gone ({self.heartbeat.why})")
                log.warning("OmniVoice step %d has no journal after %.0f s: asking the worker whether it restarted",
                            plan.step_id, probe)
                if await self._worker_came_back(probe):
                    future.cancel()
                    return None
            return await future
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - the worker is gone: fail what the step held
            log.error("OmniVoice worker step failed: %s", e)
            if self.heartbeat.down.is_set() or not await self._worker_came_back(self.config.restart_wait):
                self._fail_step(plan, f"{UNAVAILABLE}: {e}")
            return None
        finally:
            self._stepping = False

    def _fail_step(self, plan: worker_pb2.StepPlan, message: str) -> None:
        self._ended(self.policy.fail([s.request_id for s in plan.canvas_step], message))

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
        """Another worker process: every running canvas but `keep` (started on the new one) is lost."""
        lost = [rid for rid in self.policy.running if rid not in keep]
        log.error("the OmniVoice worker %s restarted (incarnation %x, was %x): failing %d running canvases",
                  self.model_name, incarnation, self.hello.incarnation, len(lost))
        self.hello.incarnation = incarnation
        metrics.WORKER_RESTARTS.inc()
        self._ended(self.policy.forget_worker(RESTARTED, keep=keep))

    # ---- metrics ---------------------------------------------------------------
    def _publish(self) -> None:
        p = self.policy
        metrics.CANVAS_QUEUE_DEPTH.labels(**self._labels).set(len(p.waiting))
        metrics.CANVAS_RUNNING.labels(**self._labels).set(len(p.running))
        metrics.CANVAS_ROWS_USED.labels(**self._labels).set(p.used_rows)
