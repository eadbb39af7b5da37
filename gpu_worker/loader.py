"""Build a MossTTSLocal from a preset (random weights) or a Hugging Face
checkpoint directory (safetensors, single or sharded, upstream names; spec
moss_tts_local.md §2).

Loading policy
--------------
* Files: ``model.safetensors``, or every shard named in the ``weight_map`` of
  ``model.safetensors.index.json`` (each tensor must sit in the shard the index
  names). The on-disk dtype (fp16 in test checkpoints, bf16 for the release)
  is cast to the compute dtype on copy.
* Names are upstream's (``transformer.*``, ``local_transformer.*``,
  ``audio_embeddings.{k}``, ``local_text_lm_head``). ``c_attn``/``c_proj`` are
  plain Linear ``[out, in]``: never transposed.
* Before anything is allocated on the device, the safetensors headers are
  checked against the model: every missing, unexpected or mis-shaped tensor is
  reported by name in one error (``fc_in`` rows are checked against the
  config's ``n_inner``, with a hint when n_inner was left to default).
* ``*rotary_emb.inv_freq`` (non-persistent upstream) is skipped.
* Tied duplicates ``text_lm_head.weight`` and ``audio_lm_heads.{k}.weight`` may
  be present or absent. They are never loaded: the heads are always taken
  from the embeddings, as upstream ties them. ``text_lm_head`` is unused in
  binary mode and is not even read; each present ``audio_lm_heads.{k}`` is
  compared with ``audio_embeddings.{k}`` after the load (in the compute dtype)
  and a mismatch is logged as a warning naming the tensor (upstream would
  also ignore the file's head), not an error.
* Streamed: the model is built on the meta device and materialised empty on
  the target device in the target dtype; tensors are then read one at a time
  from the safetensors files and copied into place, so the host never holds a
  second full copy of the weights.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from chorus.moss_config import PRESETS, MossTTSLocalConfig
from gpu_worker.model import MossTTSLocal, fuse_projections, init_random_weights, precompute_code_qkv

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp64": "float64", "double": "float64",
                  "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
LOAD_FORMATS = ("auto", "safetensors", "dummy")

_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_TEXT_HEAD = "text_lm_head.weight"
_AUDIO_HEAD = re.compile(r"^audio_lm_heads\.(\d+)\.weight$")


class CheckpointError(ValueError):
    pass


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    key = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[key]


def _shard_map(model_dir: Path) -> dict[Path, set[str] | None]:
    """Shard file → the tensor names the index puts there (None: single file, no index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({e})") from e
        shards: dict[Path, set[str] | None] = {}
        for name, file in weight_map.items():
            shards.setdefault(model_dir / file, set()).add(name)
        absent = sorted(str(p.name) for p in shards if not p.is_file())
        if absent:
            raise CheckpointError(f"{index} lists shard file(s) that are not in {model_dir}: {absent}")
        return dict(sorted(shards.items()))
    single = model_dir / "model.safetensors"
    if single.is_file():
        return {single: None}
    raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def _shard_files(model_dir: Path) -> list[Path]:
    return list(_shard_map(model_dir))


def _classify(name: str, n_vq: int) -> str:
    if _IGNORED.search(name):
        return "ignored"
    if name == _TEXT_HEAD:
        return "tied"
    m = _AUDIO_HEAD.match(name)
    if m and int(m.group(1)) < n_vq:
        return "tied"
    return "weight"


def _fmt(names: list[str], limit: int = 20) -> str:
    return ", ".join(names[:limit]) + (f" ... ({len(names)} in all)" if len(names) > limit else "")


def check_checkpoint(cfg: MossTTSLocalConfig, model_dir: str | Path) -> dict[str, Path]:
    """Read only the safetensors headers and compare them with the model `cfg`
    describes. Returns name → shard for every tensor to load (tied duplicates
    under their own names too). Raises CheckpointError naming every missing,
    unexpected or mis-shaped tensor."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    with torch.device("meta"):
        expected = {n: tuple(t.shape) for n, t in MossTTSLocal(cfg).state_dict().items()}
    where: dict[str, Path] = {}
    unexpected, misplaced, bad_shape = [], [], []
    for shard, listed in _shard_map(model_dir).items():
        with safe_open(str(shard), framework="pt") as f:
            names = list(f.keys())
            if listed is not None:
                misplaced += [f"{n} (index: {shard.name}, absent there)" for n in sorted(listed - set(names))]
            for name in names:
                kind = _classify(name, cfg.n_vq)
                if kind == "ignored":
                    continue
                if name in where:
                    raise CheckpointError(f"tensor {name} appears in both {where[name].name} and {shard.name}")
                where[name] = shard
                if kind == "tied":
                    continue
                if name not in expected:
                    unexpected.append(name)
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[name]:
                    hint = ""
                    if name.endswith("mlp.fc_in.weight") and shape[1:] == expected[name][1:]:
                        hint = (f" (gpt2_config n_inner is {cfg.local.n_inner}, 4*n_embd when unset; "
                                f"the checkpoint's fc_in has {shape[0]} rows)")
                    elif shape == expected[name][::-1] and len(shape) == 2:
                        hint = " (transposed: HF-GPT2 Conv1D layout? upstream c_attn/c_proj are Linear [out, in])"
                    bad_shape.append(f"{name}: checkpoint {shape}, model expects {expected[name]}{hint}")
    missing = sorted(set(expected) - set(where))
    problems = []
    if missing:
        problems.append(f"missing tensors: {_fmt(missing)}")
    if unexpected:
        hint = ""
        if any(n.startswith("model.") for n in unexpected):
            hint = " (names under 'model.' look like an sglang-omni export; upstream uses 'transformer.')"
        elif "local_transformer.wpe.weight" in unexpected:
            hint = " (a wpe table means position_embedding_type 'absolute', but the config says 'rope')"
        problems.append(f"unexpected tensors: {_fmt(sorted(unexpected))}{hint}")
    if misplaced:
        problems.append(f"tensors the index maps to the wrong shard: {_fmt(misplaced)}")
    if bad_shape:
        problems.append("shape mismatches: " + "; ".join(bad_shape[:20]))
    if problems:
        raise CheckpointError(f"checkpoint {model_dir} does not match its config.json: " + " | ".join(problems))
    return where


def load_checkpoint(model: MossTTSLocal, model_dir: str | Path) -> None:
    """Copy tensors by name into an allocated model, one tensor at a time (no
    second full copy in host RAM), casting to the model's dtype. Fails naming
    missing/unexpected/mis-shaped tensors before copying anything."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    where = check_checkpoint(model.cfg, model_dir)
    params = model.state_dict(keep_vars=True)
    by_shard: dict[Path, list[str]] = {}
    for name, shard in where.items():
        by_shard.setdefault(shard, []).append(name)
    heads: list[tuple[str, Path]] = []
    with torch.no_grad():
        for shard, names in by_shard.items():
            with safe_open(str(shard), framework="pt") as f:
                for name in names:
                    if _classify(name, model.cfg.n_vq) == "tied":
                        if name != _TEXT_HEAD:
                            heads.append((name, shard))
                        continue
                    params[name].copy_(f.get_tensor(name))
        for name, shard in heads:  # tied duplicates: compare, never load
            k = int(_AUDIO_HEAD.match(name).group(1))
            table = model.audio_embeddings[k].weight
            with safe_open(str(shard), framework="pt") as f:
                head = f.get_tensor(name)
            if tuple(head.shape) != tuple(table.shape) or not torch.equal(head.to(table), table):
                log.warning("checkpoint tensor %s differs from audio_embeddings.%d.weight; the head is taken "
                            "from the embedding (upstream ties them)", name, k)


def build_model(*, model_dir: str | None = None, preset: str = "tiny", load_format: str = "auto",
                dtype: str = "float32", device: str = "cpu", seed: int = 0) -> MossTTSLocal:
    """`model_dir` wins over `preset`; load_format 'dummy' gives random weights at the
    checkpoint's (or preset's) real size without reading any weight file. The model
    is built on the meta device and materialised once, on `device`, in `dtype`."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose one of {list(LOAD_FORMATS)}")
    if model_dir:
        cfg = MossTTSLocalConfig.from_pretrained(model_dir)
    else:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        cfg = PRESETS[preset]()
    torch_dtype = resolve_dtype(dtype)
    if model_dir and load_format != "dummy":
        check_checkpoint(cfg, model_dir)  # fail on headers before allocating the device memory
    with torch.device("meta"):
        model = MossTTSLocal(cfg)
    model = model.to(dtype=torch_dtype).to_empty(device=torch.device(device))
    if model_dir and load_format != "dummy":
        load_checkpoint(model, Path(model_dir))
    else:
        init_random_weights(model, seed)
    fuse_projections(model)
    precompute_code_qkv(model)
    return model.eval()
