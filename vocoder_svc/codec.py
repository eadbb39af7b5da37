"""MOSS-Audio-Tokenizer: the codec that turns code frames into a waveform
(decode, offline and streaming) and reference audio into code frames (encode).

Written from /work/shared/specs/moss_audio_tokenizer.md; section numbers (§)
below refer to it. Both released layouts are supported:

* v1: 24 kHz mono, 1920 samples per frame, v1 tensor names;
* v2: 48 kHz stereo carried as one sample-interleaved stream, 3840 samples
  per channel per frame, v2 tensor names (always-present projections).

The math, top to bottom:

    codes[n_q, B, T] --quantizer decode (fp32, §3.2)--> [B, 768, T]
      --decoder stages: ProjectedTransformer (§3.3) / patch up (§3.4)--> [B, 1, T*hop*C]
      --de-interleave (§3.5)--> [B, C, T*hop]

Streaming (§4) keeps, per attention layer, the rotated keys, values and
absolute positions of the last W tokens (a cache, concatenated with the new
chunk; never a ring), so a chunked decode equals the offline decode for any
partition of the frames.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

TRANSFORMER = "Transformer"
PATCH = "PatchedPretransform"
LN_EPS = 1e-5
# Offline attention is computed in query blocks, each against only the keys
# its window can reach, so memory stays O(block * (block + W)) for long audio.
ATTENTION_QUERY_BLOCK = 512


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


# =============================================================================
# Elementary maps (§3.3 - §3.5)
# =============================================================================

def rope_cos_sin(pos: Tensor, head_dim: int, max_period: float) -> tuple[Tensor, Tensor]:
    """cos/sin [..., head_dim/2] of the interleaved-pair RoPE at integer positions `pos`.

    The exact fp32 recipe of §3.3: c in double, then an fp32 product i*c, an
    fp32 exp, an fp32 product freq*pos, fp32 cos/sin. (pow(P, -2i/D) differs
    by a few ulp, which grows to visible phase drift over long streams.)
    """
    c = -2.0 * math.log(max_period) / head_dim
    i = torch.arange(head_dim // 2, dtype=torch.float32, device=pos.device)
    freq = torch.exp(i * torch.tensor(c, dtype=torch.float32, device=pos.device))
    angle = pos.to(torch.float32).unsqueeze(-1) * freq
    return torch.cos(angle), torch.sin(angle)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (2i, 2i+1) of x [..., T, D] by the angles behind cos/sin [..., T, D/2].

    Rotation runs in at least fp32 (fp64 models stay fp64), then casts back."""
    work = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(work)
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    cos, sin = cos.to(work), sin.to(work)
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


def window_mask(pos_q: Tensor, pos_k: Tensor, window: int) -> Tensor:
    """Boolean [..., Tq, Tk]: key j is visible from query p iff it exists (pos >= 0)
    and 0 <= p - pos_k[j] < window (causal, the window counts the query itself)."""
    diff = pos_q.unsqueeze(-1) - pos_k.unsqueeze(-2)
    return (pos_k.unsqueeze(-2) >= 0) & (diff >= 0) & (diff < window)


