"""The OmniVoice scheduler's policy: which canvases run and what each step does.

A canvas (one request, or one piece of a long one) waits in FIFO order until its packed rows
fit the worker's budget (Hello.max_packed_rows) beside the running ones and a batch slot is free
(Hello.max_batch). Every step then runs every running canvas one unmasking step, each at its own
step index with its own knobs: the forward does not depend on the index, so a canvas admitted
now shares the step with one about to finish. A canvas is done after its own num_step steps.

Plans may be built before the previous journals return (the driver's lookahead): a plan is built
from the state the plans before it leave, whose outcome the policy knows in advance (a canvas
runs exactly num_step steps). So a canvas gives its rows and batch slot back once its last step
is planned, and the next plan may start another in them; a cancelled or failed canvas gives
them back at once. A canvas the worker may hold is released by the next plan built (the worker
runs releases before starts; a plan already sent may still step it, and its result is dropped).
There is no KV, so nothing is ever retracted.

Pure bookkeeping: no I/O, no clock, no metrics. Methods that end canvases return them; the
driver tells their frontends.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from chorus.omnivoice.knobs import MAX_NUM_STEP, NUM_CODEBOOKS, packed_rows
from chorus.v1 import worker_pb2
from chorus.wire import matrix_array
from scheduler_svc.request import QueueFull


class CanvasTooLarge(ValueError):
    """A canvas that could never run: it alone needs more packed rows than the worker allows."""


class InvalidCanvas(ValueError):
    """A canvas the frontend should not have sent (its validation lets none through)."""


class CanvasPhase(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False)  # identity: canvases are compared as objects
class Canvas:
    start: worker_pb2.CanvasStart      # request_id is set when the policy accepts it
    id: int = 0
    phase: CanvasPhase = CanvasPhase.WAITING
    steps_planned: int = 0             # the next step index to plan
    steps_done: int = 0                # steps whose result came back
    on_worker: bool = False            # a plan started it: the worker holds its canvas until released
    codes: np.ndarray | None = None    # [target_frames, num_codebooks] once finished
    error: str | None = None
    cancelled: bool = False
    t_accepted: float = 0.0            # the driver's clock
    t_started: float | None = None
    t_finished: float | None = None

    @property
    def num_step(self) -> int:
        return self.start.knobs.num_step

    @property
    def cost(self) -> int:
        """Packed rows this canvas adds to every step it runs in."""
        return canvas_rows(self.start)


def check_canvas(start: worker_pb2.CanvasStart) -> None:
    ref = start.reference_codes
    if not 1 <= start.knobs.num_step <= MAX_NUM_STEP:
        raise InvalidCanvas(f"canvas.knobs.num_step = {start.knobs.num_step}: must be in [1, {MAX_NUM_STEP}]")
    if start.target_frames < 1:
        raise InvalidCanvas(f"canvas.target_frames = {start.target_frames}: must be >= 1")
    if not start.text_ids:
        raise InvalidCanvas("canvas.text_ids is empty: the style and text segments are missing")
    if ref.rows and (ref.cols != NUM_CODEBOOKS or len(ref.data) != 4 * ref.rows * ref.cols):
        raise InvalidCanvas(f"canvas.reference_codes is {ref.rows}x{ref.cols} with {len(ref.data)} bytes: give "
                            f"[frames, {NUM_CODEBOOKS}] int32 codes")


def canvas_rows(start: worker_pb2.CanvasStart) -> int:
    """Packed rows of one canvas: its cond document (text + reference + target) and, with
    guidance, its uncond document (the target again)."""
    prefix = len(start.text_ids) + start.reference_codes.rows
    return packed_rows(prefix, start.target_frames, start.knobs.guidance_scale)


class CanvasPolicy:
    def __init__(self, max_queue: int, hello: worker_pb2.Hello):
        if hello.max_batch < 1:
            raise ValueError(f"OmniVoice worker {hello.model_name!r} says max_batch {hello.max_batch}: it must run "
                             f"at least one canvas per step")
        self.max_queue = max_queue
        self.max_rows = hello.max_packed_rows or None  # 0: the worker sets no row budget
        self.max_running = hello.max_batch
        self.waiting: deque[Canvas] = deque()
        self.running: dict[int, Canvas] = {}
        self.used_rows = 0                    # packed rows of the canvases the next plan steps
        self.used_slots = 0                   # and how many they are
        self.pending_release: list[int] = []  # canvases the next plan frees on the worker
        self._ids = itertools.count(1)
        self._step_ids = itertools.count(1)

    # ---- canvases in and out -------------------------------------------------
    def add(self, canvas: Canvas) -> Canvas:
        """Queue a canvas. InvalidCanvas: malformed; CanvasTooLarge: it would never fit; QueueFull: the
        queue is full."""
        check_canvas(canvas.start)
        if self.max_rows is not None and canvas.cost > self.max_rows:
            raise CanvasTooLarge(
                f"this request needs {canvas.cost} packed rows per step (text + reference + target frames, the "
                f"target twice with guidance), more than the worker's budget of {self.max_rows}: shorten the text "
                f"or the reference, or use guidance_scale 0")
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"the OmniVoice waiting queue is full ({self.max_queue} requests); retry later")
        canvas.id = next(self._ids)
        canvas.start.request_id = canvas.id
        self.waiting.append(canvas)
        return canvas

    def cancel(self, canvas: Canvas) -> None:
        """The client went away: drop the canvas wherever it is. Idempotent."""
        if canvas.phase is CanvasPhase.DONE:
            return
        if canvas in self.waiting:
            self.waiting.remove(canvas)
        self._end(canvas)
        canvas.cancelled = True

    # ---- a step --------------------------------------------------------------
    def schedule(self) -> worker_pb2.StepPlan | None:
        """The next plan: releases, then the canvases admitted now, then one step of every running
        canvas at its own index. None: nothing to do."""
        plan = worker_pb2.StepPlan(step_id=next(self._step_ids))
        plan.release.extend(self.pending_release)
        self.pending_release = []
        self._admit(plan)
        for canvas in self.running.values():
            if canvas.steps_planned < canvas.num_step:
                plan.canvas_step.add(request_id=canvas.id, step=canvas.steps_planned)
                canvas.steps_planned += 1
                if canvas.steps_planned == canvas.num_step:
                    self._unbook(canvas)  # no later plan steps it
        if not (plan.release or plan.canvas_start or plan.canvas_step):
            return None
        return plan

    def _admit(self, plan: worker_pb2.StepPlan) -> None:
        while self.waiting and self.used_slots < self.max_running:
            canvas = self.waiting[0]
            if self.max_rows is not None and self.used_rows + canvas.cost > self.max_rows:
                break  # FIFO: wait for running canvases to finish
            self.waiting.popleft()
            canvas.phase = CanvasPhase.RUNNING
            canvas.on_worker = True
            self.used_rows += canvas.cost
            self.used_slots += 1
            self.running[canvas.id] = canvas
            plan.canvas_start.append(canvas.start)

    # ---- its journal ---------------------------------------------------------
    def apply(self, journal: worker_pb2.Journal) -> list[Canvas]:
        """A step's results; returns the canvases it finished (codes set) or failed (error set)."""
        ended = []
        for result in journal.canvases:
            canvas = self.running.get(result.request_id)
            if canvas is None:
                continue  # cancelled while the step ran
            if result.step != canvas.steps_done:
                ended.append(self._fail(canvas, f"OmniVoice worker returned step {result.step} for a canvas "
                                                f"expecting step {canvas.steps_done}"))
                continue
            canvas.steps_done += 1
            last = canvas.steps_done == canvas.num_step
            if not (result.finished or last):
                continue
            expected = (canvas.start.target_frames, NUM_CODEBOOKS)
            got = (result.codes.rows, result.codes.cols) if result.finished else None
            if not (result.finished and last) or got != expected:
                ended.append(self._fail(canvas, f"OmniVoice worker ended a canvas at step {result.step} of "
                                                f"{canvas.num_step} (finished={result.finished}) with codes of "
                                                f"shape {got}, expected {expected} after the last step"))
                continue
            try:
                codes = matrix_array(result.codes)
            except ValueError as e:
                ended.append(self._fail(canvas, f"OmniVoice worker sent bad codes: {e}"))
                continue
            canvas.codes = codes
            self._end(canvas)
            ended.append(canvas)
        return ended

    def fail(self, request_ids, message: str) -> list[Canvas]:
        """End these running canvases with an error (their step failed); returns them."""
        return [self._fail(self.running[rid], message) for rid in request_ids if rid in self.running]

    def forget_worker(self, message: str, keep: Collection[int] = ()) -> list[Canvas]:
        """The worker restarted and its canvases are gone: every running canvas but those in `keep`
        (started on the new process) fails; a canvas cannot resume mid-unmasking, the client retries
        the request. Waiting canvases stay queued for the new process. The failed canvases are still
        released: a plan sent as the worker restarted may have started them on the new process."""
        return self.fail([rid for rid in self.running if rid not in keep], message)

    def fail_waiting(self, message: str) -> list[Canvas]:
        """End every waiting canvas with an error (no worker will run them); returns them."""
        ended = [self._fail(c, message) for c in self.waiting]
        self.waiting.clear()
        return ended

    # ---- ending --------------------------------------------------------------
    def _fail(self, canvas: Canvas, message: str) -> Canvas:
        canvas.error = message
        self._end(canvas)
        return canvas

    def _unbook(self, canvas: Canvas) -> None:
        self.used_rows -= canvas.cost
        self.used_slots -= 1

    def _end(self, canvas: Canvas) -> None:
        if canvas.phase is CanvasPhase.RUNNING and canvas.steps_planned < canvas.num_step:
            self._unbook(canvas)
        canvas.phase = CanvasPhase.DONE
        self.running.pop(canvas.id, None)
        if canvas.on_worker:
            self.pending_release.append(canvas.id)
            canvas.on_worker = False
