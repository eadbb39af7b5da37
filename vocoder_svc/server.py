"""The vocoder gRPC service (chorus.v1.Vocoder): streaming Decode of code
frames to PCM, Encode of reference audio to codes, Info.

Chunking is a pure function of (first_chunk_frames, chunk_frames, total
frames): the first chunk is exactly first_chunk_frames frames, every later
one exactly chunk_frames, and `end` flushes whatever remains. Arrival timing
never matters, so the PCM is byte-identical run to run (with the slots
engine on GPU only within one bucket: see below).

Codec work runs on worker threads, never on the asyncio loop. Two decode
engines (--engine; auto = slots on CUDA devices, stream otherwise):

Stream engine (the CPU default). Each call owns a StreamState. Steps of
different streams that are due together with the same frame count are
decoded in one batched forward (up to --max-batch-streams). By default the
batch is batch-invariant (`--batch-mode invariant`): every GEMM runs per
stream inside one bmm and the codebook sum has a fixed order, so a stream's
PCM is bit-identical whatever else shares its step, and a stream replayed on
another replica (scheduler failover) reproduces the same bytes. Startup
checks this on the serving device and dtype (a solo stream against the same
stream batched with others); if the check fails (e.g. --torch-threads > 1
on CPU, where MKL splits a lone GEMM across threads) the service falls back
to one stream per step and says so. `--batch-mode fast` folds the batch into
plain GEMMs: a few percent faster, but a stream's output then moves at the
~1e-6 level with whichever streams happened to be due together.

Slots engine (the CUDA default). A SlotDecoder (vocoder_svc/slot_decoder.py)
holds the streaming state of up to --slots streams in preallocated device
buffers. A call takes a slot with its first step and gives it back when it
ends (finish, cancel or error); a step that finds every slot taken waits in
the queue (never an error) until a call ends. The oldest due step and every
other due step with the same frame count are decoded in one decoder step,
padded to the next batch bucket (--buckets); each (bucket, T) with T in
--graph-frames (default: the first and steady chunk sizes) is captured as a
CUDA graph at startup, one progress line each, and replayed; any other T (a
request's own chunk sizes) runs eagerly at the same bucket. A stream's short
last step (the tail flush) is padded to its chunk size and its PCM cut back.
Streams whose start.codebooks is not --slot-codebooks use the stream
engine. Startup prints a self-check of the byte-identity facts below. On
CUDA the slot decoder and its step loop run in a child process
(--decode-process, vocoder_svc/decode_process.py) so that gRPC's threads,
which hold the GIL while they write PCM, never stall the steps; this
process keeps the calls, the chunking, Encode and the metrics.

Byte identity on GPU (slots engine), which matters because the scheduler
replays a broken stream on another replica, where other streams share its
steps, and resumes at the exact sample:
  * holds within one bucket: every op is per row and padding rows are
    scratch rows, so a stream's PCM is bit-identical whoever its neighbours
    are, and graph replay equals eager (H200, bf16: both bitwise);
  * does not hold across buckets: GEMM shapes change with the bucket and
    cuBLAS picks other kernels; on an H200 in bf16 a stream alone (bucket 1)
    differs from the same stream in bucket 4 by up to 0.125 (random full
    codec). The bucket of a step is the number of streams due with the same
    T at that moment, i.e. load and timing, so with several buckets even two
    runs on one replica may differ, and a failover replay continues with
    audio close to, but not byte-identical with, what the failed replica
    would have sent: the CPU stream engine's guarantee does not carry over.
  * one bucket (--buckets equal to --slots) restores it for replicas with the
    same --slots, GPU and software: every step has the same shapes. The cost
    is that every step computes the full bucket whatever the load. H200, full
    codec, bf16, 25-frame steps: 167 ms per step at 64 slots, where one
    stream alone takes 14 ms in bucket 1 (30 ms at 8, 52 ms at 16, 89 ms at
    32); throughput at full load is unchanged, latency at light load is not.
    Per-stream GEMMs (the stream engine's invariant mode) are not a cheap
    alternative here: cuBLAS gives no bitwise guarantee for a bmm across
    batch counts, and one GEMM per stream gives up the batching that makes
    the slot decoder fast.
Streams are limited to SlotDecoder.max_stream_frames frames (positions exact in
fp32: 2184 frames, ~175 s, for MOSS-Audio-Tokenizer v2); a longer stream
fails alone with OUT_OF_RANGE (which the scheduler does not fail over).

    python -m vocoder_svc.server --port 50053 --preset tiny
    python -m vocoder_svc.server --codec DIR --device cuda --dtype bfloat16 --slots 64 --graph-frames 5,25
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import signal
import struct
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from chorus.audio import decode_audio, encode_pcm16, prepare_reference
from chorus.v1 import common_pb2, vocoder_pb2, vocoder_pb2_grpc
from chorus.watchdog import add_stall_flag, stall_limit
from vocoder_svc.codec import MossAudioTokenizer, StreamState, full_v2, tiny_v2
from vocoder_svc.codec_checkpoint import build_codec, load_codec
from vocoder_svc.decode_process import HOST_SILENCE_S, DecodeProcess, DecoderGone
from vocoder_svc.engines import (DEFAULT_CODEBOOKS, DecodeWorker, SlotStream, SlotWorker,
                                 StreamTooLong)
from vocoder_svc.metrics import Metrics
from vocoder_svc.selfcheck import check_batch_invariance, check_slot_decoder, describe_slot_check
from vocoder_svc.slot_decoder import SlotDecoder, default_buckets

SERVICE_NAME = vocoder_pb2.DESCRIPTOR.services_by_name["Vocoder"].full_name  # "chorus.v1.Vocoder"
MAX_CHUNK_FRAMES = 1000  # 80 s of audio per step bounds one step's memory
MAX_MESSAGE_BYTES = 64 << 20  # a 100 s 48 kHz stereo float32 reference is ~38 MB
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


async def _then(fut: asyncio.Future, fn):
    return fn(await fut)


# ---- the service ----------------------------------------------------------------------------

@dataclass
class _Stream:
    stream_id: str
    state: StreamState | None  # stream engine (or codebooks the slot decoder does not decode)
    handle: SlotStream | None  # slots engine
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
                 metrics: Metrics | None = None, slot_decoder: SlotDecoder | None = None,
                 decoder: DecodeProcess | None = None, launch_ahead_streams: int | None = None,
                 step_frames: int = 0, stall_exit_s: float = 0.0):
        """slot_decoder: decode streams of slot_decoder.n_q codebooks on this SlotDecoder (the slots
        engine); decoder: the same, with the slot decoder in a decode process (already started); other
        streams, and every stream without either, use the stream engine."""
        if not 1 <= chunk_frames <= MAX_CHUNK_FRAMES or first_chunk_frames < 1:
            raise ValueError(f"chunk sizes must be >= 1 (chunk <= {MAX_CHUNK_FRAMES}); got first "
                             f"{first_chunk_frames}, chunk {chunk_frames}")
        self.codec, self.name = codec, name
        self.first_chunk_frames, self.chunk_frames = first_chunk_frames, chunk_frames
        self.metrics = metrics or Metrics()
        if slot_decoder is not None and slot_decoder.codec is not codec:
            raise ValueError("the slot decoder must decode with the servicer's codec")
        if slot_decoder is not None and decoder is not None:
            raise ValueError("a slot decoder runs in this process or in a decode process, not both")
        self.slot_decoder = slot_decoder
        self.step_frames = step_frames
        self.queued_steps = 2  # steps a call may have queued before its reader stops reading (backpressure)
        # The slots engine, either way: open / submit / release / close, n_q, max_stream_frames.
        self.slot_worker: SlotWorker | DecodeProcess | None = (
            SlotWorker(slot_decoder, self.metrics.record_step, launch_ahead_streams, step_frames,
                          stall_exit_s=stall_exit_s)
            if slot_decoder is not None else decoder)
        # With a slot decoder, the stream engine only serves the odd codebook count: one stream per step.
        self.worker = DecodeWorker(codec, self.metrics, 1 if self.slot_worker is not None else max_batch_streams,
                                   batch_invariant)
        # Encoding a long reference takes a while; its own thread keeps streams flowing.
        self._encode_lock = threading.Lock()
        self._cache: OrderedDict[bytes, bytes] = OrderedDict()
        self._cache_size = encode_cache_size
        self.active_streams = 0

    def close(self) -> None:
        self.worker.close()
        if self.slot_worker is not None:
            self.slot_worker.close()

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
        if self.slot_worker is not None and codebooks == self.slot_worker.n_q:
            return _Stream(start.stream_id, None, self.slot_worker.open(), codebooks, first, chunk,
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
        limit = self.slot_worker.max_stream_frames if stream.handle is not None else None
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
            step = self.slot_worker.submit(stream.handle, codes, int16=int16)
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
                    self.slot_worker.release(stream.handle)  # the slot is freed before the next step
                self.active_streams -= 1
                self.metrics.active_streams.dec()

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

    async def Info(self, request, context):
        return vocoder_pb2.VocoderInfo(codec=self.name, sample_rate=self.codec.sample_rate,
                                       channels=self.codec.channels, samples_per_frame=self.codec.hop,
                                       max_codebooks=self.codec.num_codebooks, active_streams=self.active_streams)


# ---- startup -----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=50053,
                        help="gRPC port (default: %(default)s; 0 picks a free port and prints it)")
    parser.add_argument("--metrics-port", type=int, default=9103,
                        help="Prometheus /metrics HTTP port on --host (default: %(default)s; 0 disables)")
    parser.add_argument("--codec", metavar="DIR", default=None,
                        help="MOSS-Audio-Tokenizer Hugging Face directory (config.json + safetensors). "
                             "Without it, a random-weight --preset is served")
    parser.add_argument("--preset", choices=("tiny", "full"), default="tiny",
                        help="random-weight codec when --codec is not given: tiny = toy v2 for tests, "
                             "full = full-size v2 shapes with dummy weights (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="torch device where the codec runs: cpu, cuda, cuda:1 "
                        "(default: %(default)s)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                        help="codec compute dtype; the quantizer always runs in fp32 (default: %(default)s)")
    parser.add_argument("--first-chunk-frames", type=int, default=5,
                        help="frames in a stream's first PCM chunk, for low first-audio latency; a request's "
                             "start.first_chunk_frames overrides it (default: %(default)s)")
    parser.add_argument("--chunk-frames", type=int, default=25,
                        help="frames in every later PCM chunk (25 = 2 s); a request's start.chunk_frames "
                             "overrides it (default: %(default)s)")
    parser.add_argument("--encode-cache-size", type=int, default=256,
                        help="reference encodings kept in the LRU cache (default: %(default)s; 0 disables)")
    parser.add_argument("--engine", choices=("auto", "slots", "stream"), default="auto",
                        help="decode engine. slots: a SlotDecoder of --slots streams, batched steps replayed "
                             "from CUDA graphs; byte-identical within a batch bucket only (see --buckets). stream: "
                             "per-stream states, batch-invariant batching (--batch-mode), byte-identical whatever "
                             "the batch. auto: slots on CUDA devices, stream otherwise (default: %(default)s)")
    parser.add_argument("--slots", type=int, default=64,
                        help="slots engine: streams decoded concurrently; a stream holds a slot from its first "
                             "step to the end of its call, and a stream that finds none free waits for one "
                             "(default: %(default)s)")
    parser.add_argument("--buckets", default=None, metavar="B,B,...",
                        help="slots engine: batch sizes a step is padded to (the largest >= --slots; default "
                             "1,2,4,8 then every 8 up to --slots). A stream's PCM depends on the bucket its steps ran in (in "
                             "bf16 by up to ~0.1 between buckets 1 and 4 on an H200), so a failover replay on "
                             "another replica is byte-identical only in the same buckets. One bucket (--buckets "
                             "equal to --slots) makes every step the same shape: byte-identical across replicas "
                             "with the same --slots, GPU and software, but every step then costs a full bucket "
                             "(H200, full codec, bf16, 25 frames: 167 ms at 64 streams vs 14 ms for one stream "
                             "alone)")
    parser.add_argument("--graph-frames", default=None, metavar="T,T,...",
                        help="slots engine: step sizes (frames) that get a CUDA graph per bucket, captured at "
                             "startup; other sizes (tails, per-request chunk sizes) run eagerly. Default: "
                             "--first-chunk-frames,--chunk-frames; 'none' disables graphs")
    parser.add_argument("--graphs", choices=("auto", "off", "emulate"), default="auto",
                        help="slots engine: auto = CUDA graphs on CUDA devices; off = always eager; emulate = "
                             "the graph bookkeeping with eager replays (tests the path on CPU) "
                             "(default: %(default)s)")
    parser.add_argument("--decode-process", choices=("auto", "on", "off"), default="auto",
                        help="slots engine: run the SlotDecoder and its step loop in a child process, so the "
                             "decode thread never waits for the GIL that gRPC's threads hold while they write "
                             "PCM (one process tops out near 1,500 s of audio per second on an H200). The child "
                             "holds its own copy of the codec weights. auto = on for CUDA devices "
                             "(default: %(default)s)")
    parser.add_argument("--attach-decoder", default=None, metavar="DIR",
                        help="slots engine: use the decoder that `gpu_worker --host-vocoder-decoder DIR` runs "
                             "in the worker's process instead of starting a decode process. On one GPU the codec "
                             "then shares the worker's CUDA context: the GPU interleaves their kernels (the "
                             "worker's on a high-priority stream) where two processes' contexts take turns in "
                             "time slices. The codec flags (--preset, --slots, ...) go to the worker's "
                             "--vocoder-decoder-args, not here. Or DIR/i of a decoder that `python -m "
                             "vocoder_svc.decode_process --fronts-dir DIR --fronts N` runs on its own, shared by N "
                             "vocoder processes (chorus up --shared-vocoder-decoder)")
    parser.add_argument("--attach-silence-s", type=float, default=HOST_SILENCE_S, metavar="S",
                        help="with --attach-decoder: the decoder is gone (open calls end UNAVAILABLE and the "
                             "service stops, so its pod restarts) after this long without a word from it; it "
                             "sends one each second (default: %(default)s)")
    parser.add_argument("--launch-ahead-streams", type=int, default=1, metavar="N",
                        help="slots engine: launch a step while the previous one still runs on the device "
                             "only if it carries at least N streams. Default 1, every step: with a GPU to "
                             "itself the vocoder then never idles between steps (one H200, 32 streams of "
                             "10-frame chunks: 1,696 s of audio per s, 1,436 stepping one at a time). Beside "
                             "the worker on one GPU, `chorus up` passes half of --slots: below that a new "
                             "stream's first chunk waits behind one running step at most")
    parser.add_argument("--step-frames", type=int, default=0, metavar="N",
                        help="slots engine: decode chunks longer than N frames in N-frame steps (the PCM still "
                             "goes back per chunk). With N = --first-chunk-frames every step has one frame count, "
                             "so new streams' first chunks and other streams' steady chunks share steps instead of "
                             "taking turns in small ones (one H200, codec beside the worker, W1 c16: time to "
                             "first audio p50 89 -> 78 ms, 6%% less audio per second). 0 = one step per chunk "
                             "(default: %(default)s)")
    add_stall_flag(parser, "a launched slot-decoder step (slots engine)")
    parser.add_argument("--priority-first-chunks", action="store_true",
                        help="slots engine on CUDA: replay the first chunk's graphs (--first-chunk-frames) on a "
                             "high-priority CUDA stream from their own memory pool, so a new stream's first chunk "
                             "does not wait for a steady step already on the GPU (time to first audio under load; "
                             "worth 2-3 ms of W1 c16 TTFA on one H200). Steps are told apart by their frame count: "
                             "with --step-frames equal to it, every step runs there (default: off)")
    parser.add_argument("--slot-codebooks", type=int, default=DEFAULT_CODEBOOKS,
                        help="slots engine: codebooks per frame the slot decoder decodes; streams with another "
                             "start.codebooks use the stream engine (default: %(default)s, MOSS-TTS Local)")
    parser.add_argument("--max-batch-streams", type=int, default=8,
                        help="stream engine: decode up to this many streams' steps (same frame count) in one "
                             "forward when they are due together; 1 = one stream per step (default: %(default)s)")
    parser.add_argument("--batch-mode", choices=("invariant", "fast"), default="invariant",
                        help="invariant: per-stream GEMMs, a stream's PCM is byte-identical whatever it is batched "
                             "with (checked at startup; falls back to one stream per step if the device breaks "
                             "it); fast: folded GEMMs, output moves at the ~1e-6 level with the batch "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random --preset weights "
                        "(default: %(default)s)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="CPU threads for torch ops (default: %(default)s, best for the tiny preset and for GPU "
                             "serving; 0 = torch's default, all cores)")
    parser.add_argument("--switch-interval-ms", type=float, default=0.5,
                        help="the interpreter's GIL switch interval (Python's own default is 5 ms). The decode "
                             "thread takes the GIL many times per step while the gRPC thread writes PCM; each "
                             "wait can last a whole interval (default: %(default)s)")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds open calls get to finish on SIGINT/SIGTERM (default: %(default)s)")


def make_codec(args: argparse.Namespace) -> tuple[MossAudioTokenizer, str]:
    if getattr(args, "torch_threads", 0) > 0:
        torch.set_num_threads(args.torch_threads)
    dtype = DTYPES[args.dtype]
    if torch.device(args.device).type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {args.device}: no CUDA device is available")
        if torch.device(args.device).index is not None:
            torch.cuda.set_device(torch.device(args.device))  # capture streams and graph pools follow it
    if args.codec:
        return load_codec(args.codec, dtype=dtype, device=args.device), Path(args.codec).name
    config = tiny_v2() if args.preset == "tiny" else full_v2()
    codec = build_codec(config, seed=args.seed, dtype=dtype, device=args.device)
    return codec, f"{config.name} (random weights, seed {args.seed})"


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def resolve_engine(engine: str, device: str) -> str:
    """auto -> slot decoder on CUDA devices, stream otherwise."""
    if engine == "auto":
        return "slots" if torch.device(device).type == "cuda" else "stream"
    return engine


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: expected comma-separated integers") from None
    if any(v < 1 for v in values):
        raise SystemExit(f"{flag} {text!r}: values must be >= 1")
    return values


def first_chunk(args: argparse.Namespace) -> int:
    """The first chunk's frames as the service uses them: never above the steady chunk size."""
    return max(1, min(args.first_chunk_frames, args.chunk_frames))


