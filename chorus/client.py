"""Clients of the public gRPC API.

`synthesize(stub, request)` is the plain call (`chorus say`, the demo and the tests use it).
`Client` and `AsyncClient` are the SDK: one or more server addresses, a call that fails with
UNAVAILABLE or RESOURCE_EXHAUSTED before any answer is retried on the next address after a
jittered, growing wait, `stream()` yields the responses as they come, and `AudioFile` writes the
audio to a WAV or FLAC file as it streams:

    with Client(["10.0.0.1:50051", "10.0.0.2:50051"]) as client, AudioFile("out.flac") as out:
        for resp in client.stream(SynthesizeRequest(text="Hello.")):
            out.add(resp)

`synthesize_stream(config, pieces)` is SynthesizeStream: text in as it is written (an LLM's
tokens), audio out sentence by sentence:

    for resp in client.synthesize_stream(SynthesizeRequest(), llm_tokens()):
        out.add(resp)
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field

import grpc
import numpy as np
import soundfile as sf

from chorus.v1 import tts_pb2, tts_pb2_grpc

WAV_HEADER_BYTES = 44


@dataclass
class Synthesis:
    header: tts_pb2.StreamHeader | None = None
    chunks: list[tts_pb2.AudioChunk] = field(default_factory=list)
    codes: list[np.ndarray] = field(default_factory=list)
    summary: tts_pb2.SynthesisSummary | None = None  # a SynthesizeStream's: its last sentence's
    sentences: list[tts_pb2.SentenceMark] = field(default_factory=list)  # SynthesizeStream's
    first_chunk_s: float | None = None

    @property
    def audio_bytes(self) -> bytes:
        return b"".join(c.data for c in self.chunks)

    def pcm(self) -> np.ndarray:
        """Interleaved samples as [n, channels] (int16 for PCM16/WAV, float32 for FLOAT32)."""
        data = self.audio_bytes
        if self.header.format == tts_pb2.WAV:
            data = data[WAV_HEADER_BYTES:]
        dtype = "<f4" if self.header.format == tts_pb2.FLOAT32 else "<i2"
        return np.frombuffer(data, dtype=dtype).reshape(-1, self.header.channels)

    def code_frames(self) -> np.ndarray:
        return np.concatenate(self.codes) if self.codes else np.zeros((0, 0), np.int32)


def credentials(ca: str, cert: str | None = None, key: str | None = None) -> grpc.ChannelCredentials:
    """TLS that trusts the CA certificate file `ca` (PEM) and, for mTLS, presents cert/key."""
    def read(path):
        with open(path, "rb") as fh:
            return fh.read()
    return grpc.ssl_channel_credentials(read(ca), read(key) if key else None, read(cert) if cert else None)


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """The metadata that carries api_key (`authorization: Bearer KEY`), or None without one."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def channel(address: str, creds: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A channel to address: TLS with creds (see `credentials`), else plaintext."""
    options = [("grpc.max_receive_message_length", 64 << 20)]
    if creds is not None:
        return grpc.secure_channel(address, creds, options=options)
    return grpc.insecure_channel(address, options=options)


def synthesize(stub: tts_pb2_grpc.TextToSpeechStub, request: tts_pb2.SynthesizeRequest,
               timeout: float | None = None, on_chunk=None, api_key: str | None = None) -> Synthesis:
    out = Synthesis()
    t0 = time.monotonic()
    for resp in stub.Synthesize(request, timeout=timeout, metadata=auth_metadata(api_key)):
        add_response(out, resp, t0)
        if on_chunk and resp.WhichOneof("kind") == "audio":
            on_chunk(out)
    return out


# ---- the SDK ------------------------------------------------------------------------------------

Piece = str | int  # SynthesizeStream input: text, or a tts_pb2.StreamSignal (FLUSH, END, CANCEL)


def _stream_message(piece: Piece) -> tts_pb2.SynthesizeStreamRequest:
    if isinstance(piece, str):
        return tts_pb2.SynthesizeStreamRequest(text=piece)
    return tts_pb2.SynthesizeStreamRequest(signal=piece)


