"""One request's audio path: generated rows → a vocoder Decode stream → PCM
→ the client's format. Yields SynthesizeResponse audio (and codes) chunks
in order; raises SynthesisFailed when the request cannot be completed.

Failover. The vocoder's chunking is a pure function of the start message and
the frame count, and its decode is deterministic, so a stream can be rebuilt
on any replica bit for bit. The relay keeps every code frame the request has
produced (the same rows as `req.frames`, in order) and counts the native-rate
samples per channel it has handed to the output converter. When a Decode call
breaks (replica killed, drained, stuck, or an UNAVAILABLE / DEADLINE_EXCEEDED /
CANCELLED / INTERNAL / UNKNOWN status), it marks that replica unhealthy in the
pool, opens a new Decode call on another replica with the same start message,
replays all frames so far and keeps feeding new ones, and drops the samples of
the new stream that the client already has: the client's audio goes on at
exactly the next sample, and the resampler / encoder sees every native sample
once. After `max_failovers` broken streams the request fails with UNAVAILABLE.

Flow control (scheduler_svc/flow_control.py): the audio the client has not taken is counted; a
stream over its share stops reading the vocoder and pauses its request until the client reads,
and one whose client reads nothing for the stall ends through `abort`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import AsyncIterator

import grpc
import numpy as np

from chorus.v1 import tts_pb2, vocoder_pb2
from scheduler_svc.flow_control import Backlog, ReaderStalled, StreamBacklog
from scheduler_svc.output import AudioOutput
from scheduler_svc.request import ErrorEvent, FinishEvent, FrameEvent, Request
from chorus.wire import rows_matrix
from scheduler_svc.vocoder_client import REPLICA_FAILURE_CODES, NoReplica, VocoderPool, VocoderReplica

log = logging.getLogger("chorus.scheduler")


class SynthesisFailed(RuntimeError):
    """retry_after: seconds the client should wait before trying again (chorus/retry_hint.py); None: no hint."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.code = code
        self.retry_after = retry_after


QUEUE_FULL_RETRY_S = 1.0  # a full queue's hint: about the time a short request takes to free a place


