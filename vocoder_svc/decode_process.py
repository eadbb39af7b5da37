"""The slots engine in its own process (--decode-process).

Why: in one process the decode thread and gRPC's threads share one GIL. A
64-stream step takes the GIL hundreds of times (launches, graph replays, the
PCM conversion) while gRPC's C core holds it for each 384 KB PCM message it
writes (250-440 us per chunk per side, benchmarks/grpc_pcm_bench.py), so on an
H200 one process stalled at ~1,500 s of audio per second with its steps
stretched from 61 to 79 ms. Here the child owns the slot decoder, its CUDA
graphs and the step loop (SlotWorker); the gRPC process keeps
the calls, the chunking, Encode and the metrics, and only moves bytes.

Wire (protos/chorus/v1/vocoder_decoder.proto, ZeroMQ PUSH -> PULL over ipc
each way): DecoderInput down (jobs, then releases), DecoderOutput up (ready
once, then job answers with their PCM as a second frame, and the slot decoder's
reports for the metrics). The child exits when its parent is gone; the parent
fails every open job when the child is gone (the calls end UNAVAILABLE, so
the scheduler replays them on another replica) and the service stops with
an error, so its pod restarts.

The decoder can also live in another process that outlives the gRPC one:
`gpu_worker --host-vocoder-decoder DIR` serves it from a thread (host_in_thread),
so on one GPU the codec shares the worker's CUDA context instead of
time-slicing against it, and `vocoder_svc.server --attach-decoder DIR`
connects to it (vocoder_svc/decoder_client.py: DecodeProcess(attach=DIR)) instead of starting a child. It
says hello first, and it takes a heartbeat's silence for the decoder's death.
Or the decoder is a process of its own in front of which N vocoder processes
attach, one per DIR/i (`chorus up --shared-vocoder-decoder`): one
CUDA context and one slot decoder for a GPU of the vocoder's own, with the gRPC
work spread over N processes. Each front has its own socket pair; a front's
hello releases only its own streams, and every front hears a heartbeat.

    python -m vocoder_svc.decode_process --fronts-dir DIR --child --config-proto FILE   (started by the
        server; FILE a serialized chorus.v1.VocoderConfig)
    python -m vocoder_svc.decode_process --fronts-dir DIR --fronts N <vocoder flags or --config FILE>
        (one decoder, N `vocoder_svc.server --attach-decoder DIR/i` processes in front of it)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import secrets
import signal
import threading
import time
from typing import Callable

import numpy as np
import torch
import zmq

from chorus.config import ConfigError, add_config_flags, parse
from chorus.v1 import vocoder_decoder_pb2 as dpb
from vocoder_svc.config import VocoderConfig
from vocoder_svc.decoder_build import build_slot_decoder, make_codec, stall_exit_seconds
from vocoder_svc.decoder_client import front_dirs, host_endpoints, host_sockets
from vocoder_svc.metrics import StepReport
from vocoder_svc.slot_worker import SlotStream, SlotWorker, StreamTooLong

log = logging.getLogger("chorus.vocoder")

HOST_HEARTBEAT_S = 1.0


class _Replies:
    """The child's one PUSH socket, shared by the slot decoder thread (answers, reports) and the main
    thread (ready): ZeroMQ sockets are not thread-safe, so sends take a lock."""

    def __init__(self, sock: zmq.Socket):
        self._sock, self._lock = sock, threading.Lock()
        self.last_sent = time.monotonic()

    def send(self, msg: dpb.DecoderOutput, pcm: bytes | None = None) -> None:
        with self._lock:
            self.last_sent = time.monotonic()
            if pcm is None:
                self._sock.send(msg.SerializeToString())
            else:
                self._sock.send_multipart([msg.SerializeToString(), pcm], copy=False)

    def report(self, r: StepReport) -> None:
        self.send(dpb.DecoderOutput(report=dpb.DecoderReport(
            free_slots=r.free_slots, waiting_streams=r.waiting_streams, stepped=r.step_ms is not None,
            step_ms=r.step_ms or 0.0, step_streams=r.step_streams, graphed=r.graphed, step_frames=r.step_frames,
            queue_wait_ms=r.queue_wait_ms, launched_ahead=r.launched_ahead)))

    def finish(self, job: int) -> Callable[[object, BaseException | None], None]:
        def done(result: object, error: BaseException | None) -> None:
            if isinstance(error, asyncio.CancelledError):
                return  # dropped by a release: the parent no longer waits for it
            if error is None:
                self.send(dpb.DecoderOutput(done=dpb.DecoderJobDone(job=job)), result)
                return
            kind = dpb.DecoderJobDone.STREAM_TOO_LONG if isinstance(error, StreamTooLong) else dpb.DecoderJobDone.FAILED
            self.send(dpb.DecoderOutput(done=dpb.DecoderJobDone(job=job, error=kind, message=str(error))), b"")
        return done


def _exit_with_parent() -> None:
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)  # the gRPC process is gone (even by SIGKILL): nobody will read our answers


class Decoder:
    """The decode side: one SlotDecoder and its SlotWorker, answering DecoderInput from gRPC
    processes ("fronts") with DecoderOutput, each front on its own (jobs, results) endpoint pair.
    Runs as a process of its own (main): one gRPC process's child, or shared by several fronts; or
    as a thread of the worker's process (host_in_thread). Shared, it is one CUDA
    context and one slot decoder whose steps mix every front's streams, while the fronts' gRPC work
    (250-440 us of host time a PCM chunk, benchmarks/grpc_pcm_bench.py) is spread over their processes."""

    def __init__(self, args: VocoderConfig, endpoints: list[tuple[str, str]], *, cuda_stream=None,
                 hosted: bool = False):
        self._ctx = zmq.Context()
        self._inboxes: list[zmq.Socket] = []
        self._fronts: list[_Replies] = []
        for pair in endpoints:
            inbox, outbox = host_sockets(self._ctx, pair)
            self._inboxes.append(inbox)
            self._fronts.append(_Replies(outbox))
        codec, _ = make_codec(args)
        slot_decoder = build_slot_decoder(codec, args)
        # Step reports go to the first front only: summed over the fronts' metrics, each step counts once.
        self.worker = SlotWorker(slot_decoder, self._fronts[0].report, args.launch_ahead_streams or None,
                                 args.step_frames, cuda_stream=cuda_stream, stall_exit_s=stall_exit_seconds(args))
        self.ready = dpb.DecoderReady(
            slots=slot_decoder.slots, n_q=slot_decoder.n_q, max_stream_frames=slot_decoder.max_stream_frames,
            attention=slot_decoder.attention_path, glue=slot_decoder.glue_impl, glue_fallback=slot_decoder.glue_fallback or "",
            incarnation=secrets.randbits(63), pid=os.getpid(), hosted=hosted,
            graph_frames=slot_decoder.graphed_frames(), step_frames=args.step_frames)
        self._streams: dict[int, tuple[int, SlotStream]] = {}  # stream id -> (front, its slot decoder stream)

    def serve(self, heartbeat_s: float | None = None) -> None:
        """Answer DecoderInput until `shutdown`. heartbeat_s: send a front a report when it has heard
        nothing for that long (a hosted decoder's sign of life; its gRPC processes have no child to watch)."""
        for front in self._fronts:
            front.send(dpb.DecoderOutput(ready=self.ready))
        poller = zmq.Poller()
        for inbox in self._inboxes:
            poller.register(inbox, zmq.POLLIN)
        timeout = None if heartbeat_s is None else int(heartbeat_s * 1000)
        try:
            while True:
                ready = dict(poller.poll(timeout))
                if heartbeat_s is not None:
                    now = time.monotonic()
                    for front in self._fronts:
                        if now - front.last_sent >= heartbeat_s:
                            front.report(self.worker.gauges())
                if any(self._handle(i, inbox.recv()) for i, inbox in enumerate(self._inboxes) if inbox in ready):
                    break
        finally:
            self.worker.close()
            self._ctx.destroy(linger=0)

    def _handle(self, front: int, frame: bytes) -> bool:
        """One DecoderInput from `front`; True when it says shutdown."""
        try:
            msg = dpb.DecoderInput.FromString(frame)
        except Exception:  # noqa: BLE001 - one bad frame must not end the decoder
            log.exception("unparseable DecoderInput (%d bytes) ignored", len(frame))
            return False
        if msg.hello:  # a new gRPC process on this front: whatever an earlier one left open is nobody's now
            for sid in [sid for sid, (f, _) in self._streams.items() if f == front]:
                self.worker.release(self._streams.pop(sid)[1])
            self._fronts[front].send(dpb.DecoderOutput(ready=self.ready))
        for job in msg.jobs:
            entry = self._streams.get(job.stream)
            if entry is None:
                entry = self._streams[job.stream] = (front, self.worker.open())
            codes = np.frombuffer(job.codes.data, dtype="<i4").reshape(job.codes.rows, job.codes.cols)
            self.worker.submit_job(entry[1], codes, job.int16, self._fronts[front].finish(job.job))
        for sid in msg.released:
            entry = self._streams.pop(sid, None)
            if entry is not None:
                self.worker.release(entry[1])
        return msg.shutdown


def host_in_thread(path: str, config: VocoderConfig, device: str) -> Decoder:
    """The vocoder's decoder as a daemon thread of this (the worker's) process, on `device`: one
    CUDA context with the worker, so the GPU interleaves the two processes' kernels instead of
    time-slicing whole contexts, and the decoder's steady steps run on a low-priority stream
    (its first chunks, with priority_first_chunks, on a high one). The codec is built and its
    graphs captured before this returns (never while the worker captures or replays its own);
    `vocoder_svc.server --attach-decoder path` connects to it. config: the vocoder's settings
    (preset, slots, ...); its device is the worker's."""
    args = dataclasses.replace(config, device=device)
    os.makedirs(path, exist_ok=True)
    stream = torch.cuda.Stream(torch.device(device), priority=0) if torch.device(device).type == "cuda" else None
    decoder = Decoder(args, [host_endpoints(path)], cuda_stream=stream, hosted=True)
    if stream is not None:
        torch.cuda.synchronize(torch.device(device))  # the build's work, queued on this thread's stream
    def serve() -> None:
        try:
            decoder.serve(HOST_HEARTBEAT_S)
        except BaseException:  # noqa: BLE001 - see below
            # Without its decoder this process can serve no audio, and an attached vocoder would wait for a
            # ready that never comes: exit, so whatever supervises the worker restarts both.
            log.exception("the hosted vocoder decoder failed; exiting")
            os._exit(70)

    threading.Thread(target=serve, name="vocoder-decoder", daemon=True).start()
    return decoder


def main(argv: list[str] | None = None) -> None:
    """One decoder behind N vocoder gRPC processes ("fronts"), front i attached under DIR/i: the child
    a vocoder starts for itself (--child, one front), or a process of its own shared by N
    `vocoder_svc.server --attach-decoder DIR/i` processes. Why share one: one vocoder process cannot
    feed an H200 at W1 c256 (its GPU 76-86% busy end to end, benchmarks/README.md), and two replicas
    are two CUDA contexts that take turns on the GPU. A shared decoder stops on SIGTERM/SIGINT; its
    fronts then hear no heartbeat and stop (their calls end UNAVAILABLE). A front that dies holds its
    slots until a process attaches in its place (its hello releases them), as with a hosted decoder."""
    parser = argparse.ArgumentParser(prog="python -m vocoder_svc.decode_process", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fronts-dir", required=True, metavar="DIR", help="serve the fronts under DIR/0 ... DIR/N-1")
    parser.add_argument("--fronts", type=int, default=1, metavar="N",
                        help="vocoder gRPC processes in front of this decoder (default: %(default)s)")
    parser.add_argument("--child", action="store_true",
                        help="started by its one front: exit when that process is gone, and leave SIGINT/SIGTERM "
                             "to it (it drains its calls, then sends shutdown)")
    add_config_flags(parser, VocoderConfig)
    ns = parser.parse_args(argv)
    if ns.fronts < 1 or (ns.child and ns.fronts != 1):
        parser.error(f"--fronts {ns.fronts}: at least 1, and exactly 1 with --child")
    try:
        args = parse(VocoderConfig, ns)
    except ConfigError as e:
        parser.error(str(e))
    dirs = front_dirs(ns.fronts_dir, ns.fronts)
    for d in dirs:
        os.makedirs(d, exist_ok=True)
    if ns.child:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        threading.Thread(target=_exit_with_parent, name="parent-watch", daemon=True).start()
    else:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: os._exit(0))
    decoder = Decoder(args, [host_endpoints(d) for d in dirs], hosted=not ns.child)
    if ns.child:
        print(f"vocoder: decode process {os.getpid()} ready", flush=True)
    else:
        print(f"vocoder decoder {os.getpid()} for {ns.fronts} fronts ready on {ns.fronts_dir}", flush=True)
    decoder.serve(HOST_HEARTBEAT_S)


if __name__ == "__main__":
    main()
