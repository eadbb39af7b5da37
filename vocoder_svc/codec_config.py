"""MOSS-Audio-Tokenizer configuration (§1): stage and quantizer configs, the
codec config parsed from / written to a Hugging Face config.json, and the
presets (full and tiny, v1 and v2) that tests and benchmarks build from.

Section numbers (§) refer to /work/shared/specs/moss_audio_tokenizer.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

TRANSFORMER = "Transformer"
PATCH = "PatchedPretransform"


# =============================================================================
# Configuration (§1)
# =============================================================================

@dataclass(frozen=True)
class StageConfig:
    """One entry of encoder_kwargs / decoder_kwargs (§1.2)."""

    module_type: str  # TRANSFORMER or PATCH
    patch_size: int = 0
    input_dimension: int = 0
    output_dimension: int = 0
    d_model: int = 0
    num_heads: int = 0
    num_layers: int = 0
    dim_feedforward: int = 0
    max_period: float = 10000.0
    layer_scale: float | None = 0.01
    context_duration: float | None = None  # v2 only: per-stage window in seconds

    @property
    def is_patch(self) -> bool:
        return self.module_type == PATCH

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @staticmethod
    def transformer(cin: int, cout: int, d: int, heads: int, layers: int, ff: int,
                    ctx: float | None = None) -> "StageConfig":
        return StageConfig(TRANSFORMER, input_dimension=cin, output_dimension=cout, d_model=d,
                           num_heads=heads, num_layers=layers, dim_feedforward=ff, context_duration=ctx)

    @staticmethod
    def patch(h: int) -> "StageConfig":
        return StageConfig(PATCH, patch_size=h)

    def swapped(self) -> "StageConfig":
        """The same stage with input and output widths exchanged (reversed_decoder_kwargs)."""
        if self.is_patch:
            return self
        return replace(self, input_dimension=self.output_dimension, output_dimension=self.input_dimension)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> "StageConfig":
        kind = d.get("module_type")
        if kind == PATCH:
            if "patch_size" not in d:
                raise ValueError(f"{where}: PatchedPretransform has no patch_size")
            h = int(d["patch_size"])
            if h < 1:
                raise ValueError(f"{where}: patch_size must be >= 1, got {h}")
            return cls.patch(h)
        if kind != TRANSFORMER:
            raise ValueError(f"{where}: module_type {kind!r} is not supported "
                             f"(expected {TRANSFORMER!r} or {PATCH!r})")
        for key in ("input_dimension", "output_dimension", "d_model", "num_heads", "num_layers",
                    "dim_feedforward"):
            if key not in d:
                raise ValueError(f"{where}: Transformer stage has no {key}")
        # Only the variant every released stage uses is implemented; refuse the others loudly.
        expect = {"causal": True, "norm": "layer_norm", "positional_embedding": "rope",
                  "gating": "none", "conv_layout": True}
        for key, want in expect.items():
            if key in d and d[key] != want:
                raise ValueError(f"{where}: {key}={d[key]!r} is not supported (only {want!r})")
        scale = d.get("layer_scale")
        ctx = d.get("context_duration")
        stage = cls(TRANSFORMER, input_dimension=int(d["input_dimension"]),
                    output_dimension=int(d["output_dimension"]), d_model=int(d["d_model"]),
                    num_heads=int(d["num_heads"]), num_layers=int(d["num_layers"]),
                    dim_feedforward=int(d["dim_feedforward"]),
                    max_period=float(d.get("max_period", 10000.0)),
                    layer_scale=None if scale is None else float(scale),
                    context_duration=None if ctx is None else float(ctx))
        if stage.num_heads < 1 or stage.d_model % stage.num_heads:
            raise ValueError(f"{where}: d_model {stage.d_model} is not divisible by num_heads {stage.num_heads}")
        if stage.head_dim % 2:
            raise ValueError(f"{where}: head dim {stage.head_dim} must be even for RoPE pairs")
        return stage

    def to_dict(self) -> dict[str, Any]:
        if self.is_patch:
            return {"module_type": PATCH, "patch_size": self.patch_size}
        d = {"module_type": TRANSFORMER, "input_dimension": self.input_dimension,
             "output_dimension": self.output_dimension, "d_model": self.d_model,
             "num_heads": self.num_heads, "num_layers": self.num_layers,
             "dim_feedforward": self.dim_feedforward, "causal": True, "norm": "layer_norm",
             "positional_embedding": "rope", "max_period": self.max_period, "gating": "none",
             "layer_scale": self.layer_scale, "conv_layout": True}
        if self.context_duration is not None:
            d["context_duration"] = self.context_duration
        return d


@dataclass(frozen=True)
class QuantizerConfig:
    """quantizer_kwargs: residual LFQ (§1.1, §2.2)."""

    input_dim: int = 768
    rvq_dim: int = 512
    output_dim: int = 768
    num_quantizers: int = 32
    codebook_size: int = 1024
    codebook_dim: int = 8
    quantizer_type: str = "rlfq"


@dataclass(frozen=True)
class CodecConfig:
    sampling_rate: int
    downsample_rate: int  # samples per channel per frame
    channels: int  # channels at the public waveform interface
    v2: bool  # v2 tensor naming: decided by the presence of number_channels (§1.1)
    channel_interleave: bool
    context_duration: float  # global window (s); v2 stages may override it
    encoder: tuple[StageConfig, ...]
    decoder: tuple[StageConfig, ...]
    quantizer: QuantizerConfig = field(default_factory=QuantizerConfig)
    compute_dtype: str = "fp32"  # informational: the caller picks the dtype
    attention_implementation: str = "sdpa"  # informational: same math either way
    window_override: int | None = None  # tests: every attention window becomes this
    name: str = "moss-audio-tokenizer"

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived numbers ----------------------------------------------------
    @property
    def frame_rate(self) -> float:
        return self.sampling_rate / self.downsample_rate

    @property
    def internal_channels(self) -> int:
        """C_int: channels folded into the single internal stream (2 for v2)."""
        return self.channels if self.channel_interleave else 1

    @property
    def hop(self) -> int:
        """Samples per channel per frame."""
        return self.downsample_rate

    def _window(self, stage: StageConfig, rate: float) -> int:
        if self.window_override is not None:
            return self.window_override
        seconds = self.context_duration
        if self.v2 and stage.context_duration is not None:  # v1 reads only the global value
            seconds = stage.context_duration
        # [U] floors; the epsilon keeps 0.05 s x 400 Hz = 19.999... from becoming 19.
        return math.floor(rate * seconds + 1e-9)

    def decoder_windows(self) -> dict[int, int]:
        """Attention window W (tokens, including the query) of each decoder Transformer (§1.3)."""
        rate, out = self.frame_rate, {}
        for i, s in enumerate(self.decoder):
            if s.is_patch:
                rate *= s.patch_size
            else:
                out[i] = self._window(s, rate)
        return out

    def encoder_windows(self) -> dict[int, int]:
        rate, out = float(self.sampling_rate * self.internal_channels), {}
        for i, s in enumerate(self.encoder):
            if s.is_patch:
                rate /= s.patch_size
            else:
                out[i] = self._window(s, rate)
        return out

    def with_window(self, window: int | None) -> "CodecConfig":
        """A copy whose every attention window is `window` tokens (None: the config's own)."""
        return replace(self, window_override=window)

    # ---- checks (§1.4) -------------------------------------------------------
    def validate(self) -> None:
        q = self.quantizer
        if q.quantizer_type not in ("rlfq", "random_prefix_rlfq"):
            raise ValueError(f"quantizer_type {q.quantizer_type!r} is not supported (only residual LFQ: "
                             f"'rlfq' or 'random_prefix_rlfq')")
        if min(q.input_dim, q.rvq_dim, q.output_dim, q.num_quantizers, q.codebook_size, q.codebook_dim) < 1:
            raise ValueError(f"quantizer_kwargs has a non-positive size: {q}")
        if self.channels not in (1, 2):
            raise ValueError(f"number_channels must be 1 or 2, got {self.channels}")
        if self.channels == 2 and not self.channel_interleave:
            raise ValueError("number_channels=2 needs enable_channel_interleave=true: stereo exists only "
                             "as one interleaved stream (§3.5)")
        if self.sampling_rate < 1 or self.downsample_rate < 1:
            raise ValueError(f"sampling_rate {self.sampling_rate} and downsample_rate {self.downsample_rate} "
                             "must be positive")
        if self.window_override is not None and self.window_override < 1:
            raise ValueError(f"window override must be >= 1, got {self.window_override}")
        want = self.downsample_rate * self.internal_channels
        for side, stages in (("decoder", self.decoder), ("encoder", self.encoder)):
            if not stages:
                raise ValueError(f"{side}_kwargs is empty")
            prod = math.prod(s.patch_size for s in stages if s.is_patch)
            if prod != want:
                raise ValueError(f"{side}: the patch sizes multiply to {prod}, but downsample_rate x internal "
                                 f"channels = {self.downsample_rate} x {self.internal_channels} = {want}")
        # Follow the channel width through each stack: every Transformer must
        # accept what the previous module produced, and the waveform end must
        # be the single (interleaved) stream.
        width, what = q.output_dim, "quantizer output_dim"
        for i, s in enumerate(self.decoder):
            if s.is_patch:
                if width % s.patch_size:
                    raise ValueError(f"decoder[{i}]: patch_size {s.patch_size} does not divide the {width} "
                                     f"channels of {what}")
                width, what = width // s.patch_size, f"decoder[{i}] (patch {s.patch_size})"
            else:
                if s.input_dimension != width:
                    raise ValueError(f"decoder[{i}]: input_dimension {s.input_dimension} != {width} channels "
                                     f"of {what}")
                width, what = s.output_dimension, f"decoder[{i}]"
        if width != 1:
            raise ValueError(f"decoder: ends with {width} channels; the last patch must produce the single "
                             f"waveform stream (last Transformer output_dimension = last patch_size)")
        width, what = 1, "the waveform stream"
        for i, s in enumerate(self.encoder):
            if s.is_patch:
                width, what = width * s.patch_size, f"encoder[{i}] (patch {s.patch_size})"
            else:
                if s.input_dimension != width:
                    raise ValueError(f"encoder[{i}]: input_dimension {s.input_dimension} != {width} channels "
                                     f"of {what}")
                width, what = s.output_dimension, f"encoder[{i}]"
        if width != q.input_dim:
            raise ValueError(f"encoder: ends with {width} channels but quantizer input_dim is {q.input_dim}")
        for side, windows in (("decoder", self.decoder_windows()), ("encoder", self.encoder_windows())):
            for i, w in windows.items():
                if w < 1:
                    raise ValueError(f"{side}[{i}]: attention window is {w} tokens; context_duration too short "
                                     f"for the stage's token rate")

    # ---- config.json -----------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: dict[str, Any], name: str | None = None) -> "CodecConfig":
        model_type = cfg.get("model_type")
        if model_type not in (None, "moss-audio-tokenizer", "speech_tokenizer"):
            raise ValueError(f"codec config.json model_type is {model_type!r}; expected "
                             f"'moss-audio-tokenizer' (v2) or 'speech_tokenizer' (v1)")
        rate = cfg.get("sampling_rate", cfg.get("sample_rate"))
        if rate is None:
            raise ValueError("codec config.json has neither sampling_rate nor sample_rate")
        if "downsample_rate" not in cfg:
            raise ValueError("codec config.json has no downsample_rate")
        channels_key = "number_channels" if "number_channels" in cfg else (
            "channels_numbers" if "channels_numbers" in cfg else None)
        v2 = channels_key is not None
        channels = int(cfg[channels_key]) if v2 else 1
        ctx = cfg.get("causal_transformer_context_duration")
        if ctx is None:
            raise ValueError("codec config.json has no causal_transformer_context_duration "
                             "(infinite attention windows are not supported for streaming)")

        def stages(key: str, raw: Any) -> tuple[StageConfig, ...]:
            if not isinstance(raw, list):
                raise ValueError(f"codec config.json {key} must be a list of stage dicts")
            return tuple(StageConfig.from_dict(d, f"{key}[{i}]") for i, d in enumerate(raw))

        if "encoder_kwargs" not in cfg:
            raise ValueError("codec config.json has no encoder_kwargs")
        encoder = stages("encoder_kwargs", cfg["encoder_kwargs"])
        if cfg.get("decoder_kwargs") is not None:
            decoder = stages("decoder_kwargs", cfg["decoder_kwargs"])
        elif v2 and cfg.get("reversed_decoder_kwargs") is not None:
            rev = stages("reversed_decoder_kwargs", cfg["reversed_decoder_kwargs"])
            decoder = tuple(s.swapped() for s in reversed(rev))
        else:
            raise ValueError("codec config.json has no decoder_kwargs" +
                             (" (nor reversed_decoder_kwargs)" if v2 else " (v1 does not derive it from "
                                                                          "reversed_decoder_kwargs)"))
        qk = dict(cfg.get("quantizer_kwargs") or {})
        qtype = qk.get("quantizer_type", cfg.get("quantizer_type", "rlfq"))
        defaults = QuantizerConfig()
        quantizer = QuantizerConfig(
            input_dim=int(qk.get("input_dim", defaults.input_dim)),
            rvq_dim=int(qk.get("rvq_dim", defaults.rvq_dim)),
            output_dim=int(qk.get("output_dim", defaults.output_dim)),
            num_quantizers=int(qk.get("num_quantizers", defaults.num_quantizers)),
            codebook_size=int(qk.get("codebook_size", defaults.codebook_size)),
            codebook_dim=int(qk.get("codebook_dim", defaults.codebook_dim)),
            quantizer_type=str(qtype))
        return cls(sampling_rate=int(rate), downsample_rate=int(cfg["downsample_rate"]), channels=channels,
                   v2=v2, channel_interleave=bool(cfg.get("enable_channel_interleave", False)),
                   context_duration=float(ctx), encoder=encoder, decoder=decoder, quantizer=quantizer,
                   compute_dtype=str(cfg.get("compute_dtype", cfg.get("codec_compute_dtype", "fp32"))),
                   attention_implementation=str(cfg.get("attention_implementation",
                                                        cfg.get("attention_backend", "sdpa"))),
                   name=name or cls.name)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "CodecConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{path} not found: the codec must be a Hugging Face directory with config.json")
        return cls.from_dict(json.loads(path.read_text()), name=Path(model_dir).name)

    def to_dict(self) -> dict[str, Any]:
        """config.json in the upstream layout (from_dict reads it back)."""
        q = self.quantizer
        d: dict[str, Any] = {
            "model_type": "moss-audio-tokenizer" if self.v2 else "speech_tokenizer",
            "sampling_rate": self.sampling_rate,
            "downsample_rate": self.downsample_rate,
            "causal_transformer_context_duration": self.context_duration,
            "encoder_kwargs": [s.to_dict() for s in self.encoder],
            "decoder_kwargs": [s.to_dict() for s in self.decoder],
            "quantizer_type": q.quantizer_type,
            "quantizer_kwargs": {"input_dim": q.input_dim, "rvq_dim": q.rvq_dim, "output_dim": q.output_dim,
                                 "num_quantizers": q.num_quantizers, "codebook_size": q.codebook_size,
                                 "codebook_dim": q.codebook_dim, "quantizer_type": q.quantizer_type},
            "code_dim": q.output_dim,
        }
        if self.v2:
            d["number_channels"] = self.channels
            d["enable_channel_interleave"] = self.channel_interleave
        return d


