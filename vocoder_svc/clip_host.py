"""OmniVoice's codec hosted in another process: the Higgs-Audio-v2 forwards as a thread of the
OmniVoice worker's process, answering one vocoder replica (`vocoder_svc.server --attach-decoder DIR`)
over the decode-process link (protos/chorus/v1/vocoder_decoder.proto, vocoder_svc/decoder_client.py).

Why: on one GPU a codec replica of its own is a second CUDA context, which the GPU time-slices
against the worker's back-to-back steps; inside the worker's process the two share one context and
the GPU interleaves their kernels, as MOSS's hosted decoder does (vocoder_svc/decode_process.py).
Only the forwards move here. The replica keeps the calls, the post-processing (on its own cores,
not under the worker's GIL) and Encode.

A job is a whole clip ([T, 8] codes); its answer is the clip's float32 samples. The thread takes
every job queued when it comes free, decodes them together (HiggsCodec.decode: equal lengths in one
forward where measured exact), answers each, and reports the batch (ClipReport); with nothing to
say for a second it sends an empty report, the replica's sign that this process is alive.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from contextlib import nullcontext

import numpy as np
import torch
import zmq

from chorus.v1 import vocoder_decoder_pb2 as dpb
from vocoder_svc.config import VocoderConfig
from vocoder_svc.decoder_client import host_endpoints, host_sockets

log = logging.getLogger("chorus.vocoder")

HEARTBEAT_S = 1.0


class ClipHost:
    """The codec's forwards for one front (a vocoder replica), on the thread that calls serve()."""

    def __init__(self, codec, path: str, *, max_batch: int = 16, cuda_stream=None):
        self.codec, self.max_batch, self.cuda_stream = codec, max(1, max_batch), cuda_stream
        self._ctx = zmq.Context()
        self._inbox, self._outbox = host_sockets(self._ctx, host_endpoints(path))
        self.ready = dpb.DecoderReady(slots=self.max_batch, n_q=codec.num_codebooks, max_stream_frames=0,
                                      incarnation=secrets.randbits(63), pid=os.getpid(), hosted=True)
        self._pending: list[dpb.DecoderJob] = []
        self._last_sent = time.monotonic()

    def _send(self, msg: dpb.DecoderOutput, samples: bytes | None = None) -> None:
        self._last_sent = time.monotonic()
        if samples is None:
            self._outbox.send(msg.SerializeToString())
        else:
            self._outbox.send_multipart([msg.SerializeToString(), samples], copy=False)

    def serve(self, heartbeat_s: float = HEARTBEAT_S) -> None:
        """Answer the front until it says shutdown (a hosted codec normally lives as long as its process)."""
        self._send(dpb.DecoderOutput(ready=self.ready))
        try:
            while True:
                wait = 0 if self._pending else int(heartbeat_s * 1000)
                if self._inbox.poll(wait) and self._take_input():
                    return
                if self._pending:
                    self._decode(self._pending[:self.max_batch])
                    self._pending = self._pending[self.max_batch:]
                elif time.monotonic() - self._last_sent >= heartbeat_s:
                    self._send(dpb.DecoderOutput(clip_report=dpb.ClipReport()))
        finally:
            self._ctx.destroy(linger=0)

    def _take_input(self) -> bool:
        """Every DecoderInput waiting; True when one says shutdown."""
        while True:
            try:
                frame = self._inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return False
            try:
                msg = dpb.DecoderInput.FromString(frame)
            except Exception:  # noqa: BLE001 - one bad frame must not end the codec
                log.exception("unparseable DecoderInput (%d bytes) ignored", len(frame))
                continue
            if msg.hello:  # a new replica process: an earlier one's jobs are nobody's now
                self._pending.clear()
                self._send(dpb.DecoderOutput(ready=self.ready))
            self._pending.extend(msg.jobs)
            if msg.released:
                released = set(msg.released)
                self._pending = [j for j in self._pending if j.stream not in released]
            if msg.shutdown:
                return True

    def _decode(self, group: list[dpb.DecoderJob]) -> None:
        t0 = time.perf_counter()
        try:
            clips = [np.frombuffer(j.codes.data, dtype="<i4").reshape(j.codes.rows, j.codes.cols) for j in group]
            with torch.cuda.stream(self.cuda_stream) if self.cuda_stream is not None else nullcontext():
                waves = self.codec.decode(clips)
        except Exception as e:  # noqa: BLE001 - the group's calls fail; the codec goes on
            log.exception("hosted codec: a batch of %d clips failed", len(group))
            for job in group:
                self._send(dpb.DecoderOutput(done=dpb.DecoderJobDone(job=job.job, error=dpb.DecoderJobDone.FAILED,
                                                                     message=str(e))), b"")
            return
        decode_ms = (time.perf_counter() - t0) * 1000.0
        for job, wave in zip(group, waves):
            self._send(dpb.DecoderOutput(done=dpb.DecoderJobDone(job=job.job)), wave.astype("<f4").tobytes())
        forwards = len(self.codec.forward_groups([len(c) for c in clips]))
        self._send(dpb.DecoderOutput(clip_report=dpb.ClipReport(decode_ms=decode_ms, clips=len(group),
                                                                forwards=forwards)))


def host_clips_in_thread(path: str, config: VocoderConfig, device: str) -> ClipHost:
    """OmniVoice's codec as a daemon thread of this (the OmniVoice worker's) process, on `device`,
    serving `vocoder_svc.server --attach-decoder path`. config: the codec replica's settings (preset
    or codec directory, seed); its device is the worker's. The codec is built, and whether equal
    lengths batch exactly is measured, before this returns. Its forwards run on a low-priority
    stream of their own, so the worker's steps go first where both wait for the GPU."""
    from vocoder_svc.clip_servicer import make_clip_codec  # the replica's own construction, on this device

    # torch_threads 0: the process's thread count is the worker's to set, not its guest's
    args = dataclasses.replace(config, device=device, torch_threads=0)
    os.makedirs(path, exist_ok=True)
    stream = torch.cuda.Stream(torch.device(device), priority=0) if torch.device(device).type == "cuda" else None
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        codec = make_clip_codec(args)
    if stream is not None:
        torch.cuda.synchronize(torch.device(device))
    host = ClipHost(codec, path, cuda_stream=stream)

    def serve() -> None:
        try:
            host.serve()
        except BaseException:  # noqa: BLE001 - without its codec the attached replica can serve nothing
            log.exception("the hosted OmniVoice codec failed; exiting")
            os._exit(70)

    threading.Thread(target=serve, name="omnivoice-codec", daemon=True).start()
    return host
