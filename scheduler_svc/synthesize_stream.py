"""Text spoken in pieces as one audio stream: the SynthesizeStream RPC (text in as an LLM writes
it) and long-form Synthesize (a MOSS text longer than max_text_chars).

Both cut the text into sentences (chorus.sentences) and speak them one after another through
the frontend's own single-request path, so every per-request limit applies per piece. On MOSS
each piece continues the audio of the pieces before it (the continuation prompt: their codes and
transcript, whole pieces within `continuation_seconds`), so voice and prosody carry across the
cut; a piece longer than that starts again from the config's voice. OmniVoice has no
continuation: each sentence is a plain request with the same reference. With a seed, piece i
uses seed + i, and where the text is cut depends on the text alone, so the audio is the same
however the text was split into messages. Each piece is placed on an engine as any request is, and
one refused before its audio began (queues full, its engine draining) is tried again: a session
outlives the drain of the engine that spoke its earlier pieces.

The client hears one stream: one header, audio numbered from the stream's start (a WAV stream
has one WAV header), codes likewise when it asked for them; SynthesizeStream adds a
SentenceMark before each sentence's audio and that sentence's summary after it, long-form
Synthesize one summary at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np

from chorus.audio import wav_header
from chorus.drain import RETRY_HINT_S
from chorus.sentences import SentenceCutter, join_sentences, pieces, wide
from chorus.v1 import tts_pb2
from chorus.wire import rows_matrix
from scheduler_svc.audio_relay import SynthesisFailed
from scheduler_svc.omnivoice_validation import validate_omnivoice
from chorus.request_decoding import Undecodable
from scheduler_svc.served_models import OMNIVOICE, ServedModel
from scheduler_svc.validation import InvalidRequest, check_model_name, validate

log = logging.getLogger("chorus.scheduler")
END = None         # the speaker's queue: no more sentences
DONE = "done"      # the client's queue: the stream is over
_FIELD = re.compile(r"^[a-z_]+(\[\d+\])?[. ]")
_REQUEST_FIELDS = frozenset(tts_pb2.SynthesizeRequest.DESCRIPTOR.fields_by_name)


@dataclass
class PieceLimits:
    """The scheduler config's settings for text spoken in pieces (the SchedulerConfig fields)."""
    max_longform_chars: int = 50000
    sentence_chars: int = 300
    continuation_seconds: float = 10.0
    engine_refresh: float = 5.0  # a refused piece is tried again for twice this: a frontend tier sees a new engine


def in_config(message: str) -> str:
    """A check's message about a request field, naming it as a stream's client sent it
    (config.max_frames ...)."""
    m = _FIELD.match(message)
    if m and m.group(0).rstrip(". ").split("[")[0] in _REQUEST_FIELDS:
        return "config." + message
    return "config: " + message


class Continuation:
    """Each piece's request: the config's fields with the piece's text and seed + index, and on
    MOSS the continuation of the latest pieces spoken, whole ones within max_frames frames and
    max_chars characters of transcript (none fits: the config's own voice)."""

    def __init__(self, template: tts_pb2.SynthesizeRequest, continues: bool, max_frames: int, max_chars: int):
        self.template, self.continues = template, continues
        self.max_frames, self.max_chars = max_frames, max_chars
        self.context: list[tuple[str, np.ndarray]] = []  # (transcript, codes [T, n_vq]) spoken last

    def request(self, index: int, text: str) -> tts_pb2.SynthesizeRequest:
        req = tts_pb2.SynthesizeRequest()
        req.CopyFrom(self.template)
        req.text = text
        if req.format == tts_pb2.WAV:  # the stream's one WAV header is the speaker's
            req.format = tts_pb2.PCM16
        if req.sampling.HasField("seed"):
            req.sampling.seed = (req.sampling.seed + index) % (1 << 64)
        if self.continues:
            req.return_codes = True
            if self.context:
                del req.references[:]
                transcript = join_sentences([t for t, _ in self.context])
                codes = np.concatenate([c for _, c in self.context])
                req.continuation.Clear()
                req.continuation.transcript = transcript + ("" if wide(transcript[-1]) or wide(text[0]) else " ")
                req.continuation.codes.CopyFrom(rows_matrix(codes))
        return req

    def remember(self, text: str, codes: np.ndarray) -> None:
        if not self.continues:
            return
        self.context.append((text, codes))
        while self.context and (sum(len(c) for _, c in self.context) > self.max_frames or not len(self.context[0][1])
                                or len(join_sentences([t for t, _ in self.context])) + 1 > self.max_chars):
            self.context.pop(0)


