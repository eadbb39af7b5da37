"""The slots engine: SlotWorker, one thread that owns a SlotDecoder's slots and launches its batched,
graph-replayed steps, and a second that hands each step's PCM to the calls.
See vocoder_svc/server.py for how the service picks between the engines."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from chorus.watchdog import StallWatchdog
from vocoder_svc.metrics import StepReport
from vocoder_svc.slot_decoder import SlotDecoder
from vocoder_svc.slot_pcm import PendingPcm
from vocoder_svc.batch_thread import resolve_future

log = logging.getLogger("chorus.vocoder")


class SlotStream:
    """One Decode call's claim on the SlotDecoder: a slot from its first step until release()."""

    __slots__ = ("slot", "released")

    def __init__(self) -> None:
        self.slot: int | None = None
        self.released = False


# A job's completion: (wire PCM bytes, None), or (None, the error); asyncio.CancelledError when the
# job was dropped because its stream was released first.
Finish = Callable[[object, "BaseException | None"], None]


@dataclass(eq=False)
class _SlotJob:
    stream: SlotStream
    codes: np.ndarray  # [T, n_q] int
    int16: bool        # wire PCM16, else float32
    finish: Finish     # called once, on the slot decoder thread (or the releasing thread for dropped jobs)
    abandoned: Callable[[], bool]  # the caller no longer wants the result: skip the job if not yet run
    submitted: float = field(default_factory=time.monotonic)


class _Pieces:
    """A chunk decoded in pieces (SlotWorker step_frames): each piece's PCM bytes are kept until
    every piece is in, then the chunk's bytes go to `finish` whole; the first error (or a drop) ends
    it at once, and the pieces not yet run are skipped as abandoned. Pieces finish on the finisher
    thread, or on a releasing caller's thread when dropped, hence the lock."""

    def __init__(self, n: int, finish: Finish, abandoned: Callable[[], bool]):
        self._parts: list[bytes | None] = [None] * n
        self._left, self._finish, self._abandoned = n, finish, abandoned
        self._done = False
        self._lock = threading.Lock()

    def abandoned(self) -> bool:
        return self._done or self._abandoned()

    def finish_piece(self, i: int) -> Finish:
        def finish(result, error) -> None:
            with self._lock:
                if self._done:
                    return
                if error is None:
                    self._parts[i] = result
                    self._left -= 1
                    if self._left:
                        return
                    result = b"".join(self._parts)
                self._done = True
            self._finish(None if error is not None else result, error)
        return finish