# ---- presets -------------------------------------------------------------------
_T, _P = StageConfig.transformer, StageConfig.patch


def full_v2() -> CodecConfig:
    """The released v2 shapes (§1.4): 48 kHz stereo, 2.12 B parameters."""
    big = dict(d=1280, heads=20, layers=32, ff=5120)
    mid = dict(d=768, heads=12, layers=12, ff=3072)
    decoder = (_T(768, 1280, **big, ctx=10), _P(2), _T(640, 768, **mid, ctx=10), _P(2),
               _T(384, 768, **mid, ctx=8), _P(2), _T(384, 768, **mid, ctx=4), _P(2),
               _T(384, 768, **mid, ctx=2), _P(2), _T(384, 240, **mid, ctx=1), _P(240))
    encoder = (_P(240), _T(240, 384, **mid, ctx=1), _P(2), _T(768, 384, **mid, ctx=2), _P(2),
               _T(768, 384, **mid, ctx=4), _P(2), _T(768, 384, **mid, ctx=8), _P(2),
               _T(768, 640, **mid, ctx=10), _P(2), _T(1280, 768, **big, ctx=10))
    return CodecConfig(sampling_rate=48000, downsample_rate=3840, channels=2, v2=True, channel_interleave=True,
                       context_duration=10.0, encoder=encoder, decoder=decoder,
                       name="moss-audio-tokenizer-v2")


