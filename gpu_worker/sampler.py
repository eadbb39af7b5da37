"""Seeded, batch-invariant sampler (spec moss_tts_local.md §4.1, §4.3).

Gumbel-max with noise that depends only on (request seed, position, column):
a row's draw never depends on the other rows of the batch. Everything is
vectorised over the batch with per-row parameters, no Python loop over rows
and no host sync, so it can be captured in a CUDA graph; the math is kept
simple so that a fused kernel can mirror it step by step:

    z  = logits in max(dtype, float32)            (penalty applied beforehand)
    greedy rows (T <= 0): first argmax of z
    s  = z / T
    top-k (0 < k < V): s[s < kth largest] = -inf  (ties with kth survive)
    top-p (0 < p < 1): stable descending sort, P = softmax, C = cumsum;
                       keep sorted i iff i == 0 or C[i-1] <= p
    all -inf: first argmax of z
    v  = float64(s) + gumbel(seed, position, j); result = first argmax of v
    (any NaN: the first NaN index)
"""

from __future__ import annotations

import torch

from chorus.seeds import derive_sampling_seed

__all__ = [
    "derive_sampling_seed",
    "murmur3_hash",
    "gumbel_noise",
    "apply_repetition_penalty",
    "sample",
    "top_p_keep_sorted",
    "first_argmax",
]

_M32 = 0xFFFFFFFF
_C1 = 0xCC9E2D51
_C2 = 0x1B873593
_LOG_MIN = -1.7976931348623157e308
_LOG_MAX = -(2.0 ** -32)  # = -2.3283064365386963e-10


# ---- MurmurHash3_x86_32 on int64 tensors holding uint32 values ---------------
def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2^32 for 0 <= a < 2^32 without int64 overflow: split a in 16-bit halves."""
    lo = (a & 0xFFFF) * c                    # < 2^48
    hi = (((a >> 16) * c) & 0xFFFF) << 16    # only the low 16 bits of hi*c survive the shift
    return (lo + hi) & _M32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _mix_k(w: torch.Tensor) -> torch.Tensor:
    return _mul32(_rotl32(_mul32(w, _C1), 15), _C2)


def _mix_h(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    h = _rotl32(h ^ k, 13)
    return (h * 5 + 0xE6546B64) & _M32


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def murmur3_hash(seed: torch.Tensor, position: torch.Tensor, columns: int) -> torch.Tensor:
    """MurmurHash3_x86_32 (seed 0) over the 16-byte key LE32(seed lo) ‖ LE32(seed hi) ‖
    LE32(position mod 2^32) ‖ LE32(j), for j in 0..columns-1.

    seed, position: int64 [B]. Returns int64 [B, columns] with values in [0, 2^32).
    """
    seed = seed.to(torch.int64)
    position = position.to(torch.int64)
    h = torch.zeros_like(seed)
    for w in (seed & _M32, (seed >> 32) & _M32, position & _M32):  # 3 fixed words per row
        h = _mix_h(h, _mix_k(w))
    kj = _mix_k(torch.arange(columns, dtype=torch.int64, device=seed.device))  # 4th word per column
    h = _mix_h(h[:, None], kj[None, :])
    return _fmix(h ^ 16)


def gumbel_noise(seed: torch.Tensor, position: torch.Tensor, columns: int) -> torch.Tensor:
    """float64 [B, columns]: u = h / 4294967295, L = clamp(ln u, -DBL_MAX, -2^-32), g = -ln(-L)."""
    u = murmur3_hash(seed, position, columns).to(torch.float64) / 4294967295.0
    log_u = torch.log(u).clamp(min=_LOG_MIN, max=_LOG_MAX)
    return -torch.log(-log_u)


# ---- filtering -----------------------------------------------------------------
def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def apply_repetition_penalty(logits: torch.Tensor, presence: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """§4.1 step 1: where presence, z*pen if z < 0 else z/pen. Computed in
    max(logits dtype, float32), which is the returned dtype; rows whose penalty
    is exactly 1.0 (and absent ids) keep their values bit-for-bit."""
    z = logits.to(_work_dtype(logits.dtype))
    pen = penalty.to(z.dtype)[:, None]
    penalised = torch.where(z < 0, z * pen, z / pen)
    return torch.where(presence & (pen != 1), penalised, z)


def first_argmax(v: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum along the last dim (int64); if a row has a
    NaN, the index of its first NaN. An all -inf row gives 0."""
    nan = torch.isnan(v)
    idx = torch.where(nan, float("-inf"), v).argmax(dim=-1)
    nan_idx = nan.to(torch.uint8).argmax(dim=-1)
    return torch.where(nan.any(dim=-1), nan_idx, idx)


def top_p_keep_sorted(probs_sorted: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p keep mask over descending-sorted probabilities [B, V]: keep i iff
    i == 0 or C[i-1] <= p (the mass strictly before i is at most p)."""
    cum = probs_sorted.cumsum(dim=-1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    keep = before <= top_p.to(cum.dtype)[:, None]
    keep[:, 0] = True
    return keep


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
) -> torch.Tensor:
    """One draw per row (int64 [B]) from logits [B, V] with per-row params:
    temperature [B] (<= 0: greedy), top_k [B] int64 (active iff 0 < k < V),
    top_p [B] (active iff 0 < p < 1), seed [B] int64, position [B] int64.
    Computes in max(logits dtype, float32); pass temperature/top_p in that
    dtype (or exactly representable values) for bit-exact comparisons."""
    B, V = logits.shape
    z = logits.to(_work_dtype(logits.dtype))
    t = temperature.to(z.dtype)
    greedy = t <= 0
    s = z / torch.where(greedy, torch.ones_like(t), t)[:, None]

    # One stable descending sort serves top-k and top-p: top-k masks a suffix of
    # the sorted order, so the masked order's ranks equal the unmasked ones.
    s_sorted, order = torch.sort(s, dim=-1, descending=True, stable=True)
    k = top_k.to(torch.int64)
    k_active = (k > 0) & (k < V)
    kth = s_sorted.gather(1, (k.clamp(1, V) - 1)[:, None])
    keep_sorted = ~(k_active[:, None] & (s_sorted < kth))
    p = top_p.to(z.dtype)
    p_active = (p > 0) & (p < 1)
    probs = torch.softmax(torch.where(keep_sorted, s_sorted, float("-inf")), dim=-1)
    keep_sorted = keep_sorted & (top_p_keep_sorted(probs, p) | ~p_active[:, None])
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    s = torch.where(keep, s, float("-inf"))

    v = s.to(torch.float64) + gumbel_noise(seed, position, V)
    drawn = first_argmax(v)
    fallback = greedy | torch.isneginf(s).all(dim=-1)
    return torch.where(fallback, first_argmax(z), drawn)