def stall_exit_seconds(args: argparse.Namespace) -> float:
    return stall_limit(args.stall_exit_s, torch.device(args.device).type)


def build_slot_decoder(codec: MossAudioTokenizer, args: argparse.Namespace, log=print) -> SlotDecoder:
    """The slots engine's SlotDecoder, ready to serve: every (bucket, T in --graph-frames) graph
    captured now (largest first, one progress line each), then the self-check of its byte-identity
    facts (also the warm-up), logged with a warning if the fused glue kernels fell back."""
    if args.slots < 1:
        raise SystemExit(f"--slots {args.slots}: must be >= 1")
    n_q = args.slot_codebooks
    if not 1 <= n_q <= codec.num_codebooks:
        raise SystemExit(f"--slot-codebooks {n_q}: this codec decodes 1..{codec.num_codebooks}")
    buckets = default_buckets(args.slots) if args.buckets is None else _int_list(args.buckets, "--buckets")
    if not buckets or max(buckets) < args.slots:
        raise SystemExit(f"--buckets {args.buckets}: the largest bucket must be >= --slots ({args.slots})")
    first = first_chunk(args)
    if args.step_frames < 0:
        raise SystemExit(f"--step-frames {args.step_frames}: must be >= 0")
    if args.graph_frames is None:
        frames = sorted({first, args.step_frames or args.chunk_frames})
    elif args.graph_frames.strip().lower() in ("", "none"):
        frames = []
    else:
        frames = sorted(set(_int_list(args.graph_frames, "--graph-frames")))
    if any(t > MAX_CHUNK_FRAMES for t in frames):
        raise SystemExit(f"--graph-frames: at most {MAX_CHUNK_FRAMES} frames")
    graphs = {"auto": None, "off": False, "emulate": "emulate"}[args.graphs] if frames else False
    slot_decoder = SlotDecoder(codec, slots=args.slots, n_q=n_q, buckets=buckets, graphs=graphs, graph_frames=frames,
                           priority_frames=[first] if args.priority_first_chunks else [])
    log(f"vocoder: slots engine: {slot_decoder.slots} slots, buckets {list(slot_decoder.buckets)}, {n_q} codebooks, "
        f"compute {str(slot_decoder.compute_dtype).removeprefix('torch.')}, state "
        f"{slot_decoder.state_nbytes() / 1e9:.3f} GB, graphs {slot_decoder.graph_mode or 'off'}"
        + (f" for {frames} frames" if slot_decoder.graph_mode else "")
        + (f", {sorted(slot_decoder.priority_frames)}-frame steps on a high-priority stream"
           if slot_decoder.priority_frames else ""), flush=True)
    if slot_decoder.graph_mode:
        pairs = sorted({(b, t) for b in slot_decoder.buckets for t in frames}, key=lambda bt: (-bt[0] * bt[1], -bt[0]))
        started = time.perf_counter()
        for i, (b, t) in enumerate(pairs, 1):
            t0 = time.perf_counter()
            slot_decoder.capture([b], [t])
            if slot_decoder.device.type == "cuda":
                torch.cuda.synchronize(slot_decoder.device)
            if slot_decoder.graphs_disabled:
                log(f"vocoder: graph capture failed, every step runs eagerly: {slot_decoder.graphs_disabled}", flush=True)
                break
            log(f"vocoder: captured graph {i}/{len(pairs)} (bucket {b}, {t} frames) in "
                f"{time.perf_counter() - t0:.2f} s", flush=True)
        else:
            log(f"vocoder: {len(pairs)} graphs captured in {time.perf_counter() - started:.2f} s", flush=True)
    if slot_decoder.glue_fallback:
        log(f"vocoder: WARNING: fused glue kernels unusable, running the torch path: {slot_decoder.glue_fallback}",
            flush=True)
    log(describe_slot_check(check_slot_decoder(slot_decoder, first)), flush=True)
    return slot_decoder


