"""Turns the codec's float32 PCM stream into what the client asked for:
its sample rate (streaming resampler) and format (PCM16, FLOAT32, or WAV
with the header in front of the first chunk), counting samples as it goes."""

from __future__ import annotations

import numpy as np

from chorus import audio
from chorus.v1 import tts_pb2


class AudioOutput:
    def __init__(self, native_rate: int, channels: int, out_rate: int, fmt: int):
        self.native_rate = native_rate
        self.channels = channels
        self.out_rate = out_rate
        self.format = fmt
        self.samples_sent = 0
        self._header_pending = fmt == tts_pb2.WAV
        self._resampler = audio.StreamingResampler(native_rate, out_rate, channels)

    def _chunk(self, pcm: np.ndarray) -> tts_pb2.AudioChunk | None:
        """pcm: float32 [n, channels] at out_rate."""
        if pcm.shape[0] == 0 and not self._header_pending:
            return None
        if self.format == tts_pb2.FLOAT32:
            data = audio.encode_float32(pcm)
        else:
            data = audio.encode_pcm16(pcm)
        if self._header_pending:
            data = audio.wav_header(self.out_rate, self.channels, bits=16) + data
            self._header_pending = False
        chunk = tts_pb2.AudioChunk(data=data, first_sample=self.samples_sent, num_samples=pcm.shape[0])
        self.samples_sent += pcm.shape[0]
        return chunk

    def convert(self, pcm: np.ndarray) -> tts_pb2.AudioChunk | None:
        return self._chunk(self._resampler.process(pcm))

    def flush(self) -> tts_pb2.AudioChunk | None:
        return self._chunk(self._resampler.flush())