def _future_finish(loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> Finish:
    return lambda result, error: loop.call_soon_threadsafe(resolve_future, fut, result, error)


class SlotWorker:
    """One thread that owns a SlotDecoder: it hands out slots, launches steps and frees slots; a
    second thread waits for each launched step's PCM and hands it to the jobs, so the next step is
    already queued on the device while the host turns this one's PCM into bytes.

    Every slot decoder call (acquire, launch, release) runs on this thread. A slot may
    be freed (its call cancelled) while its last step still runs on the device:
    a step that reuses it runs after, since steps on one CUDA stream run in order
    and the slot decoder orders a slot's steps across its two streams (SlotDecoder
    priority_frames). A stream takes a slot
    when its first step is picked; when every slot is taken, that step waits
    (queued, in arrival order) until a call ends and frees one, while streams
    that hold slots keep stepping. The oldest runnable step and every other
    runnable step with the same frame count are decoded in one decoder step.
    release() (call end: finish, cancel or error) drops the stream's queued
    steps and frees its slot before the next step."""

    def __init__(self, slot_decoder: SlotDecoder, report: Callable[[StepReport], None],
                 launch_ahead_streams: int | None = None, step_frames: int = 0, cuda_stream=None,
                 stall_exit_s: float = 0.0):
        """report: receives the slot gauges and each step's figures (Metrics.record_step in the
        service; the decode process forwards them to its parent).

        step_frames: decode a chunk of more frames in pieces of this many (the last may be shorter),
        one piece a step, and hand its PCM over whole once the last piece is done; 0: a chunk is one
        step. Steps group equal frame counts only, so with step_frames equal to the first chunk's
        size a new stream's first chunk shares a step with the other streams' steady chunks (under
        load, steps of a few first chunks each were most of the vocoder's steps). The codec is
        causal, so the samples equal those of whole-chunk steps up to rounding.

        launch_ahead_streams: a step is launched while the previous one still runs on the device
        only if it carries at least this many streams (default: half the slots). Under load that
        keeps the device busy while the host reads the previous step's PCM; lightly loaded, a new
        stream's first chunk then waits behind at most the one step already running, not also a
        queued one (with the vocoder beside the worker on one GPU that queue cost ~50 ms of TTFA).

        stall_exit_s: end the process when a launched step's PCM has not come back after this many
        seconds (chorus.watchdog: a hung device); 0: never.

        cuda_stream: the CUDA stream steps run on (default: the thread's current one, i.e. the
        device's default stream). A decoder hosted in the worker's process passes a low-priority
        one, so the worker's kernels go first wherever both wait for the GPU."""
        if step_frames < 0:
            raise ValueError(f"step_frames must be >= 0, got {step_frames}")
        self.slot_decoder, self.report, self.step_frames = slot_decoder, report, step_frames
        self._watchdog = StallWatchdog(stall_exit_s, "a vocoder decoder step")
        self.cuda_stream = cuda_stream
        self.launch_ahead_streams = (max(1, slot_decoder.slots // 2) if launch_ahead_streams is None
                                     else launch_ahead_streams)
        self._last: PendingPcm | None = None  # the last launched step (slot decoder thread only)
        self._cond = threading.Condition()
        self._pending: list[_SlotJob] = []
        self._releases: list[SlotStream] = []
        self._closed = False
        self._waiting = 0
        # Launched steps (jobs, slots, PendingPcm, launch time, graphed) for the finisher thread.
        self._launched: queue.Queue = queue.Queue()
        report(StepReport(slot_decoder.free_slots, 0))
        self._thread = threading.Thread(target=self._run, name="slot-decoder", daemon=True)
        self._thread.start()

    @property
    def n_q(self) -> int:
        return self.slot_decoder.n_q

    @property
    def max_stream_frames(self) -> int:
        return self.slot_decoder.max_stream_frames

    def open(self) -> SlotStream:
        return SlotStream()

    def gauges(self) -> StepReport:
        """The slot gauges now (no step)."""
        return StepReport(self.slot_decoder.free_slots, self._waiting)

    def submit(self, stream: SlotStream, codes: np.ndarray, int16: bool = False) -> asyncio.Future:
        """Queue one step of codes [T, n_q]; the future gets its audio as wire PCM bytes (interleaved,
        little-endian; int16 when `int16`, else float32: SlotDecoder.step_pcm)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.submit_job(stream, codes, int16, _future_finish(loop, fut), fut.cancelled)
        return fut

    def submit_job(self, stream: SlotStream, codes: np.ndarray, int16: bool, finish: Finish,
                   abandoned: Callable[[], bool] = lambda: False) -> None:
        """As submit, with a completion callback instead of a future (the decode process's way)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("slot decoder worker is closed")
            if stream.released:
                raise RuntimeError("decode stream already released")
            step, n = self.step_frames, codes.shape[0]
            if step and n > step:
                whole = _Pieces(-(-n // step), finish, abandoned)
                self._pending.extend(_SlotJob(stream, codes[a:a + step], int16, whole.finish_piece(i),
                                                 whole.abandoned) for i, a in enumerate(range(0, n, step)))
            else:
                self._pending.append(_SlotJob(stream, codes, int16, finish, abandoned))
            self._cond.notify()

    def release(self, stream: SlotStream) -> None:
        """The call is over: drop its queued steps; its slot (if any) is freed before the next step."""
        with self._cond:
            if stream.released:
                return
            stream.released = True
            dropped = [j for j in self._pending if j.stream is stream]
            if dropped:
                self._pending = [j for j in self._pending if j.stream is not stream]
            self._releases.append(stream)
            self._cond.notify()
        for j in dropped:
            j.finish(None, asyncio.CancelledError())

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # ---- the thread -------------------------------------------------------------------------------
    def _group(self) -> list[_SlotJob]:
        """(Under the lock.) The next step's jobs, one per stream, all of one frame count; runnable = the
        stream holds a slot, or a free one is left for it. The lead is the oldest first step of a new
        stream if one can run (its listener hears nothing until it is done: time to first audio), else
        the oldest step (later chunks have audio buffered ahead); every other stream whose next step has
        the lead's frame count joins it."""
        self._pending = [j for j in self._pending if not j.abandoned()]
        free = self.slot_decoder.free_slots
        queues: dict[int, list[_SlotJob]] = {}  # each stream's jobs, oldest first; streams by oldest job
        for j in self._pending:
            queues.setdefault(id(j.stream), []).append(j)
        starters = [q for q in queues.values() if q[0].stream.slot is None] if free else []
        slotted = [q for q in queues.values() if q[0].stream.slot is not None]
        lead = starters[0] if starters else slotted[0] if slotted else None
        group: list[_SlotJob] = []
        if lead is not None:
            frames, left = lead[0].codes.shape[0], free
            for q in queues.values():
                new = q[0].stream.slot is None
                if q[0].codes.shape[0] == frames and not (new and left == 0):
                    left -= new
                    group.append(q[0])
            taken = {id(j) for j in group}
            self._pending = [j for j in self._pending if id(j) not in taken]
            for j in group:
                if j.stream.slot is None:
                    j.stream.slot = self.slot_decoder.acquire()
        slotless = sum(j.stream.slot is None for j in self._pending)
        waiting = max(0, slotless - self.slot_decoder.free_slots)
        if waiting != self._waiting:  # a stream started or stopped waiting for a slot
            self._waiting = waiting
            self.report(StepReport(self.slot_decoder.free_slots, waiting))
        return group

    def _take(self) -> tuple[list[_SlotJob], list[SlotStream]] | None:
        with self._cond:
            while True:
                if self._releases:
                    releases, self._releases = self._releases, []
                    return [], releases
                group = self._group()
                if group:
                    return group, []
                if self._closed:
                    # Nothing can run and no call is left to free a slot: fail what still waits.
                    stuck, self._pending = self._pending, []
                    for j in stuck:
                        j.finish(None, RuntimeError("vocoder is shutting down"))
                    return None
                self._cond.wait()

    def _run(self) -> None:
        if self.slot_decoder.device.type == "cuda":
            torch.cuda.set_device(self.slot_decoder.device)  # graph replays go to the current device's stream
            if self.cuda_stream is not None:
                torch.cuda.set_stream(self.cuda_stream)  # this thread's current stream only
        finisher = threading.Thread(target=self._finish_steps, name="slot-decoder-finish", daemon=True)
        finisher.start()
        try:
            while (work := self._take()) is not None:
                group, releases = work
                for stream in releases:
                    if stream.slot is not None:
                        self.slot_decoder.release(stream.slot)
                        stream.slot = None
                if group:
                    self._launch(group)
                else:
                    self.report(StepReport(self.slot_decoder.free_slots, self._waiting))
        finally:
            self._launched.put(None)
            finisher.join()

    def _launch(self, group: list[_SlotJob]) -> None:
        """Queue the group's step on the device and hand it to the finisher thread, which waits for
        its PCM: this thread goes on to launch the next step meanwhile (SlotDecoder.launch_pcm)."""
        s = self.slot_decoder
        runnable = []
        for j in group:  # a stream past the exact-position limit fails alone, not its neighbours
            if s.frames_decoded(j.stream.slot) + j.codes.shape[0] > s.max_stream_frames:
                j.finish(None, StreamTooLong(f"decode stream longer than {s.max_stream_frames} frames "
                                             f"(the slot decoder's exact-position limit)"))
            else:
                runnable.append(j)
        if not runnable:
            return
        slots = [j.stream.slot for j in runnable]  # a release may clear stream.slot before the finish
        try:
            codes = torch.from_numpy(np.stack([j.codes.T for j in runnable]).astype(np.int64))  # [B, n_q, T]
            t = runnable[0].codes.shape[0]
            if (self._last is not None and len(runnable) < self.launch_ahead_streams
                    and not s.uses_priority_stream(t)):  # a priority step must not wait: that is its point
                self._last.wait_device()
            ahead = self._last is not None and self._last.running()
            t0 = time.perf_counter()
            waited = (time.monotonic() - min(j.submitted for j in runnable)) * 1e3
            pending = s.launch_pcm(dict(zip(slots, codes)), int16=[sl for sl, j in zip(slots, runnable) if j.int16])
        except BaseException as e:  # noqa: BLE001 - reported to every stream of the step
            for j in runnable:
                j.finish(None, e)
            return
        self._last = pending
        self._watchdog.begin()
        self._launched.put((runnable, slots, pending, t0, s.last_step_graphed, waited, ahead))

    def _finish_steps(self) -> None:
        """The finisher thread: each launched step's PCM, in launch order, to its jobs. It must outlive
        any one failure: a step it stops reading keeps a staging buffer, and launches then block."""
        while (item := self._launched.get()) is not None:
            runnable, slots, pending, t0, graphed, waited, ahead = item
            try:
                out = pending.result()
            except BaseException as e:  # noqa: BLE001 - reported to every stream of the step
                self._watchdog.end()
                results = [(None, e)] * len(runnable)
            else:
                self._watchdog.end()
                results = [(out[slot], None) for slot in slots]
                self._report_quietly(StepReport(self.slot_decoder.free_slots, self._waiting,
                                                   (time.perf_counter() - t0) * 1000.0, len(runnable), graphed,
                                                   runnable[0].codes.shape[0], waited, ahead))
            for j, (res, err) in zip(runnable, results):
                try:
                    j.finish(res, err)
                except Exception:  # noqa: BLE001 - one caller's failure is not the slot decoder's
                    log.exception("delivering a decode step's PCM failed")

    def _report_quietly(self, report: StepReport) -> None:
        try:
            self.report(report)
        except Exception:  # noqa: BLE001 - metrics must not stop the finisher
            log.exception("slot decoder report failed")


class StreamTooLong(ValueError):
    """A stream would pass SlotDecoder.max_stream_frames (OUT_OF_RANGE: no replica can do it)."""
