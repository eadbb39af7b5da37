"""OmniVoice's output post-processing and reference preprocessing (vocoder_svc/omnivoice_audio.py)
against the `omnivoice` package's own functions, on synthetic audio with silences of many lengths."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from omnivoice_oracle import omnivoice
from vocoder_svc import omnivoice_audio as oa

RATE = 24000


@pytest.fixture(scope="module")
def ov():
    return omnivoice()


def tone(seconds: float, rng, amplitude: float = 0.3) -> np.ndarray:
    n = int(seconds * RATE)
    t = np.arange(n) / RATE
    return (amplitude * np.sin(2 * np.pi * rng.uniform(150, 400) * t) * (0.6 + 0.4 * rng.random())).astype(np.float32)


def hush(seconds: float, rng, level: float = 1e-4) -> np.ndarray:
    """Near-silence: noise well under -50 dBFS."""
    return (rng.standard_normal(int(seconds * RATE)) * level).astype(np.float32)


def speech_like(rng, gaps: list[float], lead: float, trail: float) -> np.ndarray:
    parts = [hush(lead, rng)]
    for gap in gaps:
        parts += [tone(rng.uniform(0.15, 0.6), rng), hush(gap, rng)]
    parts += [tone(0.3, rng), hush(trail, rng)]
    return np.concatenate(parts)


GAPS = [0.05, 0.19, 0.21, 0.3, 0.45, 0.52, 0.8, 1.2, 2.5]


def clips(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = [speech_like(rng, GAPS, lead, trail) for lead, trail in [(0.0, 0.0), (0.05, 0.12), (0.4, 0.7), (1.3, 2.1)]]
    out.append(speech_like(rng, list(rng.permutation(GAPS)), 0.33, 0.07))
    out.append(hush(0.9, rng))  # all silence
    return out


def package_config(ov, **kw):
    from omnivoice.models.omnivoice import OmniVoiceGenerationConfig

    return OmniVoiceGenerationConfig(**kw)


def package_post_process(ov, wave: np.ndarray, ref_rms, postprocess: bool, fade: float = 0.1, pad: float = 0.1):
    from omnivoice.models.omnivoice import OmniVoice

    config = package_config(ov, postprocess_output=postprocess, fade_duration=fade, pad_duration=pad)
    return OmniVoice._post_process_audio(types.SimpleNamespace(sampling_rate=RATE), wave[None], ref_rms, config)[0]


@pytest.mark.parametrize("silences", [oa.OUTPUT_SILENCE_MS, oa.REFERENCE_SILENCE_MS, (300, 100, 300), (0, 100, 100)])
def test_trim_silence_matches_package(ov, silences):
    from omnivoice.utils.audio import remove_silence

    for wave in clips():
        ours = oa.trim_silence(wave, RATE, *silences)
        theirs = remove_silence(wave[None], RATE, *silences)[0]
        assert ours.dtype == np.float32
        assert np.array_equal(ours, theirs), (silences, len(ours), len(theirs))
    assert len(oa.trim_silence(clips()[1], RATE, *silences)) < len(clips()[1])


def test_fade_and_pad_matches_package(ov):
    from omnivoice.utils.audio import fade_and_pad_audio

    rng = np.random.default_rng(1)
    for n in (0, 1, 7, 960, 4799, 4800, 30000):
        wave = tone(n / RATE, rng) if n else np.zeros(0, np.float32)
        for fade, pad in [(0.1, 0.1), (0.0, 0.25), (0.7, 0.0), (0.05, 0.033)]:
            ours = oa.fade_and_pad(wave, oa.seconds(np.float32(fade)), oa.seconds(np.float32(pad)))
            theirs = fade_and_pad_audio(wave[None], pad_duration=pad, fade_duration=fade, sample_rate=RATE)[0]
            assert np.array_equal(ours, theirs), (n, fade, pad)


@pytest.mark.parametrize("ref_rms", [None, 0.03125, 0.0625, 0.25])
@pytest.mark.parametrize("postprocess", [False, True])
def test_whole_clip_matches_package(ov, ref_rms, postprocess):
    """One piece (no join): silence trim, levelling, fades and pads as the package's _post_process_audio."""
    for wave in clips(2):
        ours = oa.finish_piece(wave, postprocess=postprocess, reference_rms=ref_rms, fade_seconds=0.1, pad_seconds=0.1)
        if postprocess and len(oa.trim_silence(wave, RATE, *oa.OUTPUT_SILENCE_MS)) == 0:
            continue  # the package fails on an all-silent clip (peak of nothing); we keep the clip
        theirs = package_post_process(ov, wave, ref_rms, postprocess)
        assert np.array_equal(ours, theirs)


def test_all_silent_clip_is_kept(ov):
    wave = clips()[-1]
    out = oa.finish_piece(wave, postprocess=True, reference_rms=None, fade_seconds=0.1, pad_seconds=0.1)
    assert len(out) == len(wave) + 2 * 2400


def pieces(seed: int, lengths: list[int]) -> list[np.ndarray]:
    """Decoded pieces: whole codec frames of sound with short silences inside."""
    rng = np.random.default_rng(seed)
    out = []
    for frames in lengths:
        n = frames * 960
        wave = np.concatenate([speech_like(rng, [0.1, 0.3], 0.05, 0.05), tone(n / RATE, rng)])[:n]
        out.append(wave.astype(np.float32))
    return out


