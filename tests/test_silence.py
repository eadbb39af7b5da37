"""vocoder_svc/silence.py against pydub itself: the same silences, sounds and trimmed samples, on clips
built to sit on the thresholds (runs at RMS 103 and 104 around -50 dBFS's 103.6), at lengths that
are not whole milliseconds, and at rates whose samples per millisecond are not whole."""

import warnings

import numpy as np
import pytest

from vocoder_svc import omnivoice_audio, silence

with warnings.catch_warnings():  # pydub looks for ffmpeg on import and imports the deprecated audioop
    warnings.simplefilter("ignore")
    pydub = pytest.importorskip("pydub")
    from pydub import silence as pydub_silence

RATES = (24000, 16000, 22050, 44100)


def _segment(samples: np.ndarray, rate: int):
    return pydub.AudioSegment(data=samples.astype("<i2").tobytes(), sample_width=2, frame_rate=rate, channels=1)


def _samples(segment) -> np.ndarray:
    return np.frombuffer(segment.raw_data, dtype="<i2")


def _clip(rng: np.random.Generator, rate: int) -> np.ndarray:
    """Loud runs, silent runs (zeros, faint noise, constant 103 and 104) of 20-1500 ms, and a length
    off the millisecond grid."""
    parts = []
    for _ in range(rng.integers(2, 9)):
        n = int(rng.integers(20, 1500) * rate / 1000) + int(rng.integers(0, 23))
        kind = rng.integers(0, 5)
        if kind == 0:
            parts.append(rng.normal(0, 3000, n))
        elif kind == 1:
            parts.append(np.zeros(n))
        elif kind == 2:
            parts.append(rng.normal(0, 60, n))
        else:
            level = 103 if kind == 3 else 104
            parts.append(level * np.where(rng.random(n) < 0.5, -1, 1))
    return np.clip(np.concatenate(parts), -32768, 32767).astype(np.int16)


def _trim_silence_pydub(wave, rate, internal_ms, lead_ms, trail_ms, *, trim_lead=True, trim_trail=True):
    """omnivoice_audio.trim_silence as written on pydub."""
    segment = _segment(omnivoice_audio._to_int16(np.asarray(wave, dtype=np.float32)), rate)
    if internal_ms > 0:
        kept = pydub_silence.split_on_silence(segment, min_silence_len=internal_ms, silence_thresh=-50.0,
                                              keep_silence=internal_ms, seek_step=10)
        joined = np.concatenate([_samples(s) for s in kept]) if kept else np.zeros(0, np.int16)
        segment = _segment(joined, rate)
    if trim_lead:
        segment = segment[max(0, pydub_silence.detect_leading_silence(segment, silence_threshold=-50.0) - lead_ms):]
    if trim_trail:
        backwards = segment.reverse()
        cut = max(0, pydub_silence.detect_leading_silence(backwards, silence_threshold=-50.0) - trail_ms)
        segment = backwards[cut:].reverse()
    return omnivoice_audio._to_float(_samples(segment))


@pytest.mark.parametrize("rate", RATES)
def test_silences_and_sounds_equal_pydubs(rate):
    rng = np.random.default_rng(rate)
    for _ in range(12):
        x = _clip(rng, rate)
        ours, theirs = silence.Pcm(x, rate), _segment(x, rate)
        assert len(ours) == len(theirs)
        for min_len, thresh, step in ((500, -50.0, 10), (100, -40, 10), (200, -50.0, 10), (300, -50.0, 7)):
            assert silence.detect_silence(ours, min_len, thresh, step) == \
                pydub_silence.detect_silence(theirs, min_len, thresh, step)
            assert silence.detect_nonsilent(ours, min_len, thresh, step) == \
                pydub_silence.detect_nonsilent(theirs, min_len, thresh, step)
            kept = silence.split_on_silence(ours, min_len, thresh, min_len, step)
            kept_pydub = pydub_silence.split_on_silence(theirs, min_silence_len=min_len, silence_thresh=thresh,
                                                        keep_silence=min_len, seek_step=step)
            assert [k.samples.tolist() for k in kept] == [_samples(k).tolist() for k in kept_pydub]
        for pcm, segment in ((ours, theirs), (ours.reverse(), theirs.reverse())):
            assert silence.detect_leading_silence(pcm, -50.0) == \
                pydub_silence.detect_leading_silence(segment, silence_threshold=-50.0)


@pytest.mark.parametrize("rate", RATES)
def test_trim_silence_equals_the_pydub_version(rate):
    rng = np.random.default_rng(7 + rate)
    for i in range(10):
        wave = _clip(rng, rate).astype(np.float32) / 32768.0
        for internal, lead, trail in (omnivoice_audio.OUTPUT_SILENCE_MS, omnivoice_audio.REFERENCE_SILENCE_MS):
            for edges in ((True, True), (False, True), (True, False)):
                ours = omnivoice_audio.trim_silence(wave, rate, internal, lead, trail, trim_lead=edges[0],
                                                    trim_trail=edges[1])
                theirs = _trim_silence_pydub(wave, rate, internal, lead, trail, trim_lead=edges[0],
                                             trim_trail=edges[1])
                assert np.array_equal(ours, theirs), (rate, i, internal, edges)


def test_edges_all_silence_empty_and_short():
    rate = 24000
    for x in (np.zeros(0, np.int16), np.zeros(13, np.int16), np.zeros(rate, np.int16),
              np.full(rate // 2 + 7, 104, np.int16), np.full(rate // 2 + 7, 103, np.int16)):
        ours, theirs = silence.Pcm(x, rate), _segment(x, rate)
        assert silence.detect_nonsilent(ours, 500, -50.0, 10) == pydub_silence.detect_nonsilent(theirs, 500, -50.0, 10)
        assert silence.detect_leading_silence(ours, -50.0) == \
            pydub_silence.detect_leading_silence(theirs, silence_threshold=-50.0)
        wave = x.astype(np.float32) / 32768.0
        assert np.array_equal(omnivoice_audio.trim_silence(wave, rate, 500, 100, 100),
                              _trim_silence_pydub(wave, rate, 500, 100, 100))
    with pytest.raises(ValueError, match="from the start"):
        silence.Pcm(np.zeros(10, np.int16), rate)[-5:]