def patch_up(x: Tensor, h: int) -> Tensor:
    """[B, C*h, L] -> [B, C, L*h]: out[b, c, t*h + j] = in[b, c*h + j, t]."""
    b, ch, length = x.shape
    return x.reshape(b, ch // h, h, length).transpose(2, 3).reshape(b, ch // h, length * h)


def patch_down(x: Tensor, h: int) -> Tensor:
    """[B, C, L*h] -> [B, C*h, L]: out[b, c*h + j, t] = in[b, c, t*h + j] (inverse of patch_up)."""
    b, ch, length = x.shape
    return x.reshape(b, ch, length // h, h).transpose(2, 3).reshape(b, ch * h, length // h)


def interleave(x: Tensor) -> Tensor:
    """[B, C, N] -> [B, 1, C*N] sample-interleaved (L0 R0 L1 R1 ...)."""
    b, ch, n = x.shape
    return x.transpose(1, 2).reshape(b, 1, n * ch)


def deinterleave(x: Tensor, channels: int) -> Tensor:
    """[B, 1, C*M] -> [B, C, M]: channel c gets flat[C*k + c]."""
    b, _, n = x.shape
    return x.reshape(b, n // channels, channels).transpose(1, 2)


def fold_weight_norm(g: Tensor, v: Tensor) -> Tensor:
    """W[o] = g[o] * v[o] / ||v[o]||, the norm over every (in, k) entry of output channel o."""
    work = torch.promote_types(v.dtype, torch.float32)
    g, v = g.to(work), v.to(work)
    norm = v.reshape(v.shape[0], -1).norm(dim=1).reshape(-1, *([1] * (v.dim() - 1)))
    return g.reshape(-1, *([1] * (v.dim() - 1))) * v / norm


def _layer_norm(x: Tensor, norm: nn.LayerNorm) -> Tensor:
    # Half-precision inputs are normalised in fp32 (the reference's autocast does the same).
    if x.dtype in (torch.float16, torch.bfloat16):
        return F.layer_norm(x.float(), norm.normalized_shape, norm.weight.float(), norm.bias.float(),
                            norm.eps).to(x.dtype)
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def windowed_attention(q: Tensor, k: Tensor, v: Tensor, pos_q: Tensor, pos_k: Tensor, window: int,
                       n_prev: int) -> Tensor:
    """Softmax attention of q [B, H, Tq, D] over k, v [B, H, n_prev + Tq, D] under the window mask.

    Keys are (cache of n_prev entries, then one per query), in chronological
    order; query i sits at key index n_prev + i. Queries run in blocks, each
    against the key range its window can reach: for block [a, b) that is
    [n_prev + a - W + 1, n_prev + b). Scale 1/sqrt(D) is SDPA's default.
    """
    tq = q.shape[2]
    outs = []
    for a in range(0, tq, ATTENTION_QUERY_BLOCK):
        b = min(tq, a + ATTENTION_QUERY_BLOCK)
        k0, k1 = max(0, n_prev + a - window + 1), n_prev + b
        mask = window_mask(pos_q[:, a:b], pos_k[:, k0:k1], window).unsqueeze(1)  # [B, 1, Tq', Tk']
        outs.append(F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, k0:k1], v[:, :, k0:k1],
                                                   attn_mask=mask))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


# =============================================================================
# Modules (§2): the attribute names are the checkpoint's tensor names
# =============================================================================

# Batch-invariant streaming (decode_step(batch_invariant=True)): a folded GEMM
# over [B*T, in] picks its kernel and reduction order by B*T, and a reduction
# over a [n_q, B, T, C] tensor vectorises by shape, so one stream's result
# would move (~1e-6) with the number of streams sharing the forward. In this
# mode every GEMM runs per stream (one bmm of B [T, in] x [in, out] products,
# each shaped exactly as it would be alone) and the codebook sum is a fixed
# sequence of element-wise adds. Attention, norms, RoPE and patching are
# already per row. Set per thread, for the duration of one decode_step.
_BATCH_INVARIANT = threading.local()


def _batch_invariant() -> bool:
    return getattr(_BATCH_INVARIANT, "on", False)


@contextlib.contextmanager
def batch_invariant(on: bool = True):
    prev = _batch_invariant()
    _BATCH_INVARIANT.on = on
    try:
        yield
    finally:
        _BATCH_INVARIANT.on = prev


class Linear(nn.Linear):
    """nn.Linear (same tensors, same names) that runs per stream in batch-invariant mode."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3 or not _batch_invariant():
            return super().forward(x)
        y = torch.bmm(x.contiguous(), self.weight.t().unsqueeze(0).expand(x.shape[0], -1, -1))
        return y if self.bias is None else y + self.bias


_invariant_mode = batch_invariant  # decode_step's argument shadows the name


def _linear(cin: int, cout: int) -> nn.Linear:
    return Linear(cin, cout, bias=False)


@dataclass
class KVCache:
    """One attention layer's memory of the last W tokens (§4.1), in chronological order.

    k, v: [B, H, W, D] (rotated keys, values); pos: [B, W] absolute positions, -1 = empty."""

    k: Tensor
    v: Tensor
    pos: Tensor


@dataclass
class StageCache:
    """Streaming state of one Transformer stage for a batch of streams."""

    offset: Tensor  # [B] tokens this stage has consumed per stream
    layers: list[KVCache]


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, v2: bool):
        super().__init__()
        self.heads = heads
        if v2:
            self.in_proj = _linear(d, 3 * d)
            self.out_proj = _linear(d, d)
        else:
            self.in_projs = nn.ModuleList([_linear(d, 3 * d)])
            self.out_projs = nn.ModuleList([_linear(d, d)])

    def _proj(self, which: str) -> nn.Linear:
        return getattr(self, which) if hasattr(self, which) else getattr(self, which + "s")[0]

    def forward(self, a: Tensor, pos: Tensor, cos: Tensor, sin: Tensor, window: int,
                cache: KVCache | None) -> tuple[Tensor, KVCache | None]:
        bsz, t, d = a.shape
        h = self.heads
        # Rows of the fused weight: [Q | K | V], head h owning rows [D*h, D*(h+1)) of each block.
        qkv = self._proj("in_proj")(a).reshape(bsz, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        q, k, v = apply_rope(qkv[0], cos, sin), apply_rope(qkv[1], cos, sin), qkv[2]
        if cache is None:
            o = windowed_attention(q, k, v, pos, pos, window, n_prev=0)
            new_cache = None
        else:
            kc, vc = torch.cat((cache.k, k), dim=2), torch.cat((cache.v, v), dim=2)
            pc = torch.cat((cache.pos, pos), dim=1)
            o = windowed_attention(q, kc, vc, pos, pc, window, n_prev=cache.k.shape[2])
            # Keep the last W entries; clone so the chunk's full tensors can be freed.
            new_cache = KVCache(kc[:, :, -window:].clone(), vc[:, :, -window:].clone(), pc[:, -window:].clone())
        o = o.transpose(1, 2).reshape(bsz, t, d)  # heads back to channels, head-major
        return self._proj("out_proj")(o), new_cache


class LayerScale(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(d))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


class TransformerLayer(nn.Module):
    """Pre-norm layer: y += s1*Attn(LN1 y); y += s2*FFN(LN2 y), FFN = W2 GELU_erf(W1 .)."""

    def __init__(self, s: StageConfig, v2: bool):
        super().__init__()
        d, ff = s.d_model, s.dim_feedforward
        self.norm1 = nn.LayerNorm(d, eps=LN_EPS)
        self.self_attn = Attention(d, s.num_heads, v2)
        self.norm2 = nn.LayerNorm(d, eps=LN_EPS)
        if v2:
            self.ffn = nn.Sequential(_linear(d, ff), nn.GELU(approximate="none"), _linear(ff, d))
        else:
            self.linear1 = _linear(d, ff)
            self.linear2 = _linear(ff, d)
        self.layer_scale_1 = LayerScale(d) if s.layer_scale is not None else nn.Identity()
        self.layer_scale_2 = LayerScale(d) if s.layer_scale is not None else nn.Identity()

    def _ffn(self, x: Tensor) -> Tensor:
        if hasattr(self, "ffn"):
            return self.ffn(x)
        return self.linear2(F.gelu(self.linear1(x), approximate="none"))

    def forward(self, y: Tensor, pos: Tensor, cos: Tensor, sin: Tensor, window: int,
                cache: KVCache | None) -> tuple[Tensor, KVCache | None]:
        a, new_cache = self.self_attn(_layer_norm(y, self.norm1), pos, cos, sin, window, cache)
        y = y + self.layer_scale_1(a)
        y = y + self.layer_scale_2(self._ffn(_layer_norm(y, self.norm2)))
        return y, new_cache


class Transformer(nn.Module):
    def __init__(self, s: StageConfig, v2: bool):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(s, v2) for _ in range(s.num_layers))


class ProjectedTransformer(nn.Module):
    """[B, C_in, T] -> in_proj -> layers -> out_proj -> [B, C_out, T] (§3.3).

    v1 omits a projection whose widths are equal (identity); v2 always has both."""

    def __init__(self, s: StageConfig, v2: bool, window: int):
        super().__init__()
        self.cfg, self.window = s, window
        self.input_proj = _linear(s.input_dimension, s.d_model) if v2 or s.input_dimension != s.d_model else None
        self.transformer = Transformer(s, v2)
        self.output_proj = (_linear(s.d_model, s.output_dimension)
                            if v2 or s.output_dimension != s.d_model else None)

    def new_cache(self, batch: int, dtype: torch.dtype, device: torch.device) -> StageCache:
        """A fresh stream state: offset 0, every position empty (-1)."""
        h, dh, w = self.cfg.num_heads, self.cfg.head_dim, self.window
        layers = [KVCache(torch.zeros(batch, h, w, dh, dtype=dtype, device=device),
                          torch.zeros(batch, h, w, dh, dtype=dtype, device=device),
                          torch.full((batch, w), -1, dtype=torch.long, device=device))
                  for _ in range(self.cfg.num_layers)]
        return StageCache(torch.zeros(batch, dtype=torch.long, device=device), layers)

    def forward(self, x: Tensor, cache: StageCache | None = None) -> Tensor:
        """Offline when cache is None (positions from 0); otherwise continue the
        streams in `cache` and advance it in place."""
        y = x.transpose(1, 2)
        if self.input_proj is not None:
            y = self.input_proj(y)
        bsz, t = y.shape[0], y.shape[1]
        steps = torch.arange(t, device=y.device)
        pos = steps.expand(bsz, t) if cache is None else cache.offset.unsqueeze(1) + steps
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.max_period)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
        for i, layer in enumerate(self.transformer.layers):
            y, new_kv = layer(y, pos, cos, sin, self.window, None if cache is None else cache.layers[i])
            if cache is not None:
                cache.layers[i] = new_kv
        if cache is not None:
            cache.offset = cache.offset + t
        if self.output_proj is not None:
            y = self.output_proj(y)
        return y.transpose(1, 2)


class PatchedPretransform(nn.Module):
    """No parameters; holds its place in the stage index (decoder: patch up, encoder: patch down)."""

    def __init__(self, patch_size: int):
        super().__init__()
        self.patch_size = patch_size


class WNConv1x1(nn.Module):
    """1x1 Conv1d with bias; its weight norm is folded at load time (§2.2)."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cout, cin, 1))
        self.bias = nn.Parameter(torch.empty(cout))

    def forward(self, x: Tensor) -> Tensor:  # [B, cin, T] -> [B, cout, T]
        if _batch_invariant():  # as rows [B, T, cin] x [cin, cout]: the shape the GEMMs above use
            w = self.weight[:, :, 0].t().unsqueeze(0).expand(x.shape[0], -1, -1)
            return (torch.bmm(x.transpose(1, 2).contiguous(), w) + self.bias).transpose(1, 2)
        return F.conv1d(x, self.weight, self.bias)


def _maybe_conv(cin: int, cout: int) -> WNConv1x1 | None:
    return WNConv1x1(cin, cout) if cin != cout else None  # equal widths: identity, no tensors


def _apply(m: nn.Module | None, x: Tensor) -> Tensor:
    return x if m is None else m(x)


class LFQ(nn.Module):
    """One residual stage: project to the codebook space, pick, project back."""

    def __init__(self, q: QuantizerConfig):
        super().__init__()
        self.in_proj = _maybe_conv(q.rvq_dim, q.codebook_dim)
        self.out_proj = _maybe_conv(q.codebook_dim, q.rvq_dim)
        self.codebook = nn.Embedding(q.codebook_size, q.codebook_dim)


class ResidualLFQ(nn.Module):
    """The quantizer (§3.2, §5.3). Always runs in fp32 (fp64 for fp64 models)."""

    def __init__(self, q: QuantizerConfig):
        super().__init__()
        self.cfg = q
        self.input_proj = _maybe_conv(q.input_dim, q.rvq_dim)
        self.output_proj = _maybe_conv(q.rvq_dim, q.output_dim)
        self.quantizers = nn.ModuleList(LFQ(q) for _ in range(q.num_quantizers))
        self._table: tuple[tuple, Tensor] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.quantizers[0].codebook.weight.dtype

    def table(self) -> Tensor:
        """Folded decode table [num_quantizers * K, rvq_dim]: row i*K + c = Out_i(codebook_i[c]).

        Rebuilt whenever a weight changes (keyed on storage and version counters)."""
        params = [p for lfq in self.quantizers for p in lfq.parameters()]
        key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)
        if self._table is None or self._table[0] != key:
            with torch.no_grad():
                rows = [_apply(lfq.out_proj, lfq.codebook.weight.t().unsqueeze(0))[0].t() for lfq in self.quantizers]
                self._table = (key, torch.cat(rows, dim=0).contiguous())
        return self._table[1]

    def decode(self, codes: Tensor) -> Tensor:
        """codes [n_q, B, T] -> [B, output_dim, T]: sum the first n_q codebooks' projected
        rows (each with its own bias), then the output projection. Gather-sum on the table."""
        n_q = codes.shape[0]
        k = self.cfg.codebook_size
        offsets = (torch.arange(n_q, device=codes.device) * k).view(n_q, 1, 1)
        rows = F.embedding(codes + offsets, self.table())  # [n_q, B, T, rvq]
        if _batch_invariant():
            z = rows[0].clone()
            for i in range(1, n_q):
                z += rows[i]
        else:
            z = rows.sum(dim=0)  # [B, T, rvq]
        return _apply(self.output_proj, z.transpose(1, 2))

    def decode_per_codebook(self, codes: Tensor) -> Tensor:
        """Reference for decode(): the literal per-codebook sum, no folded table."""
        z = 0
        for i in range(codes.shape[0]):
            lfq = self.quantizers[i]
            z = z + _apply(lfq.out_proj, lfq.codebook(codes[i]).transpose(1, 2))
        return _apply(self.output_proj, z)

    def encode(self, h: Tensor, n_q: int) -> Tensor:
        """h [B, input_dim, T] -> codes [n_q, B, T] by residual LFQ (§5.3)."""
        r = _apply(self.input_proj, h.to(self.dtype))
        codes = []
        for lfq in self.quantizers[:n_q]:
            e = F.normalize(_apply(lfq.in_proj, r), dim=1, eps=1e-12)  # [B, cd, T]
            cb = F.normalize(lfq.codebook.weight, dim=1, eps=1e-12)  # [K, cd]
            idx = torch.einsum("bct,kc->btk", e, cb).argmax(dim=-1)  # max cosine similarity
            # Subtract the projected *raw* codebook row, exactly what decode adds back.
            r = r - _apply(lfq.out_proj, lfq.codebook(idx).transpose(1, 2))
            codes.append(idx)
        return torch.stack(codes, dim=0)


