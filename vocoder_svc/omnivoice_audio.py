"""OmniVoice's audio on either side of the codec, as the reference package treats it (spec section 6).

Output (`finish_piece`): a decoded clip is trimmed of long silences (an internal run of silence
under -50 dBFS longer than 0.5 s is cut to 1 s; the edges to 0.1 s), levelled (to the clone
reference's RMS when it is below 0.1, else left as is; without a reference its peak goes to 0.5),
faded in and out linearly and padded with silence. A long text is generated as pieces; the
reference decodes them all, joins them (fade-out, 0.1 s of silence, fade-in, 0.1 s each) and
post-processes the whole, while we stream: each piece is processed as it is decoded, carrying its
side of each join (`continues`: it starts with the silence and the fade-in; `continued`: it ends
with the fade-out), and only the outer ends get edge trimming, the edge fades and the pads. Without
post-processing and with a reference the concatenated pieces equal the reference's whole clip sample
for sample. Where they cannot:
  * without a reference each piece's peak is normalised on its own, not the whole text's;
  * silence is trimmed within each piece, so a run of more than 0.5 s of silence on one side of a
    join keeps 0.5 s there where the reference, seeing the join, keeps up to 1 s in all;
  * an outer piece shorter than twice the fade gets the fade the reference would give a clip
    of that piece's length.

Input (`prepare_reference`): a clone reference becomes mono 24 kHz, its RMS is measured (the output
level follows it), quiet audio is raised to RMS 0.1, long silences are cut (internal ones to 0.4 s,
the lead to 0.1 s, the tail to 0.2 s), a reference over 20 s without a transcript is first cut at a
silence gap, and the tail past the last whole codec frame is dropped. We resample with soxr where
the reference uses torchaudio, so a reference at another rate gives slightly different samples.

Silence trimming goes through 16-bit samples, as the reference's pydub does (a trimmed clip is
quantised to int16 and back), and finds the same silences to the sample (vocoder_svc/silence.py).
"""

from __future__ import annotations

import numpy as np

from chorus.audio import resample
from vocoder_svc.silence import Pcm, detect_leading_silence, detect_nonsilent, split_on_silence

SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 960
SILENCE_DBFS = -50.0
SEEK_MS = 10
JOIN_SECONDS = 0.3  # the long-form join: a third fade-out, a third silence, a third fade-in
OUTPUT_SILENCE_MS = (500, 100, 100)     # (internal, lead, trail) kept at most, in ms
REFERENCE_SILENCE_MS = (200, 100, 200)
RMS_FLOOR = 0.1
PEAK_TARGET = 0.5
LONG_REFERENCE_SECONDS = 20.0
REFERENCE_CUT_SECONDS = (3.0, 15.0)     # a long reference is cut at a silence gap in this window


# ---- silence ------------------------------------------------------------------------------------

def _to_int16(wave: np.ndarray) -> np.ndarray:
    return (wave * 32768.0).clip(-32768, 32767).astype(np.int16)


def _to_float(samples: np.ndarray) -> np.ndarray:
    return samples.astype(np.float32) / 32768.0


def trim_silence(wave: np.ndarray, rate: int, internal_ms: int, lead_ms: int, trail_ms: int, *,
                 trim_lead: bool = True, trim_trail: bool = True) -> np.ndarray:
    """Mono float32 -> float32 (via int16). Every run of at least internal_ms below -50 dBFS keeps
    internal_ms next to the sound on each side (so at most 2 * internal_ms inside, internal_ms at an
    edge); then the edges asked for keep at most lead_ms / trail_ms. May return no samples."""
    segment = Pcm(_to_int16(np.asarray(wave, dtype=np.float32)), rate)
    if internal_ms > 0:
        kept = split_on_silence(segment, min_silence_len=internal_ms, silence_thresh=SILENCE_DBFS,
                                keep_silence=internal_ms, seek_step=SEEK_MS)
        joined = np.concatenate([s.samples for s in kept]) if kept else np.zeros(0, np.int16)
        segment = Pcm(joined, rate)
    if trim_lead:
        segment = segment[max(0, detect_leading_silence(segment, SILENCE_DBFS) - lead_ms):]
    if trim_trail:
        backwards = segment.reverse()
        cut = max(0, detect_leading_silence(backwards, SILENCE_DBFS) - trail_ms)
        segment = backwards[cut:].reverse()
    return _to_float(segment.samples)


def cut_long_reference(wave: np.ndarray, rate: int) -> np.ndarray:
    """A reference over 20 s -> its head up to the last sound that starts within 15 s (after at
    least 0.1 s below -40 dBFS), or the first 15 s when that head would be under 3 s."""
    if len(wave) / rate <= LONG_REFERENCE_SECONDS:
        return wave
    segment = Pcm(_to_int16(wave), rate)
    sounds = detect_nonsilent(segment, min_silence_len=100, silence_thresh=-40, seek_step=SEEK_MS)
    if not sounds:
        return wave
    shortest, longest = (int(s * 1000) for s in REFERENCE_CUT_SECONDS)
    cut = 0
    for start, end in sounds:
        if cut < start <= longest:
            cut = start
        if end > longest:
            break
    if cut < shortest:
        cut = min(longest, len(segment))
    return _to_float(segment[:cut].samples)


# ---- output -------------------------------------------------------------------------------------

def _ramp(n: int, rising: bool) -> np.ndarray:
    return np.linspace(0, 1, n, dtype=np.float32) if rising else np.linspace(1, 0, n, dtype=np.float32)


