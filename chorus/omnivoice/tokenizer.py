"""OmniVoice's text tokenizer: Qwen's byte-level BPE plus seven special tokens (spec section 1).

The checkpoint's own tokenizer files win when present (chorus.tokenizer reads them); without
them the bundled Qwen BPE stands in, with Qwen3's added tokens and OmniVoice's specials, which
take the ids MOSS-TTS gives its audio delimiters.
"""

from __future__ import annotations

import os

from chorus.tokenizer import QWEN3_ADDED_TOKENS, QwenBPETextTokenizer, TextTokenizer, load_tokenizer

SPECIAL_TOKENS: dict[str, int] = {
    "<|denoise|>": 151669,
    "<|lang_start|>": 151670,
    "<|lang_end|>": 151671,
    "<|instruct_start|>": 151672,
    "<|instruct_end|>": 151673,
    "<|text_start|>": 151674,
    "<|text_end|>": 151675,
}

ADDED_TOKENS: dict[str, int] = {
    **{name: i for name, i in QWEN3_ADDED_TOKENS.items() if i < min(SPECIAL_TOKENS.values())},
    **SPECIAL_TOKENS,
}


def load_omnivoice_tokenizer(model_dir: str | os.PathLike | None) -> TextTokenizer:
    """The checkpoint's tokenizer when model_dir holds tokenizer files, else the bundled BPE."""
    if model_dir is not None:
        tok = load_tokenizer(model_dir)
        if not isinstance(tok, QwenBPETextTokenizer):
            return tok
    return QwenBPETextTokenizer(ADDED_TOKENS)
