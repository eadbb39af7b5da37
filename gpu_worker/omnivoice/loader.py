"""Build an OmniVoiceModel from a preset (random weights) or the upstream checkpoint layout.

A checkpoint directory holds config.json and model.safetensors (or shards named by
model.safetensors.index.json) with the tensors `llm.*`, `audio_embeddings.weight`,
`audio_heads.weight`, and optionally the `codebook_layer_offsets` buffer (c * audio_vocab_size; it
is recomputed, so a stored copy is only checked). Headers are checked before anything is
allocated: every missing, unexpected or mis-shaped tensor is named in one error. Tensors are then
copied one at a time into a model materialised on the device in the compute dtype (fp16 on a GPU
unless told otherwise, as upstream serves it; fp32 on the CPU). The codec is not part of this
model (vocoder_svc serves it, in fp32).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from chorus.omnivoice.config import PRESETS, OmniVoiceConfig
from gpu_worker.loader import resolve_dtype
from gpu_worker.safetensors_headers import CheckpointError, read_headers, read_tensors
from gpu_worker.model import init_random_weights
from gpu_worker.omnivoice.model import OmniVoiceModel, fuse_projections

LOAD_FORMATS = ("auto", "safetensors", "dummy")
OFFSETS = "codebook_layer_offsets"
_IGNORED = re.compile(r"(^|\.)rotary_emb\.(original_)?inv_freq$")


def expected_shapes(cfg: OmniVoiceConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in OmniVoiceModel(cfg).state_dict().items()}


def check_checkpoint(cfg: OmniVoiceConfig, model_dir: str | Path) -> dict[str, Path]:
    """Compare the safetensors headers with the model cfg describes; name -> shard of every tensor
    to load. Raises CheckpointError naming each missing, unexpected or mis-shaped tensor."""
    expected = expected_shapes(cfg)
    headers = read_headers(model_dir, skip=lambda name: bool(_IGNORED.search(name)))
    for name, shape in headers.shapes.items():
        if name == OFFSETS:
            want = (cfg.num_codebooks,)
        elif name in expected:
            want = expected[name]
        else:
            headers.unexpected.append(name)
            continue
        if shape != want:
            headers.bad_shape.append(f"{name}: checkpoint {shape}, config.json implies {want}")
    return headers.check(set(expected))


def load_checkpoint(model: OmniVoiceModel, model_dir: str | Path) -> None:
    """Copy the checkpoint's tensors into an allocated model by name, casting to its dtype."""
    params = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, tensor in read_tensors(check_checkpoint(model.cfg, model_dir)):
            if name == OFFSETS:
                want = torch.arange(model.cfg.num_codebooks) * model.cfg.audio_vocab_size
                if not torch.equal(tensor.to(torch.int64), want):
                    raise CheckpointError(f"checkpoint tensor {OFFSETS} = {tensor.tolist()}: audio rows are "
                                          f"laid out as codebook * {model.cfg.audio_vocab_size}, "
                                          f"i.e. {want.tolist()}")
                continue
            params[name].copy_(tensor)


def default_dtype(device: str) -> str:
    return "float16" if torch.device(device).type == "cuda" else "float32"


def build_omnivoice(*, model_dir: str | Path | None = None, preset: str = "tiny", load_format: str = "auto",
                    dtype: str | None = None, device: str = "cpu", seed: int = 0) -> OmniVoiceModel:
    """`model_dir` wins over `preset`; load_format 'dummy' gives random weights at the checkpoint's
    (or preset's) real size without reading a weight file. dtype None: default_dtype(device)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r}: choose one of {list(LOAD_FORMATS)}")
    if model_dir:
        cfg = OmniVoiceConfig.from_pretrained(model_dir)
    elif preset in PRESETS:
        cfg = PRESETS[preset]()
    else:
        raise ValueError(f"preset {preset!r}: choose one of {sorted(PRESETS)}")
    load = bool(model_dir) and load_format != "dummy"
    if load:
        check_checkpoint(cfg, model_dir)  # before the device memory is allocated
    with torch.device("meta"):
        model = OmniVoiceModel(cfg)
    model = model.to(dtype=resolve_dtype(dtype or default_dtype(device))).to_empty(device=torch.device(device))
    if load:
        load_checkpoint(model, model_dir)
    else:
        init_random_weights(model, seed)
    fuse_projections(model)
    return model.eval()