class StreamState:
    """Decoder state of one stream (§4.1): per Transformer stage its token
    offset and, per layer, the last W keys/values/positions. Patches,
    projections, norms, FFNs and the quantizer hold no state."""

    def __init__(self, stages: dict[int, StageCache]):
        self.stages = stages  # decoder stage index -> StageCache with batch 1
        self.frames = 0  # code frames decoded so far

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for c in self.stages.values() for kv in c.layers
                   for t in (kv.k, kv.v, kv.pos))


def _stack_caches(caches: Sequence[StageCache]) -> StageCache:
    if len(caches) == 1:
        return StageCache(caches[0].offset, list(caches[0].layers))
    layers = [KVCache(torch.cat([c.layers[i].k for c in caches]), torch.cat([c.layers[i].v for c in caches]),
                      torch.cat([c.layers[i].pos for c in caches])) for i in range(len(caches[0].layers))]
    return StageCache(torch.cat([c.offset for c in caches]), layers)


def _unstack_cache(batch: StageCache, into: Sequence[StageCache]) -> None:
    for b, c in enumerate(into):
        c.offset = batch.offset[b:b + 1]
        c.layers = [KVCache(kv.k[b:b + 1], kv.v[b:b + 1], kv.pos[b:b + 1]) for kv in batch.layers]


