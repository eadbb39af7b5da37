"""`fused_sample`: the seeded sampler of gpu_worker/sampler.py in one Triton launch.

Repetition penalty, greedy, temperature, top-k, top-p, MurmurHash3 Gumbel noise and the argmax, one
program per row (V <= MAX_SAMPLE_VOCAB): the frame decode samples 13 times a frame, and as torch ops
each draw is dozens of launches. `impl` as in gpu_worker/kernels.py (chorus/triton_support.py); the
torch path is sampler.sample itself, the reference.

Exactness: elementwise math and transcendentals as in kernels.py. The softmax sum and the cumsum
of top-p run in a fixed order in one program per row: batch invariant, but not in torch's order, so
the token exactly at the nucleus boundary can flip: simulated with another summation order on 1M
random rows (N(0,3) logits), the nucleus size changes in ~2-4e-6 of rows at the audio defaults
(T 1.7, top-k 25, top-p 0.8) and ~5e-5 (p 0.8) to ~1.3e-4 (p 0.95) with top-k off; the draw itself
changes only if the flipped token wins the Gumbel max (0 of those rows in the simulation). The spec
(§4.3) allows this for a fused sampler. The hash, the float64 Gumbel draw, top-k with ties, greedy
and the NaN / +-inf / all -inf rules are exact. benchmarks/kernel_checks.py measures it on the GPU.
"""

from __future__ import annotations

import torch

from chorus.triton_support import HAVE_TRITON, KERNEL_DTYPES, launch_opts, triton, tl, use_kernel
from gpu_worker import sampler

__all__ = ["MAX_SAMPLE_VOCAB", "fused_sample"]

MAX_SAMPLE_VOCAB = 2048
# fused_sample sorts only the 2**6 largest scores of a row whose top-k is at most 64 and
# whose ties with the k-th score do not reach past them (a bitonic top-k: half the work of
# a full sort of 1024); any other row sorts all. Rows of a batch may take either path.
FAST_TOP_K_LOG2 = 6


