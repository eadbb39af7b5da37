"""The public TextToSpeech gRPC API as a frontend serves it (the process: scheduler_svc/frontend_process.py).

Per Synthesize call for the MOSS model: validate → resolve voice references
(codes, a voice of the voice store, or audio encoded by a vocoder replica) →
build prompt rows → submit to the scheduler core → stream each generated row to a vocoder
Decode stream and the PCM that comes back to the client, converted to the
format it asked for. A call for an OmniVoice model takes its own path
(scheduler_svc/omnivoice_frontend.py); `model` picks (scheduler_svc/served_models.py).

Several frontends serve one port (SO_REUSEPORT: the kernel spreads client
connections over them), so the per-frame relay work, which is most of the
service's CPU, scales with processes while one core schedules every request.
A frontend tier process (scheduler_svc/frontend_tier.py) runs this same API in
front of many cores, one picked per request (scheduler_svc/engine_pool.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc
import numpy as np

from chorus.api_keys import ApiKeys, caller
from chorus.caller_limits import CallerLimits, Limit
from chorus.drain import RETRY_HINT_S
from chorus.moss_config import MossTTSLocalConfig
from chorus.omnivoice import knobs as ov
from chorus.prompt import build_prompt_rows, clamp_duration_frames, estimate_duration_frames
from chorus.retry_hint import set_retry_hint
from chorus.v1 import common_pb2, frontend_pb2, tts_pb2, tts_pb2_grpc, vocoder_pb2
from scheduler_svc.audio_relay import QUEUE_FULL_RETRY_S, AudioRelay, SynthesisFailed
from scheduler_svc.engine_pool import EnginePool, affinity_key
from scheduler_svc.flow_control import Backlog
from scheduler_svc.output import AudioOutput
from scheduler_svc.request import QueueFull, Unavailable
from chorus.wire import rows_matrix
from chorus.wire import matrix_array as _matrix  # ValueError; matrix_field: InvalidRequest
from scheduler_svc.omnivoice_frontend import OmniVoiceFrontend
from scheduler_svc.served_models import MOSS, OMNIVOICE, ServedModel, ServedModels
from scheduler_svc.synthesize_stream import PieceLimits, TextStreams
from scheduler_svc.validation import (InvalidRequest, Limits, check_create_voice, check_model_name, matrix_field,
                                      printable, shown, validate)
from scheduler_svc.vocoder_client import VocoderPool
from scheduler_svc.voices import VoiceLibrary

log = logging.getLogger("chorus.scheduler")
SERVICE_NAME = "chorus.v1.TextToSpeech"
# refused while draining (reads are still answered)
WRITES = ("Synthesize", "SynthesizeStream", "CreateVoice", "DeleteVoice")
FINISH_REASONS = {"stop": tts_pb2.STOP, "max_frames": tts_pb2.MAX_FRAMES}


class TextToSpeechServicer(tts_pb2_grpc.TextToSpeechServicer):
    def __init__(self, core: EnginePool, vocoders: VocoderPool, cfg: MossTTSLocalConfig, tokenizer,
                 limits: Limits, codec: vocoder_pb2.VocoderInfo, voices: VoiceLibrary,
                 first_chunk_frames_loaded: int = 0, models: ServedModels | None = None,
                 omnivoice: OmniVoiceFrontend | None = None, backlog: Backlog | None = None,
                 keys: ApiKeys | None = None, pieces: PieceLimits | None = None,
                 caller_limits: CallerLimits | None = None):
        """codec: a vocoder replica's Info; the pool's chunk defaults (vocoders.chunks) are those of
        streams whose client leaves streaming.* unset. voices: the stored voices. models: every served
        model (None: the MOSS model alone); omnivoice: the OmniVoice path, where models has OmniVoice
        models; keys: the API keys, whose owners own voices (None: no keys; every voice is everyone's);
        caller_limits: each owner's cap on open calls and call starts (None: none)."""
        self.core = core
        self.voices = voices
        self.models = models or ServedModels([ServedModel(cfg.name, MOSS)])
        self.omnivoice = omnivoice
        self.vocoders = vocoders
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.limits = limits
        self.codec = codec
        self.first_chunk_frames_loaded = first_chunk_frames_loaded
        self.relay = AudioRelay(vocoders, codec, cfg.n_vq, backlog=backlog, pause=core.pause)
        self.frame_rate = codec.sample_rate / codec.samples_per_frame
        self.keys = keys
        self.streams = TextStreams(self, pieces or PieceLimits())  # SynthesizeStream, long-form Synthesize
        self.caller_limits = caller_limits or CallerLimits(Limit())
        self._refusal_logged = float("-inf")  # a noisy caller's refusals: a log line a second at most

    def _caller(self, context) -> str:
        """The owner of the call's API key ("" without keys); the interceptor has checked the key."""
        owner = self.keys.owner(context.invocation_metadata()) if self.keys else ""
        caller.set(owner or "")
        return owner or ""

    # ---- references ------------------------------------------------------------
    async def _encode_audio(self, audio: common_pb2.AudioData, field: str) -> np.ndarray:
        """The audio's codes, [T, n_vq] with 0 < T <= the reference limit (checked again here: a
        container's header, which validation read, may understate its length)."""
        try:
            resp = await self.vocoders.encode(vocoder_pb2.EncodeRequest(audio=audio, codebooks=self.cfg.n_vq))
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequest(f"{field}: {e.details()}") from e
            raise SynthesisFailed(grpc.StatusCode.UNAVAILABLE, f"vocoder could not encode {field}: {e.details()}")
        codes = matrix_field(resp.codes, field)
        if codes.shape[0] == 0:
            raise InvalidRequest(f"{field} is too short to give one frame; it needs at least "
                                 f"{1000 / self.frame_rate:g} ms of audio")
        limit = self.limits.max_reference_seconds
        if codes.shape[0] > limit * self.frame_rate:
            raise InvalidRequest(f"{field} is {codes.shape[0] / self.frame_rate:.1f} s long; the limit is {limit:g} s")
        return codes

    async def _reference_codes(self, ref: tts_pb2.VoiceReference, field: str) -> np.ndarray:
        kind = ref.WhichOneof("source")
        if kind == "codes":
            codes = matrix_field(ref.codes, f"{field}.codes")
            if codes.shape[1] != self.cfg.n_vq or codes.shape[0] == 0:
                raise InvalidRequest(f"{field}.codes must be [T>0, {self.cfg.n_vq}], got {list(codes.shape)}")
            if codes.min() < 0 or codes.max() >= self.cfg.audio_vocab_size:
                raise InvalidRequest(f"{field}.codes values must be in [0, {self.cfg.audio_vocab_size})")
            return codes
        if kind == "voice_id":
            voice = await self.voices.get_voice(ref.voice_id, caller.get())
            if voice is None:
                raise SynthesisFailed(grpc.StatusCode.NOT_FOUND,
                                      f"{field}.voice_id {shown(ref.voice_id)} not found; create it with "
                                      "CreateVoice first")
            if voice.model not in ("", self.cfg.name):
                raise InvalidRequest(f"{field}.voice_id {shown(ref.voice_id)} was made for model {voice.model}, "
                                     f"not {self.cfg.name}; create one with CreateVoice(model=...)")
            return _matrix(voice.codes)
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
        try:  # tokenizing a long text: off the event loop, which relays every other stream's audio
            return await asyncio.to_thread(
                build_prompt_rows, self.cfg, self.tokenizer, request.text, language=request.language or None,
                instruction=request.instructions or None, tokens=self._duration_frames(request),
                references=refs, continuation=cont,
                continuation_transcript=request.continuation.transcript if cont is not None else None)
        except ValueError as e:
            raise InvalidRequest(str(e)) from e

    def _chunk_frames(self, streaming: tts_pb2.StreamingPolicy, loaded: bool) -> tuple[int, int]:
        """A stream's (first, steady) chunk frames: the client's, else the vocoder's defaults, with the
        first chunk first_chunk_frames_loaded when the request was taken under load."""
        first, chunk = self.vocoders.chunks
        if loaded and self.first_chunk_frames_loaded:
            first = self.first_chunk_frames_loaded
        return streaming.first_chunk_frames or first, streaming.chunk_frames or chunk

    # ---- Synthesize -------------------------------------------------------------
    async def Synthesize(self, request: tts_pb2.SynthesizeRequest, context: grpc.aio.ServicerContext):
        async for response in self._answer(lambda: self._synthesize(request, context), context):
            yield response

    async def SynthesizeStream(self, requests, context: grpc.aio.ServicerContext):
        async for response in self._answer(lambda: self.streams.stream(requests, context), context):
            yield response

    async def _answer(self, responses, context: grpc.aio.ServicerContext):
        """The call's responses (from responses()), its failures as statuses, reported to the core. A
        caller over its limits is refused first, before any work."""
        owner = self._caller(context)
        now = time.monotonic()
        refusal = self.caller_limits.admit(owner, now)
        if refusal is not None:
            if now - self._refusal_logged >= 1.0:
                self._refusal_logged = now
                log.info("caller %s refused: %s", printable(owner) or "(no key)", refusal.message)
            self.core.report("refused", outcome=refusal.limit)
            set_retry_hint(context, refusal.retry_after)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.message)
        outcome = ""
        try:
            self.core.report("start")
            async for response in responses():
                yield response
            outcome = "ok"
        except InvalidRequest as e:
            outcome = "invalid"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except SynthesisFailed as e:
            outcome = "failed"
            if e.retry_after is not None:
                set_retry_hint(context, e.retry_after)
            elif e.code == grpc.StatusCode.UNAVAILABLE:  # another replica, or this one later, may serve it
                set_retry_hint(context, RETRY_HINT_S)
            await context.abort(e.code, str(e))
        finally:
            self.caller_limits.release(owner)
            self.core.report("end", outcome=outcome)

    async def _synthesize(self, request: tts_pb2.SynthesizeRequest, context: grpc.aio.ServicerContext):
        check_model_name(request.model, self.limits)
        model = self.models.resolve(request.model)
        if model.name in self.core.down:
            raise SynthesisFailed(grpc.StatusCode.UNAVAILABLE, self.core.refusal(model.name))
        if model.architecture == OMNIVOICE:
            async for response in self.omnivoice.synthesize(request, model.name):
                yield response
            return
        if self.streams.is_longform(request, model):
            async for response in self.streams.longform(request, context):
                yield response
            return
        resolved = await asyncio.to_thread(validate, request, self.limits, None, self.frame_rate)
        request_id = request.request_id or uuid.uuid4().hex
        rows = await self._prompt_rows(request)
        worker = self.core.worker
        if rows.shape[0] + resolved.max_frames > worker.max_context:
            raise InvalidRequest(f"prompt ({rows.shape[0]} rows) + max_frames ({resolved.max_frames}) exceeds the "
                                 f"context limit {worker.max_context}; lower max_frames or shorten the text")
        if not self.core.fits(rows.shape[0]):
            raise InvalidRequest(f"the prompt ({rows.shape[0]} rows) does not fit the worker's KV cache "
                                 f"({worker.kv_slots} rows); shorten the text or the references")
        try:
            req = await self.core.submit(rows, resolved.sampling, resolved.max_frames,
                                         key=affinity_key(request, caller.get()))
        except QueueFull as e:
            raise SynthesisFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e),
                                  e.retry_after if e.retry_after > 0 else QUEUE_FULL_RETRY_S) from e
        except Unavailable as e:
            raise SynthesisFailed(grpc.StatusCode.UNAVAILABLE, str(e)) from e
        log.info("request %s (#%d): %d prompt rows, max_frames %d", printable(request_id), req.id, rows.shape[0],
                 resolved.max_frames)
        output = AudioOutput(self.codec.sample_rate, self.codec.channels, resolved.sample_rate or
                             self.codec.sample_rate, resolved.output_format)
        first_audio = None
        try:
            yield tts_pb2.SynthesizeResponse(header=tts_pb2.StreamHeader(
                request_id=request_id, model=self.cfg.name, sample_rate=output.out_rate,
                channels=self.codec.channels, format=resolved.output_format,
                samples_per_frame=self.codec.samples_per_frame * output.out_rate // self.codec.sample_rate))
            first_chunk, chunk = self._chunk_frames(request.streaming, req.loaded)
            handler = asyncio.current_task()

            def abort(code: grpc.StatusCode, message: str) -> None:
                """The handler waits on a write the client does not take: send the status from another
                task (a client reading again gets the audio gRPC holds, then it), and end the handler."""
                async def send() -> None:
                    try:
                        await context.abort(code, message)
                    except BaseException:  # noqa: BLE001 - abort raises once the status is sent
                        pass
                    handler.cancel()
                asyncio.ensure_future(send())

            async for item in self.relay.stream(req, output, first_chunk, chunk, request.return_codes, abort):
                if first_audio is None and item.HasField("audio"):
                    first_audio = time.monotonic()
                    self.core.report("first_audio", ttfa_s=first_audio - req.t_accepted)
                yield item
            done = req.finished
            ms = lambda t: (t - req.t_accepted) * 1e3 if t else 0.0  # noqa: E731
            yield tts_pb2.SynthesizeResponse(summary=tts_pb2.SynthesisSummary(
                frames=done.frames, audio_seconds=done.frames * self.codec.samples_per_frame
                / self.codec.sample_rate, finish_reason=FINISH_REASONS.get(done.reason, 0),
                queue_ms=done.queue_ms, first_audio_ms=ms(first_audio), total_ms=ms(time.monotonic()),
                prompt_rows=req.prompt_len, cached_prompt_rows=done.cached_prompt_rows,
                first_frame_ms=ms(req.t_first_frame), first_chunk_frames_ms=ms(req.t_first_chunk),
                last_frame_ms=ms(req.t_last_frame), max_audio_lag_ms=req.max_audio_lag * 1e3))
        finally:
            self.core.abort(req)

    # ---- models and voices ---------------------------------------------------------
    def _model_info(self, model: ServedModel) -> tts_pb2.ModelInfo:
        if model.architecture == OMNIVOICE:
            info = tts_pb2.ModelInfo(sample_rate=ov.SAMPLE_RATE, channels=1, frame_rate=ov.FRAME_RATE,
                                     codebooks=ov.NUM_CODEBOOKS)
        else:
            info = tts_pb2.ModelInfo(sample_rate=self.codec.sample_rate, channels=self.codec.channels,
                                     frame_rate=self.frame_rate, codebooks=self.cfg.n_vq,
                                     max_frames=self.limits.max_frames)
        info.name, info.architecture, info.is_default = model.name, model.architecture, model == self.models.default
        return info

    async def ListModels(self, request, context):
        return tts_pb2.ListModelsResponse(models=[self._model_info(m) for m in self.models.models])

    async def CreateVoice(self, request: tts_pb2.CreateVoiceRequest, context):
        owner = self._caller(context)
        rms = 0.0
        try:
            check_create_voice(request, self.limits)
            model = self.models.resolve(request.model)
            if model.architecture == OMNIVOICE:
                codes, rms = await self.omnivoice.encode(request.audio, "audio")
            else:
                codes = await self._encode_audio(request.audio, "audio")
            voice_id = request.voice_id or uuid.uuid4().hex[:12]
            created_at = await self.voices.create(frontend_pb2.StoredVoice(
                voice_id=voice_id, codes=rows_matrix(codes), transcript=request.transcript, frames=codes.shape[0],
                model=model.name, rms=rms, owner=owner))
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except SynthesisFailed as e:
            await context.abort(e.code, str(e))
        return tts_pb2.Voice(voice_id=voice_id, frames=codes.shape[0], transcript=request.transcript,
                             model=model.name, created_at=created_at)

    async def ListVoices(self, request, context):
        try:
            voices = await self.voices.list(self._caller(context))
        except SynthesisFailed as e:
            await context.abort(e.code, str(e))
        return tts_pb2.ListVoicesResponse(voices=[
            tts_pb2.Voice(voice_id=v.voice_id, frames=v.frames, transcript=v.transcript, model=v.model or self.cfg.name,
                          created_at=v.created_at) for v in voices])

    async def DeleteVoice(self, request, context):
        if len(request.voice_id) > self.limits.max_id_chars:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"voice_id has {len(request.voice_id)} "
                                f"characters; the limit is {self.limits.max_id_chars}")
        try:
            voice = await self.voices.delete(request.voice_id, self._caller(context))
        except SynthesisFailed as e:
            await context.abort(e.code, str(e))
        if voice is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"voice_id {shown(request.voice_id)} not found")
        if voice.model in ("", self.cfg.name):  # the core's radix cache holds MOSS prompts only
            self.core.evict_prefix(*await asyncio.to_thread(self._voice_prefix, _matrix(voice.codes)))
        return tts_pb2.DeleteVoiceResponse()

    def _voice_prefix(self, codes: np.ndarray) -> tuple[np.ndarray, int]:
        """The prompt rows every request cloning this voice starts with (its reference ends them), and
        how many of them every cloning prompt starts with, whatever the voice."""
        rows = build_prompt_rows(self.cfg, self.tokenizer, "", references=[codes])
        code_rows = np.flatnonzero(rows[:, 0] == self.cfg.audio_user_slot_token_id)
        return rows[:code_rows[-1] + 2], int(code_rows[0])  # through the reference's audio_end row