def full_v1() -> CodecConfig:
    """The released v1 shapes (§1.4): 24 kHz mono, 1.78 B parameters."""
    big = dict(d=1280, heads=20, layers=32, ff=5120)
    mid = dict(d=768, heads=12, layers=12, ff=3072)
    decoder = (_T(768, 1280, **big), _P(2), _T(640, 768, **mid), _P(2), _T(384, 768, **mid), _P(2),
               _T(384, 240, **mid), _P(240))
    encoder = (_P(240), _T(240, 384, **mid), _P(2), _T(768, 384, **mid), _P(2), _T(768, 640, **mid), _P(2),
               _T(1280, 768, **big))
    return CodecConfig(sampling_rate=24000, downsample_rate=1920, channels=1, v2=False, channel_interleave=False,
                       context_duration=10.0, encoder=encoder, decoder=decoder, name="moss-audio-tokenizer-v1")


_TINY_Q = QuantizerConfig(input_dim=32, rvq_dim=16, output_dim=32, num_quantizers=32, codebook_size=1024,
                          codebook_dim=8)


def tiny_v2(window: int | None = None) -> CodecConfig:
    """v2-shaped (48 kHz stereo, hop 3840, patches 2,2,2,2,2,240) at toy widths.

    Stage 0 is 64 wide with 4 heads, the rest 32 wide with 2 heads (head dims
    16 everywhere; nothing assumes 64). Windows come from the real formula:
    10 tokens at 12.5 Hz and 20 at every faster stage, so a few frames already
    overflow them. `window` overrides every window.
    """
    w0 = dict(d=64, heads=4, layers=1, ff=128)
    w = dict(d=32, heads=2, layers=1, ff=64)
    decoder = (_T(32, 64, **w0, ctx=0.8), _P(2), _T(32, 32, **w, ctx=0.8), _P(2), _T(16, 32, **w, ctx=0.4),
               _P(2), _T(16, 32, **w, ctx=0.2), _P(2), _T(16, 32, **w, ctx=0.1), _P(2),
               _T(16, 240, **w, ctx=0.05), _P(240))
    encoder = (_P(240), _T(240, 16, **w, ctx=0.05), _P(2), _T(32, 16, **w, ctx=0.1), _P(2),
               _T(32, 16, **w, ctx=0.2), _P(2), _T(32, 16, **w, ctx=0.4), _P(2), _T(32, 32, **w, ctx=0.8),
               _P(2), _T(64, 32, **w0, ctx=0.8))
    return CodecConfig(sampling_rate=48000, downsample_rate=3840, channels=2, v2=True, channel_interleave=True,
                       context_duration=10.0, encoder=encoder, decoder=decoder, quantizer=_TINY_Q,
                       window_override=window, name="moss-audio-tokenizer-v2-tiny")