@pytest.mark.parametrize("lengths", [[30], [30, 1], [1, 40], [50, 2, 3, 60], [25, 25, 25]])
def test_join_matches_cross_fade_chunks(ov, lengths):
    from omnivoice.utils.audio import cross_fade_chunks

    chunk_audios = pieces(3, lengths)
    theirs = cross_fade_chunks([c[None] for c in chunk_audios], RATE)[0]
    assert np.array_equal(oa.join_pieces(chunk_audios), theirs)


@pytest.mark.parametrize("ref_rms", [0.03125, 0.5])
@pytest.mark.parametrize("postprocess", [False, True])
def test_streamed_pieces_equal_the_package_whole(ov, ref_rms, postprocess):
    """With a reference and joins without long silence, the pieces processed one by one and
    concatenated equal the package's decode-all, join, post-process."""
    from omnivoice.utils.audio import cross_fade_chunks

    chunk_audios = pieces(4, [60, 7, 45, 80])
    joined = cross_fade_chunks([c[None] for c in chunk_audios], RATE)[0]
    theirs = package_post_process(ov, joined, ref_rms, postprocess)
    last = len(chunk_audios) - 1
    ours = np.concatenate([
        oa.finish_piece(c, postprocess=postprocess, reference_rms=ref_rms, fade_seconds=0.1, pad_seconds=0.1,
                        continues=i > 0, continued=i < last) for i, c in enumerate(chunk_audios)])
    assert np.array_equal(ours, theirs)


def test_long_silence_at_a_join_is_capped_per_side(ov):
    """The documented difference: 0.8 s of silence ending a piece keeps 0.5 s there; the package,
    seeing the join, keeps it (0.8 s + the join's 0.1 s is under the 1 s cap)."""
    from omnivoice.utils.audio import cross_fade_chunks

    rng = np.random.default_rng(5)
    first = np.concatenate([tone(1.2, rng), np.zeros(int(0.8 * RATE), np.float32)])
    second = tone(1.2, rng)
    theirs = package_post_process(ov, cross_fade_chunks([first[None], second[None]], RATE)[0], 0.5, True)
    ours = [oa.finish_piece(p, postprocess=True, reference_rms=0.5, fade_seconds=0.1, pad_seconds=0.1,
                            continues=i == 1, continued=i == 0) for i, p in enumerate([first, second])]
    assert len(theirs) - sum(map(len, ours)) == int(0.3 * RATE)


# ---- reference ------------------------------------------------------------------------------------

def package_reference(ov, wav: np.ndarray, ref_text):
    """The package's create_voice_clone_prompt on 24 kHz audio (no resampling, so no torchaudio),
    with its codec replaced by one that records the samples it is asked to encode."""
    from omnivoice.models.omnivoice import OmniVoice

    seen = {}

    def encode(x):
        seen["wave"] = x[0, 0].numpy()
        return types.SimpleNamespace(audio_codes=torch.zeros(1, 8, x.shape[-1] // 960, dtype=torch.long))

    codec = types.SimpleNamespace(config=types.SimpleNamespace(hop_length=960), device="cpu", encode=encode)
    fake = types.SimpleNamespace(audio_tokenizer=codec, sampling_rate=RATE, _asr_pipe=object(),
                                 transcribe=lambda audio: "a transcript")
    prompt = OmniVoice.create_voice_clone_prompt(fake, (torch.from_numpy(wav), RATE), ref_text=ref_text)
    return seen["wave"], prompt.ref_rms


@pytest.mark.parametrize("transcript", ["Hello there.", None])
def test_reference_matches_package(ov, transcript):
    rng = np.random.default_rng(6)
    quiet = speech_like(rng, GAPS[:5], 0.3, 0.4) * 0.1
    left = speech_like(rng, GAPS, 0.02, 0.5)
    loud_stereo = np.stack([left, np.roll(left, 7) * 0.8]) * 3
    long = speech_like(rng, [0.3, 0.15, 0.25] * 12, 0.2, 0.2)  # over 20 s: cut at a gap without a transcript
    assert len(long) > 20 * RATE
    levels = []
    for wav in (quiet[None], loud_stereo, long[None]):
        wave, rms = oa.prepare_reference(wav, RATE, has_transcript=transcript is not None)
        levels.append(rms)
        their_wave, their_rms = package_reference(ov, wav, transcript)
        assert rms == their_rms and np.float32(rms) == rms  # survives EncodeResponse.rms (float32)
        assert np.array_equal(wave, their_wave)
        assert len(wave) % 960 == 0
    assert min(levels) < oa.RMS_FLOOR < max(levels)  # both sides of the levelling
    cut, _ = oa.prepare_reference(long[None], RATE, has_transcript=False)
    assert len(cut) <= 15 * RATE


def test_reference_errors_and_resampling():
    with pytest.raises(ValueError, match="nothing is left after trimming silence"):
        oa.prepare_reference(np.zeros((1, RATE), np.float32), RATE)
    with pytest.raises(ValueError, match="shorter than one codec frame"):
        oa.prepare_reference(np.full((1, 500), 0.5, np.float32), RATE)
    rng = np.random.default_rng(7)
    wave, rms = oa.prepare_reference(np.stack([tone(1.0, rng)] * 2)[:, ::3].copy(), 8000)
    assert abs(len(wave) - RATE) <= 960 and len(wave) % 960 == 0 and rms > 0.1
