"""VocoderServicer: the chorus.v1.Vocoder calls (Decode, Encode, Info) over the two decode engines.
Chunking, backpressure, the short last step's padding and the error statuses live here; what the
engines guarantee is in vocoder_svc/server.py's docstring."""

from __future__ import annotations

import asyncio
import hashlib
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from chorus.audio import decode_audio, encode_pcm16, prepare_reference
from chorus.v1 import common_pb2, vocoder_pb2, vocoder_pb2_grpc
from vocoder_svc.codec import MossAudioTokenizer, StreamState
from vocoder_svc.codec_config import DEFAULT_CODEBOOKS
from vocoder_svc.config import MAX_CHUNK_FRAMES
from vocoder_svc.decoder_client import DecodeProcess, DecoderGone, RemoteStream
from vocoder_svc.metrics import Metrics
from vocoder_svc.slot_worker import StreamTooLong
from vocoder_svc.stream_worker import DecodeWorker


async def _then(fut: asyncio.Future, fn):
    return fn(await fut)


@dataclass
class _Stream:
    stream_id: str
    state: StreamState | None  # stream engine (or codebooks the slot decoder does not decode)
    handle: RemoteStream | None  # slots engine
    codebooks: int
    first_chunk: int
    chunk: int
    pcm_encoding: int = vocoder_pb2.PCM_FLOAT32
    pending: list[np.ndarray] = field(default_factory=list)  # [n, codebooks] int32 blocks
    pending_frames: int = 0
    next_frame: int = 0  # first frame of the next chunk

    @property
    def threshold(self) -> int:
        return self.first_chunk if self.next_frame == 0 else self.chunk

    def take(self, n: int) -> np.ndarray:
        """The oldest n pending frames as one [n, codebooks] array."""
        block = np.concatenate(self.pending, axis=0) if len(self.pending) > 1 else self.pending[0]
        head, rest = block[:n], block[n:]
        self.pending = [rest] if len(rest) else []
        self.pending_frames -= n
        return head


class _BadRequest(Exception):
    pass


