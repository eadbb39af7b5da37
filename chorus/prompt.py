"""MOSS-TTS Local v1.5 prompt rows (spec moss_tts_local.md §5).

A prompt is an int32 array [T, 1 + n_vq]: column 0 a text id, columns 1..n_vq
audio codes (the pad code on text rows). Every literal piece is tokenized on
its own and the id lists are concatenated (§5.1); never the joined string.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from chorus.moss_config import MossTTSLocalConfig
from chorus.tokenizer import TextTokenizer

__all__ = [
    "build_prompt_rows",
    "normalize_field",
    "estimate_duration_frames",
    "duration_frame_bounds",
    "clamp_duration_frames",
    "DURATION_RATES",
]

# §5.1 literal pieces.
PIECE_USER = "user\n"                                   # B
PIECE_INST_OPEN = "<user_inst>\n- Reference(s):\n"      # C
PIECE_NO_REFERENCE = "None"                             # D0
PIECE_INST_CLOSE = "\n</user_inst>"                     # G
PIECE_NEWLINE = "\n"                                    # J
PIECE_ASSISTANT = "assistant\n"                         # M


def normalize_field(value: Any) -> str:
    """§5.1 field value: None -> "None"; else str(value).strip(), "None" if blank."""
    if value is None:
        return "None"
    s = str(value).strip()
    return s if s else "None"


def _piece_e(*, instruction: Any, tokens: Any, quality: Any, sound_event: Any, ambient_sound: Any,
             language: Any) -> str:
    lang = normalize_field(language)
    if lang.lower() == "auto":  # the app's "Auto" choice omits the language
        lang = "None"
    return ("\n- Instruction:\n" + normalize_field(instruction)
            + "\n- Tokens:\n" + normalize_field(tokens)
            + "\n- Quality:\n" + normalize_field(quality)
            + "\n- Sound Event:\n" + normalize_field(sound_event)
            + "\n- Ambient Sound:\n" + normalize_field(ambient_sound)
            + "\n- Language:\n" + lang
            + "\n- Text:\n")


def _check_codes(cfg: MossTTSLocalConfig, codes: Any, what: str) -> np.ndarray:
    n_vq, vocab = cfg.n_vq, cfg.audio_vocab_size
    arr = np.asarray(codes)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must be an integer array of codec codes [frames, {n_vq}], got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise ValueError(f"{what} must be 2-D [frames, {n_vq}], got shape {tuple(arr.shape)}")
    if arr.shape[1] != n_vq:
        hint = (f"; it looks like [{n_vq}, frames], transpose it" if arr.shape[0] == n_vq
                else f"; encode the audio with {n_vq} quantizers")
        raise ValueError(f"{what} must have shape [frames, {n_vq}], got {tuple(arr.shape)}{hint}")
    if arr.shape[0] == 0:
        raise ValueError(f"{what} has no frames; pass at least one frame of codes or leave it out")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab):
        bad = arr[(arr < 0) | (arr >= vocab)]
        raise ValueError(f"{what} has codes outside [0, {vocab}) (e.g. {int(bad.flat[0])}); codes must be real "
                         f"codec codes, without the pad code {cfg.audio_pad_code}")
    return arr.astype(np.int32, copy=False)


def build_prompt_rows(
    cfg: MossTTSLocalConfig,
    tokenizer: TextTokenizer,
    text: str | None,
    *,
    language: str | None = None,
    instruction: str | None = None,
    tokens: int | str | None = None,
    quality: str | None = None,
    sound_event: str | None = None,
    ambient_sound: str | None = None,
    references: Sequence[np.ndarray] = (),
    continuation: np.ndarray | None = None,
    continuation_transcript: str | None = None,
) -> np.ndarray:
    """Prompt rows int32 [T, 1 + n_vq] for plain TTS, voice clone (one or more
    ``references``, each [Tr, n_vq]) or continuation (one ``continuation``
    array [Tp, n_vq] whose transcript is prepended to ``text``). Raises
    ValueError on inputs that cannot form a valid prompt."""
    if isinstance(references, np.ndarray):  # a single [Tr, n_vq] array passed bare
        raise ValueError("references must be a sequence of [frames, n_vq] arrays; wrap a single one in a list")
    refs = [_check_codes(cfg, r, f"references[{i}]") for i, r in enumerate(references)]
    cont = None if continuation is None else _check_codes(cfg, continuation, "continuation")
    if cont is not None and refs:
        raise ValueError("use either references (voice clone) or continuation, not both")
    if continuation_transcript is not None and cont is None:
        raise ValueError("continuation_transcript was given without continuation audio codes")
    if tokens is not None and not isinstance(tokens, str):
        if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)):
            raise ValueError(f"tokens must be a positive integer frame count, got {tokens!r}")
        if tokens <= 0:
            raise ValueError(f"tokens must be a positive frame count (12.5 frames per second), got {tokens}")

    width = cfg.row_width
    pad = cfg.audio_pad_code
    blocks: list[np.ndarray] = []
    text_ids: list[int] = []

    def flush() -> None:
        if text_ids:
            rows = np.full((len(text_ids), width), pad, dtype=np.int32)
            rows[:, 0] = text_ids
            blocks.append(rows)
            text_ids.clear()

    def piece(s: str) -> None:
        text_ids.extend(tokenizer.encode(s))

    def code_rows(text_id: int, codes: np.ndarray) -> None:
        flush()
        rows = np.empty((codes.shape[0], width), dtype=np.int32)
        rows[:, 0] = text_id
        rows[:, 1:] = codes
        blocks.append(rows)

    text_ids.append(cfg.im_start_token_id)                    # A
    piece(PIECE_USER)                                         # B
    piece(PIECE_INST_OPEN)                                    # C
    if refs:
        for r in refs:                                        # no separator between references
            text_ids.append(cfg.audio_start_token_id)
            code_rows(cfg.audio_user_slot_token_id, r)
            text_ids.append(cfg.audio_end_token_id)
    else:
        piece(PIECE_NO_REFERENCE)                             # D0
    piece(_piece_e(instruction=instruction, tokens=tokens, quality=quality, sound_event=sound_event,
                   ambient_sound=ambient_sound, language=language))  # E
    target = "" if text is None else text                     # F: as-is, not stripped
    if cont is not None:
        target = (continuation_transcript or "") + target
    piece(target)
    piece(PIECE_INST_CLOSE)                                   # G
    text_ids.append(cfg.im_end_token_id)                      # H
    piece(PIECE_NEWLINE)                                      # J
    text_ids.append(cfg.im_start_token_id)                    # K'
    piece(PIECE_ASSISTANT)                                    # M
    text_ids.append(cfg.audio_start_token_id)                 # N
    if cont is not None:
        code_rows(cfg.audio_assistant_slot_token_id, cont)
    flush()
    return np.concatenate(blocks, axis=0)


# ---- duration control (§5.3) ------------------------------------------------
DURATION_RATES = {
    "zh": 3.098411951313033,
    "en": 0.8673376262755219,
    "fr": 0.9,
    "ja": 2.2,
    "ko": 1.8,
}
_LANGUAGE_ALIASES = {
    "zh": "zh", "chinese": "zh", "mandarin": "zh", "zh-cn": "zh", "zh-tw": "zh",
    "en": "en", "english": "en",
    "fr": "fr", "french": "fr",
    "ja": "ja", "japanese": "ja", "jp": "ja",
    "ko": "ko", "korean": "ko", "kr": "ko",
}


def _has_cjk(text: str) -> bool:
    return any("\u3400" <= ch <= "\u9fff" for ch in text)


def _rate(text: str, language: str | None) -> float:
    code = _LANGUAGE_ALIASES.get((language or "").strip().lower())
    if code is None:  # no tag, "Auto", or a language without a rate: detect
        code = "zh" if _has_cjk(text) else "en"
    return DURATION_RATES[code]


def estimate_duration_frames(text: str, language: str | None = None) -> int:
    """The app's frame-count estimate: max(1, round(len(text) * rate))."""
    return max(1, round(len(text) * _rate(text, language)))


def duration_frame_bounds(text: str, language: str | None = None) -> tuple[int, int]:
    """[lo, hi] frame counts within 0.5x .. 1.5x of the estimate (lo >= 1)."""
    est = estimate_duration_frames(text, language)
    lo = max(1, math.ceil(0.5 * est))
    hi = max(lo, math.floor(1.5 * est))
    return lo, hi


def clamp_duration_frames(tokens: int, text: str, language: str | None = None) -> int:
    """Limit a requested frame count to 0.5x .. 1.5x of the estimate, as the app's UI does."""
    lo, hi = duration_frame_bounds(text, language)
    return min(max(int(tokens), lo), hi)