def tiny_v1(window: int | None = None) -> CodecConfig:
    """v1-shaped (24 kHz mono, hop 1920, patches 2,2,2,240) at toy widths; a
    0.8 s global window (10, 20, 40, 80 tokens). Stage 2 is square (32->32 at
    d 32), so in v1 naming it has no projection tensors at all."""
    w0 = dict(d=64, heads=4, layers=1, ff=128)
    w = dict(d=32, heads=2, layers=1, ff=64)
    decoder = (_T(32, 64, **w0), _P(2), _T(32, 32, **w), _P(2), _T(16, 32, **w), _P(2), _T(16, 240, **w), _P(240))
    encoder = (_P(240), _T(240, 16, **w), _P(2), _T(32, 32, **w), _P(2), _T(64, 32, **w), _P(2), _T(64, 32, **w0))
    return CodecConfig(sampling_rate=24000, downsample_rate=1920, channels=1, v2=False, channel_interleave=False,
                       context_duration=0.8, encoder=encoder, decoder=decoder, quantizer=_TINY_Q,
                       window_override=window, name="moss-audio-tokenizer-v1-tiny")


PRESETS = {"tiny": tiny_v2, "tiny_v2": tiny_v2, "tiny_v1": tiny_v1, "full": full_v2, "full_v2": full_v2,
           "full_v1": full_v1}

# Codebooks per frame a stream decodes when it names none: MOSS-TTS Local v1.5's n_vq.
DEFAULT_CODEBOOKS = 12
