"""WebSocket /v1/audio/speech/stream: text in as an LLM writes it, audio out sentence by sentence.

The client's first message is the session's config, a JSON object with the fields of
POST /v1/audio/speech except `input` and `stream_format` (they apply to each sentence, e.g.
max_frames); `response_format` is pcm (default) or wav (one streaming WAV header, then PCM).
Then it sends, in any number:

    {"type": "text", "text": "..."}   more text
    {"type": "flush"}                 speak what is buffered, even without a sentence end
    {"type": "end"}                   the text is complete: speak the rest, then finish
    {"type": "cancel"}                stop now (the running generation is cancelled)

The gateway answers `{"type": "ready", model, sample_rate, channels, response_format}`, then per
sentence `{"type": "sentence", index, text}`, binary frames of interleaved int16 PCM, and
`{"type": "audio_done", index, ...summary}`; at the end `{"type": "done", cancelled, usage}` and
close code 1000. A failure is `{"type": "error", "error": {message, type, param, code}}` and close
code 4000 + the HTTP status the same failure gets on POST (4400 a bad field, 4404 unknown model or
voice, 4429 queue full, 4503 draining).

The session is a client of the scheduler's SynthesizeStream (scheduler_svc/synthesize_stream.py),
which cuts the sentences and speaks each one in the session's voice, on MOSS continuing the audio
of the sentences before it. With a seed, sentence i uses seed + i, and the cut depends only on the
text (chorus.sentences), so the audio is the same however the text was split into pieces.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import grpc
from starlette.websockets import WebSocket, WebSocketDisconnect

from chorus.v1 import tts_pb2
from gateway_svc.errors import GatewayError, from_rpc, invalid
from gateway_svc.speech import SpeechPlan
from gateway_svc.stream import summary_fields

log = logging.getLogger("gateway")

NOT_IN_CONFIG = {"input": "send the text in text messages after the config",
                 "stream_format": "a WebSocket session streams already"}
FORMATS = ("pcm", "wav")
SIGNALS = {"flush": tts_pb2.FLUSH, "end": tts_pb2.END, "cancel": tts_pb2.CANCEL}


class SpeechSession:
    """One WebSocket over one SynthesizeStream call: a reader that forwards the client's messages,
    a relay that sends the call's answers back as events and audio."""

    def __init__(self, ws: WebSocket, gateway):
        self.ws, self.gw, self.cfg = ws, gateway, gateway.cfg
        self.plan: SpeechPlan | None = None
        self.call = None
        self.usage = {"input_tokens": 0, "output_tokens": 0, "sentences": 0, "audio_seconds": 0.0}

    async def serve(self) -> None:
        await self.ws.accept()
        reader = relay = None
        try:
            await self._open(await self._receive())
            reader = asyncio.ensure_future(self._read())
            relay = asyncio.ensure_future(self._relay())
            await asyncio.wait({reader, relay}, return_when=asyncio.FIRST_COMPLETED)
            cancelled = False
            if reader.done():  # cancel, a bad message or a disconnect
                cancelled = reader.result()
            await relay
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
            if self.call is not None:
                self.call.cancel()
            for task in (reader, relay):
                if task is not None:
                    await _stop(task)

    # ---- the config ---------------------------------------------------------------------------

    async def _open(self, config: dict) -> None:
        body = dict(config)
        if body.pop("type", "config") != "config":
            raise invalid("type", "the first message is the session's config (type config, or no type)")
        for key, why in NOT_IN_CONFIG.items():
            if key in body:
                raise invalid(key, f"is not a session field: {why}")
        fmt = body.pop("response_format", "pcm")
        if fmt not in FORMATS:
            raise invalid("response_format", f"{fmt!r}: a speech stream sends pcm or wav")
        self.plan = await self.gw.plan({**body, "input": "-", "response_format": fmt})
        self.plan.request.text = ""
        self.call, header = await self.gw.open_synthesis(self.plan, stream=True)
        await self.ws.send_json({"type": "ready", "model": header.model, "sample_rate": header.sample_rate,
                                 "channels": header.channels, "response_format": fmt})

    # ---- the client's messages ------------------------------------------------------------------

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

    async def _read(self) -> bool:
        """Forwards text and signals until `cancel` (True); after `end` only `cancel` may follow."""
        ended = False
        while True:
            msg = await self._receive()
            kind = msg.get("type")
            if kind == "cancel":
                await self._send(tts_pb2.SynthesizeStreamRequest(signal=tts_pb2.CANCEL))
                return True
            if ended:
                raise invalid("type", f"{kind!r} after end; only cancel may follow end")
            if kind == "text":
                if set(msg) - {"type", "text"}:
                    raise invalid(sorted(set(msg) - {"type", "text"})[0], "unknown field; a text message is "
                                  '{"type": "text", "text": "..."}')
                if not isinstance(msg.get("text"), str):
                    raise invalid("text", f"expected a string, got {msg.get('text')!r:.40}")
                await self._send(tts_pb2.SynthesizeStreamRequest(text=msg["text"]))
            elif kind in SIGNALS:
                ended = kind == "end"
                await self._send(tts_pb2.SynthesizeStreamRequest(signal=SIGNALS[kind]))
            else:
                raise invalid("type", f"{kind!r} is no message type; send text, flush, end or cancel")

    async def _send(self, msg: tts_pb2.SynthesizeStreamRequest) -> None:
        """A message to the call; one that has ended already is the relay's to report."""
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await self.call.write(msg)

    # ---- the scheduler's answers --------------------------------------------------------------

    async def _relay(self) -> None:
        index = 0
        try:
            while (msg := await self.call.read()) is not grpc.aio.EOF:
                kind = msg.WhichOneof("kind")
                if kind == "audio" and msg.audio.data:
                    await self.ws.send_bytes(msg.audio.data)
                elif kind == "sentence":
                    index = msg.sentence.index
                    await self.ws.send_json({"type": "sentence", "index": index, "text": msg.sentence.text})
                elif kind == "summary":
                    s = msg.summary
                    self.usage["input_tokens"] += s.prompt_rows
                    self.usage["output_tokens"] += s.frames
                    self.usage["sentences"] += 1
                    self.usage["audio_seconds"] += s.audio_seconds
                    await self.ws.send_json({"type": "audio_done", "index": index, **summary_fields(s)})
        except grpc.aio.AioRpcError as e:
            err = from_rpc(e, self.cfg.retry_after)
            if err.param == "voice":
                err.param = self.plan.reference_param
            raise err from None

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


async def _stop(task: asyncio.Future) -> None:
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
