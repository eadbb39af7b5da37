"""An OmniVoice request as the canvases the worker fills (spec 3): each piece's prompt ids and
target length.

A canvas's prompt is a style segment (denoise flag, language, instruct) then a text segment (the
reference transcript, if any, and the text). Its length comes from the duration estimator, or
from a fixed duration. A text longer than 30 s is generated in pieces of about 15 s, cut at
punctuation: with a reference, every piece clones it; without, piece 0 runs free and every later
piece clones piece 0 (its text and its final canvas), so all prompts are known before any runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from chorus.omnivoice.duration import estimate_frames, frames_for_seconds
from chorus.omnivoice.instruct import InstructError, resolve_instruct
from chorus.omnivoice.knobs import FRAME_RATE
from chorus.omnivoice.languages import resolve_language
from chorus.omnivoice.text import add_end_punctuation, chunk_text, combine_text, split_nonverbal

LONG_FORM_FRAMES = int(30.0 * FRAME_RATE)  # a longer target is generated in pieces
PIECE_SECONDS = 15.0  # the length a piece aims at
MIN_PIECE_CHARS = 3  # a shorter piece is joined to its neighbour


class PromptError(ValueError):
    """A request the prompt cannot be built from; `field` is the public request field at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Piece:
    text: str  # this piece's text (a long text's chunk, or the whole text)
    text_ids: list[int]  # style segment + text segment ids: CanvasStart.text_ids
    target_frames: int  # T (25 Hz frames)
    reference: str  # "none" | "request" (the request's reference codes) | "first_piece" (piece 0's canvas)


def style_text(language_id: str | None, instruct: str | None, denoise: bool) -> str:
    """The style segment's literal; `denoise` only when the canvas clones reference audio."""
    return ("<|denoise|>" if denoise else "") + (
        f"<|lang_start|>{language_id or 'None'}<|lang_end|>"
        f"<|instruct_start|>{instruct or 'None'}<|instruct_end|>")


def text_segment_ids(tokenizer, text: str, reference_text: str | None = None) -> list[int]:
    """The text segment's ids: the combined text between its markers, each non-verbal tag
    tokenized apart from its neighbours."""
    wrapped = f"<|text_start|>{combine_text(text, reference_text)}<|text_end|>"
    return [i for part in split_nonverbal(wrapped) for i in tokenizer.encode(part)]


def prompt_ids(tokenizer, text: str, *, language_id: str | None, instruct: str | None,
               reference_text: str | None, cloning: bool, denoise: bool) -> list[int]:
    """One canvas's prompt ids (style then text segment), without the reference codes."""
    style = tokenizer.encode(style_text(language_id, instruct, denoise and cloning))
    return style + text_segment_ids(tokenizer, text, reference_text if cloning else None)


def plan_pieces(tokenizer, text: str, *, language: str | None = None, instructions: str | None = None,
                has_reference: bool = False, reference_text: str | None = None, reference_frames: int = 0,
                denoise: bool = True, speed: float | None = None, duration_seconds: float | None = None,
                preprocess_prompt: bool = True) -> list[Piece]:
    """The canvases a request generates, in playback order (one unless its target exceeds 30 s).

    reference_text is the reference audio's transcript (may be empty: the codes are still
    cloned); reference_frames its code frames after reference preprocessing. duration_seconds
    fixes the total length (speed is then ignored); speed scales the estimate.
    """
    if not text.strip():
        raise PromptError("text", "is empty; give the words to speak")
    if duration_seconds is not None and not (math.isfinite(duration_seconds) and duration_seconds > 0):
        raise PromptError("duration_seconds", "must be a positive number of seconds")
    if has_reference and reference_frames <= 0:
        raise PromptError("references", "the reference audio has no frames; give at least 40 ms of speech")
    if not has_reference and reference_text:
        raise PromptError("references", "a transcript needs reference audio (or a voice) to go with it")
    language_id = resolve_language(language)
    try:
        instruct = resolve_instruct(instructions, text)
    except InstructError as e:
        raise PromptError("instructions", str(e)) from e

    ref_text = (reference_text or "") if has_reference else None
    if has_reference and preprocess_prompt:
        ref_text = add_end_punctuation(ref_text)
    ref_frames = reference_frames if has_reference else None

    # A fixed duration sets T; the ratio to the estimate then scales every piece alike.
    if duration_seconds is not None:
        estimate = estimate_frames(text, ref_text, ref_frames)
        target = frames_for_seconds(duration_seconds)
        speed = estimate / target
    else:
        speed = 1.0 if speed is None else speed
        target = estimate_frames(text, ref_text, ref_frames, speed)

    def piece(chunk: str, frames: int, chunk_ref_text: str | None, reference: str) -> Piece:
        ids = prompt_ids(tokenizer, chunk, language_id=language_id, instruct=instruct,
                         reference_text=chunk_ref_text, cloning=reference != "none", denoise=denoise)
        return Piece(chunk, ids, frames, reference)

    if target <= LONG_FORM_FRAMES:
        return [piece(text, target, ref_text, "request" if has_reference else "none")]

    chunks = chunk_text(text, int(PIECE_SECONDS * FRAME_RATE / (target / len(text))), MIN_PIECE_CHARS)
    if has_reference:
        return [piece(c, estimate_frames(c, ref_text, ref_frames, speed), ref_text, "request") for c in chunks]
    first = piece(chunks[0], estimate_frames(chunks[0], None, None, speed), None, "none")
    return [first] + [
        piece(c, estimate_frames(c, first.text, first.target_frames, speed), first.text, "first_piece")
        for c in chunks[1:]]
