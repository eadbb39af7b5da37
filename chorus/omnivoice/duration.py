"""How many 25 Hz frames a text needs (spec 3.4): the reference's rule-based estimator.

Every character has a speaking weight (a Latin letter is 1.0); a reference transcript and its
frame count give a speaking rate, and the target text's weight over that rate is its length.
Short estimates are stretched on a cube-root curve, since short utterances are spoken slower.
The arithmetic keeps the reference's operation order so that the floors agree to the frame.
"""

from __future__ import annotations

import bisect
import unicodedata
from functools import lru_cache

from chorus.omnivoice.knobs import FRAME_RATE

# Without a reference transcript the rate is that of this phrase spoken in one second.
DEFAULT_REFERENCE_TEXT = "Nice to meet you."
DEFAULT_REFERENCE_FRAMES = 25

SHORT_FRAMES = 50.0  # estimates below this are stretched ...
SHORT_CURVE = 1.0 / 3  # ... to SHORT_FRAMES * (est / SHORT_FRAMES) ** SHORT_CURVE

# Weights by Unicode block, for letters the category rules do not settle: (last code point of a
# run of blocks, weight), ascending. Facts of omnivoice 0.2.1 utils/duration.py, with adjacent
# blocks of equal weight joined.
_BLOCK_WEIGHTS: tuple[tuple[int, float], ...] = (
    (0x058F, 1.0),  # Latin, IPA, Greek, Cyrillic, Armenian
    (0x08FF, 1.5),  # Hebrew, Arabic, Syriac
    (0x0DFF, 1.8),  # Devanagari ... Sinhala
    (0x0EFF, 1.5),  # Thai, Lao
    (0x109F, 1.8),  # Tibetan, Myanmar
    (0x10FF, 1.0),  # Georgian
    (0x11FF, 2.5),  # Hangul Jamo
    (0x139F, 3.0),  # Ethiopic
    (0x177F, 1.0),  # Cherokee, Canadian syllabics, Ogham, Runic, Philippine scripts
    (0x17FF, 1.8),  # Khmer
    (0x18FF, 1.0),  # Mongolian, Canadian syllabics extended
    (0x1C7F, 1.8),  # Limbu ... Ol Chiki
    (0x1CBF, 1.0),  # Cyrillic extended-C, Georgian extended
    (0x1CFF, 1.8),  # Sundanese supplement, Vedic
    (0x1EFF, 1.0),  # phonetic extensions, combining supplement, Latin extended additional
    (0x30FF, 2.2),  # Greek extended through Katakana (the reference counts all of it as kana)
    (0x312F, 3.0),  # Bopomofo
    (0x318F, 2.5),  # Hangul compatibility Jamo
    (0xA4CF, 3.0),  # CJK ideographs and their kin, Yi
    (0xA7FF, 1.0),  # Lisu, Vai, Cyrillic extended-B, Bamum, Latin extended-D
    (0xA82F, 1.8),  # Syloti Nagri
    (0xA87F, 1.0),  # Phags-pa
    (0xA95F, 1.8),  # Saurashtra, Devanagari extended, Kayah Li, Rejang
    (0xA97F, 2.5),  # Hangul Jamo extended-A
    (0xAAFF, 1.8),  # Javanese, Myanmar extended, Cham, Tai Viet, Meetei Mayek extensions
    (0xAB2F, 3.0),  # Ethiopic extended-A
    (0xABBF, 1.0),  # Latin extended-E, Cherokee supplement
    (0xABFF, 1.8),  # Meetei Mayek
    (0xD7AF, 2.5),  # Hangul syllables
    (0xFAFF, 3.0),  # Hangul Jamo extended-B, surrogates, private use, CJK compatibility
    (0xFDFF, 1.5),  # alphabetic and Arabic presentation forms
    (0xFE6F, 1.0),  # variation selectors, vertical and small forms
    (0xFEFF, 1.5),  # Arabic presentation forms-B
    (0xFFEF, 1.0),  # half- and fullwidth forms
)
_BLOCK_ENDS = [end for end, _ in _BLOCK_WEIGHTS]
_BEYOND_BMP_IDEOGRAPHS = 0x20000  # above this, the supplementary ideograph planes: weight 3.0


@lru_cache(maxsize=8192)
def char_weight(ch: str) -> float:
    """One character's speaking weight, relative to a Latin letter."""
    code = ord(ch)
    if ("A" <= ch <= "Z") or ("a" <= ch <= "z"):
        return 1.0
    if code == 0x20:
        return 0.2
    if code == 0x0640:  # Arabic tatweel only stretches a letter
        return 0.0
    major = unicodedata.category(ch)[0]
    if major == "M":
        return 0.0
    if major in "PS":
        return 0.5
    if major == "Z":
        return 0.2
    if major == "N":
        return 3.5
    block = bisect.bisect_left(_BLOCK_ENDS, code)
    if block < len(_BLOCK_WEIGHTS):
        return _BLOCK_WEIGHTS[block][1]
    return 3.0 if code > _BEYOND_BMP_IDEOGRAPHS else 1.0


def text_weight(text: str) -> float:
    """The summed weight of a text, added in character order."""
    return sum(char_weight(ch) for ch in text)


def estimate_length(text: str, reference_text: str, reference_frames: float) -> float:
    """Frames `text` takes when `reference_text` took `reference_frames` (0.0 if the
    reference carries no weight or no frames), before any speed change."""
    if reference_frames <= 0 or not reference_text:
        return 0.0
    reference_weight = text_weight(reference_text)
    if reference_weight == 0:
        return 0.0
    rate = reference_weight / reference_frames
    frames = text_weight(text) / rate
    if frames < SHORT_FRAMES:
        return SHORT_FRAMES * (frames / SHORT_FRAMES) ** SHORT_CURVE
    return frames


def estimate_frames(text: str, reference_text: str | None = None, reference_frames: int | None = None,
                    speed: float = 1.0) -> int:
    """The target length T in frames (at least 1). Without reference frames or with an empty
    transcript the default phrase sets the rate; speed > 1 shortens, < 1 lengthens."""
    if reference_frames is None or not reference_text:
        reference_text, reference_frames = DEFAULT_REFERENCE_TEXT, DEFAULT_REFERENCE_FRAMES
    frames = estimate_length(text, reference_text, reference_frames)
    if speed > 0 and speed != 1.0:
        frames = frames / speed
    return max(1, int(frames))


def frames_for_seconds(seconds: float) -> int:
    """The target length a fixed duration asks for (floored, at least 1 frame)."""
    return max(1, int(seconds * FRAME_RATE))
