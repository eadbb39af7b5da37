"""AAC in ADTS frames, through PyAV (FFmpeg's native AAC encoder): libsndfile has no AAC. ADTS
gives every frame its own header, so the stream needs nothing written at the end or patched later
and a player starts at any frame. The encoder delays the audio by one 1024-sample frame (its
priming), as every AAC encoder does."""

from __future__ import annotations

import importlib.util

import numpy as np

RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)


def available() -> bool:
    return importlib.util.find_spec("av") is not None


class AacFile:
    """The SoundFile surface the gateway's Encoder uses (write, close, closed), writing ADTS AAC
    into `sink` (anything with write(bytes))."""

    def __init__(self, sink, sample_rate: int, channels: int, kbps_per_channel: int = 128):
        import av

        self.channels, self.sample_rate = channels, sample_rate
        self._layout = {1: "mono", 2: "stereo"}.get(channels)
        if self._layout is None:
            raise ValueError(f"aac: {channels} channels; this encoder takes 1 or 2")
        self._container = av.open(sink, mode="w", format="adts")
        self._stream = self._container.add_stream("aac", rate=sample_rate, layout=self._layout)
        self._stream.bit_rate = kbps_per_channel * 1000 * channels
        self.closed = False

    def write(self, pcm: np.ndarray) -> None:
        """pcm: int16 [n, channels]."""
        import av

        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm, dtype=np.int16).reshape(1, -1), format="s16",
                                           layout=self._layout)
        frame.sample_rate = self.sample_rate
        for packet in self._stream.encode(frame):
            self._container.mux(packet)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