class MossAudioTokenizer(nn.Module):
    def __init__(self, config: CodecConfig):
        super().__init__()
        self.config = config
        dec_w, enc_w = config.decoder_windows(), config.encoder_windows()
        self.quantizer = ResidualLFQ(config.quantizer)
        self.encoder = nn.ModuleList(
            PatchedPretransform(s.patch_size) if s.is_patch else ProjectedTransformer(s, config.v2, enc_w[i])
            for i, s in enumerate(config.encoder))
        self.decoder = nn.ModuleList(
            PatchedPretransform(s.patch_size) if s.is_patch else ProjectedTransformer(s, config.v2, dec_w[i])
            for i, s in enumerate(config.decoder))

    # ---- facts -------------------------------------------------------------------
    @property
    def sample_rate(self) -> int:
        return self.config.sampling_rate

    @property
    def channels(self) -> int:
        return self.config.channels

    @property
    def hop(self) -> int:
        return self.config.hop

    @property
    def num_codebooks(self) -> int:
        return self.config.quantizer.num_quantizers

    @property
    def codebook_size(self) -> int:
        return self.config.quantizer.codebook_size

    @property
    def dtype(self) -> torch.dtype:
        return next(self.decoder.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return self.quantizer.quantizers[0].codebook.weight.device

    # ---- decode ----------------------------------------------------------------------
    def _check_codes(self, codes: Tensor) -> Tensor:
        if codes.dim() == 2:
            codes = codes.unsqueeze(1)
        if codes.dim() != 3:
            raise ValueError(f"codes must be [n_q, B, T] (or [n_q, T]), got shape {tuple(codes.shape)}")
        if codes.dtype.is_floating_point or codes.dtype == torch.bool:
            raise ValueError(f"codes must be an integer tensor, got {codes.dtype}")
        n_q = codes.shape[0]
        if not 1 <= n_q <= self.num_codebooks:
            raise ValueError(f"codes have {n_q} codebooks; this codec decodes 1..{self.num_codebooks}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size):
            raise ValueError(f"codes must lie in [0, {self.codebook_size}); got "
                             f"[{int(codes.min())}, {int(codes.max())}] (split segments at pad frames first)")
        return codes.to(device=self.device, dtype=torch.long)

    def _decode(self, codes: Tensor, caches: dict[int, StageCache] | None) -> Tensor:
        x = self.quantizer.decode(codes).to(self.dtype)  # [B, out_dim, T]
        for i, m in enumerate(self.decoder):
            if isinstance(m, PatchedPretransform):
                x = patch_up(x, m.patch_size)
            else:
                x = m(x, None if caches is None else caches[i])
        return deinterleave(x, self.config.internal_channels)  # [B, C, T*hop]

    @torch.inference_mode()
    def decode(self, codes: Tensor) -> Tensor:
        """Offline decode: codes [n_q, B, T] (first n_q codebooks) -> waveform [B, C, T*hop]."""
        codes = self._check_codes(codes)
        if codes.shape[2] == 0:
            return torch.zeros(codes.shape[1], self.channels, 0, dtype=self.dtype, device=self.device)
        return self._decode(codes, None)

    def new_stream(self) -> StreamState:
        """A fresh streaming state (one stream)."""
        dtype, device = self.dtype, self.device
        return StreamState({i: m.new_cache(1, dtype, device) for i, m in enumerate(self.decoder)
                            if isinstance(m, ProjectedTransformer)})

    @torch.inference_mode()
    def decode_step(self, states: StreamState | Sequence[StreamState], codes: Tensor,
                    batch_invariant: bool = False) -> Tensor:
        """Decode T new frames for each stream in `states` (one batch row each, same T).

        codes [n_q, B, T] with B = len(states) ([n_q, T] for one stream).
        Returns [B, C, T*hop] and advances every state; the states change
        only once the whole step has succeeded.

        batch_invariant: every stream's output is bit-identical whatever else
        shares the step (per-stream GEMMs, see `batch_invariant`); use it for
        every step of a stream, batched or alone, to get the same bytes.
        """
        if isinstance(states, StreamState):
            states = [states]
        codes = self._check_codes(codes)
        if codes.shape[1] != len(states):
            raise ValueError(f"codes batch {codes.shape[1]} != {len(states)} streams")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("a stream appears twice in one step")
        t = codes.shape[2]
        if t == 0:
            return torch.zeros(len(states), self.channels, 0, dtype=self.dtype, device=self.device)
        caches = {i: _stack_caches([s.stages[i] for s in states]) for i in states[0].stages}
        with _invariant_mode(batch_invariant):
            wav = self._decode(codes, caches)
        for i, batch in caches.items():
            _unstack_cache(batch, [s.stages[i] for s in states])
        for s in states:
            s.frames += t
        return wav

    # ---- encode (§5) -------------------------------------------------------------------
    @torch.inference_mode()
    def encode(self, wav: Tensor, n_q: int | None = None) -> Tensor:
        """Reference waveform [B, C, N] (or [C, N]) at the codec rate -> codes [n_q, B, floor(N/hop)].

        Only whole frames are encoded: the encoder is causal, so the frames
        before a partial last frame do not depend on it, and its codes would
        not depend on the input at all (§5.2, floor)."""
        if wav.dim() == 2:
            wav = wav.unsqueeze(0)
        n_q = self.num_codebooks if n_q is None else n_q
        if not 1 <= n_q <= self.num_codebooks:
            raise ValueError(f"n_q must be in 1..{self.num_codebooks}, got {n_q}")
        if wav.dim() != 3 or wav.shape[1] != self.channels:
            raise ValueError(f"wav must be [B, {self.channels}, N], got shape {tuple(wav.shape)}")
        t = wav.shape[2] // self.hop
        if t == 0:
            return torch.zeros(n_q, wav.shape[0], 0, dtype=torch.long, device=self.device)
        x = wav[:, :, :t * self.hop].to(device=self.device, dtype=self.dtype)
        x = interleave(x)  # [B, 1, C*N]; a no-op reshape for mono
        for m in self.encoder:
            x = patch_down(x, m.patch_size) if isinstance(m, PatchedPretransform) else m(x)
        return self.quantizer.encode(x, n_q)


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
