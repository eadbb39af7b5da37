"""Audio I/O shared by the scheduler and the vocoder.

* decode_audio: an AudioData message -> float32 [C, N] and its rate;
* prepare_reference: a voice-clone reference -> what the codec encoder wants
  (codec rate and channels, RMS loudness normalised; codec spec §5.1);
* resample / StreamingResampler: soxr, offline and chunk by chunk;
* encode_pcm16 / encode_float32 / wav_header: output bytes.

Layouts: planar [C, N] for whole signals, interleaved [N, C] for output
chunks (the vocoder's DecodeResponse.pcm and every wire format are interleaved).
"""

from __future__ import annotations

import io
import struct

import numpy as np
import soundfile as sf
import soxr

from chorus.v1 import common_pb2

MAX_REFERENCE_SECONDS = 100.0
MIN_SAMPLE_RATE = 4000
MAX_SAMPLE_RATE = 384000
MAX_CHANNELS = 64
LOUDNESS_TARGET_DB = -20.0
LOUDNESS_MAX_GAIN_DB = 3.0

_SUPPORTED = ("supported: WAV/FLAC/OGG containers, or raw PCM16/FLOAT32 with sample_rate and channels")


# ---- input ----------------------------------------------------------------------

def decode_audio(data: common_pb2.AudioData, what: str = "reference audio",
                 max_seconds: float = MAX_REFERENCE_SECONDS) -> tuple[np.ndarray, int]:
    """AudioData -> (float32 [C, N] in [-1, 1] for integer formats, sample rate).

    Raises ValueError with a message that says what to fix."""
    raw = bytes(data.data)
    if not raw:
        raise ValueError(f"{what}: no audio bytes ({_SUPPORTED})")
    enc = data.encoding
    if enc in (common_pb2.AUDIO_ENCODING_UNSPECIFIED, common_pb2.AUDIO_ENCODING_CONTAINER):
        wav, rate = _decode_container(raw, what, max_seconds)
    elif enc in (common_pb2.AUDIO_ENCODING_PCM16, common_pb2.AUDIO_ENCODING_FLOAT32):
        wav, rate = _decode_raw(raw, enc, data.sample_rate, data.channels, what, max_seconds)
    else:
        raise ValueError(f"{what}: unknown encoding {enc} ({_SUPPORTED})")
    if wav.shape[1] == 0:
        raise ValueError(f"{what}: the audio has no samples")
    if not np.isfinite(wav).all():
        raise ValueError(f"{what}: the audio contains NaN or Inf samples")
    return wav, rate


def _check_duration(frames: int, rate: int, what: str, max_seconds: float) -> None:
    if frames > max_seconds * rate:
        raise ValueError(f"{what}: {frames / rate:.1f} s is too long (at most {max_seconds:g} s); trim it")


def _decode_container(raw: bytes, what: str, max_seconds: float) -> tuple[np.ndarray, int]:
    try:
        with sf.SoundFile(io.BytesIO(raw)) as f:
            rate = int(f.samplerate)
            if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
                raise ValueError(f"{what}: sample rate {rate} Hz is outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE}")
            if f.frames > 0:  # known up front for WAV/FLAC/OGG: refuse before decoding it all
                _check_duration(f.frames, rate, what, max_seconds)
            wav = f.read(dtype="float32", always_2d=True)  # [N, C]
    except ValueError:
        raise
    except Exception as e:  # soundfile raises LibsndfileError / RuntimeError / TypeError
        raise ValueError(f"{what}: could not decode the bytes as an audio container ({e}) ({_SUPPORTED})") from e
    _check_duration(wav.shape[0], rate, what, max_seconds)
    return np.ascontiguousarray(wav.T), rate


def _decode_raw(raw: bytes, enc: int, rate: int, channels: int, what: str,
                max_seconds: float) -> tuple[np.ndarray, int]:
    name = "PCM16" if enc == common_pb2.AUDIO_ENCODING_PCM16 else "FLOAT32"
    if rate <= 0 or channels <= 0:
        raise ValueError(f"{what}: raw {name} needs sample_rate and channels (got sample_rate={rate}, "
                         f"channels={channels}) ({_SUPPORTED})")
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise ValueError(f"{what}: sample_rate {rate} Hz is outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE}")
    if channels > MAX_CHANNELS:
        raise ValueError(f"{what}: {channels} channels is too many (at most {MAX_CHANNELS})")
    width = 2 if name == "PCM16" else 4
    if len(raw) % (width * channels):
        raise ValueError(f"{what}: {len(raw)} bytes is not a whole number of {channels}-channel {name} frames "
                         f"({width * channels} bytes each)")
    frames = len(raw) // (width * channels)
    _check_duration(frames, rate, what, max_seconds)
    if name == "PCM16":
        x = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    else:
        x = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    return np.ascontiguousarray(x.reshape(frames, channels).T), rate


# ---- reference preparation ------------------------------------------------------------

def loudness_gain(wav: np.ndarray) -> float:
    """Linear gain that moves the RMS level toward -20 dB, by at most +-3 dB.

    dB = 10 log10(mean(x^2) + 1e-9) over all samples and channels; one
    scalar for every channel (codec spec §5.1: RMS, not LUFS)."""
    x = wav.astype(np.float64, copy=False)
    db = 10.0 * np.log10(np.mean(x * x) + 1e-9) if x.size else LOUDNESS_TARGET_DB
    gain_db = float(np.clip(LOUDNESS_TARGET_DB - db, -LOUDNESS_MAX_GAIN_DB, LOUDNESS_MAX_GAIN_DB))
    return 10.0 ** (gain_db / 20.0)


