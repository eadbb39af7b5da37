"""MOSS-Audio-Tokenizer elementary maps (§3.3 - §3.5): pure tensor functions
with no parameters or state of their own — RoPE, the causal window mask,
patch up/down, channel interleave, weight-norm folding, layer norm and
windowed attention.

Section numbers (§) refer to /work/shared/specs/moss_audio_tokenizer.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Offline attention is computed in query blocks, each against only the keys
# its window can reach, so memory stays O(block * (block + W)) for long audio.
ATTENTION_QUERY_BLOCK = 512


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
