"""A small synchronous client of the public API (used by `chorus say`,
the demo and the tests)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from chorus.v1 import tts_pb2, tts_pb2_grpc

WAV_HEADER_BYTES = 44


@dataclass
class Synthesis:
    header: tts_pb2.StreamHeader | None = None
    chunks: list[tts_pb2.AudioChunk] = field(default_factory=list)
    codes: list[np.ndarray] = field(default_factory=list)
    summary: tts_pb2.SynthesisSummary | None = None
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


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])


def synthesize(stub: tts_pb2_grpc.TextToSpeechStub, request: tts_pb2.SynthesizeRequest,
               timeout: float | None = None, on_chunk=None) -> Synthesis:
    out = Synthesis()
    t0 = time.monotonic()
    for resp in stub.Synthesize(request, timeout=timeout):
        kind = resp.WhichOneof("kind")
        if kind == "header":
            out.header = resp.header
        elif kind == "audio":
            if out.first_chunk_s is None:
                out.first_chunk_s = time.monotonic() - t0
            out.chunks.append(resp.audio)
            if on_chunk:
                on_chunk(out)
        elif kind == "codes":
            m = resp.codes.codes
            out.codes.append(np.frombuffer(m.data, dtype="<i4").reshape(m.rows, m.cols))
        elif kind == "summary":
            out.summary = resp.summary
    return out
