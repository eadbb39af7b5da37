"""The gRPC process's side of a decode process: DecodeProcess starts one as a child (or attaches to
a decoder hosted elsewhere) and speaks SlotWorker's interface to it over ZeroMQ
(protos/chorus/v1/vocoder_decoder.proto). Why a decoder runs in a process of its own, and where it
can live: vocoder_svc/decode_process.py."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import time
from typing import Callable

import numpy as np
import zmq
import zmq.asyncio

from chorus.config import write_proto
from chorus.v1 import common_pb2, vocoder_decoder_pb2 as dpb
from vocoder_svc.config import DECODE_LINK_BYTES, VocoderConfig
from vocoder_svc.metrics import Metrics, StepReport
from vocoder_svc.slot_worker import StreamTooLong

log = logging.getLogger("chorus.vocoder")



class DecoderGone(RuntimeError):
    """The decode process exited: open jobs cannot finish on this replica."""


def front_dirs(path: str, fronts: int) -> list[str]:
    """The directories of a decode process's fronts (its --fronts-dir and --fronts): `vocoder_svc.server
    --attach-decoder` takes one each; a child decode process has one."""
    return [os.path.join(path, str(i)) for i in range(fronts)]


def host_endpoints(path: str) -> tuple[str, str]:
    """(jobs, results) ipc endpoints under a directory shared by the decoder's host and one vocoder."""
    return f"ipc://{path}/jobs", f"ipc://{path}/results"


def host_sockets(ctx: zmq.Context, endpoints: tuple[str, str]) -> tuple[zmq.Socket, zmq.Socket]:
    """The decoder side of one front's link: (inbox PULL, outbox PUSH), connected to its (jobs,
    results) endpoints. No high-water marks (a send never blocks) and no linger."""
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (inbox, outbox):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    inbox.setsockopt(zmq.MAXMSGSIZE, DECODE_LINK_BYTES)
    inbox.connect(endpoints[0])
    outbox.connect(endpoints[1])
    return inbox, outbox


class RemoteStream:
    """A Decode call's stream in the decode process (SlotStream's stand-in on this side)."""

    __slots__ = ("id", "released")

    def __init__(self, stream_id: int) -> None:
        self.id = stream_id
        self.released = False


class DecodeProcess:
    """Starts the decode process (or, with `attach`, connects to a decoder that gpu_worker hosts) and
    speaks SlotWorker's interface to it: open, submit (a future of wire PCM bytes), release,
    close. Use from one asyncio loop."""

    def __init__(self, args: VocoderConfig, metrics: Metrics,
                 on_exit: Callable[[str], None] = lambda reason: None, attach: str | None = None):
        """on_exit(reason): called once if the decoder is gone while the service still runs.
        attach: the directory a hosted decoder serves under (host_endpoints); no child is started."""
        self.metrics, self.on_exit = metrics, on_exit
        self._tmp = None if attach else tempfile.TemporaryDirectory(prefix="chorus-vocoder-")
        self._ctx = zmq.asyncio.Context()
        self._jobs = self._ctx.socket(zmq.PUSH)
        self._results = self._ctx.socket(zmq.PULL)
        for sock in (self._jobs, self._results):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        self._results.setsockopt(zmq.MAXMSGSIZE, DECODE_LINK_BYTES)
        # A child is a decode process with this process as its one front (the same protocol and code
        # as a shared one), under a directory of its own.
        front = attach or front_dirs(self._tmp.name, 1)[0]
        os.makedirs(front, exist_ok=True)
        jobs, results = host_endpoints(front)
        self._jobs.bind(jobs)
        self._results.bind(results)
        # The child's progress lines (graph capture, self-check) go to this process's stdout/stderr.
        self.proc = None if attach else subprocess.Popen(
            [sys.executable, "-m", "vocoder_svc.decode_process", "--fronts-dir", self._tmp.name, "--child",
             "--config-proto", write_proto(args, os.path.join(self._tmp.name, "config.pb"))])
        self.ready: dpb.DecoderReady | None = None
        self.gone: str | None = None
        self._closing = False
        self._heard = time.monotonic()
        self.silence_s = args.attach_silence_s
        # Ids from a random base: a hosted decoder may still answer an earlier gRPC process's jobs.
        self._ids = itertools.count(secrets.randbits(40) << 20)
        self._open: dict[int, tuple[asyncio.Future, RemoteStream]] = {}  # job id -> (future, stream)
        self._tasks: list[asyncio.Task] = []

    @property
    def pid(self) -> int:
        """The decoder's process: the child, or the worker hosting it."""
        return self.ready.pid if self.ready is not None else self.proc.pid

    # What the servicer reads off a slot decoder.
    @property
    def n_q(self) -> int:
        return self.ready.n_q

    @property
    def max_stream_frames(self) -> int:
        return self.ready.max_stream_frames

    async def start(self, timeout: float = 1800.0) -> dpb.DecoderReady:
        """Wait for the decoder's ready message (it loads the codec and captures its graphs first; a
        hosted one may not have started yet)."""
        deadline = time.monotonic() + timeout
        self._send(dpb.DecoderInput(hello=True))  # a hosted decoder drops an earlier process's streams
        while self.ready is None:
            if self.proc is not None and self.proc.poll() is not None:
                raise SystemExit(f"vocoder: the decode process exited with {self.proc.returncode} before it was "
                                 f"ready (its output is above)")
            if time.monotonic() > deadline:
                if self.proc is not None:
                    self.proc.kill()
                raise SystemExit(f"vocoder: the decoder was not ready after {timeout:.0f} s")
            if await self._results.poll(200):
                msg = dpb.DecoderOutput.FromString((await self._results.recv_multipart())[0])
                # A hosted decoder that was already up answers our hello after its own start-up ready
                # (meant for nobody): either will do, it is the same decoder.
                if msg.WhichOneof("kind") == "ready":
                    self.ready = msg.ready
        self._heard = time.monotonic()
        self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._watch())]
        return self.ready

    def open(self) -> RemoteStream:
        return RemoteStream(next(self._ids))

    def submit(self, stream: RemoteStream, codes: np.ndarray, int16: bool = False) -> asyncio.Future:
        if self.gone is not None:
            raise DecoderGone(self.gone)
        if stream.released:
            raise RuntimeError("decode stream already released")
        job = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._open[job] = (fut, stream)
        codes = np.ascontiguousarray(codes, dtype="<i4")
        matrix = common_pb2.IntMatrix(rows=codes.shape[0], cols=codes.shape[1], data=codes.tobytes())
        self._send(dpb.DecoderInput(jobs=[dpb.DecoderJob(job=job, stream=stream.id, codes=matrix, int16=int16)]))
        return fut

    def release(self, stream: RemoteStream) -> None:
        if stream.released:
            return
        stream.released = True
        for job in [j for j, (_, s) in self._open.items() if s is stream]:
            fut, _ = self._open.pop(job)
            fut.cancel()
        if self.gone is None:
            self._send(dpb.DecoderInput(released=[stream.id]))

    def _send(self, msg: dpb.DecoderInput) -> None:
        self._jobs.send(msg.SerializeToString())  # no high-water mark: never blocks

    async def _read(self) -> None:
        while True:
            frames = await self._results.recv_multipart(copy=True)
            self._heard = time.monotonic()
            try:
                self._handle(frames)
            except Exception:  # noqa: BLE001 - one bad message must not leave every call waiting
                log.exception("bad message from the decode process")

    def _handle(self, frames: list[bytes]) -> None:
        msg = dpb.DecoderOutput.FromString(frames[0])
        kind = msg.WhichOneof("kind")
        if kind == "done":
            done = msg.done
            entry = self._open.pop(done.job, None)
            if entry is None or entry[0].done():  # released meanwhile
                return
            fut = entry[0]
            if done.error == dpb.DecoderJobDone.NONE:
                fut.set_result(frames[1])
            elif done.error == dpb.DecoderJobDone.STREAM_TOO_LONG:
                fut.set_exception(StreamTooLong(done.message))
            else:
                fut.set_exception(RuntimeError(done.message))
        elif kind == "ready" and msg.ready.incarnation != self.ready.incarnation:
            self._lost(f"the vocoder's decoder restarted (pid {msg.ready.pid}): its streams are gone")
        elif kind == "clip_report":
            if msg.clip_report.clips:  # 0: a hosted codec's heartbeat
                self.metrics.record_clips(msg.clip_report.decode_ms, msg.clip_report.clips, msg.clip_report.forwards)
        elif kind == "report":
            r = msg.report
            self.metrics.record_step(StepReport(r.free_slots, r.waiting_streams,
                                                      r.step_ms if r.stepped else None, r.step_streams, r.graphed,
                                                      r.step_frames, r.queue_wait_ms, r.launched_ahead))

    async def _watch(self) -> None:
        if self.proc is None:  # hosted: its heartbeat stops when the worker's process is gone
            while time.monotonic() - self._heard < self.silence_s and self.gone is None:
                await asyncio.sleep(0.2)
            if self.gone is None:
                self._lost(f"the vocoder's hosted decoder (pid {self.ready.pid}) went silent for "
                           f"{self.silence_s:g} s")
            return
        while self.proc.poll() is None:
            await asyncio.sleep(0.2)
        self._lost(f"the vocoder's decode process exited with {self.proc.returncode}")

    def _lost(self, reason: str) -> None:
        """The decoder is gone: fail every open job (their calls end UNAVAILABLE) and tell the service."""
        if self._closing or self.gone is not None:
            return
        self.gone = reason
        for fut, _ in self._open.values():
            if not fut.done():
                fut.set_exception(DecoderGone(self.gone))
        self._open.clear()
        self.on_exit(self.gone)

    def close(self) -> None:
        """Stop the child (after the calls have drained: it ignores SIGTERM/SIGINT so that a signal to
        the whole process group does not cut them off). A hosted decoder keeps running (it belongs to
        the worker): it only hears that this process's streams are released."""
        if self._closing:
            return
        self._closing = True
        for t in self._tasks:
            t.cancel()
        if self.proc is None:
            streams = {s.id for _, s in self._open.values()}
            if streams and self.gone is None:
                self._send(dpb.DecoderInput(released=sorted(streams)))
        elif self.proc.poll() is None:
            self._send(dpb.DecoderInput(shutdown=True))
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._ctx.destroy(linger=0 if self.proc is not None else 500)
        if self._tmp is not None:
            self._tmp.cleanup()
