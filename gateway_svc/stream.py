"""The audio answer of one synthesis: the gRPC stream's PCM, encoded chunk by chunk, as raw bytes or
as server-sent events. A client that goes away cancels the gRPC call at once (the scheduler then
frees the request's KV pages, worker state and vocoder stream)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging

import grpc

from chorus.v1 import tts_pb2
from gateway_svc.encoders import Encoder
from gateway_svc.errors import from_rpc

log = logging.getLogger("gateway")


def sse_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def summary_fields(s: tts_pb2.SynthesisSummary) -> dict:
    return {"frames": s.frames, "audio_seconds": s.audio_seconds,
            "finish_reason": tts_pb2.FinishReason.Name(s.finish_reason).lower(), "queue_ms": s.queue_ms,
            "first_audio_ms": s.first_audio_ms, "total_ms": s.total_ms, "prompt_rows": s.prompt_rows,
            "cached_prompt_rows": s.cached_prompt_rows}


class AudioStream:
    """An ASGI response that relays one open Synthesize call (its header already read)."""

    def __init__(self, call, encoder: Encoder, sse: bool, headers: dict[str, str], retry_after: int):
        self.call, self.encoder, self.sse, self.retry_after = call, encoder, sse, retry_after
        self.media_type = "text/event-stream" if sse else encoder.media_type
        self.headers = headers

    async def __call__(self, scope, receive, send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(self._watch_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            if pump.done():
                pump.result()  # a failure mid-stream aborts the connection: the client sees it cut
            else:
                log.info("client disconnected; cancelling its synthesis")
        finally:
            for task in (pump, watch):
                task.cancel()
            self.call.cancel()
            self.encoder.close()

    @staticmethod
    async def _watch_disconnect(receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def _encode(self, pcm16: bytes | None) -> bytes:
        """Encoded bytes of a chunk (None: the encoder's tail). The codecs run in a thread (libsndfile
        lets go of the GIL) so that one stream's encoding never stalls the others' relays."""
        work = self.encoder.finish if pcm16 is None else lambda: self.encoder.encode(pcm16)
        return work() if self.encoder.passthrough else await asyncio.to_thread(work)

    async def _pump(self, send) -> None:
        headers = [(b"content-type", self.media_type.encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def body(data: bytes) -> None:
            if data:
                payload = sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) \
                    if self.sse else data
                await send({"type": "http.response.body", "body": payload, "more_body": True})

        summary = None
        try:
            while (msg := await self.call.read()) is not grpc.aio.EOF:
                kind = msg.WhichOneof("kind")
                if kind == "audio":
                    await body(await self._encode(msg.audio.data))
                elif kind == "summary":
                    summary = msg.summary
            await body(await self._encode(None))
        except grpc.aio.AioRpcError as e:
            if not self.sse:
                raise
            await send({"type": "http.response.body", "more_body": False, "body": sse_event(
                {"type": "error", **from_rpc(e, self.retry_after).body()})})
            return
        tail = b""
        if self.sse:
            s = summary or tts_pb2.SynthesisSummary()
            tail = sse_event({"type": "speech.audio.done", "usage": {
                "input_tokens": s.prompt_rows, "output_tokens": s.frames, "total_tokens": s.prompt_rows + s.frames},
                "summary": summary_fields(s)})
        await send({"type": "http.response.body", "body": tail, "more_body": False})
