"""The gateway process: OpenAI's speech API over HTTP, translated to Chorus's public gRPC API.

    python -m gateway_svc.server --port 8000 --scheduler 127.0.0.1:50051

Routes: POST /v1/audio/speech, WebSocket /v1/audio/speech/stream (text in as it is written,
gateway_svc.speech_stream), GET /v1/models, POST/GET /v1/audio/voices,
DELETE /v1/audio/voices/{voice_id}, GET /health, and the playground: GET / and /static/*.

SIGTERM drains (chorus.drain): from then on every new HTTP request, /health included, gets 503 with
Retry-After and `Connection: close`; the responses and speech streams under way finish (a WebSocket
session after its current sentence, closed 1001), and the process exits 0 once none is left or
drain_seconds have passed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import contextvars
import itertools
import json
import signal
import sys
import time
from pathlib import Path

import grpc
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from chorus.api_keys import bearer_interceptors
from chorus.config import add_config_flags, parse_command_line
from chorus.drain import CUT_MARGIN_S, RETRY_HINT_S, Drain
from chorus.retry_hint import retry_after_header
from chorus.tls import aio_channel
from chorus.v1 import common_pb2, tts_pb2, tts_pb2_grpc
from gateway_svc.config import GatewayConfig
from gateway_svc.encoders import Encoder
from gateway_svc.errors import GatewayError, from_rpc, invalid
from gateway_svc.speech import SpeechPlan, parse_speech, resolve_model
from gateway_svc.speech_stream import SpeechSession
from gateway_svc.stream import AudioStream

STATIC = Path(__file__).with_name("static")  # the playground: one page, its script and its style

# The API key of the HTTP request being served (its `Authorization: Bearer KEY`), sent on to the
# scheduler with every gRPC call the request makes; the scheduler judges it.
BEARER: contextvars.ContextVar[str | None] = contextvars.ContextVar("bearer", default=None)


class BearerPassthrough:
    """ASGI middleware: puts an HTTP request's or WebSocket's bearer key in BEARER."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            value = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
            BEARER.set(value[7:].strip() if value[:7].lower() == "bearer " else None)
        await self.app(scope, receive, send)


