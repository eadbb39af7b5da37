"""MOSS-TTS Local v1.5 configuration: parse a checkpoint's config.json
(spec moss_tts_local.md §1) or build the tiny test preset.

Shared by the worker (model shapes) and the scheduler (special ids for
prompt rows), which receives the worker's config.json in its hello.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ARCHITECTURE = "moss_tts_local"


class ConfigError(ValueError):
    """The checkpoint's config.json describes something Chorus cannot serve."""


@dataclass(frozen=True)
class BackboneConfig:
    """The Qwen3 backbone (`qwen3_config`)."""

    vocab_size: int = 151936
    hidden_size: int = 2560
    intermediate_size: int = 9728
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0


@dataclass(frozen=True)
class LocalConfig:
    """The local (per-frame) transformer (`gpt2_config`)."""

    n_embd: int = 2560
    n_head: int = 32
    n_inner: int = 9728
    n_layer: int = 1
    activation_function: str = "silu"
    layer_norm_epsilon: float = 1e-6
    position_embedding_type: str = "rope"
    rope_base: float = 1_000_000.0

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


@dataclass(frozen=True)
class MossTTSLocalConfig:
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    local: LocalConfig = field(default_factory=LocalConfig)
    n_vq: int = 12
    audio_vocab_size: int = 1024
    audio_pad_code: int = 1024
    pad_token_id: int = 151643
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    audio_start_token_id: int = 151669
    audio_end_token_id: int = 151670
    audio_user_slot_token_id: int = 151654
    audio_assistant_slot_token_id: int = 151656
    sampling_rate: int = 48000
    name: str = "moss-tts-local-v1.5"

    @property
    def hidden_size(self) -> int:
        return self.backbone.hidden_size

    @property
    def row_width(self) -> int:
        """Columns of a prompt/frame row: one text id and n_vq codes."""
        return 1 + self.n_vq

    # ---- (de)serialisation -------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: dict[str, Any], name: str | None = None) -> "MossTTSLocalConfig":
        return _parse(cfg, name)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "MossTTSLocalConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path} not found: --model must be a Hugging Face model directory with config.json")
        return _parse(json.loads(path.read_text()), Path(model_dir).name)

    def to_dict(self) -> dict[str, Any]:
        """A config.json in the upstream layout (what from_dict reads back)."""
        bb = asdict(self.backbone)
        local = asdict(self.local)
        return {
            "model_type": ARCHITECTURE,
            "architectures": ["MossTTSLocalModel"],
            "qwen3_config": bb,
            "language_config": bb,
            "gpt2_config": {**local, "n_positions": self.n_vq + 1, "n_ctx": self.n_vq + 1},
            "n_vq": self.n_vq,
            "audio_vocab_size": self.audio_vocab_size,
            "audio_codebook_sizes": [self.audio_vocab_size] * self.n_vq,
            "audio_pad_token_id": self.audio_pad_code,
            "pad_token_id": self.pad_token_id,
            "im_start_token_id": self.im_start_token_id,
            "im_end_token_id": self.im_end_token_id,
            "audio_start_token_id": self.audio_start_token_id,
            "audio_end_token_id": self.audio_end_token_id,
            "audio_user_slot_token_id": self.audio_user_slot_token_id,
            "audio_assistant_slot_token_id": self.audio_assistant_slot_token_id,
            "sampling_rate": self.sampling_rate,
            "local_text_head_mode": "binary",
            "chorus_name": self.name,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def tiny_config() -> MossTTSLocalConfig:
    """The `tiny` preset: the real layer structure, special ids and 13-column
    rows at a size that runs in milliseconds on a CPU. The text vocabulary
    stays full-size because the real special ids (151643..151670) index it."""
    return MossTTSLocalConfig(
        backbone=BackboneConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        local=LocalConfig(n_embd=64, n_head=4, n_inner=128, n_layer=1),
        name="moss-tts-local-tiny",
    )


PRESETS = {"tiny": tiny_config, "full": MossTTSLocalConfig}


def _parse(cfg: dict[str, Any], name: str | None) -> MossTTSLocalConfig:
    model_type = cfg.get("model_type")
    if model_type != ARCHITECTURE:
        hint = " (that is MOSS-TTS v1.0 / Delay, not Local v1.5)" if model_type == "moss_tts_delay" else ""
        raise ConfigError(f"config.json model_type is {model_type!r}{hint}; Chorus serves {ARCHITECTURE!r}")
    q = cfg.get("qwen3_config") or cfg.get("language_config")
    if not isinstance(q, dict):
        raise ConfigError("config.json has neither qwen3_config nor language_config")
    theta = q.get("rope_theta")
    if theta is None:
        theta = (q.get("rope_parameters") or {}).get("rope_theta")
    if theta is None:
        theta = (q.get("rope_scaling") or {}).get("rope_theta")
    if theta is None:
        raise ConfigError("qwen3_config has no rope_theta (nor rope_parameters.rope_theta); refusing to guess")
    if "head_dim" not in q:
        raise ConfigError("qwen3_config has no head_dim; refusing to guess (upstream would use 128)")
    scaling = q.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
        raise ConfigError(f"qwen3_config.rope_scaling {scaling} is not supported (MOSS-TTS Local uses plain RoPE)")
    backbone = BackboneConfig(
        vocab_size=int(q.get("vocab_size", 151936)),
        hidden_size=int(q["hidden_size"]),
        intermediate_size=int(q["intermediate_size"]),
        num_hidden_layers=int(q["num_hidden_layers"]),
        num_attention_heads=int(q["num_attention_heads"]),
        num_key_value_heads=int(q.get("num_key_value_heads", q["num_attention_heads"])),
        head_dim=int(q["head_dim"]),
        rms_norm_eps=float(q.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
    )
    hidden = backbone.hidden_size
    g = cfg.get("gpt2_config")
    if g is None:  # upstream's derived default (spec §1.1)
        g = {"n_embd": hidden, "n_layer": 1, "n_head": max(1, hidden // 80), "activation_function": "silu",
             "layer_norm_epsilon": 1e-6, "position_embedding_type": "absolute", "rope_base": 10000.0}
    n_embd = int(g.get("n_embd", g.get("hidden_size", 768)))
    if n_embd != hidden:
        raise ConfigError(f"gpt2_config.n_embd {n_embd} must equal the backbone hidden_size {hidden}")
    pos_type = str(g.get("position_embedding_type", "absolute")).lower()
    if pos_type == "rope" and g.get("rope_base") is None:
        raise ConfigError("gpt2_config uses rope but has no rope_base; refusing to guess (1e6 vs upstream 1e4)")
    n_head = int(g.get("n_head", g.get("num_attention_heads", 12)))
    local = LocalConfig(
        n_embd=n_embd,
        n_head=n_head,
        n_inner=int(g["n_inner"]) if g.get("n_inner") else 4 * n_embd,
        n_layer=int(cfg.get("local_transformer_layers") or g.get("n_layer", 12)),
        activation_function=str(g.get("activation_function", "gelu_new")),
        layer_norm_epsilon=float(g.get("layer_norm_epsilon", 1e-5)),
        position_embedding_type=pos_type,
        rope_base=float(g.get("rope_base") or 10000.0),
    )
    if local.activation_function not in ("silu", "swish"):
        raise ConfigError(f"gpt2_config.activation_function {local.activation_function!r} is not supported (silu)")
    if n_embd % n_head:
        raise ConfigError(f"gpt2_config.n_embd {n_embd} is not divisible by n_head {n_head}")
    head_mode = cfg.get("local_text_head_mode", "binary")
    if head_mode is None or str(head_mode).strip().lower() != "binary":
        raise ConfigError(f"local_text_head_mode {head_mode!r} is not supported: only the binary stop head is")
    n_vq = int(cfg.get("n_vq", 12))
    sizes = cfg.get("audio_codebook_sizes") or []
    audio_vocab = max([int(cfg.get("audio_vocab_size", 1024)), *map(int, sizes)])
    pad = cfg.get("audio_pad_code")
    pad = int(pad if pad is not None else cfg.get("audio_pad_token_id", 1024))
    if pad < audio_vocab:
        raise ConfigError(f"audio_pad_token_id {pad} must be >= audio_vocab_size {audio_vocab}")
    gen_slot = cfg.get("audio_assistant_gen_slot_token_id")
    return MossTTSLocalConfig(
        backbone=backbone,
        local=local,
        n_vq=n_vq,
        audio_vocab_size=audio_vocab,
        audio_pad_code=pad,
        pad_token_id=int(cfg.get("pad_token_id", 151643)),
        im_start_token_id=int(cfg.get("im_start_token_id", 151644)),
        im_end_token_id=int(cfg.get("im_end_token_id", 151645)),
        audio_start_token_id=int(cfg.get("audio_start_token_id", 151669)),
        audio_end_token_id=int(cfg.get("audio_end_token_id", 151670)),
        audio_user_slot_token_id=int(cfg.get("audio_user_slot_token_id", 151654)),
        audio_assistant_slot_token_id=int(gen_slot if gen_slot is not None
                                          else cfg.get("audio_assistant_slot_token_id", 151656)),
        sampling_rate=int(cfg.get("sampling_rate", 48000)),
        name=str(cfg.get("chorus_name") or name or "moss-tts-local"),
    )
