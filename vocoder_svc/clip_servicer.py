"""ClipServicer: the chorus.v1.Vocoder calls on a replica that serves OmniVoice's codec
(Higgs-Audio-v2, vocoder_svc/higgs_codec.py). OmniVoice finishes a canvas whole, so this replica
decodes whole clips:

  * DecodeClip: codes [T, 8] -> mono 24 kHz PCM after the reference's post-processing
    (vocoder_svc/omnivoice_audio.py). A ClipDecoder thread takes every clip queued when it comes
    free and decodes them together (equal lengths in one forward where the startup measurement
    found that exact, else one by one), so a clip's PCM is the same alone or under load. Each
    clip's post-processing runs on the event loop's executor, so the decode thread goes straight
    on to the next forward. With --attach-decoder the forwards run in a codec hosted by the
    OmniVoice worker's process (vocoder_svc/clip_host.py) and this replica keeps the calls, the
    post-processing and Encode;
  * Encode: a clone reference -> preprocessed as the reference does -> codes [F, 8] and its RMS;
  * Info: the codec's facts.
Streaming Decode belongs to MOSS replicas and answers UNIMPLEMENTED here.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from chorus.audio import decode_audio, encode_pcm16
from chorus.v1 import common_pb2, vocoder_pb2, vocoder_pb2_grpc
from vocoder_svc import omnivoice_audio
from vocoder_svc.config import VocoderConfig
from vocoder_svc.decoder_client import DecodeProcess, DecoderGone
from vocoder_svc.higgs_codec import PRESETS, CodecInputError, HiggsCodec, codec_dir
from vocoder_svc.metrics import Metrics
from vocoder_svc.servicer import VocoderServicer
from vocoder_svc.batch_thread import BatchThread

MAX_CLIP_FRAMES = 25 * 300  # 5 minutes of audio bounds one clip's memory
MAX_EDGE_SECONDS = 10.0     # fade_seconds and pad_seconds


def serves_clips(args: VocoderConfig) -> bool:
    """Whether these settings make a Higgs replica: a Higgs preset without --codec, or a --codec
    directory holding a Higgs codec."""
    return codec_dir(args.codec) is not None if args.codec else args.preset in PRESETS


def make_clip_codec(args: VocoderConfig, log=print, *, decodes: bool = True) -> HiggsCodec:
    """The replica's codec. decodes=False: it only encodes (its decodes run in a hosted codec), so
    whether batching is exact is not measured here."""
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    if args.dtype != "float32":
        raise SystemExit(f"--dtype {args.dtype}: the Higgs-Audio-v2 codec runs in float32 only "
                         "(in float16 it decodes to silence)")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device is available")
    if args.codec:
        codec = HiggsCodec.from_dir(args.codec, device=args.device)
        log(f"vocoder: Higgs-Audio-v2 codec from {codec_dir(args.codec)}", flush=True)
    else:
        codec = HiggsCodec.from_preset(args.preset, seed=args.seed, device=args.device)
        log(f"vocoder: Higgs-Audio-v2 codec, preset {args.preset} (random weights, seed {args.seed})", flush=True)
    if not decodes:
        return codec
    problem = codec.measure_batching()
    log("vocoder: DecodeClip batches equal-length clips in one forward (measured exact)" if problem is None else
        f"vocoder: DecodeClip decodes one clip per forward: batching is not exact on {args.device} ({problem})",
        flush=True)
    return codec


@dataclass
class _Clip:
    codes: np.ndarray  # int64 [T, 8]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class ClipDecoder(BatchThread):
    """One thread: takes every queued clip (up to max_batch), decodes them in one codec call and
    hands back each clip's samples (float32, before post-processing)."""

    def __init__(self, codec: HiggsCodec, metrics: Metrics, max_batch: int = 16):
        self.codec, self.metrics, self.max_batch = codec, metrics, max(1, max_batch)
        super().__init__("clip-decode")

    async def decode(self, codes: np.ndarray) -> np.ndarray:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.queue(_Clip(codes, fut, loop))
        return await fut

    def choose(self, pending: list[_Clip]) -> list[_Clip]:
        return pending[:self.max_batch]

    def run(self, group: list[_Clip]) -> list[np.ndarray]:
        t0 = time.perf_counter()
        try:
            return self.codec.decode([c.codes for c in group])
        finally:
            self.metrics.record_clips((time.perf_counter() - t0) * 1000.0, len(group),
                                      len(self.codec.forward_groups([len(c.codes) for c in group])))


def finish_clip(wave: np.ndarray, r: vocoder_pb2.DecodeClipRequest, sample_rate: int,
                metrics: Metrics) -> vocoder_pb2.DecodeClipResponse:
    """A decoded clip -> its DecodeClipResponse: the reference's post-processing, then the wire PCM."""
    t0 = time.perf_counter()
    pcm = omnivoice_audio.finish_piece(
        wave, postprocess=r.postprocess, reference_rms=float(r.reference_rms) if r.reference_rms > 0 else None,
        fade_seconds=omnivoice_audio.seconds(r.fade_seconds), pad_seconds=omnivoice_audio.seconds(r.pad_seconds),
        continues=r.continues, continued=r.continued)
    data = encode_pcm16(pcm) if r.pcm_encoding == vocoder_pb2.PCM_INT16 else pcm.astype("<f4").tobytes()
    metrics.audio_seconds.inc(len(pcm) / sample_rate)
    metrics.clip_finish_ms.observe((time.perf_counter() - t0) * 1000.0)
    return vocoder_pb2.DecodeClipResponse(pcm=data, num_samples=len(pcm), pcm_encoding=r.pcm_encoding)


