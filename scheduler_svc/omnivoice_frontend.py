"""The OmniVoice Synthesize path of a frontend.

validate -> resolve the one voice reference (codes, a stored voice of this model, or audio the
OmniVoice codec encodes) -> plan the pieces (one, or a long text's chunks) -> one canvas per
piece through the core -> each finished canvas decoded whole by an OmniVoice vocoder replica ->
the client, piece by piece in order.

Pieces run concurrently as far as they can: every piece that needs nothing from another goes to
the core at once; a piece whose reference is piece 0's canvas goes once that canvas is back.
A piece's audio goes to the client as soon as it and every piece before it are decoded.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
import numpy as np

from chorus.api_keys import caller
from chorus.omnivoice import knobs as ov
from chorus.omnivoice.prompt import Piece, PromptError, plan_pieces
from chorus.v1 import common_pb2, tts_pb2, vocoder_pb2, worker_pb2
from chorus.wire import matrix_array, rows_matrix
from scheduler_svc.audio_relay import QUEUE_FULL_RETRY_S, SynthesisFailed
from scheduler_svc.canvas_scheduler import UNAVAILABLE as WORKER_UNAVAILABLE
from scheduler_svc.clip_vocoders import FADE_SECONDS, PAD_SECONDS, ClipVocoders, pcm_samples
from scheduler_svc.core_client import CanvasTicket, CoreClient
from scheduler_svc.omnivoice_validation import OmniVoiceRequest, validate_omnivoice
from scheduler_svc.output import AudioOutput
from scheduler_svc.request import QueueFull, Unavailable
from scheduler_svc.validation import InvalidRequest, Limits, matrix_field, printable, shown
from scheduler_svc.vocoder_client import NoReplica
from scheduler_svc.voices import VoiceLibrary

log = logging.getLogger("chorus.scheduler")
CHUNK_SECONDS = 1.0  # a decoded piece goes to the client in audio chunks of at most this long
CODES = 1024  # codes per codebook (the canvas's MASK, 1024, is never a reference code)


@dataclass(frozen=True)
class Reference:
    codes: np.ndarray  # [R, 8]
    rms: float         # of the reference audio before levelling; 0: unknown (the output is peak-levelled)
    transcript: str


def piece_seed(seed: int, index: int) -> int:
    """Piece `index`'s sampling seed: piece 0 keeps the request's; the others get their own, so
    that two pieces of one request never draw the same noise."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"omnivoice-piece:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def plan(tokenizer, req: tts_pb2.SynthesizeRequest, resolved: OmniVoiceRequest,
         ref: Reference | None) -> list[Piece]:
    try:
        return plan_pieces(tokenizer, req.text, language=req.language or None,
                           instructions=req.instructions or None, has_reference=ref is not None,
                           reference_text=ref.transcript if ref else None,
                           reference_frames=ref.codes.shape[0] if ref else 0, denoise=resolved.denoise,
                           speed=resolved.speed, duration_seconds=resolved.duration_seconds)
    except PromptError as e:
        message = str(e)
        raise InvalidRequest(message if message.startswith(e.field) else f"{e.field}: {message}") from None


def reference_frames(pieces: list[Piece], i: int, ref: Reference | None) -> int:
    kind = pieces[i].reference
    return ref.codes.shape[0] if kind == "request" else pieces[0].target_frames if kind == "first_piece" else 0