def stream_messages(config: tts_pb2.SynthesizeRequest, pieces: Iterable[Piece]) -> Iterator[
        tts_pb2.SynthesizeStreamRequest]:
    """SynthesizeStream's messages: the config, the pieces, then END (unless a piece was END or CANCEL)."""
    yield tts_pb2.SynthesizeStreamRequest(config=config)
    for piece in pieces:
        yield _stream_message(piece)
        if not isinstance(piece, str) and piece in (tts_pb2.END, tts_pb2.CANCEL):
            return
    yield tts_pb2.SynthesizeStreamRequest(signal=tts_pb2.END)


async def _async_stream_messages(config: tts_pb2.SynthesizeRequest, pieces: AsyncIterable[Piece] | Iterable[Piece]):
    if not hasattr(pieces, "__aiter__"):
        for message in stream_messages(config, pieces):
            yield message
        return
    yield tts_pb2.SynthesizeStreamRequest(config=config)
    async for piece in pieces:
        yield _stream_message(piece)
        if not isinstance(piece, str) and piece in (tts_pb2.END, tts_pb2.CANCEL):
            return
    yield tts_pb2.SynthesizeStreamRequest(signal=tts_pb2.END)


RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


@dataclass
class Retry:
    """How often and how patiently a call is retried (exponential backoff with full jitter)."""
    attempts: int = 4          # calls in all, the first included
    first_wait: float = 0.1    # seconds before the second call (at most; jittered down)
    max_wait: float = 2.0      # cap of one wait in seconds

    def wait(self, attempt: int) -> float:
        """Seconds to wait after failed call number `attempt` (0-based)."""
        return random.uniform(0, min(self.max_wait, self.first_wait * 2 ** attempt))

    def should_retry(self, e: grpc.RpcError, attempt: int) -> bool:
        # RESOURCE_EXHAUSTED also says "message larger than max": that one never fits later
        return (attempt + 1 < self.attempts and e.code() in RETRYABLE
                and "larger than max" not in (e.details() or ""))


def _addresses(addresses: str | list[str]) -> list[str]:
    out = [addresses] if isinstance(addresses, str) else list(addresses)
    if not out:
        raise ValueError("addresses: give at least one HOST:PORT")
    return out


_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]