def seconds(value: float) -> float:
    """A float32 wire value as the decimal its sender wrote (0.7f -> 0.7), so sample counts
    int(value * rate) come out as they do from the reference's Python floats."""
    return float(str(np.float32(value)))


def join_in(wave: np.ndarray, rate: int = SAMPLE_RATE) -> np.ndarray:
    """A piece after the first: the join's silence, then the piece faded in."""
    third = int(JOIN_SECONDS * rate) // 3
    x = np.array(wave, dtype=np.float32)
    n = min(third, len(x))
    x[:n] *= _ramp(n, rising=True)
    return np.concatenate([np.zeros(third, np.float32), x])


def join_out(wave: np.ndarray, rate: int = SAMPLE_RATE) -> np.ndarray:
    """A piece before the last: its last 0.1 s faded out. The reference fades the last 0.1 s of
    everything joined so far, which reaches past this piece's own samples only into the silence
    before it (zeros) or, for the first piece, not at all: the same samples either way."""
    x = np.array(wave, dtype=np.float32)
    n = min(int(JOIN_SECONDS * rate) // 3, len(x))
    if n > 0:
        x[len(x) - n:] *= _ramp(n, rising=False)
    return x


def level(wave: np.ndarray, reference_rms: float | None) -> np.ndarray:
    """To a quiet reference's level, or (no reference) the peak to 0.5."""
    if reference_rms is not None:
        return wave * reference_rms / RMS_FLOOR if reference_rms < RMS_FLOOR else wave
    peak = np.abs(wave).max() if len(wave) else 0.0
    return wave / peak * PEAK_TARGET if peak > 1e-6 else wave


def fade_and_pad(wave: np.ndarray, fade_seconds: float, pad_seconds: float, rate: int = SAMPLE_RATE, *,
                 start: bool = True, end: bool = True) -> np.ndarray:
    """Linear fades of fade_seconds (at most half the clip) and pad_seconds of silence, at the
    start and/or end."""
    if len(wave) == 0:
        return wave
    x = np.array(wave, dtype=np.float32)
    k = min(int(fade_seconds * rate), len(x) // 2)
    if k > 0:
        if start:
            x[:k] *= _ramp(k, rising=True)
        if end:
            x[len(x) - k:] *= _ramp(k, rising=False)
    pad = np.zeros(max(0, int(pad_seconds * rate)), np.float32)
    return np.concatenate([pad if start else pad[:0], x, pad if end else pad[:0]])


def finish_piece(wave: np.ndarray, *, postprocess: bool, reference_rms: float | None, fade_seconds: float,
                 pad_seconds: float, continues: bool = False, continued: bool = False,
                 rate: int = SAMPLE_RATE) -> np.ndarray:
    """A decoded clip (or one piece of a long text) -> the float32 audio to send."""
    x = np.asarray(wave, dtype=np.float32)
    if continues:
        x = join_in(x, rate)
    if continued:
        x = join_out(x, rate)
    if postprocess:
        internal, lead, trail = OUTPUT_SILENCE_MS
        trimmed = trim_silence(x, rate, internal, lead, trail, trim_lead=not continues, trim_trail=not continued)
        if len(trimmed):  # all silence: keep it rather than send nothing
            x = trimmed
    x = level(x, reference_rms)
    return fade_and_pad(x, fade_seconds, pad_seconds, rate, start=not continues, end=not continued)


def join_pieces(pieces: list[np.ndarray], rate: int = SAMPLE_RATE) -> np.ndarray:
    """Decoded pieces joined as finish_piece joins them, without the rest of its processing."""
    last = len(pieces) - 1
    return np.concatenate([finish_piece(p, postprocess=False, reference_rms=1.0, fade_seconds=0, pad_seconds=0,
                                        continues=i > 0, continued=i < last, rate=rate)
                           for i, p in enumerate(pieces)]) if pieces else np.zeros(0, np.float32)


# ---- reference ----------------------------------------------------------------------------------

def prepare_reference(wav: np.ndarray, rate: int, *, has_transcript: bool = True) -> tuple[np.ndarray, float]:
    """A decoded reference [C, N] at `rate` -> (mono float32 24 kHz samples, a whole number of codec
    frames; its RMS before levelling). ValueError naming the audio when nothing usable is left."""
    x = np.asarray(wav, dtype=np.float32)
    if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"reference audio: expected [channels, samples], got shape {list(x.shape)}")
    x = x.mean(axis=0, keepdims=True) if x.shape[0] > 1 else x
    x = resample(x, rate, SAMPLE_RATE)  # [1, M]
    rms = float(np.sqrt(np.mean(x ** 2)))
    if 0 < rms < RMS_FLOOR:
        x = x * RMS_FLOOR / rms
    wave = x[0]
    if not has_transcript:  # the transcript is made from the audio: a long one is cut first
        wave = cut_long_reference(wave, SAMPLE_RATE)
    wave = trim_silence(wave, SAMPLE_RATE, *REFERENCE_SILENCE_MS)
    if len(wave) == 0:
        raise ValueError("reference audio: nothing is left after trimming silence (all of it is below "
                         f"{SILENCE_DBFS:g} dBFS); send audio with speech in it")
    frames = len(wave) // SAMPLES_PER_FRAME
    if frames == 0:
        raise ValueError(f"reference audio: {len(wave)} samples of sound after trimming silence is shorter than "
                         f"one codec frame ({SAMPLES_PER_FRAME} samples at {SAMPLE_RATE} Hz)")
    return np.ascontiguousarray(wave[:frames * SAMPLES_PER_FRAME]), rms