def prepare_reference(wav: np.ndarray, rate: int, target_rate: int, channels: int) -> np.ndarray:
    """A decoded reference [C, N] at `rate` -> float32 [channels, M] at `target_rate`, loudness normalised.

    channels=1 (v1 codec) averages to mono; channels=2 (v2) duplicates mono
    and keeps only the first two of more channels. Channels are fixed before
    resampling (both operations commute; this resamples fewer channels)."""
    if wav.ndim != 2 or wav.shape[0] < 1:
        raise ValueError(f"reference audio must be [channels, samples], got shape {wav.shape}")
    if channels == 1:
        x = wav.mean(axis=0, keepdims=True)
    elif channels == 2:
        x = np.repeat(wav, 2, axis=0) if wav.shape[0] == 1 else wav[:2]
    else:
        raise ValueError(f"codec channels must be 1 or 2, got {channels}")
    x = resample(np.asarray(x, dtype=np.float32), rate, target_rate)
    return np.ascontiguousarray(x * np.float32(loudness_gain(x)), dtype=np.float32)


# ---- resampling -------------------------------------------------------------------------

def resample(wav: np.ndarray, from_rate: int, to_rate: int, quality: str = "HQ") -> np.ndarray:
    """[C, N] float -> float32 [C, M] with soxr (band-limited; M ~ N * to/from)."""
    x = np.asarray(wav, dtype=np.float32)
    if from_rate == to_rate:
        return np.ascontiguousarray(x)
    if x.shape[1] == 0:
        return np.zeros((x.shape[0], 0), np.float32)
    y = soxr.resample(np.ascontiguousarray(x.T), from_rate, to_rate, quality=quality)  # soxr wants [N, C]
    return np.ascontiguousarray(np.asarray(y, dtype=np.float32).reshape(-1, x.shape[0]).T)


class StreamingResampler:
    """Chunk-by-chunk resampling of an interleaved [N, C] float32 stream.

    Output depends only on the concatenated input, not on how it was
    chunked (soxr keeps its filter state); call flush() once at the end to
    get the filter's tail. Equal rates pass chunks through unchanged.
    """

    def __init__(self, from_rate: int, to_rate: int, channels: int, quality: str = "HQ"):
        self.from_rate, self.to_rate, self.channels = from_rate, to_rate, channels
        self._stream = None if from_rate == to_rate else soxr.ResampleStream(
            from_rate, to_rate, channels, dtype="float32", quality=quality)
        self._done = False

    def process(self, chunk: np.ndarray) -> np.ndarray:
        """Interleaved [N, C] in -> interleaved [M, C] out (M may be 0 early on: filter delay)."""
        if self._done:
            raise RuntimeError("StreamingResampler: process() after flush()")
        x = np.ascontiguousarray(np.asarray(chunk, dtype=np.float32).reshape(-1, self.channels))
        if self._stream is None:
            return x
        return self._stream.resample_chunk(x, last=False).reshape(-1, self.channels)

    def flush(self) -> np.ndarray:
        """The remaining output; the resampler is finished afterwards."""
        if self._done:
            return np.zeros((0, self.channels), np.float32)
        self._done = True
        if self._stream is None:
            return np.zeros((0, self.channels), np.float32)
        empty = np.zeros((0, self.channels), np.float32)
        return self._stream.resample_chunk(empty, last=True).reshape(-1, self.channels)


# ---- output ---------------------------------------------------------------------------------

def encode_pcm16(x: np.ndarray) -> bytes:
    """Interleaved float [N, C] -> int16 LE bytes: clip to [-1, 1], scale by 32767, round."""
    # One temporary, scaled then clipped in place: the same values as clip-then-scale (the
    # relay runs this on every sample it sends, see chorus/bench/relay_bench.py).
    y = np.multiply(x, np.float32(32767.0), dtype=np.float32)
    np.clip(y, -32767.0, 32767.0, out=y)
    np.rint(y, out=y)
    return y.astype("<i2").tobytes()


def encode_float32(x: np.ndarray) -> bytes:
    """Interleaved float [N, C] -> float32 LE bytes (no clipping)."""
    return np.asarray(x, dtype="<f4").tobytes()


UNKNOWN_SIZE = 0xFFFFFFFF


def wav_header(sample_rate: int, channels: int, bits: int = 16) -> bytes:
    """A 44-byte RIFF/WAVE header for a stream whose length is not known yet.

    bits=16: PCM int16; bits=32: IEEE float32. The RIFF and data sizes are
    0xFFFFFFFF ("until end of file"), the usual streaming convention:
    libsndfile (soundfile), ffmpeg and browsers read such a file up to its
    real end (tests/test_codec.py checks soundfile on header + PCM16 data)."""
    if bits not in (16, 32):
        raise ValueError(f"wav_header: bits must be 16 (PCM) or 32 (float), got {bits}")
    fmt_tag = 1 if bits == 16 else 3
    block = channels * bits // 8
    return (b"RIFF" + struct.pack("<I", UNKNOWN_SIZE) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, fmt_tag, channels, sample_rate, sample_rate * block, block, bits)
            + b"data" + struct.pack("<I", UNKNOWN_SIZE))