class _StreamBroke(Exception):
    """A Decode call failed in a way another replica can fix."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code


class _Attempt:
    """One Decode call on one replica."""

    def __init__(self, number: int, replica: VocoderReplica, call):
        self.number = number
        self.replica = replica
        self.call = call
        self.tasks: list[asyncio.Task] = []
        self.fed = 0              # frames written on this call
        self.returned = 0         # frames the call has answered with PCM
        self.end_sent = False
        self.owed_since: float | None = None  # stall watchdog
        self.writes: collections.deque[tuple[int, float]] = collections.deque()  # (fed after a write, its time)


class _RelayStream:
    """The state of one request's relay, across however many Decode calls it takes."""

    def __init__(self, relay: "AudioRelay", req: Request, output: AudioOutput, start: vocoder_pb2.DecodeStart,
                 chunk_frames: int, return_codes: bool, backlog: StreamBacklog):
        self.relay = relay
        self.backlog = backlog
        self.abort = None  # (code, message) -> None: ends the call (AudioRelay.stream)
        self.pool = relay.vocoders
        self.req = req
        self.output = output
        self.start = start
        self.chunk_frames = chunk_frames
        self.return_codes = return_codes
        self.channels = relay.codec.channels
        self.codes: list[np.ndarray] = []   # [n_vq] code row of every frame seen so far (req.frames[:, 1:])
        self.finished = False               # FinishEvent seen: no more frames
        self.changed = asyncio.Event()      # new frames or the finish
        self.sent_native = 0                # samples per channel handed to `output`
        self.out_q: asyncio.Queue = asyncio.Queue()
        self.attempt: _Attempt | None = None
        self.failovers = 0
        self.closed = False
        self.max_lag = 0.0  # seconds: the longest wait of a chunk for its audio (see _record_lag)

    # ---- scheduler events (one task for the whole request) ------------------------------------
    async def pump(self) -> None:
        while True:
            event = await self.req.events.get()
            if isinstance(event, FrameEvent):
                self.req.t_last_frame = time.monotonic()
                codes = event.row[1:]
                self.codes.append(codes)
                if self.return_codes:
                    self._put(tts_pb2.SynthesizeResponse(codes=tts_pb2.CodesChunk(
                        first_frame=event.index, codes=rows_matrix(codes[None]))))
                self.changed.set()
            elif isinstance(event, FinishEvent):
                self.finished = True
                self.changed.set()
                return
            elif isinstance(event, ErrorEvent):
                code = grpc.StatusCode.UNAVAILABLE if event.unavailable else grpc.StatusCode.INTERNAL
                self.out_q.put_nowait(SynthesisFailed(code, event.message))
                return

    def _put(self, resp: tts_pb2.SynthesizeResponse) -> None:
        """Queue a response for the client, counted until gRPC takes it (AudioRelay.stream)."""
        self.backlog.add(resp.ByteSize())
        self.out_q.put_nowait(resp)

    # ---- attempts --------------------------------------------------------------------------------
    def begin(self, replica: VocoderReplica, delay: float = 0.0) -> None:
        number = self.attempt.number + 1 if self.attempt else 0
        self.pool.acquire(replica)
        att = _Attempt(number, replica, replica.stub.Decode())
        self.attempt = att
        att.tasks = [asyncio.get_running_loop().create_task(self._write(att, delay)),
                     asyncio.get_running_loop().create_task(self._read(att))]

    def end(self, att: _Attempt) -> None:
        current = asyncio.current_task()
        for t in att.tasks:
            if t is not current:
                t.cancel()
        att.call.cancel()
        self.pool.release(att.replica)
        att.tasks = []

    def close(self) -> None:
        self.closed = True
        if self.attempt is not None and self.attempt.tasks:
            self.end(self.attempt)

    def _broke(self, att: _Attempt, code: grpc.StatusCode, details: str) -> None:
        """Attempt `att` failed with `code`: fail over, or fail the request."""
        if att is not self.attempt or self.closed or not att.tasks:
            return  # an older call, already replaced
        if code not in REPLICA_FAILURE_CODES:
            self.end(att)
            self.out_q.put_nowait(SynthesisFailed(grpc.StatusCode.INTERNAL,
                                                  f"vocoder {att.replica.address} rejected the stream: "
                                                  f"{code.name}: {details}"))
            return
        why = f"{code.name}: {details}"
        self.pool.mark_failed(att.replica, f"Decode: {why}")
        self.end(att)
        self.failovers += 1
        if self.failovers > self.relay.max_failovers:
            self.out_q.put_nowait(SynthesisFailed(
                grpc.StatusCode.UNAVAILABLE,
                f"vocoder stream failed {self.failovers} times (last on {att.replica.address}: {why}); "
                f"giving up after {self.relay.max_failovers} failovers"))
            return
        try:
            replica = self.pool.pick(exclude=[att.replica])
        except NoReplica as e:
            self.out_q.put_nowait(SynthesisFailed(grpc.StatusCode.UNAVAILABLE, str(e)))
            return
        # A replica still cooling down (the only one left) is tried again after a short pause.
        delay = 0.0 if replica.available() else min(2.0, 0.25 * self.failovers)
        log.warning("request %s: vocoder stream on %s broke (%s) at sample %d, frame %d/%d; replaying %d frames "
                    "on %s (failover %d/%d)", self.req.id, att.replica.address, why, self.sent_native,
                    att.returned, len(self.codes), len(self.codes), replica.address, self.failovers,
                    self.relay.max_failovers)
        self.begin(replica, delay)

    def _fail_other(self, att: _Attempt, e: BaseException) -> None:
        if att is not self.attempt or self.closed:
            return
        self.end(att)
        self.out_q.put_nowait(SynthesisFailed(grpc.StatusCode.INTERNAL, f"audio relay failed: {e!r}"))

    # ---- frames → vocoder --------------------------------------------------------------------------
    async def _write(self, att: _Attempt, delay: float) -> None:
        call = att.call
        try:
            if delay:
                await asyncio.sleep(delay)
            await call.write(vocoder_pb2.DecodeRequest(start=self.start))
            while True:
                if att.fed < len(self.codes) and (self.finished or len(self.codes) >= self._boundary(att.fed)):
                    # Everything not yet sent in one message (a replay sends the whole history at once);
                    # the vocoder's chunking does not depend on how frames are split into messages.
                    block = np.stack(self.codes[att.fed:])
                    if att.number == 0 and att.fed == 0:
                        self.req.t_first_chunk = time.monotonic()  # reported in the request's summary
                    await call.write(vocoder_pb2.DecodeRequest(frames=rows_matrix(block)))
                    att.fed += len(block)
                    att.writes.append((att.fed, time.monotonic()))
                elif self.finished:
                    att.end_sent = True  # before the await: the reader may see the stream's end first
                    await call.write(vocoder_pb2.DecodeRequest(end=True))
                    await call.done_writing()
                    return
                else:
                    self.changed.clear()
                    await self.changed.wait()
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            self._broke(att, e.code(), e.details() or "")
        except asyncio.InvalidStateError:
            pass  # the call is over; the reader sees its status
        except Exception as e:  # noqa: BLE001
            self._fail_other(att, e)

    def _boundary(self, fed: int) -> int:
        """The next chunk boundary after `fed` frames. The vocoder decodes only at
        boundaries, so frames go out when one is reached (or at the end): one gRPC
        write per chunk instead of one per frame, with no added latency."""
        chunk = max(1, self.chunk_frames)
        first = min(self.start.first_chunk_frames or 1, chunk)  # the vocoder caps it the same way
        return first + ((fed - first) // chunk + 1) * chunk

    # ---- vocoder → client ----------------------------------------------------------------------------
    def _owed(self, att: _Attempt) -> bool:
        """Does the vocoder owe PCM on this call (it has a whole chunk, or the tail after `end`)?"""
        pending = att.fed - att.returned
        return pending > 0 and (att.end_sent or (self.chunk_frames > 0 and pending >= self.chunk_frames))

    async def _next(self, att: _Attempt):
        """call.read(), failing with DEADLINE_EXCEEDED when the replica owes PCM for too long."""
        stall = self.relay.stall_timeout
        if not stall:
            return await att.call.read()
        read = asyncio.ensure_future(att.call.read())
        try:
            while True:
                done, _ = await asyncio.wait({read}, timeout=min(1.0, stall))
                if done:
                    return read.result()
                now = time.monotonic()
                if not self._owed(att):
                    att.owed_since = None
                elif att.owed_since is None:
                    att.owed_since = now
                elif now - att.owed_since > stall:
                    raise _StreamBroke(grpc.StatusCode.DEADLINE_EXCEEDED,
                                       f"no audio for {stall:.0f}s while {att.fed - att.returned} frames "
                                       f"were due")
        finally:
            if not read.done():
                read.cancel()

    async def _read(self, att: _Attempt) -> None:
        try:
            while True:
                await self.backlog.room()
                resp = await self._next(att)
                if resp is grpc.aio.EOF:
                    break
                att.owed_since = None
                self._deliver(att, resp)
            if not (self.finished and att.end_sent and att.returned == len(self.codes)):
                raise _StreamBroke(grpc.StatusCode.UNKNOWN, f"the stream ended after {att.returned} of "
                                                            f"{len(self.codes)} frames")
            tail = self.output.flush()
            if tail is not None:
                self._put(tail)
            self.out_q.put_nowait(None)
            self.pool.mark_healthy(att.replica)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            self._broke(att, e.code(), e.details() or "")
        except _StreamBroke as e:
            self._broke(att, e.code, str(e))
        except ReaderStalled as e:
            self.relay.stalled(self, e)
        except Exception as e:  # noqa: BLE001
            self._fail_other(att, e)

    def _record_lag(self, att: _Attempt) -> None:
        """The request's longest wait so far from a chunk's frames all written to the vocoder to its PCM
        back (the summary's max_audio_lag_ms): a vocoder falling behind shows here first."""
        while att.writes and att.writes[0][0] < att.returned:
            att.writes.popleft()
        if att.writes:
            self.max_lag = max(self.max_lag, time.monotonic() - att.writes[0][1])
            self.req.max_audio_lag = self.max_lag

    def _deliver(self, att: _Attempt, resp: vocoder_pb2.DecodeResponse) -> None:
        """Hand the part of resp the client does not have yet to the output converter (no awaits here:
        the sample count and the converter move together)."""
        int16 = resp.pcm_encoding == vocoder_pb2.PCM_INT16
        if int16 and not self.output.passes_pcm16:
            raise _StreamBroke(grpc.StatusCode.INTERNAL, "int16 PCM for an output that needs float32")
        pcm = np.frombuffer(resp.pcm, dtype="<i2" if int16 else "<f4").reshape(-1, self.channels)
        if pcm.shape[0] != resp.num_samples or resp.first_frame != att.returned:
            raise _StreamBroke(grpc.StatusCode.INTERNAL,
                               f"malformed chunk: frame {resp.first_frame} (expected {att.returned}), "
                               f"{pcm.shape[0]} samples (header says {resp.num_samples})")
        att.returned = resp.first_frame + resp.frames
        self._record_lag(att)
        first, n = resp.first_sample, pcm.shape[0]
        if first > self.sent_native:
            raise _StreamBroke(grpc.StatusCode.INTERNAL, f"chunk starts at sample {first} but the client has "
                                                         f"only {self.sent_native}")
        skip = self.sent_native - first  # replayed samples the client already has
        if skip >= n:
            return
        self.sent_native = first + n
        if int16:  # already the client's bytes: forwarded, sliced only when replayed samples are dropped
            out = self.output.forward_pcm16(pcm[skip:].tobytes() if skip else resp.pcm, n - skip)
        else:
            out = self.output.convert(pcm[skip:])
        if out is not None:
            self._put(out)


class AudioRelay:
    def __init__(self, vocoders: VocoderPool, codec: vocoder_pb2.VocoderInfo, n_vq: int, *,
                 max_failovers: int = 3, stall_timeout: float = 30.0, backlog: Backlog | None = None,
                 pause=lambda req, paused: None):
        """backlog: the frontend's bound on undelivered audio (None: 4 MiB a stream, 256 MiB in all, a
        30 s reader stall); pause(req, paused): tell the scheduler to stop or go on planning req."""
        self.vocoders = vocoders
        self.backlog = backlog or Backlog(4 << 20, 256 << 20, 30.0)
        self.pause = pause
        self.codec = codec
        self.n_vq = n_vq
        self.max_failovers = max_failovers
        self.stall_timeout = stall_timeout  # 0 = no watchdog

    def stalled(self, stream: _RelayStream, e: ReaderStalled) -> None:
        """The client stopped reading: end the stream now (its handler waits on gRPC, not on out_q)."""
        log.warning("request %s: %s", stream.req.id, e)
        stream.close()
        stream.backlog.close()  # the handler may wait on gRPC for long yet
        if stream.abort is not None:
            stream.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        else:
            stream.out_q.put_nowait(SynthesisFailed(grpc.StatusCode.DEADLINE_EXCEEDED, str(e)))

    async def stream(self, req: Request, output: AudioOutput, first_chunk_frames: int, chunk_frames: int,
                     return_codes: bool, abort=None) -> AsyncIterator[tts_pb2.SynthesizeResponse]:
        """abort(code, message): end the call while the handler waits on gRPC (a client not reading)."""
        encoding = vocoder_pb2.PCM_INT16 if output.passes_pcm16 else vocoder_pb2.PCM_FLOAT32
        start = vocoder_pb2.DecodeStart(stream_id=str(req.id), first_chunk_frames=first_chunk_frames,
                                        chunk_frames=chunk_frames, codebooks=self.n_vq, pcm_encoding=encoding)
        backlog = self.backlog.stream(lambda paused: self.pause(req, paused))
        relay = _RelayStream(self, req, output, start, chunk_frames, return_codes, backlog)
        relay.abort = abort
        try:
            relay.begin(self.vocoders.pick())
        except NoReplica as e:
            raise SynthesisFailed(grpc.StatusCode.UNAVAILABLE, str(e)) from e
        pump = asyncio.create_task(relay.pump())
        try:
            while True:
                item = await relay.out_q.get()
                if item is None:
                    break
                if isinstance(item, Exception):
                    raise item
                yield item
                backlog.delivered(item.ByteSize())
        finally:
            pump.cancel()
            relay.close()
            backlog.close()