class OmniVoiceFrontend:
    def __init__(self, core: CoreClient, vocoders: ClipVocoders, tokenizer, limits: Limits, voices: VoiceLibrary):
        self.core = core
        self.voices = voices
        self.vocoders = vocoders
        self.tokenizer = tokenizer
        self.limits = limits

    # ---- references -------------------------------------------------------------------------
    async def encode(self, audio: common_pb2.AudioData, field: str) -> tuple[np.ndarray, float]:
        """The audio's codes [F, 8] (0 < F <= the reference limit) and its RMS."""
        try:
            resp = await self.vocoders.encode_reference(audio)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequest(f"{field}: {e.details()}") from e
            raise SynthesisFailed(grpc.StatusCode.UNAVAILABLE, f"vocoder could not encode {field}: {e.details()}")
        except NoReplica as e:
            raise SynthesisFailed(grpc.StatusCode.UNAVAILABLE, f"vocoder could not encode {field}: {e}") from e
        codes = matrix_field(resp.codes, field)
        if codes.shape[0] == 0:
            raise InvalidRequest(f"{field} is too short to give one frame; it needs at least "
                                 f"{1000 / ov.FRAME_RATE:g} ms of audio")
        limit = self.limits.max_reference_seconds
        if codes.shape[0] > limit * ov.FRAME_RATE:
            raise InvalidRequest(f"{field} is {codes.shape[0] / ov.FRAME_RATE:.1f} s long; the limit is {limit:g} s")
        return codes, resp.rms

    async def reference(self, ref: tts_pb2.VoiceReference, field: str, model: str) -> Reference:
        kind = ref.WhichOneof("source")
        transcript, rms = ref.transcript, 0.0
        if kind == "codes":
            codes = matrix_field(ref.codes, f"{field}.codes")
            if codes.shape[1] != ov.NUM_CODEBOOKS or codes.shape[0] == 0:
                raise InvalidRequest(f"{field}.codes must be [T>0, {ov.NUM_CODEBOOKS}], got {list(codes.shape)}")
            if codes.min() < 0 or codes.max() >= CODES:
                raise InvalidRequest(f"{field}.codes values must be in [0, {CODES})")
        elif kind == "voice_id":
            voice = await self.voices.get_voice(ref.voice_id, caller.get())
            if voice is None:
                raise SynthesisFailed(grpc.StatusCode.NOT_FOUND, f"{field}.voice_id {shown(ref.voice_id)} not "
                                      "found; create it with CreateVoice first")
            if voice.model != model:
                raise InvalidRequest(f"{field}.voice_id {shown(ref.voice_id)} was made for model "
                                     f"{voice.model or 'MOSS'}, not {model}; create one with CreateVoice(model=...)")
            codes, rms, transcript = matrix_array(voice.codes), voice.rms, transcript or voice.transcript
        elif kind == "audio":
            codes, rms = await self.encode(ref.audio, f"{field}.audio")
        else:
            raise InvalidRequest(f"{field} has no source: set audio, codes or voice_id")
        if not transcript.strip():
            raise InvalidRequest(f"{field}.transcript is empty: an OmniVoice clone needs what the reference says")
        return Reference(codes, rms, transcript)

    # ---- Synthesize -------------------------------------------------------------------------
    def _check_budget(self, model: str, pieces: list[Piece], ref: Reference | None, guidance: float) -> None:
        budget = max((h.max_packed_rows for h in self.core.hello.canvas_workers if h.model_name == model), default=0)
        for i, p in enumerate(pieces):
            rows = ov.packed_rows(len(p.text_ids) + reference_frames(pieces, i, ref), p.target_frames, guidance)
            if budget and rows > budget:
                raise InvalidRequest(f"the text needs {rows} packed rows ({p.target_frames} frames); the model's "
                                     f"budget is {budget}: shorten the text, the reference or duration_seconds")

    async def synthesize(self, request: tts_pb2.SynthesizeRequest,
                         model: str) -> AsyncIterator[tts_pb2.SynthesizeResponse]:
        resolved = validate_omnivoice(request, self.limits, model)
        request_id = request.request_id or uuid.uuid4().hex
        ref = await self.reference(request.references[0], "references[0]", model) if request.references else None
        pieces = await asyncio.to_thread(plan, self.tokenizer, request, resolved, ref)  # tokenizing: off the loop
        self._check_budget(model, pieces, ref, resolved.knobs.guidance_scale)
        output = AudioOutput(ov.SAMPLE_RATE, 1, resolved.sample_rate or ov.SAMPLE_RATE, resolved.output_format)
        run = _PieceRun(self, model, pieces, ref, resolved, output.passes_pcm16)
        try:
            await run.start()
            log.info("request %s (#%d): %s, %d piece(s), %d frames", printable(request_id), run.tickets[0].id,
                     model, len(pieces), sum(p.target_frames for p in pieces))
            yield tts_pb2.SynthesizeResponse(header=tts_pb2.StreamHeader(
                request_id=request_id, model=model, sample_rate=output.out_rate, channels=1,
                format=resolved.output_format, samples_per_frame=ov.SAMPLES_PER_FRAME * output.out_rate
                // ov.SAMPLE_RATE))
            t0, first_audio, frame = run.tickets[0].t_accepted, None, 0
            for i in range(len(pieces)):
                codes, clip = await run.tasks[i]
                if request.return_codes:
                    yield tts_pb2.SynthesizeResponse(codes=tts_pb2.CodesChunk(first_frame=frame,
                                                                              codes=rows_matrix(codes)))
                frame += codes.shape[0]
                for chunk in _audio_chunks(output, clip):
                    if first_audio is None:
                        first_audio = time.monotonic()
                        self.core.report("first_audio", ttfa_s=first_audio - t0)
                    yield chunk
            tail = output.flush()
            if tail is not None:
                yield tail
            yield tts_pb2.SynthesizeResponse(summary=run.summary(output, first_audio))
        finally:
            run.cancel()


def _audio_chunks(output: AudioOutput, clip: vocoder_pb2.DecodeClipResponse):
    """A decoded piece as the client's audio responses, CHUNK_SECONDS at most each."""
    step = int(CHUNK_SECONDS * ov.SAMPLE_RATE)
    if clip.pcm_encoding == vocoder_pb2.PCM_INT16 and output.passes_pcm16:
        for start in range(0, clip.num_samples, step):
            n = min(step, clip.num_samples - start)
            resp = output.forward_pcm16(clip.pcm[2 * start:2 * (start + n)], n)
            if resp is not None:
                yield resp
        return
    pcm = pcm_samples(clip)
    for start in range(0, pcm.shape[0], step):
        resp = output.convert(pcm[start:start + step])
        if resp is not None:
            yield resp


class _PieceRun:
    """One request's pieces: their canvases in the core and their decodes, each piece a task that
    ends with (codes [T, 8], its decoded clip)."""

    def __init__(self, owner: OmniVoiceFrontend, model: str, pieces: list[Piece], ref: Reference | None,
                 resolved: OmniVoiceRequest, int16: bool):
        self.core = owner.core
        self.vocoders = owner.vocoders
        self.model = model
        self.pieces = pieces
        self.ref = ref
        self.resolved = resolved
        self.int16 = int16
        self.tickets: list[CanvasTicket | None] = [None] * len(pieces)
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Piece 0 first, then every piece that does not wait for piece 0's canvas."""
        for i, p in enumerate(self.pieces):
            if p.reference != "first_piece":
                self.tickets[i] = await self._submit(i, self.ref.codes if p.reference == "request" else None)
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._piece(i)) for i in range(len(self.pieces))]
        for t in self.tasks:
            t.add_done_callback(lambda t: t.cancelled() or t.exception())  # read where awaited, or dropped

    async def _submit(self, i: int, reference: np.ndarray | None) -> CanvasTicket:
        p = self.pieces[i]
        canvas = worker_pb2.CanvasStart(text_ids=p.text_ids, target_frames=p.target_frames,
                                        knobs=self.resolved.knobs.to_proto(), seed=piece_seed(self.resolved.seed, i))
        if reference is not None:
            canvas.reference_codes.CopyFrom(rows_matrix(reference))
        try:
            return await self.core.submit_canvas(self.model, canvas)
        except QueueFull as e:
            raise SynthesisFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), QUEUE_FULL_RETRY_S) from e
        except Unavailable as e:
            raise SynthesisFailed(grpc.StatusCode.UNAVAILABLE, str(e)) from e

    async def _codes(self, i: int) -> np.ndarray:
        done = await self.tickets[i].done
        if done.error:
            retry = done.error.startswith(WORKER_UNAVAILABLE)
            raise SynthesisFailed(grpc.StatusCode.UNAVAILABLE if retry else grpc.StatusCode.INTERNAL,
                                  f"piece {i} failed: {done.error}")
        return matrix_array(done.codes)

    async def _piece(self, i: int) -> tuple[np.ndarray, vocoder_pb2.DecodeClipResponse]:
        if self.tickets[i] is None:
            self.tickets[i] = await self._submit(i, await self._codes(0))
        codes = await self._codes(i)
        post = self.resolved.postprocess
        request = vocoder_pb2.DecodeClipRequest(
            codes=rows_matrix(codes), pcm_encoding=vocoder_pb2.PCM_INT16 if self.int16 else vocoder_pb2.PCM_FLOAT32,
            postprocess=post, reference_rms=self.ref.rms if self.ref else 0.0,
            fade_seconds=FADE_SECONDS if post else 0.0, pad_seconds=PAD_SECONDS if post else 0.0,
            continues=i > 0, continued=i < len(self.pieces) - 1)
        try:
            return codes, await self.vocoders.decode_clip(request)
        except grpc.aio.AioRpcError as e:
            raise SynthesisFailed(grpc.StatusCode.UNAVAILABLE, f"vocoder could not decode piece {i}: "
                                  f"{e.code().name}: {e.details()}") from e
        except NoReplica as e:
            raise SynthesisFailed(grpc.StatusCode.UNAVAILABLE, f"vocoder could not decode piece {i}: {e}") from e

    def summary(self, output: AudioOutput, first_audio: float | None) -> tts_pb2.SynthesisSummary:
        t0 = self.tickets[0].t_accepted
        ms = lambda t: (t - t0) * 1e3 if t else 0.0  # noqa: E731
        done = [t.done.result() for t in self.tickets]
        frames = sum(p.target_frames for p in self.pieces)
        return tts_pb2.SynthesisSummary(
            frames=frames, audio_seconds=output.samples_sent / output.out_rate, finish_reason=tts_pb2.STOP,
            queue_ms=done[0].queue_ms, first_audio_ms=ms(first_audio), total_ms=ms(time.monotonic()),
            prompt_rows=sum(len(p.text_ids) + reference_frames(self.pieces, i, self.ref)
                            for i, p in enumerate(self.pieces)),
            first_frame_ms=ms(self.tickets[0].t_done), first_chunk_frames_ms=ms(self.tickets[0].t_done),
            last_frame_ms=ms(max(t.t_done for t in self.tickets)))

    def cancel(self) -> None:
        """The stream is over (done, failed or cancelled): drop whatever is still running."""
        for t in self.tickets:
            if t is not None:
                self.core.abort(t)
        for t in self.tasks:
            t.cancel()