if HAVE_TRITON:
    from chorus.triton_support import div as _div, exp as _exp, log as _log

    @triton.jit
    def _rotl32(x, r: tl.constexpr):
        return (x << r) | (x >> (32 - r))

    @triton.jit
    def _mix_k(w):
        return _rotl32(w * 0xCC9E2D51, 15) * 0x1B873593

    @triton.jit
    def _mix_h(h, k):
        return _rotl32(h ^ k, 13) * 5 + 0xE6546B64

    @triton.jit
    def _bit(n_dims: tl.constexpr, b: tl.constexpr):
        """Bit b of the flat index, shaped to broadcast over the [2]*n_dims hypercube."""
        return tl.reshape(tl.arange(0, 2), [1] * (n_dims - b - 1) + [2] + [1] * b)

    @triton.jit
    def _merge(h, N_DIMS: tl.constexpr, S: tl.constexpr, DIR_BIT: tl.constexpr):
        """Bitonic merge of the blocks of 2**S of the [2]*N_DIMS hypercube h: compare-exchange
        along bits S-1 .. 0. Blocks whose bit DIR_BIT is 0 end descending, the others
        ascending; DIR_BIT >= N_DIMS: all descending. Each compare-exchange takes the min and
        max over one axis of size 2; plain min/max reductions (not tl.sort's xor-swap) keep
        the interpreter fast enough for tests."""
        for i in tl.static_range(S - 1, -1, -1):
            lo = tl.min(h, axis=N_DIMS - 1 - i, keep_dims=True)
            hi = tl.max(h, axis=N_DIMS - 1 - i, keep_dims=True)
            # an element takes the larger value iff its bit i equals its block's "ascending" bit
            if DIR_BIT < N_DIMS:
                takes_hi = _bit(N_DIMS, i) == _bit(N_DIMS, DIR_BIT)
            else:
                takes_hi = _bit(N_DIMS, i) == 0
            h = tl.where(takes_hi, hi, lo)
        return h

    @triton.jit
    def _sort_descending(x, N_DIMS: tl.constexpr):
        """Bitonic sort of a 2**N_DIMS vector, largest first."""
        h = tl.reshape(x, [2] * N_DIMS)
        for s in tl.static_range(1, N_DIMS + 1):
            h = _merge(h, N_DIMS, s, s)  # blocks of 2**s alternate direction by bit s
        return tl.reshape(h, [2 ** N_DIMS])

    @triton.jit
    def _topk_descending(x, N_DIMS: tl.constexpr, LOG_K: tl.constexpr):
        """The 2**LOG_K largest of a 2**N_DIMS vector, largest first (bitonic top-k: sort
        blocks of K in alternating directions, then repeatedly keep the pairwise max of
        neighbouring blocks, a bitonic block holding the top K of both, and merge it):
        about half the compare-exchanges of a full sort for K = 64 of 1024."""
        h = tl.reshape(x, [2] * N_DIMS)
        for s in tl.static_range(1, LOG_K + 1):
            h = _merge(h, N_DIMS, s, s)
        for r in tl.static_range(1, N_DIMS - LOG_K + 1):
            h = tl.max(h, axis=N_DIMS - r - LOG_K)  # bit LOG_K of the remaining 2**(N_DIMS-r+1)
            h = _merge(h, N_DIMS - r, LOG_K, LOG_K if r < N_DIMS - LOG_K else N_DIMS)
        return tl.reshape(h, [2 ** LOG_K])

    @triton.jit
    def _decode_keys(skey):
        """Scores of sorted int32 keys (fp32 bits with the order of the scores)."""
        return (skey ^ ((skey >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def _nucleus(skey, k, k_active, V, p, p_active, SIZE: tl.constexpr, CUDA: tl.constexpr):
        """(k-th largest score, key at the last rank of the top-p nucleus, nucleus size) from the
        SIZE largest keys, sorted descending; exact when every score >= the k-th is among them
        (or SIZE = all). A size past SIZE (no key matches) means: keep every score."""
        NEG_INF = float("-inf")
        j = tl.arange(0, SIZE)
        s_sorted = _decode_keys(skey)
        # top-k (0 < k < V): drop scores below the k-th largest; ties with it survive.
        kth = tl.max(tl.where(j == tl.minimum(tl.maximum(k, 1), V) - 1, s_sorted, NEG_INF), axis=0)
        drop_k_sorted = k_active & (s_sorted < kth)
        # top-p (0 < p < 1) over the top-k-masked sorted scores, in torch's formula:
        # P = exp(x - max) / sum, C = cumsum(P); keep sorted i iff i == 0 or C[i-1] <= p.
        # C is non-decreasing, so the kept set is the prefix up to and including the
        # first i with !(C[i] <= p) (a NaN C, from +inf scores, keeps index 0 only).
        # Equal scores have equal P: C does not depend on the order among ties.
        masked = tl.where(drop_k_sorted, NEG_INF, s_sorted)
        e = _exp(masked - tl.max(masked, axis=0), CUDA)
        total = tl.sum(e, axis=0)
        if CUDA:
            probs = _div(e, total)  # torch-CUDA softmax divides by the sum
        else:
            probs = e * (1.0 / total)  # torch-CPU softmax multiplies by its reciprocal
        cum = tl.cumsum(probs, axis=0)
        n_keep = tl.where(p_active, _first_index(~(cum <= p), j, SIZE) + 1, SIZE)
        thr = tl.max(tl.where(j == n_keep - 1, skey, -2147483647 - 1), axis=0)
        return kth, thr, n_keep

    @triton.jit
    def _nucleus_keep(key, thr, n_keep):
        """Columns in the first n_keep ranks of a stable descending sort (equal keys by column
        index), given thr, the key at rank n_keep - 1: every key above thr, and of those equal
        to it the lowest-indexed n_keep - #above."""
        above = key > thr
        tie = key == thr
        keep = above | tie
        m = n_keep - tl.sum(above.to(tl.int32), axis=0)
        if m < tl.sum(tie.to(tl.int32), axis=0):  # the nucleus ends inside a run of equal scores
            keep = above | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= m))
        return keep

    @triton.jit
    def _first_index(cond, j, BLOCK: tl.constexpr):
        """Smallest j where cond holds, BLOCK if none."""
        return tl.min(tl.where(cond, j, BLOCK), axis=0)

    @triton.jit
    def _fused_sample_kernel(logits_ptr, logits_stride, V,
                             temp_ptr, topk_ptr, topp_ptr, seed_ptr, pos_ptr, pos_offset,
                             pres_ptr, pres_stride, pen_ptr, out_ptr,
                             HAS_PENALTY: tl.constexpr, BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr,
                             LOG_FAST: tl.constexpr, CUDA: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK)
        valid = j < V
        NEG_INF = float("-inf")
        z = tl.load(logits_ptr + row * logits_stride + j, mask=valid, other=NEG_INF).to(tl.float32)

        # -- repetition penalty (sampler.apply_repetition_penalty) --
        if HAS_PENALTY:
            # a block, not a scalar: the interpreter mislabels a scalar float compare
            pen = tl.broadcast_to(tl.load(pen_ptr + row).to(tl.float32), [BLOCK])
            present = tl.load(pres_ptr + row * pres_stride + j, mask=valid, other=0) != 0
            penalised = tl.where(z < 0, z * pen, _div(z, pen))
            z = tl.where(present & (pen != 1.0), penalised, z)

        # -- greedy / fallback choice: first argmax of z (first NaN if any) --
        z_nan = (z != z) & valid
        z_clean = tl.where(z_nan, NEG_INF, z)
        z_arg = _first_index((z_clean == tl.max(z_clean, axis=0)) & valid, j, BLOCK)
        z_first_nan = _first_index(z_nan, j, BLOCK)
        z_choice = tl.where(z_first_nan < BLOCK, z_first_nan, z_arg)

        # -- temperature --
        t = tl.load(temp_ptr + row).to(tl.float32)
        greedy = t <= 0
        s = _div(z, tl.where(greedy, 1.0, t))
        s = tl.where(valid, s, NEG_INF)
        # A NaN score always survives top-k and is the top of the stable sort, so
        # sampler.sample returns the first NaN column: decide it here, sort without NaNs.
        s_nan = s != s
        s_first_nan = _first_index(s_nan, j, BLOCK)

        # -- one descending sort of score keys serves top-k and top-p --
        # fp32 -> int32 with the same order (flip the magnitude bits of negatives). Only the
        # scores are sorted (int32 moves half the bytes of (score, index) int64 keys); torch's
        # stable order among equal scores, lower index first, is restored from the column
        # index afterwards (_nucleus_keep).
        s_key = tl.where(s_nan, NEG_INF, s)
        s_key = tl.where(s_key == 0.0, 0.0, s_key)  # -0.0 == +0.0: one key for both
        bits = s_key.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        k = tl.load(topk_ptr + row).to(tl.int64)
        k_active = (k > 0) & (k < V)
        p = tl.load(topp_ptr + row).to(tl.float32)
        p_active = (p > 0) & (p < 1)
        if LOG_FAST < LOG_BLOCK:
            # Small top-k (the audio default is 25): only the FAST largest keys need sorting,
            # unless ties with the k-th score reach past them; else the full sort.
            top = _topk_descending(key, LOG_BLOCK, LOG_FAST)
            jt = tl.arange(0, 2 ** LOG_FAST)
            s_top = _decode_keys(top)
            kth_top = tl.max(tl.where(jt == tl.minimum(tl.maximum(k, 1), V) - 1, s_top, NEG_INF), axis=0)
            last = tl.min(s_top, axis=0)
            if k_active & (k <= 2 ** LOG_FAST) & (last < kth_top):
                kth, thr, n_keep = _nucleus(top, k, k_active, V, p, p_active, 2 ** LOG_FAST, CUDA)
            else:
                kth, thr, n_keep = _nucleus(_sort_descending(key, LOG_BLOCK), k, k_active, V, p, p_active,
                                            BLOCK, CUDA)
        else:
            kth, thr, n_keep = _nucleus(_sort_descending(key, LOG_BLOCK), k, k_active, V, p, p_active, BLOCK, CUDA)
        keep = valid & _nucleus_keep(key, thr, n_keep) & ~(k_active & (s_key < kth))
        s = tl.where(keep, s, NEG_INF)
        all_neg_inf = tl.max(s, axis=0) == NEG_INF

        # -- MurmurHash3_x86_32 (seed 0) of LE32(seed lo, seed hi, position, j) --
        seed = tl.load(seed_ptr + row).to(tl.int64)
        pos = tl.load(pos_ptr + row).to(tl.int64) + pos_offset
        # uint32 arithmetic wraps mod 2^32 as the spec's; int64 -> uint32 keeps the low word.
        h = _rotl32(_mix_k(seed.to(tl.uint32)), 13) * 5 + 0xE6546B64  # _mix_h(0, k)
        h = _mix_h(h, _mix_k((seed >> 32).to(tl.uint32)))
        h = _mix_h(h, _mix_k(pos.to(tl.uint32)))
        h = _mix_h(h, _mix_k(j.to(tl.uint32))) ^ 16
        h = (h ^ (h >> 16)) * 0x85EBCA6B
        h = (h ^ (h >> 13)) * 0xC2B2AE35
        h = h ^ (h >> 16)

        # -- float64 Gumbel: u = h / (2^32-1), L = clamp(ln u), g = -ln(-L) --
        u = _div(h.to(tl.float64), 4294967295.0)
        log_u = tl.minimum(tl.maximum(_log(u, CUDA), -1.7976931348623157e308), -2.3283064365386963e-10)
        g = -_log(-log_u, CUDA)
        v = tl.where(keep, s.to(tl.float64) + g, NEG_INF)
        drawn = _first_index(v == tl.max(v, axis=0), j, BLOCK)

        out = tl.where(all_neg_inf, z_choice, drawn)
        out = tl.where(s_first_nan < BLOCK, s_first_nan, out)
        out = tl.where(greedy, z_choice, out)
        tl.store(out_ptr + row, out.to(tl.int64))


def fused_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 seed: torch.Tensor, position: torch.Tensor, presence: torch.Tensor | None = None,
                 penalty: torch.Tensor | None = None, *, position_offset: int = 0,
                 impl: str = "auto", num_warps: int | None = None, fast_log2: int | None = None) -> torch.Tensor:
    """One seeded draw per row: int64 [B].

    Equals `sampler.sample(apply_repetition_penalty(logits, presence, penalty), temperature,
    top_k, top_p, seed, position + position_offset)` (the penalty step only when both
    presence and penalty are given). logits [B, V] (fp32, or bf16/fp16: promoted to fp32
    as the sampler does), V <= 2048, rows may be strided; presence [B, V] bool (a strided
    view such as presence[:, k, :V] is fine); every parameter is [B]. `position_offset`
    saves the caller a `position + c` launch per channel. Wire it at the call sites
    (model.decode_frame): its torch path calls sampler.sample.
    """
    B, V = logits.shape
    penalise = presence is not None and penalty is not None
    params = (temperature, top_k, top_p, seed, position) + ((penalty,) if penalise else ())
    supported = (logits.dtype in KERNEL_DTYPES and 0 < B and V <= MAX_SAMPLE_VOCAB and logits.stride(1) == 1
                 and all(t.shape == (B,) and t.stride(0) == 1 for t in params)
                 and (not penalise or (presence.shape == (B, V) and presence.stride(1) == 1)))
    if not use_kernel(impl, supported, logits, *params, *((presence,) if penalise else ()),
                      unsupported="dtype, strides or size"):
        if penalise:
            logits = sampler.apply_repetition_penalty(logits, presence, penalty)
        if position_offset:
            position = position + position_offset
        return sampler.sample(logits, temperature, top_k, top_p, seed, position)
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if penalise:
        pres = presence.view(torch.uint8) if presence.dtype == torch.bool else presence
        pres_stride = pres.stride(0)
    else:
        pres, pres_stride, penalty = out, 0, out  # unused (HAS_PENALTY=False)
    block = max(16, triton.next_power_of_2(V))
    _fused_sample_kernel[(B,)](
        logits, logits.stride(0), V, temperature, top_k, top_p, seed, position, int(position_offset),
        pres, pres_stride, penalty, out,
        HAS_PENALTY=penalise, BLOCK=block, LOG_BLOCK=block.bit_length() - 1,
        LOG_FAST=min(block.bit_length() - 1, fast_log2 if fast_log2 is not None else FAST_TOP_K_LOG2),
        CUDA=logits.is_cuda, **launch_opts(num_warps or (8 if block >= 512 else 1)))
    return out