class VocoderServicer(vocoder_pb2_grpc.VocoderServicer):
    def __init__(self, codec: MossAudioTokenizer, name: str, first_chunk_frames: int = 5, chunk_frames: int = 25,
                 encode_cache_size: int = 256, max_batch_streams: int = 8, batch_invariant: bool = True,
                 metrics: Metrics | None = None, decoder: DecodeProcess | None = None):
        """decoder: the slots engine, a started client of a slot decoder in a decode process (or hosted
        by another process); it decodes the streams of its n_q codebooks. Other streams, and every
        stream without it, use the stream engine."""
        if not 1 <= chunk_frames <= MAX_CHUNK_FRAMES or first_chunk_frames < 1:
            raise ValueError(f"chunk sizes must be >= 1 (chunk <= {MAX_CHUNK_FRAMES}); got first "
                             f"{first_chunk_frames}, chunk {chunk_frames}")
        self.codec, self.name = codec, name
        self.first_chunk_frames, self.chunk_frames = first_chunk_frames, chunk_frames
        self.metrics = metrics or Metrics()
        self.decoder = decoder
        # The decoder's own step size: it pads a short last step (_padded_length).
        self.step_frames = decoder.ready.step_frames if decoder is not None else 0
        self.queued_steps = 2  # steps a call may have queued before its reader stops reading (backpressure)
        # With a slot decoder, the stream engine only serves the odd codebook count: one stream per step.
        self.worker = DecodeWorker(codec, self.metrics, 1 if decoder is not None else max_batch_streams,
                                   batch_invariant)
        # Encoding a long reference takes a while; its own thread keeps streams flowing.
        self._encode_lock = threading.Lock()
        self._cache: OrderedDict[bytes, bytes] = OrderedDict()
        self._cache_size = encode_cache_size
        self.active_streams = 0

    def close(self) -> None:
        self.worker.close()
        if self.decoder is not None:
            self.decoder.close()

    # ---- Decode ---------------------------------------------------------------------------------
    def _open(self, start: vocoder_pb2.DecodeStart) -> _Stream:
        max_cb = self.codec.num_codebooks
        codebooks = start.codebooks or min(DEFAULT_CODEBOOKS, max_cb)
        if not 1 <= codebooks <= max_cb:
            raise _BadRequest(f"start.codebooks={start.codebooks}: this codec decodes 1..{max_cb} codebooks")
        if start.first_chunk_frames < 0 or start.chunk_frames < 0:
            raise _BadRequest(f"start.first_chunk_frames ({start.first_chunk_frames}) and start.chunk_frames "
                              f"({start.chunk_frames}) must be >= 0 (0 = server default)")
        chunk = start.chunk_frames or self.chunk_frames
        if chunk > MAX_CHUNK_FRAMES:
            raise _BadRequest(f"start.chunk_frames={chunk} is over the limit {MAX_CHUNK_FRAMES}")
        first = min(start.first_chunk_frames or self.first_chunk_frames, chunk)  # never above the steady size
        if start.pcm_encoding not in (vocoder_pb2.PCM_FLOAT32, vocoder_pb2.PCM_INT16):
            raise _BadRequest(f"start.pcm_encoding={start.pcm_encoding}: use PCM_FLOAT32 (0) or PCM_INT16 (1)")
        if self.decoder is not None and codebooks == self.decoder.n_q:
            return _Stream(start.stream_id, None, self.decoder.open(), codebooks, first, chunk,
                           start.pcm_encoding)
        return _Stream(start.stream_id, self.codec.new_stream(), None, codebooks, first, chunk, start.pcm_encoding)

    def _parse_frames(self, m: common_pb2.IntMatrix, stream: _Stream) -> np.ndarray:
        if m.cols != stream.codebooks:
            raise _BadRequest(f"frames has {m.cols} columns but start.codebooks is {stream.codebooks}")
        if m.rows < 0:
            raise _BadRequest(f"frames.rows is {m.rows}; must be >= 0")
        if len(m.data) != m.rows * m.cols * 4:
            raise _BadRequest(f"frames.data has {len(m.data)} bytes; a {m.rows}x{m.cols} int32 matrix needs "
                              f"{m.rows * m.cols * 4}")
        codes = np.frombuffer(m.data, dtype="<i4").reshape(m.rows, m.cols)
        if codes.size:
            lo, hi = int(codes.min()), int(codes.max())
            if lo < 0 or hi >= self.codec.codebook_size:
                bad = np.argwhere((codes < 0) | (codes >= self.codec.codebook_size))[0]
                raise _BadRequest(f"frames: code {int(codes[bad[0], bad[1]])} at row {int(bad[0])}, codebook "
                                  f"{int(bad[1])} is outside [0, {self.codec.codebook_size}) (pad ids are not "
                                  f"codec codes)")
        return codes

    def _padded_length(self, chunk: int, n: int) -> int:
        """Frames a stream's short last step of n frames is padded to: its chunk size, or with
        --step-frames the next multiple of the step (pieces past the real frames would be all padding)."""
        step = self.step_frames
        return chunk if not step else min(chunk, -(-n // step) * step)

    def _submit(self, stream: _Stream, n: int, last: bool = False) -> asyncio.Future:
        """Queue the stream's next n frames for decoding; the future resolves to its DecodeResponse.
        Steps of one stream run in submission order, so the next may be queued before this one is done.

        last: the stream's final flush. On the slots engine a short last step is padded with code-0
        frames to the stream's current chunk size (_padded_length) and its PCM cut back to the n real frames: the codec
        is causal, so the real samples do not depend on the padding, and the step then joins the
        steady steps of other streams in their graph instead of running alone, eagerly (a W1 tail of
        20 frames otherwise waited behind 128-stream steps at c256). Padding is a pure function of the
        chunk sizes and the length, like the chunking, so a replay on another replica pads alike."""
        limit = self.decoder.max_stream_frames if stream.handle is not None else None
        if limit is not None and stream.next_frame + n > limit:
            raise StreamTooLong(f"decode stream longer than {limit} frames: the slot decoder "
                                f"engine keeps positions exact in fp32 only that far")
        codes = stream.take(n)
        int16 = stream.pcm_encoding == vocoder_pb2.PCM_INT16
        first_frame = stream.next_frame
        if stream.handle is not None:  # the slot decoder converts on the device: PCM bytes come back
            pad = self._padded_length(stream.threshold, n) - n if last else 0
            if pad > 0 and first_frame + n + pad <= limit:
                codes = np.concatenate([codes, np.zeros((pad, codes.shape[1]), dtype=codes.dtype)])
            step = self.decoder.submit(stream.handle, codes, int16=int16)
        else:
            step = self.worker.submit(stream.state, codes)  # [C, n*hop] float32
        stream.next_frame += n
        real_bytes = n * self.codec.hop * self.codec.channels * (2 if int16 else 4)

        def response(out) -> vocoder_pb2.DecodeResponse:
            if stream.handle is not None:  # cut back to the real frames if the step was padded
                pcm, num = out[:real_bytes], n * self.codec.hop
            else:  # the scheduler's own PCM16 encoding, so its output bytes do not change
                num = out.shape[1]
                pcm = encode_pcm16(out.T) if int16 else np.ascontiguousarray(out.T).astype("<f4", copy=False).tobytes()
            self.metrics.audio_seconds.inc(num / self.codec.sample_rate)
            return vocoder_pb2.DecodeResponse(first_sample=first_frame * self.codec.hop, num_samples=num, pcm=pcm,
                                              first_frame=first_frame, frames=n, pcm_encoding=stream.pcm_encoding)

        return asyncio.ensure_future(_then(step, response))

    async def _read_steps(self, request_iterator, opened: asyncio.Future, steps: asyncio.Queue) -> None:
        """The call's reader: parses requests and queues a decode step per full chunk (then the tail)
        without waiting for earlier steps' PCM to be written back, so the decoder always finds this
        stream's next chunk queued. At most `steps.maxsize` steps wait unwritten (backpressure)."""
        stream: _Stream | None = None
        try:
            async for req in request_iterator:
                kind = req.WhichOneof("kind")
                if stream is None:
                    if kind != "start":
                        raise _BadRequest(f"the first DecodeRequest must be `start` (got {kind or 'nothing'})")
                    stream = self._open(req.start)
                    opened.set_result(stream)
                    continue
                if kind == "frames":
                    block = self._parse_frames(req.frames, stream)
                    if len(block):
                        stream.pending.append(block)
                        stream.pending_frames += len(block)
                    while stream.pending_frames >= stream.threshold:
                        await steps.put(self._submit(stream, stream.threshold))
                elif kind == "end":
                    break
                elif kind == "start":
                    raise _BadRequest("`start` sent twice in one Decode call")
                else:
                    raise _BadRequest("empty DecodeRequest: set one of start, frames, end")
            # `end`, or the client half-closed without it: flush the tail either way.
            if stream is None:
                raise _BadRequest("no DecodeRequest received: send `start` first")
            if stream.pending_frames:
                await steps.put(self._submit(stream, stream.pending_frames, last=True))
            await steps.put(None)
        except Exception as e:  # noqa: BLE001 - handed to the call, which aborts with the right status
            if not opened.done():
                opened.set_result(None)
            await steps.put(e)

    async def Decode(self, request_iterator, context):
        opened: asyncio.Future = asyncio.get_running_loop().create_future()
        steps: asyncio.Queue = asyncio.Queue(maxsize=self.queued_steps)
        reader = asyncio.ensure_future(self._read_steps(request_iterator, opened, steps))
        stream: _Stream | None = None
        try:
            stream = await opened
            if stream is not None:
                self.active_streams += 1
                self.metrics.active_streams.inc()
            while (item := await steps.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield await item
        except _BadRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except StreamTooLong as e:  # not a replica failure: the scheduler must not fail over
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(e))
        except DecoderGone as e:  # this replica is going down: the scheduler replays the stream elsewhere
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        finally:
            reader.cancel()
            while not steps.empty():  # queued steps nobody will write back (the call ended early)
                item = steps.get_nowait()
                if isinstance(item, asyncio.Future):
                    item.cancel()
            if stream is not None:  # also on cancellation and errors: the state goes with the call
                if stream.handle is not None:
                    self.decoder.release(stream.handle)  # the slot is freed before the next step
                self.active_streams -= 1
                self.metrics.active_streams.dec()

    async def DecodeClip(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"this replica serves {self.name} and streams with Decode; DecodeClip (whole clips) is "
                            "served by OmniVoice codec (Higgs-Audio-v2) replicas")

    # ---- Encode -----------------------------------------------------------------------------------
    @staticmethod
    def _cache_key(req: vocoder_pb2.EncodeRequest, codebooks: int) -> bytes:
        a = req.audio
        h = hashlib.blake2b(digest_size=32)
        h.update(struct.pack("<iiii", int(a.encoding), a.sample_rate, a.channels, codebooks))
        h.update(a.data)
        return h.digest()

    def _encode_sync(self, audio: common_pb2.AudioData, codebooks: int) -> common_pb2.IntMatrix:
        wav, rate = decode_audio(audio)
        ref = prepare_reference(wav, rate, self.codec.sample_rate, self.codec.channels)
        with self._encode_lock:
            codes = self.codec.encode(torch.from_numpy(ref).unsqueeze(0), codebooks)  # [n_q, 1, T]
        mat = codes[:, 0, :].T.to("cpu", torch.int32).numpy()  # [T, n_q]
        return common_pb2.IntMatrix(rows=mat.shape[0], cols=mat.shape[1], data=mat.astype("<i4").tobytes())

    async def Encode(self, request, context):
        max_cb = self.codec.num_codebooks
        codebooks = request.codebooks or min(DEFAULT_CODEBOOKS, max_cb)
        if not 1 <= codebooks <= max_cb:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"codebooks={request.codebooks}: this codec encodes 1..{max_cb} codebooks")
        key = self._cache_key(request, codebooks)
        if key in self._cache:
            self._cache.move_to_end(key)
            self.metrics.encode_cache_hits.inc()
            return vocoder_pb2.EncodeResponse(codes=common_pb2.IntMatrix.FromString(self._cache[key]),
                                              cache_hit=True)
        self.metrics.encode_cache_misses.inc()
        try:
            mat = await asyncio.get_running_loop().run_in_executor(None, self._encode_sync, request.audio, codebooks)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self._cache_size > 0:
            self._cache[key] = mat.SerializeToString()
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return vocoder_pb2.EncodeResponse(codes=mat, cache_hit=False)

    def _slots_facts(self) -> tuple[int, int, list[int]]:
        """(slots, step_frames, graph_frames) of the slots engine as it runs (the decoder's ready
        message); zeros for the stream engine."""
        if self.decoder is None:
            return 0, 0, []
        ready = self.decoder.ready
        return ready.slots, ready.step_frames, list(ready.graph_frames)

    async def Info(self, request, context):
        slots, step_frames, graph_frames = self._slots_facts()
        return vocoder_pb2.VocoderInfo(codec=self.name, sample_rate=self.codec.sample_rate,
                                       channels=self.codec.channels, samples_per_frame=self.codec.hop,
                                       max_codebooks=self.codec.num_codebooks, active_streams=self.active_streams,
                                       first_chunk_frames=min(self.first_chunk_frames, self.chunk_frames),
                                       chunk_frames=self.chunk_frames, step_frames=step_frames,
                                       graph_frames=graph_frames, slots=slots)
