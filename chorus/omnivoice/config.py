"""OmniVoice's model configuration: parse a checkpoint's config.json (spec section 1) or build a preset.

Shared by the worker (model shapes) and the scheduler, which receives the worker's config in its
hello. The body is a Qwen3 model without an LM head, described by the nested `llm_config`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chorus.omnivoice.knobs import NUM_CODEBOOKS

ARCHITECTURE = "omnivoice"
CODEBOOK_WEIGHTS = [8, 8, 6, 6, 4, 4, 2, 2]  # the training loss's; carried so to_dict() is the package's layout


class ConfigError(ValueError):
    """The checkpoint's config.json describes something Chorus cannot serve; the message names the field."""


@dataclass(frozen=True)
class OmniVoiceConfig:
    """Defaults: the released k2-fsa/OmniVoice (Qwen3-0.6B body, 8 codebooks of 1024 codes + MASK)."""

    name: str = "omnivoice"
    vocab_size: int = 151676
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_layers: int = 28
    num_heads: int = 16
    num_kv_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    audio_vocab_size: int = 1025  # codes per codebook, MASK included
    audio_mask_id: int = 1024
    num_codebooks: int = NUM_CODEBOOKS

    @classmethod
    def from_dict(cls, d: dict[str, Any], name: str | None = None) -> "OmniVoiceConfig":
        return _parse(d, name)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "OmniVoiceConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path} not found: --model must be an OmniVoice checkpoint directory with config.json")
        try:
            d = json.loads(path.read_text())
        except ValueError as e:
            raise ConfigError(f"{path} is not JSON: {e}") from e
        return _parse(d, Path(model_dir).resolve().name)

    def to_dict(self) -> dict[str, Any]:
        """A config.json in the package's layout (what from_dict, and the package, read back)."""
        return {
            "model_type": ARCHITECTURE,
            "architectures": ["OmniVoice"],
            "audio_vocab_size": self.audio_vocab_size,
            "audio_mask_id": self.audio_mask_id,
            "num_audio_codebook": self.num_codebooks,
            "audio_codebook_weights": list(CODEBOOK_WEIGHTS),
            "llm_config": {
                "model_type": "qwen3",
                "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_layers,
                "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim,
                "rms_norm_eps": self.rms_norm_eps,
                "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
                "max_position_embeddings": self.max_position_embeddings,
                "hidden_act": "silu",
                "attention_bias": False,
                "tie_word_embeddings": True,
            },
            "chorus_name": self.name,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @property
    def num_params(self) -> int:
        """Parameters of the model this config describes (body + audio table + audio head)."""
        h, d = self.hidden_size, self.head_dim
        attention = h * d * (2 * self.num_heads + 2 * self.num_kv_heads) + 2 * d
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        audio = 2 * self.num_codebooks * self.audio_vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + audio


def tiny_config() -> OmniVoiceConfig:
    """The `tiny` preset: the real structure at a size that runs in milliseconds on a CPU. The text
    vocabulary stays full-size because the special ids (151669..151675) index it."""
    return OmniVoiceConfig(name="omnivoice-tiny", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, max_position_embeddings=4096)


PRESETS = {"tiny": tiny_config, "full": OmniVoiceConfig}


def _int(section: str, d: dict[str, Any], key: str, default: int | None = None, minimum: int = 1) -> int:
    value = d.get(key, default)
    if value is None:
        raise ConfigError(f"{section}{key} is missing; refusing to guess")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{section}{key} = {value!r}: needs an integer >= {minimum}")
    return value


def _float(section: str, d: dict[str, Any], key: str, default: float) -> float:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{section}{key} = {value!r}: needs a positive number")
    return float(value)


def _rope_theta(q: dict[str, Any]) -> float:
    """rope_parameters.rope_theta (transformers >= 5) or rope_theta; plain RoPE only."""
    params = q.get("rope_parameters") or q.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"llm_config.rope_parameters = {params!r}: needs an object")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", None):
        raise ConfigError(f"llm_config.rope_parameters.rope_type = {kind!r}: only plain RoPE ('default') is served")
    theta = params.get("rope_theta", q.get("rope_theta"))
    if theta is None:
        raise ConfigError("llm_config.rope_parameters.rope_theta is missing (nor llm_config.rope_theta); "
                          "refusing to guess (OmniVoice uses 1000000)")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 1:
        raise ConfigError(f"llm_config.rope_parameters.rope_theta = {theta!r}: needs a number > 1")
    return float(theta)


def _parse(d: Any, name: str | None) -> OmniVoiceConfig:
    if not isinstance(d, dict):
        raise ConfigError(f"config.json must be a JSON object, got {type(d).__name__}")
    if d.get("model_type") != ARCHITECTURE:
        raise ConfigError(f"config.json model_type = {d.get('model_type')!r}: an OmniVoice checkpoint says "
                          f"{ARCHITECTURE!r}")
    q = d.get("llm_config")
    if not isinstance(q, dict):
        raise ConfigError("config.json llm_config is missing or not an object (the Qwen3 body's config)")
    if q.get("model_type", "qwen3") != "qwen3":
        raise ConfigError(f"llm_config.model_type = {q.get('model_type')!r}: the OmniVoice body is 'qwen3'")
    if str(q.get("hidden_act", "silu")).lower() not in ("silu", "swish"):
        raise ConfigError(f"llm_config.hidden_act = {q.get('hidden_act')!r}: the Qwen3 body uses silu")
    if q.get("attention_bias"):
        raise ConfigError("llm_config.attention_bias = true: the OmniVoice body has no attention biases")
    if q.get("use_sliding_window") or any(t != "full_attention" for t in q.get("layer_types") or []):
        raise ConfigError("llm_config asks for sliding-window layers (use_sliding_window / layer_types): "
                          "OmniVoice attends over whole documents")
    s = "llm_config."
    heads = _int(s, q, "num_attention_heads")
    cfg = OmniVoiceConfig(
        name=str(d.get("chorus_name") or name or ARCHITECTURE),
        vocab_size=_int(s, q, "vocab_size"),
        hidden_size=_int(s, q, "hidden_size"),
        intermediate_size=_int(s, q, "intermediate_size"),
        num_layers=_int(s, q, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=_int(s, q, "num_key_value_heads", heads),
        head_dim=_int(s, q, "head_dim"),
        rms_norm_eps=_float(s, q, "rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(q),
        max_position_embeddings=_int(s, q, "max_position_embeddings", 40960),
        audio_vocab_size=_int("", d, "audio_vocab_size", 1025, minimum=2),
        audio_mask_id=_int("", d, "audio_mask_id", 1024, minimum=0),
        num_codebooks=_int("", d, "num_audio_codebook", NUM_CODEBOOKS),
    )
    if cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError(f"llm_config.num_attention_heads = {cfg.num_heads} is not a multiple of "
                          f"num_key_value_heads = {cfg.num_kv_heads}")
    if cfg.head_dim % 2:
        raise ConfigError(f"llm_config.head_dim = {cfg.head_dim}: needs an even size (half-split RoPE)")
    if cfg.num_codebooks != NUM_CODEBOOKS:
        raise ConfigError(f"num_audio_codebook = {cfg.num_codebooks}: the Higgs-Audio-v2 codec has {NUM_CODEBOOKS}")
    if cfg.audio_mask_id >= cfg.audio_vocab_size:
        raise ConfigError(f"audio_mask_id = {cfg.audio_mask_id}: needs to be below audio_vocab_size = "
                          f"{cfg.audio_vocab_size} (MASK has its own embedding row per codebook)")
    return cfg
