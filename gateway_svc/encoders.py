"""Audio encoders that stream: PCM16 in, a chunk of the container's bytes out, as it is produced.

wav and pcm pass the scheduler's bytes through. flac, mp3 and opus run libsndfile (soundfile) into
an append-only sink: every byte it writes at the end is sent as soon as it exists. Bytes it goes
back to patch at close (FLAC's total length and checksum) are already sent and stay as first
written; those fields mean "unknown" there, and the stream decodes the same. mp3 is constant bit
rate, so a decoder needs no tag frame to know its length: the blank frame LAME reserves for one is
dropped (it would decode as a frame of silence before the speech). Ogg Opus pages are cut every
50 ms instead of libsndfile's default second, so a chunk's audio leaves with the chunk. aac is
ADTS from PyAV (gateway_svc/aac.py), into the same sink, where PyAV is installed.
"""

from __future__ import annotations

import threading

import numpy as np
import soundfile as sf

from gateway_svc import aac
from gateway_svc.errors import invalid

# response_format -> (media type, libsndfile (format, subtype) or None: passed through)
FORMATS = {
    "mp3": ("audio/mpeg", ("MP3", "MPEG_LAYER_III")),
    "opus": ("audio/ogg", ("OGG", "OPUS")),
    "flac": ("audio/flac", ("FLAC", "PCM_16")),
    "aac": ("audio/aac", ("ADTS", "AAC")),
    "wav": ("audio/wav", None),
    "pcm": ("audio/pcm", None),
}
NOT_OFFERED = {} if aac.available() else {
    "aac": "this gateway has no AAC encoder (install PyAV: pip install av); use mp3, opus, flac, wav or pcm"}
OGG_PAGE_MS = 50.0
_SFC_SET_OGG_PAGE_LATENCY_MS = 0x1302  # sndfile.h; soundfile has no wrapper for it
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
MP3_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)


def check_format(name: str) -> str:
    if name in NOT_OFFERED:
        raise invalid("response_format", f"{name!r} is not offered: {NOT_OFFERED[name]}")
    if name not in FORMATS:
        raise invalid("response_format", f"{name!r} is not a format; choose one of {', '.join(FORMATS)}")
    return name


def check_rate(fmt: str, rate: int, param: str = "sample_rate") -> None:
    """A rate the format's encoder takes, else 400 (opus and mp3 have fixed sets)."""
    allowed = {"opus": OPUS_RATES, "mp3": MP3_RATES, "aac": aac.RATES}.get(fmt)
    if allowed and rate not in allowed:
        raise invalid(param, f"{fmt} needs one of {', '.join(map(str, allowed))} Hz, not {rate}")


_MP3_KBPS = {1: (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),  # MPEG-1 layer III
             2: (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160)}   # MPEG-2 / 2.5
_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}


def drop_blank_mp3_frame(data: bytes) -> bytes:
    """data without its first MPEG audio frame when that frame is blank (LAME's reserved tag frame)."""
    if len(data) < 4 or data[0] != 0xFF or data[1] & 0xE0 != 0xE0:
        return data
    version, kbps_index, rate_index = (data[1] >> 3) & 3, data[2] >> 4, (data[2] >> 2) & 3
    if version == 1 or rate_index == 3 or kbps_index in (0, 15):
        return data
    kbps = _MP3_KBPS[1 if version == 3 else 2][kbps_index]
    rate = _MP3_RATES[version][rate_index]
    length = (144 if version == 3 else 72) * kbps * 1000 // rate + ((data[2] >> 1) & 1)
    blank = len(data) >= length and not any(data[6:length])
    return data[length:] if blank else data


class _AppendOnlySink:
    """A file for libsndfile that keeps only what is written at its end; drain() hands it over."""

    def __init__(self):
        self._pending = bytearray()
        self._size = 0
        self._pos = 0

    def write(self, data) -> int:
        data = bytes(data)
        if self._pos == self._size:  # a patch of bytes already sent is dropped
            self._pending += data
            self._size += len(data)
        self._pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else self._pos + offset if whence == 1 else self._size + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        return b""

    def drain(self) -> bytes:
        out = bytes(self._pending)
        self._pending.clear()
        return out


def _set_ogg_page_latency(f: sf.SoundFile, ms: float) -> None:
    """Cut Ogg pages every `ms` (before the first write). Through soundfile's private handle: where
    that is missing, pages stay a second long (later audio, same bytes)."""
    try:
        value = sf._ffi.new("double*", ms)
        sf._snd.sf_command(f._file, _SFC_SET_OGG_PAGE_LATENCY_MS, value, sf._ffi.sizeof("double"))
    except AttributeError:
        pass


class Encoder:
    """PCM16 (interleaved, little-endian) in, the container's bytes out, chunk by chunk."""

    def __init__(self, fmt: str, sample_rate: int, channels: int, mp3_kbps: int = 128, aac_kbps: int = 128):
        """aac_kbps: per channel."""
        self.media_type, codec = FORMATS[fmt]
        self.channels = channels
        # encode runs in a worker thread; close may come from the event loop while one is in flight
        self._lock = threading.Lock()
        self._first = fmt == "mp3"  # its first bytes may hold the blank tag frame
        # libsndfile's lossy encoders mangle int16 input (clicks throughout): hand them float32
        self._as_float = fmt in ("mp3", "opus")
        self._sink = self._file = None
        if codec is not None:
            self._sink = _AppendOnlySink()
            extra = {}
            if fmt == "mp3":
                # libsndfile's compression level runs 0 (best, 320 kbit/s) .. 1 (smallest, 32 kbit/s)
                extra = dict(bitrate_mode="CONSTANT", compression_level=(320 - mp3_kbps) / 288)
            if fmt == "aac":
                self._file = aac.AacFile(self._sink, sample_rate, channels, aac_kbps)
            else:
                self._file = sf.SoundFile(self._sink, "w", sample_rate, channels, codec[1], format=codec[0], **extra)
            if fmt == "opus":
                _set_ogg_page_latency(self._file, OGG_PAGE_MS)

    @property
    def passthrough(self) -> bool:
        """wav and pcm: the bytes go out as they came, no work to move off the event loop."""
        return self._file is None

    def encode(self, pcm16: bytes) -> bytes:
        if self._file is None:
            return pcm16
        pcm = np.frombuffer(pcm16, dtype="<i2").reshape(-1, self.channels)
        with self._lock:
            if self._file.closed:  # closed under a write that was already on its way
                return b""
            self._file.write(pcm.astype(np.float32) / 32768 if self._as_float else pcm)
            return self._drained()

    def _drained(self) -> bytes:
        out = self._sink.drain()
        if self._first and out:
            self._first = False
            out = drop_blank_mp3_frame(out)
        return out

    def finish(self) -> bytes:
        if self._file is None:
            return b""
        with self._lock:
            self._file.close()
            return self._drained()

    def close(self) -> None:
        """Drop the encoder without finishing (the client went away)."""
        if self._file is not None:
            with self._lock:
                if not self._file.closed:
                    self._file.close()
