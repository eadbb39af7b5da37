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

The configuration lives in codec_config.py and the elementary maps in
codec_ops.py (both re-exported here); this module owns the nn.Modules and
MossAudioTokenizer. Building and loading one (build_codec, load_codec) is
codec_checkpoint.py, which imports this module.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vocoder_svc.codec_config import (PATCH, PRESETS, TRANSFORMER, CodecConfig, QuantizerConfig, StageConfig,
                                      full_v1, full_v2, tiny_v1, tiny_v2)
from vocoder_svc.codec_ops import (ATTENTION_QUERY_BLOCK, _layer_norm, apply_rope, deinterleave, fold_weight_norm,
                                   interleave, patch_down, patch_up, rope_cos_sin, window_mask, windowed_attention)

__all__ = [
    # codec_config
    "TRANSFORMER", "PATCH", "StageConfig", "QuantizerConfig", "CodecConfig", "full_v2", "full_v1", "tiny_v2",
    "tiny_v1", "PRESETS",
    # codec_ops
    "ATTENTION_QUERY_BLOCK", "rope_cos_sin", "apply_rope", "window_mask", "patch_up", "patch_down", "interleave",
    "deinterleave", "fold_weight_norm", "windowed_attention",
    # this module
    "LN_EPS", "batch_invariant", "Linear", "KVCache", "StageCache", "Attention", "LayerScale", "TransformerLayer",
    "Transformer", "ProjectedTransformer", "PatchedPretransform", "WNConv1x1", "LFQ", "ResidualLFQ", "StreamState",
    "MossAudioTokenizer",
]

LN_EPS = 1e-5


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