class Client:
    """A synchronous client over one or more servers (tried in turn, starting at a random one)."""

    def __init__(self, addresses: str | list[str], retry: Retry | None = None, timeout: float | None = None,
                 api_key: str | None = None, creds: grpc.ChannelCredentials | None = None):
        """api_key: sent as `authorization: Bearer KEY`; creds: TLS (see `credentials`), else plaintext."""
        self.retry, self.timeout = retry or Retry(), timeout
        self._metadata = auth_metadata(api_key)
        self._channels = [grpc.secure_channel(a, creds, options=_OPTIONS) if creds is not None else
                          grpc.insecure_channel(a, options=_OPTIONS) for a in _addresses(addresses)]
        self._stubs = [tts_pb2_grpc.TextToSpeechStub(c) for c in self._channels]
        self._turn = itertools.count(random.randrange(len(self._stubs)))

    def _stub(self) -> tts_pb2_grpc.TextToSpeechStub:
        return self._stubs[next(self._turn) % len(self._stubs)]

    def stream(self, request: tts_pb2.SynthesizeRequest) -> Iterator[tts_pb2.SynthesizeResponse]:
        """The responses of one Synthesize call as they come. Retried only before the first one
        arrives (after that the caller holds audio a second call would repeat)."""
        for attempt in itertools.count():
            call = self._stub().Synthesize(request, timeout=self.timeout, metadata=self._metadata)
            try:
                first = next(call)
            except StopIteration:
                return
            except grpc.RpcError as e:
                if not self.retry.should_retry(e, attempt):
                    raise
                time.sleep(self.retry.wait(attempt))
                continue
            try:
                yield first
                yield from call
            finally:
                call.cancel()  # the caller stopped early: free the server's resources now
            return

    def synthesize(self, request: tts_pb2.SynthesizeRequest) -> Synthesis:
        """The whole answer of one call, collected."""
        return collect(self.stream(request))

    def synthesize_stream(self, config: tts_pb2.SynthesizeRequest,
                          pieces: Iterable[Piece]) -> Iterator[tts_pb2.SynthesizeResponse]:
        """SynthesizeStream: config (a SynthesizeRequest without text), then each piece as it comes
        (text, or FLUSH / END / CANCEL); END follows the last. Yields the header, then per sentence
        its SentenceMark, audio and summary, as they come. Not retried: the pieces are read once."""
        call = self._stub().SynthesizeStream(stream_messages(config, pieces), timeout=self.timeout,
                                             metadata=self._metadata)
        try:
            yield from call
        finally:
            call.cancel()

    def _unary(self, name: str, request):
        for attempt in itertools.count():
            try:
                return getattr(self._stub(), name)(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as e:
                if not self.retry.should_retry(e, attempt):
                    raise
                time.sleep(self.retry.wait(attempt))

    def list_models(self) -> list[tts_pb2.ModelInfo]:
        return list(self._unary("ListModels", tts_pb2.ListModelsRequest()).models)

    def create_voice(self, audio: bytes, transcript: str = "", voice_id: str = "", model: str = "") -> tts_pb2.Voice:
        """Store a reference (an audio file's bytes) once; use its voice_id in later requests."""
        from chorus.v1 import common_pb2
        return self._unary("CreateVoice", tts_pb2.CreateVoiceRequest(
            voice_id=voice_id, audio=common_pb2.AudioData(data=audio), transcript=transcript, model=model))

    def list_voices(self) -> list[tts_pb2.Voice]:
        return list(self._unary("ListVoices", tts_pb2.ListVoicesRequest()).voices)

    def delete_voice(self, voice_id: str) -> None:
        self._unary("DeleteVoice", tts_pb2.DeleteVoiceRequest(voice_id=voice_id))

    def close(self) -> None:
        for c in self._channels:
            c.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """Client's asyncio twin (grpc.aio); create it inside the running event loop."""

    def __init__(self, addresses: str | list[str], retry: Retry | None = None, timeout: float | None = None,
                 api_key: str | None = None, creds: grpc.ChannelCredentials | None = None):
        """api_key: sent as `authorization: Bearer KEY`; creds: TLS (see `credentials`), else plaintext."""
        self.retry, self.timeout = retry or Retry(), timeout
        self._metadata = auth_metadata(api_key)
        self._channels = [grpc.aio.secure_channel(a, creds, options=_OPTIONS) if creds is not None else
                          grpc.aio.insecure_channel(a, options=_OPTIONS) for a in _addresses(addresses)]
        self._stubs = [tts_pb2_grpc.TextToSpeechStub(c) for c in self._channels]
        self._turn = itertools.count(random.randrange(len(self._stubs)))

    def _stub(self) -> tts_pb2_grpc.TextToSpeechStub:
        return self._stubs[next(self._turn) % len(self._stubs)]

    async def stream(self, request: tts_pb2.SynthesizeRequest) -> AsyncIterator[tts_pb2.SynthesizeResponse]:
        for attempt in itertools.count():
            call = self._stub().Synthesize(request, timeout=self.timeout, metadata=self._metadata)
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as e:
                if not self.retry.should_retry(e, attempt):
                    raise
                await asyncio.sleep(self.retry.wait(attempt))
                continue
            try:
                while first is not grpc.aio.EOF:
                    yield first
                    first = await call.read()
            finally:
                call.cancel()
            return

    async def synthesize_stream(self, config: tts_pb2.SynthesizeRequest, pieces: AsyncIterable[Piece] |
                                Iterable[Piece]) -> AsyncIterator[tts_pb2.SynthesizeResponse]:
        """Client.synthesize_stream's twin; pieces may be an async iterable (an LLM's stream)."""
        call = self._stub().SynthesizeStream(_async_stream_messages(config, pieces), timeout=self.timeout,
                                             metadata=self._metadata)
        try:
            while (resp := await call.read()) is not grpc.aio.EOF:
                yield resp
        finally:
            call.cancel()

    async def synthesize(self, request: tts_pb2.SynthesizeRequest) -> Synthesis:
        out = Synthesis()
        t0 = time.monotonic()
        async for resp in self.stream(request):
            add_response(out, resp, t0)
        return out

    async def _unary(self, name: str, request):
        for attempt in itertools.count():
            try:
                return await getattr(self._stub(), name)(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.aio.AioRpcError as e:
                if not self.retry.should_retry(e, attempt):
                    raise
                await asyncio.sleep(self.retry.wait(attempt))

    async def list_models(self) -> list[tts_pb2.ModelInfo]:
        return list((await self._unary("ListModels", tts_pb2.ListModelsRequest())).models)

    async def list_voices(self) -> list[tts_pb2.Voice]:
        return list((await self._unary("ListVoices", tts_pb2.ListVoicesRequest())).voices)

    async def close(self) -> None:
        for c in self._channels:
            await c.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def add_response(out: Synthesis, resp: tts_pb2.SynthesizeResponse, t0: float) -> None:
    """Adds one response to out; t0: when the call started (monotonic), for first_chunk_s."""
    kind = resp.WhichOneof("kind")
    if kind == "header":
        out.header = resp.header
    elif kind == "audio":
        if out.first_chunk_s is None:
            out.first_chunk_s = time.monotonic() - t0
        out.chunks.append(resp.audio)
    elif kind == "codes":
        m = resp.codes.codes
        out.codes.append(np.frombuffer(m.data, dtype="<i4").reshape(m.rows, m.cols))
    elif kind == "summary":
        out.summary = resp.summary
    elif kind == "sentence":
        out.sentences.append(resp.sentence)


def collect(responses) -> Synthesis:
    """A Synthesis from a stream of responses (Client.stream's)."""
    out = Synthesis()
    t0 = time.monotonic()
    for resp in responses:
        add_response(out, resp, t0)
    return out


class AudioFile:
    """Writes a call's audio to a WAV or FLAC file (by the path's suffix, or `format`) as it
    streams: give it every response; the header opens the file, audio chunks go in as they come.
    PCM16 and WAV streams are written as 16-bit, FLOAT32 streams as float (WAV) or 24-bit (FLAC)."""

    def __init__(self, path, format: str | None = None):
        self.path = path
        self.format = (format or str(path).rsplit(".", 1)[-1]).upper()
        if self.format not in ("WAV", "FLAC"):
            raise ValueError(f"format: {self.format!r} is not WAV or FLAC (name the file .wav or .flac)")
        self._file: sf.SoundFile | None = None
        self._header: tts_pb2.StreamHeader | None = None
        self._skip = 0  # the WAV stream's own header bytes, still to drop

    def add(self, resp: tts_pb2.SynthesizeResponse) -> None:
        kind = resp.WhichOneof("kind")
        if kind == "header":
            h = self._header = resp.header
            floats = h.format == tts_pb2.FLOAT32
            subtype = ("FLOAT" if self.format == "WAV" else "PCM_24") if floats else "PCM_16"
            self._file = sf.SoundFile(self.path, "w", h.sample_rate, h.channels, subtype, format=self.format)
            self._skip = WAV_HEADER_BYTES if h.format == tts_pb2.WAV else 0
        elif kind == "audio":
            if self._file is None:
                raise ValueError("an audio chunk before the stream's header")
            data = resp.audio.data
            if self._skip:
                data, self._skip = data[self._skip:], max(0, self._skip - len(data))
            dtype = "<f4" if self._header.format == tts_pb2.FLOAT32 else "<i2"
            self._file.write(np.frombuffer(data, dtype=dtype).reshape(-1, self._header.channels))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> "AudioFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
