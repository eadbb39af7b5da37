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
    # Per-codebook sizes when they differ from audio_vocab_size (the maximum);
    # empty means every codebook has audio_vocab_size codes (v1.5: 12 x 1024).
    audio_codebook_sizes: tuple[int, ...] = ()

    @property
    def codebook_sizes(self) -> tuple[int, ...]:
        """Rows of audio embedding / head k, for k in 0..n_vq-1."""
        return tuple(self.audio_codebook_sizes) or (self.audio_vocab_size,) * self.n_vq

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
            "qwen3_config": {"model_type": "qwen3", **bb, "hidden_act": "silu", "attention_bias": False},
            "language_config": {"model_type": "qwen3", **bb, "hidden_act": "silu", "attention_bias": False},
            "gpt2_config": {**local, "n_positions": self.n_vq + 1, "n_ctx": self.n_vq + 1},
            "n_vq": self.n_vq,
            "audio_vocab_size": self.audio_vocab_size,
            "audio_codebook_sizes": list(self.codebook_sizes),
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


_HEAD_MODE_ALIASES = {"binary": "binary", "full_vocab": "full_vocab", "full": "full_vocab",
                      "full-vocab": "full_vocab", "vocab": "full_vocab"}


def _head_mode(cfg: dict[str, Any]) -> str:
    """§1.1: a missing key means binary; explicit null or "" means full_vocab;
    otherwise matched ignoring case and surrounding spaces, with aliases."""
    if "local_text_head_mode" not in cfg:
        return "binary"
    raw = cfg["local_text_head_mode"]
    key = "" if raw is None else str(raw).strip().lower()
    if key == "":
        return "full_vocab"
    if key not in _HEAD_MODE_ALIASES:
        raise ConfigError(f"local_text_head_mode {raw!r} is unknown (binary or full_vocab)")
    return _HEAD_MODE_ALIASES[key]


def _rope_theta(q: dict[str, Any]) -> float:
    """qwen3 theta: rope_theta, else rope_parameters.rope_theta (transformers >= 5),
    else rope_scaling.rope_theta. Missing → refuse (upstream would silently use 10 000)."""
    for where, value in (("rope_theta", q.get("rope_theta")),
                         ("rope_parameters.rope_theta", (q.get("rope_parameters") or {}).get("rope_theta")),
                         ("rope_scaling.rope_theta", (q.get("rope_scaling") or {}).get("rope_theta"))):
        if value is not None:
            theta = float(value)
            if not theta > 1.0:
                raise ConfigError(f"qwen3_config.{where} = {value!r} must be > 1")
            return theta
    raise ConfigError("qwen3_config has no rope_theta (nor rope_parameters.rope_theta / rope_scaling.rope_theta); "
                      "refusing to guess: upstream would silently fall back to Qwen3Config's 10000, "
                      "while MOSS-TTS Local v1.5 (Qwen3-4B) uses 1000000")


def _check_no_rope_scaling(q: dict[str, Any]) -> None:
    for key in ("rope_scaling", "rope_parameters"):
        sc = q.get(key) or {}
        if not isinstance(sc, dict):
            raise ConfigError(f"qwen3_config.{key} must be an object, got {sc!r}")
        kind = sc.get("rope_type", sc.get("type", "default"))
        if kind not in ("default", None):
            raise ConfigError(f"qwen3_config.{key} has rope_type {kind!r}: RoPE scaling is not supported "
                              "(MOSS-TTS Local v1.5 uses plain RoPE)")


def _required_int(section: str, d: dict[str, Any], key: str, why: str = "") -> int:
    if d.get(key) is None:
        raise ConfigError(f"{section} has no {key}; refusing to guess{why}")
    return int(d[key])


def _positive(name: str, value: int) -> int:
    if value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value}")
    return value


