"""WebSocket /v1/audio/speech/stream: text in as an LLM writes it, audio out sentence by sentence.

The client's first message is the session's config, a JSON object with the fields of
POST /v1/audio/speech except `input` and `stream_format` (they apply to each sentence, e.g.
max_frames); `response_format` is pcm (default) or wav (one streaming WAV header, then PCM). Then it sends, in any number:

    {"type": "text", "text": "..."}   more text
    {"type": "flush"}                 speak what is buffered, even without a sentence end
    {"type": "end"}                   the text is complete: speak the rest, then finish
    {"type": "cancel"}                stop now (the running generation is cancelled)

The gateway answers `{"type": "ready", model, sample_rate, channels, response_format}`, then per
sentence `{"type": "sentence", index, text}`, binary frames of interleaved int16 PCM, and
`{"type": "audio_done", index, ...summary}`; at the end `{"type": "done", cancelled, usage}` and
close code 1000. A failure is `{"type": "error", "error": {message, type, param, code}}` and close
code 4000 + the HTTP status the same failure gets on POST (4400 a bad field, 4404 unknown model or
voice, 4429 queue full, 4503 no scheduler answering).

A gateway that drains (SIGTERM) finishes the sentence being spoken, then sends
`{"type": "done", "cancelled", "going_away": true, "unspoken": TEXT, usage}` (unspoken: the text
received but not spoken, for the client to send again on a new session) and closes with 1001
(going away); a sentence still running at the drain deadline is cut the same way.

Sentences are spoken one after another in the session's voice. On MOSS each continues the audio
of the sentences before it (the continuation prompt: their codes and transcript, whole sentences
up to `continuation_seconds`), so prosody carries across the cut; a sentence longer than that
starts again from the voice reference. OmniVoice has no continuation: every sentence is a plain
request with the same reference. With a seed, sentence i uses seed + i, and the cut depends only
on the text (gateway_svc.sentences), so the audio is the same however the text was split into
pieces.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import grpc
import numpy as np
from starlette.websockets import WebSocket, WebSocketDisconnect

from chorus.audio import wav_header
from chorus.v1 import common_pb2, tts_pb2
from gateway_svc.errors import GatewayError, from_rpc, invalid
from gateway_svc.sentences import SentenceCutter
from gateway_svc.speech import SpeechPlan, resolve_model
from gateway_svc.stream import summary_fields

log = logging.getLogger("gateway")

NOT_IN_CONFIG = {"input": "send the text in text messages after the config",
                 "stream_format": "a WebSocket session streams already"}
FORMATS = ("pcm", "wav")
END = None  # the speaker's queue: no more sentences


class SpeechSession:
    """One WebSocket: a reader that cuts sentences as text arrives, a speaker that generates them."""

    def __init__(self, ws: WebSocket, gateway):
        self.ws, self.gw, self.cfg = ws, gateway, gateway.cfg
        self.cutter = SentenceCutter(self.cfg.sentence_chars)
        self.sentences: asyncio.Queue = asyncio.Queue()
        self.template: tts_pb2.SynthesizeRequest | None = None
        self.builtin_voice, self.reference_param = False, "voice"
        self.continues = False         # MOSS: each sentence continues the previous ones' audio
        self.max_context_frames = 0
        self.context: list[tuple[str, np.ndarray]] = []  # (transcript, codes [T, n_vq]) spoken last
        self.wav, self.header_sent = False, False
        self.usage = {"input_tokens": 0, "output_tokens": 0, "sentences": 0, "audio_seconds": 0.0}
        self.going_away = False        # the gateway drains: no sentence is started any more
        self.unspoken: list[str] = []  # sentences dequeued but not spoken

    async def serve(self) -> None:
        await self.ws.accept()
        speaker = reader = None
        try:
            await self._configure(await self._receive())
            speaker = asyncio.ensure_future(self._speak())
            reader = asyncio.ensure_future(self._read())
            cut = asyncio.ensure_future(self.gw.drain.expired.wait())
            try:
                await asyncio.wait({speaker, reader, cut}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                cut.cancel()
            cancelled = not speaker.done()
            if cancelled:  # cancel, a bad message, a disconnect, or the drain deadline
                await _stop(speaker)
                if reader.done():
                    reader.result()
                else:
                    self.going_away = True
            else:
                speaker.result()
            if self.going_away:
                await self._go_away(cancelled)
                return
            await self.ws.send_json({"type": "done", "cancelled": cancelled, "usage": self._usage()})
            await self.ws.close(1000)
        except WebSocketDisconnect:
            log.info("speech stream client went away; its generation is cancelled")
        except GatewayError as e:
            await self._fail(e)
        except Exception as e:  # noqa: BLE001 - the client hears of any failure before the close
            log.exception("speech stream failed")
            await self._fail(GatewayError(500, f"the gateway failed: {type(e).__name__}: {e}", code="internal_error"))
        finally:
            for task in (reader, speaker):
                if task is not None:
                    await _stop(task)

    # ---- reading ----------------------------------------------------------------------------

    async def _receive(self) -> dict:
        msg = await self.ws.receive()
        if msg["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(msg.get("code", 1000))
        if msg.get("text") is None:
            raise GatewayError(400, "messages are JSON text frames, not binary", code="invalid_json")
        try:
            data = json.loads(msg["text"])
        except json.JSONDecodeError as e:
            raise GatewayError(400, f"a message is not JSON: {e}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise GatewayError(400, "a message must be a JSON object", code="invalid_json")
        return data

    async def _read(self) -> None:
        """Feeds the speaker until `end` (then keeps listening for `cancel`); returns on `cancel`."""
        ended = False
        while True:
            msg = await self._receive()
            kind = msg.get("type")
            if kind == "cancel":
                return
            if ended:
                raise invalid("type", f"{kind!r} after end; only cancel may follow end")
            if kind == "text":
                if set(msg) - {"type", "text"}:
                    raise invalid(sorted(set(msg) - {"type", "text"})[0], "unknown field; a text message is "
                                  '{"type": "text", "text": "..."}')
                if not isinstance(msg.get("text"), str):
                    raise invalid("text", f"expected a string, got {msg.get('text')!r:.40}")
                self._queue(self.cutter.feed(msg["text"]))
            elif kind == "flush":
                self._queue(self.cutter.flush())
            elif kind == "end":
                self._queue(self.cutter.flush())
                self.sentences.put_nowait(END)
                ended = True
            else:
                raise invalid("type", f"{kind!r} is no message type; send text, flush, end or cancel")

    def _queue(self, sentences: list[str]) -> None:
        for s in sentences:
            self.sentences.put_nowait(s)

    # ---- the config ---------------------------------------------------------------------------

    async def _configure(self, config: dict) -> None:
        body = dict(config)
        if body.pop("type", "config") != "config":
            raise invalid("type", "the first message is the session's config (type config, or no type)")
        for key, why in NOT_IN_CONFIG.items():
            if key in body:
                raise invalid(key, f"is not a session field: {why}")
        fmt = body.pop("response_format", "pcm")
        if fmt not in FORMATS:
            raise invalid("response_format", f"{fmt!r}: a speech stream sends pcm or wav")
        self.wav = fmt == "wav"
        plan = await self.gw.plan({**body, "input": "-", "response_format": "pcm"})
        model = resolve_model(body.get("model") or "", await self.gw.models())
        self.template, self.builtin_voice, self.reference_param = plan.request, plan.voice_may_be_builtin, \
            plan.reference_param
        self.continues = model is not None and model.architecture != "omnivoice"
        if model is not None:
            self.max_context_frames = int(self.cfg.continuation_seconds * model.frame_rate)
        await self.ws.send_json({
            "type": "ready", "model": model.name if model else plan.request.model,
            "sample_rate": self.template.sample_rate or (model.sample_rate if model else 0),
            "channels": model.channels if model else 0, "response_format": fmt})

    # ---- speaking ---------------------------------------------------------------------------

    async def _speak(self) -> None:
        index = 0
        while (text := await self._next_sentence()) is not END:
            try:
                await self._sentence(index, text)
            except asyncio.CancelledError:
                self.unspoken.insert(0, text)
                raise
            index += 1

    async def _next_sentence(self) -> str | None:
        """The next sentence; END at the end of the text or once the gateway drains."""
        drain = self.gw.drain
        get = asyncio.ensure_future(self.sentences.get())
        draining = asyncio.ensure_future(drain.started.wait())
        try:
            await asyncio.wait({get, draining}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            draining.cancel()
        if not drain.draining:
            return get.result()
        if get.done():
            if get.result() is not END:
                self.unspoken.append(get.result())
        else:
            get.cancel()
        self.going_away = True
        return END

    async def _go_away(self, cancelled: bool) -> None:
        """The gateway drains: what was not spoken goes back to the client, then close 1001."""
        while not self.sentences.empty():
            if (s := self.sentences.get_nowait()) is not END:
                self.unspoken.append(s)
        parts = [s for s in (*self.unspoken, self.cutter.buffer.strip()) if s]
        unspoken = _join(parts) if parts else ""
        with contextlib.suppress(Exception):  # the client may be gone already
            await self.ws.send_json({"type": "done", "cancelled": cancelled or bool(unspoken), "going_away": True,
                                     "unspoken": unspoken, "usage": self._usage()})
            await self.ws.close(1001, "going away: the server restarts; open a new session for the unspoken text")

    def _request(self, index: int, text: str) -> SpeechPlan:
        req = tts_pb2.SynthesizeRequest()
        req.CopyFrom(self.template)
        req.text = text
        if req.sampling.HasField("seed"):
            req.sampling.seed = (req.sampling.seed + index) % (1 << 64)
        builtin = self.builtin_voice
        if self.continues:
            req.return_codes = True
            if self.context:
                del req.references[:]
                transcript = _join([t for t, _ in self.context])
                codes = np.concatenate([c for _, c in self.context])
                req.continuation.transcript = transcript + ("" if _wide(transcript[-1]) or _wide(text[0]) else " ")
                req.continuation.codes.CopyFrom(common_pb2.IntMatrix(
                    rows=codes.shape[0], cols=codes.shape[1], data=codes.astype("<i4").tobytes()))
                builtin = False
        return SpeechPlan(req, "pcm", False, builtin, self.reference_param)

    async def _sentence(self, index: int, text: str) -> None:
        plan = self._request(index, text)
        had_reference = bool(plan.request.references)
        await self.ws.send_json({"type": "sentence", "index": index, "text": text})
        call, header = await self.gw.open_synthesis(plan)
        try:
            if had_reference and not plan.request.references:  # an OpenAI voice name no stored voice has
                del self.template.references[:]
                self.builtin_voice = False
            if self.wav and not self.header_sent:
                await self.ws.send_bytes(wav_header(header.sample_rate, header.channels))
            self.header_sent = True
            codes, summary = [], tts_pb2.SynthesisSummary()
            try:
                while (msg := await call.read()) is not grpc.aio.EOF:
                    kind = msg.WhichOneof("kind")
                    if kind == "audio" and msg.audio.data:
                        await self.ws.send_bytes(msg.audio.data)
                    elif kind == "codes":
                        m = msg.codes.codes
                        codes.append(np.frombuffer(m.data, "<i4").reshape(m.rows, m.cols))
                    elif kind == "summary":
                        summary = msg.summary
            except grpc.aio.AioRpcError as e:
                raise from_rpc(e, self.cfg.retry_after) from None
        finally:
            call.cancel()
        self._remember(text, codes)
        self.usage["input_tokens"] += summary.prompt_rows
        self.usage["output_tokens"] += summary.frames
        self.usage["sentences"] += 1
        self.usage["audio_seconds"] += summary.audio_seconds
        await self.ws.send_json({"type": "audio_done", "index": index, **summary_fields(summary)})

    def _remember(self, text: str, codes: list[np.ndarray]) -> None:
        """The sentences the next one continues: the latest whole ones within the frame budget."""
        if not self.continues:
            return
        spoken = np.concatenate(codes) if codes else np.zeros((0, 0), np.int32)
        self.context.append((text, spoken))
        while self.context and (sum(len(c) for _, c in self.context) > self.max_context_frames
                                or not len(self.context[0][1])):
            self.context.pop(0)

    def _usage(self) -> dict:
        u = dict(self.usage)
        u["total_tokens"] = u["input_tokens"] + u["output_tokens"]
        u["audio_seconds"] = round(u["audio_seconds"], 3)
        return u

    async def _fail(self, e: GatewayError) -> None:
        """The error event, then the close code that carries its HTTP status."""
        with contextlib.suppress(Exception):  # the client may be gone already
            await self.ws.send_json({"type": "error", **e.body()})
            reason = e.message.encode()[:120].decode(errors="ignore")
            await self.ws.close(4000 + e.status, reason)


def _wide(ch: str) -> bool:
    """A CJK character or full-width punctuation: no space joins it to the next sentence."""
    return ord(ch) >= 0x2E80


def _join(sentences: list[str]) -> str:
    out = sentences[0]
    for s in sentences[1:]:
        out += s if _wide(out[-1]) or _wide(s[0]) else " " + s
    return out


async def _stop(task: asyncio.Future) -> None:
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