def use_decode_process(args: argparse.Namespace) -> bool:
    """--decode-process: auto = for the slots engine on CUDA devices."""
    if getattr(args, "attach_decoder", None):
        return True
    if resolve_engine(args.engine, args.device) != "slots" or args.decode_process == "off":
        return False
    return args.decode_process == "on" or torch.device(args.device).type == "cuda"


async def serve(args: argparse.Namespace, stop: asyncio.Event | None = None) -> None:
    stop = stop or asyncio.Event()
    metrics = Metrics()
    engine = resolve_engine(args.engine, args.device)
    decoder = failure = None
    if use_decode_process(args):
        def decoder_exited(reason: str) -> None:
            nonlocal failure
            failure = reason
            print(f"vocoder: {reason}; stopping", flush=True)
            stop.set()

        # A child starts loading beside this process; a hosted decoder may be up already.
        decoder = DecodeProcess(args, metrics, on_exit=decoder_exited, attach=args.attach_decoder)
    codec, name = make_codec(args)
    slot_decoder = None
    if decoder is not None:
        try:
            ready = await decoder.start()
        except BaseException:
            decoder.close()
            raise
        metrics.slot_kernels.labels("attention", ready.attention).set(1)
        metrics.slot_kernels.labels("glue", ready.glue).set(1)
        where = f"the decoder hosted by process {decoder.pid}" if ready.hosted else f"decode process {decoder.pid}"
        print(f"vocoder: slots engine in {where}", flush=True)
    elif engine == "slots":
        slot_decoder = build_slot_decoder(codec, args)
        metrics.slot_kernels.labels("attention", slot_decoder.attention_path).set(1)
        metrics.slot_kernels.labels("glue", slot_decoder.glue_impl).set(1)
    max_batch, invariant = max(1, args.max_batch_streams), args.batch_mode == "invariant"
    if slot_decoder is not None or decoder is not None:
        max_batch = 1  # the stream engine only serves other codebook counts
    elif max_batch > 1 and invariant:
        problem = check_batch_invariance(codec, first_chunk(args), max(1, min(args.chunk_frames, MAX_CHUNK_FRAMES)))
        if problem is not None:
            print(f"vocoder: batched decode is not batch-invariant on {args.device}/{args.dtype} "
                  f"(torch threads {torch.get_num_threads()}): {problem}; decoding one stream per step",
                  flush=True)
            max_batch = 1
    if slot_decoder is None and decoder is None:
        print(f"vocoder: stream engine, up to {max_batch} streams per decode step"
              + ("" if max_batch == 1 else f" ({'batch-invariant' if invariant else 'fast, not batch-invariant'})"),
              flush=True)
    servicer = VocoderServicer(codec, name, first_chunk_frames=args.first_chunk_frames,
                               chunk_frames=args.chunk_frames, encode_cache_size=args.encode_cache_size,
                               max_batch_streams=max_batch, batch_invariant=invariant, metrics=metrics,
                               slot_decoder=slot_decoder, decoder=decoder, launch_ahead_streams=args.launch_ahead_streams,
                               step_frames=args.step_frames, stall_exit_s=stall_exit_seconds(args))
    if slot_decoder is None and decoder is None:
        # Warm-up: the first real step should not pay one-time allocation costs.
        codec.decode_step(codec.new_stream(), torch.zeros(1, 1, servicer.first_chunk_frames, dtype=torch.long),
                          batch_invariant=invariant)

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    vocoder_pb2_grpc.add_VocoderServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(_host_port(args.host, args.port))
    if port == 0:
        raise SystemExit(f"could not bind {_host_port(args.host, args.port)}")
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    http = None
    if args.metrics_port:
        http, _ = start_http_server(args.metrics_port, addr=args.host, registry=metrics.registry)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread / platform without signals
            pass
    print(f"vocoder ready on {_host_port(args.host, port)}", flush=True)
    try:
        await stop.wait()
    finally:
        # Drain: report NOT_SERVING so balancers move away, let open calls finish, then stop.
        await health_servicer.enter_graceful_shutdown()
        await server.stop(args.grace)
        servicer.close()  # and the decode process, if there is one
        if http is not None:
            http.shutdown()
        print("vocoder stopped", flush=True)
    if failure is not None:
        raise SystemExit(f"vocoder: {failure}")


def run(args: argparse.Namespace) -> None:
    """Serve until SIGINT/SIGTERM (blocking)."""
    if args.switch_interval_ms > 0:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    asyncio.run(serve(args))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vocoder_svc.server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