def _parse(cfg: dict[str, Any], name: str | None) -> MossTTSLocalConfig:
    if not isinstance(cfg, dict):
        raise ConfigError(f"config.json must be a JSON object, got {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    if model_type != ARCHITECTURE:
        if model_type == "moss_tts_delay":
            raise ConfigError(
                "config.json model_type is 'moss_tts_delay': that is MOSS-TTS v1.0 (32 codebooks, 24 kHz, "
                "Qwen3-1.7B backbone), not MOSS-TTS Local v1.5; Chorus serves model_type "
                f"{ARCHITECTURE!r} (OpenMOSS-Team/MOSS-TTS-Local-Transformer-v1.5)")
        raise ConfigError(f"config.json model_type is {model_type!r}; Chorus serves {ARCHITECTURE!r} "
                          "(MOSS-TTS Local v1.5)")

    # ---- backbone (§1.2) --------------------------------------------------------
    q = cfg.get("qwen3_config") or cfg.get("language_config")
    if not isinstance(q, dict):
        raise ConfigError("config.json has neither qwen3_config nor language_config (a v1.5 config has both)")
    theta = _rope_theta(q)
    _check_no_rope_scaling(q)
    sec = "qwen3_config"
    head_dim = _required_int(sec, q, "head_dim",
                             " (upstream would use Qwen3Config's 128, not hidden_size / num_attention_heads)")
    act = str(q.get("hidden_act", "silu")).lower()
    if act not in ("silu", "swish"):
        raise ConfigError(f"qwen3_config.hidden_act {q.get('hidden_act')!r} is not supported (Qwen3 uses silu)")
    if q.get("attention_bias"):
        raise ConfigError("qwen3_config.attention_bias is true; the MOSS-TTS Local v1.5 backbone has no biases")
    n_heads = _required_int(sec, q, "num_attention_heads")
    backbone = BackboneConfig(
        vocab_size=_positive(f"{sec}.vocab_size", int(q.get("vocab_size") or 151936)),
        hidden_size=_positive(f"{sec}.hidden_size", _required_int(sec, q, "hidden_size")),
        intermediate_size=_positive(f"{sec}.intermediate_size", _required_int(sec, q, "intermediate_size")),
        num_hidden_layers=_positive(f"{sec}.num_hidden_layers", _required_int(sec, q, "num_hidden_layers")),
        num_attention_heads=_positive(f"{sec}.num_attention_heads", n_heads),
        num_key_value_heads=_positive(f"{sec}.num_key_value_heads",
                                      int(q.get("num_key_value_heads") or n_heads)),
        head_dim=_positive(f"{sec}.head_dim", head_dim),
        rms_norm_eps=float(q.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
    )
    if backbone.num_attention_heads % backbone.num_key_value_heads:
        raise ConfigError(f"qwen3_config.num_attention_heads {backbone.num_attention_heads} is not a multiple of "
                          f"num_key_value_heads {backbone.num_key_value_heads}")
    if backbone.head_dim % 2:
        raise ConfigError(f"qwen3_config.head_dim {backbone.head_dim} must be even (half-split RoPE)")
    hidden = backbone.hidden_size

    # ---- local transformer (§1.3) -------------------------------------------------
    g = cfg.get("gpt2_config")
    if g is None:  # upstream's derived default (spec §1.1): absolute positions, n_inner unset
        g = {"n_embd": hidden, "n_layer": 1, "n_head": max(1, hidden // 80), "activation_function": "silu",
             "layer_norm_epsilon": 1e-6}
    if not isinstance(g, dict):
        raise ConfigError(f"gpt2_config must be an object, got {g!r}")

    def gget(key: str, alias: str, default: Any) -> Any:
        for k in (key, alias):  # GPT2Config attribute_map aliases
            if g.get(k) is not None:
                return g[k]
        return default

    n_embd = int(gget("n_embd", "hidden_size", 768))
    if n_embd != hidden:
        raise ConfigError(f"gpt2_config.n_embd {n_embd} must equal the backbone hidden_size {hidden} "
                          "(audio embeddings are both local-transformer inputs and head weights)")
    n_head = _positive("gpt2_config.n_head", int(gget("n_head", "num_attention_heads", 12)))
    if n_embd % n_head:
        raise ConfigError(f"gpt2_config.n_embd {n_embd} is not divisible by n_head {n_head}")
    pos_type = str(g.get("position_embedding_type") or "absolute").strip().lower()
    if pos_type not in ("rope", "absolute"):
        raise ConfigError(f"gpt2_config.position_embedding_type {g.get('position_embedding_type')!r} is not "
                          "supported (rope or absolute)")
    if pos_type == "rope":
        if g.get("rope_base") is None:
            raise ConfigError("gpt2_config uses position_embedding_type 'rope' but has no rope_base; refusing to "
                              "guess (the upstream module would use 10000, sglang-omni and the ports 1000000)")
        if (n_embd // n_head) % 2:
            raise ConfigError(f"gpt2_config head size {n_embd // n_head} must be even (interleaved RoPE)")
    rope_base = float(g["rope_base"]) if g.get("rope_base") is not None else 10000.0
    if not rope_base > 1.0:
        raise ConfigError(f"gpt2_config.rope_base {g.get('rope_base')!r} must be > 1")
    act = str(g.get("activation_function", "gelu_new"))
    if act.lower() not in ("silu", "swish"):
        raise ConfigError(f"gpt2_config.activation_function {act!r} is not supported: MOSS-TTS Local v1.5 uses silu "
                          "(gelu_new is GPT2Config's default when the field is absent)")
    if not g.get("scale_attn_weights", True):
        raise ConfigError("gpt2_config.scale_attn_weights is false; only 1/sqrt(head_dim) score scaling is supported")
    if g.get("scale_attn_by_inverse_layer_idx", False):
        raise ConfigError("gpt2_config.scale_attn_by_inverse_layer_idx is true; not supported (v1.5: false)")
    n_inner = g.get("n_inner")
    n_layer = cfg.get("local_transformer_layers")  # upstream: getattr(config, ..., None); overrides n_layer
    if n_layer is None:
        n_layer = gget("n_layer", "num_hidden_layers", 12)
    local = LocalConfig(
        n_embd=n_embd,
        n_head=n_head,
        n_inner=_positive("gpt2_config.n_inner", int(n_inner) if n_inner is not None else 4 * n_embd),
        n_layer=_positive("local_transformer_layers / gpt2_config.n_layer", int(n_layer)),
        activation_function="silu",
        layer_norm_epsilon=float(g.get("layer_norm_epsilon", 1e-5)),
        position_embedding_type=pos_type,
        rope_base=rope_base,
    )

    # ---- heads and audio channels (§1.1) -----------------------------------------
    mode = _head_mode(cfg)
    if mode != "binary":
        raise ConfigError(f"local_text_head_mode {cfg.get('local_text_head_mode')!r} means full_vocab; only the "
                          "binary continue/stop head (MOSS-TTS Local v1.5) is supported")
    n_vq = _positive("n_vq", int(cfg.get("n_vq") or 12))
    base_vocab = _positive("audio_vocab_size", int(cfg.get("audio_vocab_size") or 1024))
    sizes = cfg.get("audio_codebook_sizes")
    if sizes is None:
        sizes = [base_vocab] * n_vq
    sizes = [int(x) for x in sizes]
    if len(sizes) != n_vq or any(x <= 0 for x in sizes):
        raise ConfigError(f"audio_codebook_sizes must be {n_vq} positive sizes (n_vq), got {sizes}")
    audio_vocab = max(base_vocab, *sizes)
    pad = cfg.get("audio_pad_code")
    pad = int(pad if pad is not None else cfg.get("audio_pad_token_id", 1024))
    if pad < audio_vocab:
        raise ConfigError(f"audio pad code {pad} (audio_pad_code / audio_pad_token_id) must be >= "
                          f"audio_vocab_size {audio_vocab}")
    gen_slot = cfg.get("audio_assistant_gen_slot_token_id")
    text_ids = dict(
        pad_token_id=int(cfg.get("pad_token_id", 151643)),
        im_start_token_id=int(cfg.get("im_start_token_id", 151644)),
        im_end_token_id=int(cfg.get("im_end_token_id", 151645)),
        audio_start_token_id=int(cfg.get("audio_start_token_id", 151669)),
        audio_end_token_id=int(cfg.get("audio_end_token_id", 151670)),
        audio_user_slot_token_id=int(cfg.get("audio_user_slot_token_id", 151654)),
        audio_assistant_slot_token_id=int(gen_slot if gen_slot is not None
                                          else cfg.get("audio_assistant_slot_token_id", 151656)),
    )
    for key, tid in text_ids.items():
        if not 0 <= tid < backbone.vocab_size:
            raise ConfigError(f"{key} {tid} is outside the text vocabulary [0, {backbone.vocab_size})")
    return MossTTSLocalConfig(
        backbone=backbone,
        local=local,
        n_vq=n_vq,
        audio_vocab_size=audio_vocab,
        audio_pad_code=pad,
        **text_ids,
        sampling_rate=int(cfg.get("sampling_rate") or 48000),
        name=str(cfg.get("chorus_name") or name or "moss-tts-local"),
        audio_codebook_sizes=tuple(sizes) if any(x != audio_vocab for x in sizes) else (),
    )