class Speaker:
    """Pieces spoken one after another as one response stream (see the module's doc)."""

    def __init__(self, tts, model: ServedModel, template: tts_pb2.SynthesizeRequest, header: tts_pb2.StreamHeader,
                 context, limits: PieceLimits, frame_rate: float):
        self.tts, self.header, self.context = tts, header, context
        continues = model.architecture != OMNIVOICE
        self.turns = Continuation(template, continues, int(limits.continuation_seconds * frame_rate),
                                  tts.limits.max_text_chars)
        self.codes_wanted = template.return_codes
        self.retry_seconds = 2 * limits.engine_refresh
        self.wav_pending = template.format == tts_pb2.WAV
        self.samples = self.frames = 0
        self.t0 = time.monotonic()
        self.first_audio: float | None = None
        self.summaries: list[tts_pb2.SynthesisSummary] = []

    async def piece(self, index: int, text: str, mark: bool) -> AsyncIterator[tts_pb2.SynthesizeResponse]:
        """The piece's responses. A piece refused before any of its audio went out is tried again
        (_retry_wait), on the engine the pick gives then: a session outlives its engine's drain. The
        first piece of a long-form Synthesize is not: its caller retries it as it retries any call."""
        if mark:
            yield tts_pb2.SynthesizeResponse(sentence=tts_pb2.SentenceMark(index=index, text=text,
                                                                           first_sample=self.samples))
        request = self.turns.request(index, text)
        give_up = time.monotonic() + self.retry_seconds
        while True:
            codes: list[np.ndarray] = []
            samples, sent = 0, False
            try:
                async for resp in self._attempt(request, codes, mark):
                    sent = True
                    samples += resp.audio.num_samples
                    yield resp
                break
            except SynthesisFailed as e:
                wait = None if sent or not (mark or index) else self._retry_wait(e, give_up)
                if wait is None:
                    raise
                log.info("request %s: piece %d refused (%s); trying again in %.1f s", self.header.request_id,
                         index, e, wait)
                await asyncio.sleep(wait)
        spoken = np.concatenate(codes) if codes else np.zeros((0, 0), np.int32)
        self.turns.remember(text, spoken)
        self.frames += len(spoken)
        self.samples += samples

    def _retry_wait(self, e: SynthesisFailed, give_up: float) -> float | None:
        """Seconds to wait before a refused piece is tried again; None: it is not. A full queue: its
        hint. No engine takes it (UNAVAILABLE): the drain's hint, in a frontend tier only, where an
        engine that joins takes it; a core's own frontends have that one core, whose drain or dead
        worker no wait cures. A hint past give_up is cut to it (a place may free sooner than the
        queue's estimate): one last try then. Never past the call's deadline."""
        if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.retry_after is not None:
            wait = e.retry_after
        elif e.code == grpc.StatusCode.UNAVAILABLE and not self.tts.core.parent:
            wait = RETRY_HINT_S if e.retry_after is None else e.retry_after
        else:
            return None
        wait = min(wait, give_up - time.monotonic())
        left = self.context.time_remaining() if self.context is not None else None
        if wait <= 0 or (left is not None and left <= wait):
            return None
        return wait

    async def _attempt(self, request: tts_pb2.SynthesizeRequest, codes: list[np.ndarray],
                       mark: bool) -> AsyncIterator[tts_pb2.SynthesizeResponse]:
        """One try at a piece: what of it the client gets, placed in the stream (its summary last, with
        mark); codes: the piece's codes, as they come."""
        async for resp in self.tts._synthesize(request, self.context):
            kind = resp.WhichOneof("kind")
            if kind == "audio":
                resp.audio.first_sample += self.samples
                if self.wav_pending:
                    resp.audio.data = wav_header(self.header.sample_rate, self.header.channels) + resp.audio.data
                    self.wav_pending = False
                if self.first_audio is None:
                    self.first_audio = time.monotonic()
                yield resp
            elif kind == "codes":
                m = resp.codes.codes
                codes.append(np.frombuffer(m.data, "<i4").reshape(m.rows, m.cols))
                if self.codes_wanted:
                    resp.codes.first_frame += self.frames
                    yield resp
            elif kind == "summary":
                self.summaries.append(resp.summary)
                if mark:
                    yield resp

    def summary(self) -> tts_pb2.SynthesisSummary:
        """The whole stream's summary: sums, the first piece's waits, the slowest audio lag."""
        s = self.summaries
        total = (time.monotonic() - self.t0) * 1e3
        first = s[0] if s else tts_pb2.SynthesisSummary()
        return tts_pb2.SynthesisSummary(
            frames=sum(x.frames for x in s), audio_seconds=sum(x.audio_seconds for x in s),
            finish_reason=s[-1].finish_reason if s else 0, queue_ms=first.queue_ms,
            first_audio_ms=(self.first_audio - self.t0) * 1e3 if self.first_audio else 0.0, total_ms=total,
            prompt_rows=sum(x.prompt_rows for x in s), cached_prompt_rows=sum(x.cached_prompt_rows for x in s),
            first_frame_ms=first.first_frame_ms, first_chunk_frames_ms=first.first_chunk_frames_ms,
            last_frame_ms=total - (s[-1].total_ms - s[-1].last_frame_ms) if s else 0.0,
            max_audio_lag_ms=max((x.max_audio_lag_ms for x in s), default=0.0))


