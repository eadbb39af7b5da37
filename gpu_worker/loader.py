"""Build a MossTTSLocal from a preset (random weights) or a Hugging Face
checkpoint directory (safetensors, single or sharded, upstream names)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from chorus.moss_config import PRESETS, MossTTSLocalConfig
from gpu_worker.model import MossTTSLocal, init_random_weights

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}

# Tied duplicates (heads = embeddings) and non-persistent buffers some exports carry.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_TIED_PREFIXES = ("text_lm_head.", "audio_lm_heads.")


class CheckpointError(ValueError):
    pass


def _shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def load_checkpoint(model: MossTTSLocal, model_dir: Path) -> None:
    """Copy tensors by name into an allocated model, one tensor at a time
    (no second full copy in host RAM). Fails naming missing/unexpected tensors."""
    from safetensors import safe_open

    params = dict(model.state_dict())
    expected = set(params)
    seen, unexpected = set(), []
    for shard in _shard_files(model_dir):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or name.startswith(_TIED_PREFIXES):
                    continue
                if name not in params:
                    unexpected.append(name)
                    continue
                t = f.get_tensor(name)
                if tuple(t.shape) != tuple(params[name].shape):
                    raise CheckpointError(f"{name}: checkpoint shape {tuple(t.shape)}, model expects "
                                          f"{tuple(params[name].shape)}")
                with torch.no_grad():
                    params[name].copy_(t)
                seen.add(name)
    missing = sorted(expected - seen)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {model_dir} does not match the model: missing {missing[:20]}"
                              f"{' ...' if len(missing) > 20 else ''}, unexpected {sorted(unexpected)[:20]}")


def build_model(*, model_dir: str | None = None, preset: str = "tiny", load_format: str = "auto",
                dtype: str = "float32", device: str = "cpu", seed: int = 0) -> MossTTSLocal:
    """`model_dir` wins over `preset`; load_format 'dummy' gives random weights at the
    checkpoint's (or preset's) real size without reading any weights."""
    if model_dir:
        cfg = MossTTSLocalConfig.from_pretrained(model_dir)
    else:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        cfg = PRESETS[preset]()
    torch_dtype = DTYPES[dtype]
    model = MossTTSLocal(cfg)
    if model_dir and load_format != "dummy":
        model = model.to(dtype=torch_dtype, device=device)
        load_checkpoint(model, Path(model_dir))
    else:
        init_random_weights(model, seed)
        model = model.to(dtype=torch_dtype, device=device)
    return model.eval()