def _parse_clip(r: vocoder_pb2.DecodeClipRequest, codec: HiggsCodec) -> np.ndarray:
    """The request's codes as int64 [T, 8]; CodecInputError naming the first bad field."""
    m = r.codes
    if m.cols != codec.num_codebooks:
        raise CodecInputError("codes", f"{m.cols} columns; this codec decodes {codec.num_codebooks} codebooks "
                              f"(codes is [frames, {codec.num_codebooks}])")
    if not 1 <= m.rows <= MAX_CLIP_FRAMES:
        raise CodecInputError("codes", f"{m.rows} frames; a clip has 1..{MAX_CLIP_FRAMES} "
                              f"({MAX_CLIP_FRAMES // 25} s)")
    if len(m.data) != m.rows * m.cols * 4:
        raise CodecInputError("codes", f"data has {len(m.data)} bytes; a {m.rows}x{m.cols} int32 matrix needs "
                              f"{m.rows * m.cols * 4}")
    if r.pcm_encoding not in (vocoder_pb2.PCM_FLOAT32, vocoder_pb2.PCM_INT16):
        raise CodecInputError("pcm_encoding", f"{r.pcm_encoding}: use PCM_FLOAT32 (0) or PCM_INT16 (1)")
    if not (math.isfinite(r.reference_rms) and r.reference_rms >= 0):
        raise CodecInputError("reference_rms", f"{r.reference_rms}: must be >= 0 (the clone reference's RMS; "
                              "0 = no reference, peak-normalise)")
    for field in ("fade_seconds", "pad_seconds"):
        value = getattr(r, field)
        if not (math.isfinite(value) and 0 <= value <= MAX_EDGE_SECONDS):
            raise CodecInputError(field, f"{value}: must be in [0, {MAX_EDGE_SECONDS:g}] seconds")
    codes = np.frombuffer(m.data, dtype="<i4").reshape(m.rows, m.cols)
    return codec.check_codes(codes)


class HostedClipDecoder:
    """ClipDecoder's stand-in when the codec's forwards run in another process (a hosted codec,
    vocoder_svc/clip_host.py): each clip is one job of a one-job stream over the decode process's link."""

    def __init__(self, process: DecodeProcess):
        self.process = process

    async def decode(self, codes: np.ndarray) -> np.ndarray:
        stream = self.process.open()
        try:
            samples = await self.process.submit(stream, codes)
        except asyncio.CancelledError:  # the call went away: the host drops the clip if it has not begun it
            self.process.release(stream)
            raise
        return np.frombuffer(samples, dtype="<f4")  # answered: the host holds nothing of it

    def close(self) -> None:
        self.process.close()


class ClipServicer(vocoder_pb2_grpc.VocoderServicer):
    def __init__(self, codec: HiggsCodec, metrics: Metrics | None = None, encode_cache_size: int = 256,
                 max_batch: int = 16, decoder: HostedClipDecoder | None = None):
        """decoder: where the forwards run when not in this process (a hosted codec)."""
        self.codec = codec
        self.metrics = metrics or Metrics()
        self.decoder = decoder or ClipDecoder(codec, self.metrics, max_batch)
        self._encode_lock = threading.Lock()  # encodes run one at a time beside the decode thread
        self._cache: OrderedDict[bytes, bytes] = OrderedDict()  # serialized EncodeResponse
        self._cache_size = encode_cache_size

    def close(self) -> None:
        self.decoder.close()

    async def DecodeClip(self, request, context):
        try:
            codes = _parse_clip(request, self.codec)
        except CodecInputError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            wave = await self.decoder.decode(codes)
        except DecoderGone as e:  # the hosted codec's process is gone: the scheduler retries elsewhere
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"this vocoder replica lost its codec: {e}")
        return await asyncio.get_running_loop().run_in_executor(
            None, finish_clip, wave, request, self.codec.sample_rate, self.metrics)

    async def Decode(self, request_iterator, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"this replica serves {self.codec.name} (OmniVoice) and decodes whole clips: use "
                            "DecodeClip; streaming Decode is served by MOSS codec replicas")

    def _encode_sync(self, audio: common_pb2.AudioData) -> vocoder_pb2.EncodeResponse:
        wav, rate = decode_audio(audio)
        wave, rms = omnivoice_audio.prepare_reference(wav, rate)
        with self._encode_lock:
            codes = self.codec.encode([wave])[0].astype("<i4")  # [F, 8]
        matrix = common_pb2.IntMatrix(rows=codes.shape[0], cols=codes.shape[1], data=codes.tobytes())
        return vocoder_pb2.EncodeResponse(codes=matrix, rms=rms)

    async def Encode(self, request, context):
        if request.codebooks not in (0, self.codec.num_codebooks):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"codebooks={request.codebooks}: this codec ({self.codec.name}) encodes exactly "
                                f"{self.codec.num_codebooks} codebooks (0 = that)")
        key = VocoderServicer._cache_key(request, self.codec.num_codebooks)
        if key in self._cache:
            self._cache.move_to_end(key)
            self.metrics.encode_cache_hits.inc()
            response = vocoder_pb2.EncodeResponse.FromString(self._cache[key])
            response.cache_hit = True
            return response
        self.metrics.encode_cache_misses.inc()
        try:
            response = await asyncio.get_running_loop().run_in_executor(None, self._encode_sync, request.audio)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self._cache_size > 0:
            self._cache[key] = response.SerializeToString()
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return response

    async def Info(self, request, context):
        c = self.codec
        return vocoder_pb2.VocoderInfo(codec=c.name, sample_rate=c.sample_rate, channels=c.channels,
                                       samples_per_frame=c.hop, max_codebooks=c.num_codebooks)
