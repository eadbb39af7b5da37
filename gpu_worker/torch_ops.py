"""The model's numerics in plain torch ops: RMSNorm, the two RoPEs and the local transformer's
attention, with the dtype policy of model.py (promote before reductions and softmax, cast before
the weight multiply). gpu_worker/kernels.py's fused kernels run these on CUDA and take them as
their torch path elsewhere: each kernel must equal its function here.
"""

from __future__ import annotations

import torch
from torch import Tensor


def promote(x: Tensor) -> Tensor:
    """At least fp32 (float64 stays float64 for the CPU determinism tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    xf = promote(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)  # normalised value cast before the weight multiply


def rotate_half_split(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """NeoX RoPE: pairs (i, i + d/2). cos/sin: [N, d/2] broadcast over heads."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rotate_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """GPT-J RoPE: pairs (2i, 2i+1); cos/sin already expanded to the full head dim."""
    rot = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
    return x * cos + rot * sin


def local_attention(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, p: int, cos: Tensor | None,
                    sin: Tensor | None, n_head: int) -> Tensor:
    """The local block's attention at local position p for the whole batch.

    qkv [B, 3*n_head*d] is c_attn's output; k_cache/v_cache [B, n_head, P, d] hold
    positions < p and receive position p here; cos/sin are the fp32 RoPE table rows
    at p (None without RoPE). Returns [B, n_head*d]. kernels.local_attention is this
    in one launch."""
    b = qkv.shape[0]
    q, k, v = qkv.view(b, 3, n_head, -1).unbind(1)
    if cos is not None:
        cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)
        q, k = rotate_interleaved(q, cos, sin), rotate_interleaved(k, cos, sin)
    k_cache[:, :, p] = k
    v_cache[:, :, p] = v
    # Scores and softmax in >= fp32 (as flash/SDPA kernels keep them); probabilities are cast
    # back to the activation dtype for the weighted sum of V. No-ops in fp32/fp64.
    scores = torch.einsum("bhd,bhpd->bhp", promote(q), promote(k_cache[:, :, :p + 1])) * (q.shape[-1] ** -0.5)
    probs = torch.softmax(scores, dim=-1).to(qkv.dtype)
    return torch.einsum("bhp,bhpd->bhd", probs, v_cache[:, :, :p + 1]).reshape(b, -1)
