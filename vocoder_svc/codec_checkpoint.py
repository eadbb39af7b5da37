"""MOSS-Audio-Tokenizer building and loading: random-weight codecs
(build_codec), the checkpoint's tensor names, reading and strictly loading a
Hugging Face codec directory (single or sharded safetensors, weight norm
folded, v1 aliases resolved) and writing one back (save_codec).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable

import torch
from torch import Tensor, nn

from vocoder_svc.codec import MossAudioTokenizer
from vocoder_svc.codec_config import CodecConfig
from vocoder_svc.codec_ops import fold_weight_norm


# =============================================================================
# Building and loading
# =============================================================================

def _quantizer_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _set_tensor(model: nn.Module, name: str, value: Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    owner._parameters[attr] = nn.Parameter(value, requires_grad=False)


def _skeleton(config: CodecConfig) -> MossAudioTokenizer:
    with torch.device("meta"):
        return MossAudioTokenizer(config)


def _target_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return _quantizer_dtype(dtype) if name.startswith("quantizer.") else dtype


def build_codec(config: CodecConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> MossAudioTokenizer:
    """A codec with random weights, deterministic in (config, seed, device).

    Values are drawn in fp32 then cast, so fp32 and fp64 builds hold the same
    weights. Linear/conv weights ~ N(0, 1/fan_in); LayerScale ~ U(0.1, 1)
    (large enough that mistakes show); LayerNorm ~ 1 + N(0, 0.1^2)."""
    device = torch.device(device)
    model = _skeleton(config)
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    for name, p in model.named_parameters():  # registration order: deterministic
        shape = tuple(p.shape)
        if name.endswith(".scale"):
            value = 0.1 + 0.9 * torch.rand(*shape, generator=gen, device=device)
        elif ".norm" in name:
            value = (1.0 if name.endswith(".weight") else 0.0) + 0.1 * draw(*shape)
        elif name.endswith("codebook.weight"):
            value = draw(*shape)
        elif name.endswith(".bias"):
            value = 0.1 * draw(*shape)
        else:  # Linear [out, in] or conv [out, in, 1]
            value = draw(*shape) / math.sqrt(shape[1])
        _set_tensor(model, name, value.to(_target_dtype(name, dtype)))
    return model.eval()


def checkpoint_names(config: CodecConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape as a released checkpoint stores them (weight norm
    as parametrizations.weight.original0/1). Used for checksums and dummy exports."""
    out: dict[str, tuple[int, ...]] = {}
    for name, p in _skeleton(config).named_parameters():
        shape = tuple(p.shape)
        if name.startswith("quantizer.") and name.endswith(".weight") and len(shape) == 3:
            base = name[:-len(".weight")]
            out[f"{base}.parametrizations.weight.original0"] = (shape[0], 1, 1)
            out[f"{base}.parametrizations.weight.original1"] = shape
        else:
            out[name] = shape
    return out


_V1_ALIASES = ((".self_attn.in_proj_weight", ".self_attn.in_projs.0.weight"),
               (".self_attn.in_proj.weight", ".self_attn.in_projs.0.weight"),
               (".self_attn.out_proj.weight", ".self_attn.out_projs.0.weight"))
_WN_PAIRS = ((".parametrizations.weight.original0", ".parametrizations.weight.original1"),
             (".weight_g", ".weight_v"))


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise ValueError(f"{index} names shard {f.name}, which is missing")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no model.safetensors, no model.safetensors.index.json, no *.safetensors")
    return files


def read_checkpoint(model_dir: str | Path, config: CodecConfig, device: str | torch.device = "cpu"
                    ) -> dict[str, Tensor]:
    """Every tensor of the checkpoint under the in-memory names: weight norm
    folded (original0/1 or weight_g/v), v1 attention aliases resolved."""
    from safetensors import safe_open

    raw: dict[str, Tensor] = {}
    for path in _checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for key in f.keys():
                raw[key] = f.get_tensor(key)
    out: dict[str, Tensor] = {}
    for key, value in raw.items():
        for g_suffix, v_suffix in _WN_PAIRS:
            if key.endswith(g_suffix) or key.endswith(v_suffix):
                is_g = key.endswith(g_suffix)
                base = key[:-len(g_suffix if is_g else v_suffix)]
                partner = base + (v_suffix if is_g else g_suffix)
                if partner not in raw:
                    raise ValueError(f"codec checkpoint {model_dir}: {key} has no partner {partner} "
                                     f"(weight norm needs both g and v)")
                if is_g:
                    out[base + ".weight"] = fold_weight_norm(value, raw[partner])
                break
        else:
            name = key
            if not config.v2:
                for old, new in _V1_ALIASES:
                    if name.endswith(old):
                        name = name[:-len(old)] + new
            out[name] = value
    return out


def _names_list(names: Iterable[str], limit: int = 12) -> str:
    names = sorted(names)
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_codec(model_dir: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> MossAudioTokenizer:
    """Load a Hugging Face codec directory (config.json + safetensors, single or sharded).

    Loading is strict: a missing, unexpected or misshapen tensor is an error
    that names it. The quantizer stays fp32 (fp64 for dtype=float64)."""
    model_dir = Path(model_dir)
    config = CodecConfig.from_pretrained(model_dir)
    model = _skeleton(config)
    tensors = read_checkpoint(model_dir, config, "cpu")
    expected = dict(model.named_parameters())
    missing, unexpected = expected.keys() - tensors.keys(), tensors.keys() - expected.keys()
    naming = "v2" if config.v2 else "v1"
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {_names_list(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s): {_names_list(unexpected)}")
        raise ValueError(f"codec checkpoint {model_dir} does not match its config.json ({naming} naming, chosen "
                         f"by {'presence' if config.v2 else 'absence'} of number_channels): " + "; ".join(parts))
    for name, p in expected.items():
        value = tensors[name]
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"codec checkpoint {model_dir}: {name} has shape {tuple(value.shape)}, "
                             f"config.json implies {tuple(p.shape)}")
        _set_tensor(model, name, value.to(device=device, dtype=_target_dtype(name, dtype)))
    return model.eval()


def save_codec(model: MossAudioTokenizer, model_dir: str | Path, shards: int = 1) -> None:
    """Write config.json and safetensors (weight norm as parametrizations
    original0 = ||W[o]||, original1 = W) in the checkpoint layout; with shards > 1
    also model.safetensors.index.json. For dummy checkpoints and tests."""
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2))
    tensors: dict[str, Tensor] = {}
    for name, p in model.named_parameters():
        t = p.detach().to("cpu").contiguous()
        if name.startswith("quantizer.") and name.endswith(".weight") and t.dim() == 3:
            base = name[:-len(".weight")]
            tensors[f"{base}.parametrizations.weight.original0"] = t.reshape(t.shape[0], -1).norm(dim=1).reshape(
                -1, 1, 1)
            tensors[f"{base}.parametrizations.weight.original1"] = t
        else:
            tensors[name] = t
    names = sorted(tensors)
    if shards <= 1:
        save_file(tensors, str(model_dir / "model.safetensors"))
        return
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(model_dir / fname))
        weight_map.update({n: fname for n in part})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                       indent=2))
