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

import logging
import re
from pathlib import Path

import torch

from chorus.moss_config import PRESETS, MossTTSLocalConfig
from gpu_worker.model import MossTTSLocal, fuse_projections, init_random_weights, precompute_code_qkv
from gpu_worker.safetensors_headers import CheckpointError, read_headers, read_tensors  # noqa: F401 (CheckpointError: re-exported)

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp64": "float64", "double": "float64",
                  "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
LOAD_FORMATS = ("auto", "safetensors", "dummy")

_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_TEXT_HEAD = "text_lm_head.weight"
_AUDIO_HEAD = re.compile(r"^audio_lm_heads\.(\d+)\.weight$")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    key = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[key]


def _classify(name: str, n_vq: int) -> str:
    if _IGNORED.search(name):
        return "ignored"
    if name == _TEXT_HEAD:
        return "tied"
    m = _AUDIO_HEAD.match(name)
    if m and int(m.group(1)) < n_vq:
        return "tied"
    return "weight"


def check_checkpoint(cfg: MossTTSLocalConfig, model_dir: str | Path) -> dict[str, Path]:
    """Read only the safetensors headers and compare them with the model `cfg`
    describes. Returns name → shard for every tensor to load (tied duplicates
    under their own names too). Raises CheckpointError naming every missing,
    unexpected or mis-shaped tensor."""
    with torch.device("meta"):
        expected = {n: tuple(t.shape) for n, t in MossTTSLocal(cfg).state_dict().items()}
    headers = read_headers(model_dir, skip=lambda name: _classify(name, cfg.n_vq) == "ignored")
    for name, shape in headers.shapes.items():
        if _classify(name, cfg.n_vq) == "tied":
            continue
        if name not in expected:
            headers.unexpected.append(name)
        elif shape != expected[name]:
            hint = ""
            if name.endswith("mlp.fc_in.weight") and shape[1:] == expected[name][1:]:
                hint = (f" (gpt2_config n_inner is {cfg.local.n_inner}, 4*n_embd when unset; "
                        f"the checkpoint's fc_in has {shape[0]} rows)")
            elif shape == expected[name][::-1] and len(shape) == 2:
                hint = " (transposed: HF-GPT2 Conv1D layout? upstream c_attn/c_proj are Linear [out, in])"
            headers.bad_shape.append(f"{name}: checkpoint {shape}, model expects {expected[name]}{hint}")
    hint = ""
    if any(n.startswith("model.") for n in headers.unexpected):
        hint = " (names under 'model.' look like an sglang-omni export; upstream uses 'transformer.')"
    elif "local_transformer.wpe.weight" in headers.unexpected:
        hint = " (a wpe table means position_embedding_type 'absolute', but the config says 'rope')"
    return headers.check(set(expected), unexpected_hint=hint)


def load_checkpoint(model: MossTTSLocal, model_dir: str | Path) -> None:
    """Copy tensors by name into an allocated model, one tensor at a time (no
    second full copy in host RAM), casting to the model's dtype. Fails naming
    missing/unexpected/mis-shaped tensors before copying anything."""
    shards = check_checkpoint(model.cfg, Path(model_dir))
    params = model.state_dict(keep_vars=True)
    loaded = {n: s for n, s in shards.items() if _classify(n, model.cfg.n_vq) != "tied"}
    heads = {n: s for n, s in shards.items() if _classify(n, model.cfg.n_vq) == "tied" and n != _TEXT_HEAD}
    with torch.no_grad():
        for name, tensor in read_tensors(loaded):
            params[name].copy_(tensor)
        for name, head in read_tensors(heads):  # tied duplicates: compare, never load
            k = int(_AUDIO_HEAD.match(name).group(1))
            table = model.audio_embeddings[k].weight
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