class Gateway:
    """gRPC channels to the scheduler, and the served models (cached: they change only when the
    scheduler restarts, so a name not found refreshes them once).

    The scheduler's frontends share one port (SO_REUSEPORT), and the kernel hands each TCP
    connection to one of them: over a single channel, every call of every HTTP client would land
    on one frontend. So the gateway opens `channels` connections and spreads calls over them."""

    def __init__(self, cfg: GatewayConfig, drain: Drain | None = None):
        self.cfg = cfg
        self.drain = drain or Drain(cfg.drain_seconds, "this gateway")
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[tts_pb2_grpc.TextToSpeechStub] = []
        self._turn = itertools.count()
        self._models: dict[str, tts_pb2.ModelInfo] = {}
        # OpenAI voice names lately found not stored -> until when to trust that (monotonic seconds)
        self._not_stored: dict[tuple[str | None, str], float] = {}  # by (caller's key, name): voices are per key

    async def open(self) -> None:
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", -1),
                   ("grpc.use_local_subchannel_pool", 1)]  # a connection of its own per channel
        self._channels = [aio_channel(self.cfg.scheduler, self.cfg.scheduler_tls_dir, options,
                                      interceptors=bearer_interceptors(BEARER.get))
                          for _ in range(self.cfg.channels)]
        self._stubs = [tts_pb2_grpc.TextToSpeechStub(c) for c in self._channels]

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    @property
    def stub(self) -> tts_pb2_grpc.TextToSpeechStub:
        """The next connection's stub, in turn."""
        return self._stubs[next(self._turn) % len(self._stubs)]

    async def rpc(self, method, request, timeout: float | None = 30.0):
        try:
            return await method(request, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise from_rpc(e, self.cfg.retry_after) from None

    async def models(self, refresh: bool = False) -> dict[str, tts_pb2.ModelInfo]:
        if refresh or not self._models:
            resp = await self.rpc(self.stub.ListModels, tts_pb2.ListModelsRequest())
            self._models = {m.name: m for m in resp.models}
        return self._models

    async def plan(self, body) -> SpeechPlan:
        try:
            return parse_speech(body, await self.models())
        except GatewayError as e:
            if e.code != "model_not_found":
                raise
            return parse_speech(body, await self.models(refresh=True))

    async def open_synthesis(self, plan: SpeechPlan, stream: bool = False):
        """The call (Synthesize, or SynthesizeStream with plan.request as its config) and its stream
        header; a failure before the header is an HTTP error answer."""
        name = plan.request.references[0].voice_id if plan.voice_may_be_builtin else ""
        if name and self._not_stored.get((BEARER.get(), name), 0.0) > time.monotonic():
            self._use_model_voice(plan)
        while True:
            call = self.stub.SynthesizeStream() if stream else self.stub.Synthesize(plan.request)
            try:
                if stream:
                    await call.write(tts_pb2.SynthesizeStreamRequest(config=plan.request))
                first = await call.read()
            except grpc.aio.AioRpcError as e:
                if (e.code() == grpc.StatusCode.NOT_FOUND and plan.voice_may_be_builtin
                        and "voice_id" in (e.details() or "")):
                    self._not_stored[BEARER.get(), name] = time.monotonic() + self.cfg.voice_name_cache
                    self._use_model_voice(plan)
                    continue
                err = from_rpc(e, self.cfg.retry_after)
                if err.param == "voice":
                    err.param = plan.reference_param
                raise err from None
            if first is grpc.aio.EOF or first.WhichOneof("kind") != "header":
                call.cancel()
                raise GatewayError(502, "the scheduler's stream did not start with a header", code="bad_gateway")
            return call, first.header

    @staticmethod
    def _use_model_voice(plan: SpeechPlan) -> None:
        del plan.request.references[:]
        plan.voice_may_be_builtin = False

    def voice_stored(self, voice_id: str) -> None:
        self._not_stored.pop((BEARER.get(), voice_id), None)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or 413 once it passes `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise GatewayError(413, f"the body has {declared} bytes; at most {limit} are accepted",
                           code="request_too_large")
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > limit:
            raise GatewayError(413, f"the body is over {limit} bytes", code="request_too_large")
    request._body = bytes(data)  # Starlette's own cache: request.form() reads it from here
    return request._body


async def read_json(request: Request, limit: int):
    try:
        return json.loads(await read_body(request, limit) or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GatewayError(400, f"the body is not JSON: {e}", code="invalid_json") from None


async def read_voice_request(request: Request, limit: int) -> tts_pb2.CreateVoiceRequest:
    """From multipart/form-data (file `audio_sample` or `audio`, `name`, `transcript`, `model`)
    or a JSON object (`audio` base64, `name` or `voice_id`, `transcript`, `model`)."""
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        await read_body(request, limit)  # 413 before parsing a body too large
        form = await request.form(max_part_size=limit)
        upload = form.get("audio_sample") or form.get("audio") or form.get("file")
        if upload is None or isinstance(upload, str):
            raise invalid("audio_sample", "attach the reference audio file as audio_sample")
        fields = {k: form.get(k) for k in ("name", "voice_id", "transcript", "model") if form.get(k)}
        audio = await upload.read()
    else:
        fields = await read_json(request, limit)
        if not isinstance(fields, dict):
            raise GatewayError(400, "the body must be a JSON object or multipart/form-data", code="invalid_json")
        for key, value in fields.items():
            if key not in ("audio", "name", "voice_id", "transcript", "model"):
                raise invalid(key, "unknown field; the fields are audio, name, voice_id, transcript, model")
            if not isinstance(value, str):
                raise invalid(key, f"expected a string, got {value!r:.40}")
        try:
            audio = base64.b64decode(fields.get("audio", ""), validate=True)
        except (binascii.Error, ValueError):
            raise invalid("audio", "is not base64 (send an audio file's bytes, base64-encoded)") from None
    if not audio:
        raise invalid("audio", "is required: the reference audio file")
    return tts_pb2.CreateVoiceRequest(voice_id=fields.get("voice_id") or fields.get("name") or "",
                                      audio=common_pb2.AudioData(data=audio),
                                      transcript=fields.get("transcript", ""), model=fields.get("model", ""))


def voice_json(v: tts_pb2.Voice) -> dict:
    return {"id": v.voice_id, "object": "audio.voice", "name": v.voice_id, "created_at": v.created_at,
            "frames": v.frames, "transcript": v.transcript, "model": v.model}


class DrainGate:
    """ASGI middleware: counts the requests and sessions under way; while draining, answers new ones
    503 (HTTP) or closes them before accepting (WebSocket)."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        if self.drain.draining:
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1013, "reason": self.drain.refusal})
            error = GatewayError(503, self.drain.refusal, code="unavailable")
            response = error.response()
            response.headers["Retry-After"] = retry_after_header(RETRY_HINT_S)
            response.headers["Connection"] = "close"  # the client's next request opens a connection elsewhere
            return await response(scope, receive, send)
        with self.drain.track():
            await self.app(scope, receive, send)


def build_app(cfg: GatewayConfig, drain: Drain | None = None) -> Starlette:
    gw = Gateway(cfg, drain)

    async def speech(request: Request):
        plan = await gw.plan(await read_json(request, cfg.max_body_bytes))
        call, header = await gw.open_synthesis(plan)
        encoder = Encoder(plan.response_format, header.sample_rate, header.channels, cfg.mp3_bitrate_kbps,
                          cfg.aac_bitrate_kbps)
        return AudioStream(call, encoder, plan.sse, {
            "X-Sample-Rate": str(header.sample_rate), "X-Channels": str(header.channels),
            "X-Request-Id": header.request_id, "X-Model": header.model, "Cache-Control": "no-store"},
            cfg.retry_after)

    async def list_models(request: Request):
        models = await gw.models(refresh=True)
        return JSONResponse({"object": "list", "data": [
            {"id": m.name, "object": "model", "created": 0, "owned_by": "chorus", "architecture": m.architecture,
             "sample_rate": m.sample_rate, "channels": m.channels, "frame_rate": m.frame_rate,
             "max_frames": m.max_frames, "default": m.is_default} for m in models.values()]})

    async def create_voice(request: Request):
        req = await read_voice_request(request, cfg.max_body_bytes)
        if req.model:
            req.model = resolve_model(req.model, await gw.models(refresh=True)).name
        voice = await gw.rpc(gw.stub.CreateVoice, req, timeout=120)
        gw.voice_stored(voice.voice_id)
        return JSONResponse(voice_json(voice))

    async def list_voices(request: Request):
        resp = await gw.rpc(gw.stub.ListVoices, tts_pb2.ListVoicesRequest())
        return JSONResponse({"object": "list", "data": [voice_json(v) for v in resp.voices]})

    async def delete_voice(request: Request):
        voice_id = request.path_params["voice_id"]
        await gw.rpc(gw.stub.DeleteVoice, tts_pb2.DeleteVoiceRequest(voice_id=voice_id))
        return JSONResponse({"id": voice_id, "object": "audio.voice.deleted", "deleted": True})

    async def health(request: Request):
        await gw.models(refresh=True)
        return JSONResponse({"status": "ok", "time": time.time()})

    async def playground(request: Request):
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def on_error(request: Request, exc: GatewayError):
        return exc.response()

    async def on_http(request: Request, exc):
        code = "not_found" if exc.status_code == 404 else "method_not_allowed"
        return GatewayError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code).response()

    async def on_crash(request: Request, exc: Exception):
        return GatewayError(500, f"the gateway failed: {type(exc).__name__}: {exc}", code="internal_error").response()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await gw.open()
        yield
        await gw.close()

    return Starlette(middleware=[Middleware(DrainGate, drain=gw.drain), Middleware(BearerPassthrough)], routes=[
        Route("/v1/audio/speech", speech, methods=["POST"]),
        WebSocketRoute("/v1/audio/speech/stream", lambda ws: SpeechSession(ws, gw).serve()),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/audio/voices", create_voice, methods=["POST"]),
        Route("/v1/audio/voices", list_voices, methods=["GET"]),
        Route("/v1/audio/voices/{voice_id}", delete_voice, methods=["DELETE"]),
        Route("/health", health, methods=["GET"]),
        Route("/", playground, methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ], exception_handlers={
        GatewayError: on_error, 404: on_http, 405: on_http, Exception: on_crash}, lifespan=lifespan)


async def serve(cfg: GatewayConfig) -> None:
    """Serve until SIGINT or SIGTERM, then drain; says `ready on HOST:PORT` once the port listens."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # the drain handles them: uvicorn would stop at once, then die of the signal
            yield

    drain = Drain(cfg.drain_seconds, "this gateway")
    server = Server(uvicorn.Config(build_app(cfg, drain), host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                                   lifespan="on", timeout_graceful_shutdown=CUT_MARGIN_S))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, drain.begin)
    serving = asyncio.ensure_future(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        print(f"gateway ready on {host}:{port} (HTTP, translating to {cfg.scheduler})", flush=True)
    draining = asyncio.ensure_future(drain.started.wait())
    await asyncio.wait({serving, draining}, return_when=asyncio.FIRST_COMPLETED)
    draining.cancel()
    if drain.draining:
        await drain.wait()
        server.should_exit = True
    await serving


def main(argv: list[str] | None = None, prog: str = "python -m gateway_svc.server") -> int:
    """`chorus gateway` / `python -m gateway_svc.server`."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(p, GatewayConfig)
    cfg, _ = parse_command_line(GatewayConfig, p, argv)
    asyncio.run(serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
