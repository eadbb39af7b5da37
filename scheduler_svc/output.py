"""Turns the codec's float32 PCM stream into what the client asked for:
its sample rate (streaming resampler) and format (PCM16, FLOAT32, or WAV
with the header in front of the first chunk), counting samples as it goes.

PCM16 or WAV at the native rate needs no resampling, so the vocoder can encode
it (vocoder PcmEncoding INT16, with this module's very function): the relay
then forwards those bytes (`forward_pcm16`) instead of converting float32."""

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

    @property
    def passes_pcm16(self) -> bool:
        """Whether the client's audio is exactly the vocoder's int16 encoding (PCM16 or WAV, native rate)."""
        return self.out_rate == self.native_rate and self.format in (tts_pb2.PCM16, tts_pb2.WAV)

    def _chunk(self, pcm: np.ndarray) -> tts_pb2.SynthesizeResponse | None:
        """pcm: float32 [n, channels] at out_rate."""
        if pcm.shape[0] == 0 and not self._header_pending:
            return None
        if self.format == tts_pb2.FLOAT32:
            data = audio.encode_float32(pcm)
        else:
            data = audio.encode_pcm16(pcm)
        return self._emit(data, pcm.shape[0])

    def _emit(self, data: bytes, n: int) -> tts_pb2.SynthesizeResponse:
        """The client's next audio response. Filled in place: building an AudioChunk and then
        SynthesizeResponse(audio=chunk) would copy the PCM twice (18% of the relay's CPU)."""
        if self._header_pending:
            data = audio.wav_header(self.out_rate, self.channels, bits=16) + data
            self._header_pending = False
        resp = tts_pb2.SynthesizeResponse()
        chunk = resp.audio
        chunk.data, chunk.first_sample, chunk.num_samples = data, self.samples_sent, n
        self.samples_sent += n
        return resp

    def forward_pcm16(self, data: bytes, n: int) -> tts_pb2.SynthesizeResponse | None:
        """n samples per channel of int16 LE PCM already in the client's encoding (passes_pcm16)."""
        if not self.passes_pcm16:
            raise ValueError("int16 PCM can only be forwarded to a PCM16/WAV client at the native rate")
        if n == 0 and not self._header_pending:
            return None
        return self._emit(data, n)

    def convert(self, pcm: np.ndarray) -> tts_pb2.SynthesizeResponse | None:
        return self._chunk(self._resampler.process(pcm))

    def flush(self) -> tts_pb2.SynthesizeResponse | None:
        return self._chunk(self._resampler.flush())
