"""The `omnivoice` package (0.2.1) as a test oracle.

The package is installed without its dependencies (the test command does `pip install --no-deps
omnivoice==0.2.1`): it declares gradio, librosa and torchaudio, and PyPI's torchaudio is a CUDA
build that cannot load beside the CPU torch. Its model code calls torchaudio only to resample
reference audio files, which these tests never hand it, so a stand-in module that refuses to be
used is installed when the real one does not import.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest


def _stand_in_torchaudio() -> None:
    try:
        import torchaudio  # noqa: F401
        return
    except Exception:  # noqa: BLE001 - any failure to load: the stand-in
        sys.modules.pop("torchaudio", None)

    def refuse(*_a, **_k):
        raise RuntimeError("torchaudio is not available in the test environment")

    module = types.ModuleType("torchaudio")
    module.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
    module.functional = types.SimpleNamespace(resample=refuse)
    module.load = refuse
    sys.modules["torchaudio"] = module


def omnivoice():
    """The package's `omnivoice` module, or a skip when it is not installed."""
    pytest.importorskip("pydub")
    _stand_in_torchaudio()
    return pytest.importorskip("omnivoice")


class PackageTokenizer:
    """Our tokenizer in the calling convention the package uses on a Hugging Face tokenizer
    (`tok(text, add_special_tokens=False).input_ids`, `return_tensors="pt"`), so the package's
    prompt code runs over exactly the ids ours sees."""

    def __init__(self, tokenizer=None):
        from chorus.omnivoice.tokenizer import load_omnivoice_tokenizer

        self.tokenizer = tokenizer or load_omnivoice_tokenizer(None)

    def __call__(self, text, add_special_tokens=True, return_tensors=None):
        import torch

        ids = self.tokenizer.encode(text)
        return types.SimpleNamespace(input_ids=torch.tensor([ids]) if return_tensors == "pt" else ids)