class TextStreams:
    """The frontend's SynthesizeStream and long-form Synthesize; tts: the TextToSpeechServicer."""

    def __init__(self, tts, limits: PieceLimits):
        self.tts, self.limits = tts, limits

    @property
    def sentence_chars(self) -> int:
        return min(self.limits.sentence_chars, self.tts.limits.max_text_chars)

    async def _prepare(self, config: tts_pb2.SynthesizeRequest, stream: bool, context) -> Speaker:
        """The speaker of the config's pieces, the config checked (its text aside). Audio references
        are encoded once here rather than again for every piece. stream: errors name config.*"""
        tts = self.tts
        probe = tts_pb2.SynthesizeRequest()
        probe.CopyFrom(config)
        probe.text = "-"
        try:
            check_model_name(config.model, tts.limits)
            model = tts.models.resolve(config.model)
            if model.name in tts.core.down:
                raise SynthesisFailed(grpc.StatusCode.UNAVAILABLE, tts.core.refusal(model.name))
            if model.architecture == OMNIVOICE:
                validate_omnivoice(probe, tts.limits, model.name)
                info = tts._model_info(model)
            else:
                validate(probe, tts.limits, None, tts.frame_rate)
                info = tts._model_info(model)
                for i, ref in enumerate(config.references):
                    codes = await tts._reference_codes(ref, f"references[{i}]")
                    if ref.WhichOneof("source") == "audio":
                        ref.codes.CopyFrom(rows_matrix(codes))
        except InvalidRequest as e:
            if not stream:
                raise
            raise InvalidRequest(in_config(str(e))) from None
        except SynthesisFailed as e:
            if not stream:
                raise
            raise SynthesisFailed(e.code, in_config(str(e))) from None
        config.request_id = config.request_id or uuid.uuid4().hex  # every piece's, for the logs
        out_rate = config.sample_rate or info.sample_rate
        header = tts_pb2.StreamHeader(
            request_id=config.request_id, model=model.name, sample_rate=out_rate, channels=info.channels,
            format=config.format or tts_pb2.PCM16,
            samples_per_frame=round(info.sample_rate / info.frame_rate) * out_rate // info.sample_rate)
        return Speaker(tts, model, config, header, context, self.limits, info.frame_rate)

    # ---- long-form Synthesize ------------------------------------------------------------------
    def is_longform(self, request: tts_pb2.SynthesizeRequest, model: ServedModel) -> bool:
        return model.architecture != OMNIVOICE and len(request.text) > self.tts.limits.max_text_chars

    async def longform(self, request: tts_pb2.SynthesizeRequest, context) -> AsyncIterator[tts_pb2.SynthesizeResponse]:
        limit = self.limits.max_longform_chars
        if len(request.text) > limit:
            raise InvalidRequest(f"text has {len(request.text)} characters; the limit is {limit} (max_longform_chars)")
        config = tts_pb2.SynthesizeRequest()
        config.CopyFrom(request)
        config.text = ""
        speaker = await self._prepare(config, False, context)
        texts = pieces(request.text, self.sentence_chars)
        if not texts:
            raise InvalidRequest("text has nothing to speak: give words, not only punctuation")
        yield tts_pb2.SynthesizeResponse(header=speaker.header)
        for i, text in enumerate(texts):
            async for resp in speaker.piece(i, text, mark=False):
                yield resp
        yield tts_pb2.SynthesizeResponse(summary=speaker.summary())

    # ---- SynthesizeStream ----------------------------------------------------------------------
    async def stream(self, requests, context) -> AsyncIterator[tts_pb2.SynthesizeResponse]:
        messages = requests.__aiter__()
        try:
            first = await messages.__anext__()
        except StopAsyncIteration:
            raise InvalidRequest("config: the stream ended before its first message, the config") from None
        if isinstance(first, Undecodable):
            raise InvalidRequest(first.message)
        kind = first.WhichOneof("kind")
        if kind != "config":
            raise InvalidRequest(f"config: the first message must be the config, not {kind or 'an empty one'}")
        if first.config.text:
            raise InvalidRequest("config.text must be empty: send the text in text messages after the config")
        speaker = await self._prepare(first.config, True, context)
        yield tts_pb2.SynthesizeResponse(header=speaker.header)
        session = _Session(speaker, self.sentence_chars)
        async for resp in session.run(messages):
            yield resp


class _Session:
    """One SynthesizeStream after its config: a reader that cuts sentences as text arrives, a
    speaker that speaks them in order, and the client's queue between the speaker and the call."""

    def __init__(self, speaker: Speaker, sentence_chars: int):
        self.speaker = speaker
        self.cutter = SentenceCutter(sentence_chars)
        self.sentences: asyncio.Queue = asyncio.Queue()
        self.out: asyncio.Queue = asyncio.Queue(maxsize=4)  # the speaker waits for a slow client
        self.speaking: asyncio.Task | None = None

    async def run(self, messages) -> AsyncIterator[tts_pb2.SynthesizeResponse]:
        self.speaking = asyncio.ensure_future(self._speak())
        reading = asyncio.ensure_future(self._read(messages))
        try:
            while (item := await self.out.get()) is not DONE:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            for task in (reading, self.speaking):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def _speak(self) -> None:
        try:
            index = 0
            while (text := await self.sentences.get()) is not END:
                async for resp in self.speaker.piece(index, text, mark=True):
                    await self.out.put(resp)
                index += 1
            await self.out.put(DONE)
        except (InvalidRequest, SynthesisFailed) as e:
            await self.out.put(e)

    def _stop(self, item) -> None:
        """Now, ahead of any audio still queued: the speaker's generation is cancelled."""
        self.speaking.cancel()
        while not self.out.empty():
            self.out.get_nowait()
        self.out.put_nowait(item)

    async def _read(self, messages) -> None:
        try:
            if await self._feed(messages):
                self._stop(DONE)
        except InvalidRequest as e:
            self._stop(e)

    async def _feed(self, messages) -> bool:
        """Feeds the speaker until END (then listens for CANCEL); True on CANCEL. A client that
        stops sending without END ends the text as END does."""
        ended = False
        async for msg in messages:
            if isinstance(msg, Undecodable):
                raise InvalidRequest(msg.message)
            kind = msg.WhichOneof("kind")
            if kind == "signal" and msg.signal == tts_pb2.CANCEL:
                return True
            if ended:
                raise InvalidRequest(f"{kind or 'an empty message'} after END; only CANCEL may follow END")
            if kind == "text":
                self._queue(self.cutter.feed(msg.text))
            elif kind == "signal" and msg.signal == tts_pb2.FLUSH:
                self._queue(self.cutter.flush())
            elif kind == "signal" and msg.signal == tts_pb2.END:
                ended = True
                self._queue(self.cutter.flush())
                self.sentences.put_nowait(END)
            elif kind == "signal":
                raise InvalidRequest(f"signal {msg.signal} is no signal; send FLUSH, END or CANCEL")
            elif kind == "config":
                raise InvalidRequest("config: only the first message is the config")
            else:
                raise InvalidRequest("a message with nothing set: send text or a signal")
        if not ended:
            self._queue(self.cutter.flush())
            self.sentences.put_nowait(END)
        return False

    def _queue(self, sentences: list[str]) -> None:
        for s in sentences:
            self.sentences.put_nowait(s)
