"""Fused Triton kernels for the decode step, each with a pure-torch path.

A full-size decode step is ~3000 tiny kernels, so it is latency bound even
inside one CUDA graph. These kernels collapse the worst offenders:

- `fused_sample`: repetition penalty + the whole seeded sampler of
  gpu_worker/sampler.py (greedy, temperature, top-k, top-p, MurmurHash3
  Gumbel noise, argmax) in ONE launch, one program per row (V <= 2048).
- `rms_norm` / `add_rms_norm`: model.RMSNorm (fp32 normalise, cast, then the
  weight multiply), optionally after the residual add it follows.
- `add_layer_norm`: the local transformer's residual add + LayerNorm.
- `qk_norm_rope_store`: per-head RMSNorm of q and k + half-split RoPE, and
  the store of k, v in their paged KV slots, one launch.
- `local_attention`: the local transformer's interleaved RoPE, cache append
  and attention over its <= 13 positions, one launch.
- `embed_rows`: the summed text + audio-code row embedding.
- `silu_mul`: F.silu(gate) * up with torch's two bf16 roundings.
- `head_linear`: x @ w.T for the frame decode's sampling heads (N <= 1024 outputs
  and a few rows), tiled over enough programs to read the weights at speed.

Every function takes `impl` (chorus/triton_support.py): "auto" runs the
kernel on CUDA tensors and the torch path elsewhere (the CPU tests and the
tiny model never touch Triton); "triton" forces the kernel (CUDA, or CPU
under TRITON_INTERPRET=1); "torch" forces the torch path.
Every launch is sync-free and allocation-only, so it can be captured in a
CUDA graph (after one warm-up call per shape compiles it).

Exactness (the torch paths are the references):
- Elementwise math mirrors torch op by op: each bf16 op rounds where torch
  rounds, fp32 division is IEEE (`div_rn`: Triton's `/` is div.full.f32), and
  FMA contraction is off (`enable_fp_fusion=False`), so `a*b - c*d` rounds
  twice as in torch. On CUDA the transcendentals are libdevice's (`__nv_expf`,
  `__nv_log`, `__nv_rsqrtf`), i.e. the CUDA math library torch's kernels use,
  compiled without flush-to-zero where Triton allows it (`enable_reflect_ftz`).
  Under the interpreter they are numpy's, which may differ from torch-CPU's
  (SLEEF) by an ulp; tests/test_kernels.py accounts for that.
- Reductions (RMSNorm's sum of squares; the softmax sum and cumsum of top-p)
  run in a fixed order in one program per row: batch invariant, but not in
  torch's order. (Torch's CUDA reduce picks its thread layout from the number
  of rows, ReduceConfig.set_block_dimension, and cumsum uses another kernel
  for a single row, so the torch path is not batch invariant there.) A sum
  that rounds differently moves rsqrt by an ulp: fp32 RMSNorm outputs of that
  row then move by an ulp or two, bf16 ones rarely (one bf16 ulp in a small
  fraction of elements); with exactly representable sums the kernels are
  bit-exact. For top-p, the token exactly at the nucleus boundary can flip:
  simulated with another summation order on 1M random rows (N(0,3) logits),
  the nucleus size changes in ~2-4e-6 of rows at the audio defaults
  (T 1.7, top-k 25, top-p 0.8) and ~5e-5 (p 0.8) to ~1.3e-4 (p 0.95) with
  top-k off; the draw itself changes only if the flipped token wins the
  Gumbel max (0 of those rows in the simulation). The spec (§4.3) allows this
  for a fused sampler. The hash, the float64 Gumbel draw, top-k with ties,
  greedy and the NaN / +-inf / all -inf rules are exact.
chorus/bench/kernel_checks.py measures all of this on the GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from chorus.triton_support import HAVE_TRITON, INTERPRET, triton, tl, libdevice  # noqa: F401 - re-exported
from chorus.triton_support import KERNEL_DTYPES as _KERNEL_DTYPES, launch_opts as _launch_opts
from chorus.triton_support import use_kernel

__all__ = ["HAVE_TRITON", "INTERPRET", "fused_sample", "rms_norm", "add_rms_norm", "add_layer_norm",
           "qk_norm_rope_store", "local_attention", "silu_mul", "head_linear"]

MAX_SAMPLE_VOCAB = 2048
# fused_sample sorts only the 2**6 largest scores of a row whose top-k is at most 64 and
# whose ties with the k-th score do not reach past them (a bitonic top-k: half the work of
# a full sort of 1024); any other row sorts all. Rows of a batch may take either path.
FAST_TOP_K_LOG2 = 6


def _use_kernel(impl: str, supported: bool, *tensors: torch.Tensor) -> bool:
    return use_kernel(impl, supported, *tensors, unsupported="dtype, strides or size")


def _inv(n: int) -> float:
    """fl32(1/n) as torch-CUDA's mean computes its factor (fp32 division)."""
    return float(np.float32(1.0) / np.float32(n))


# =============================================================================
# Triton kernels
# =============================================================================
if HAVE_TRITON:
    from chorus.triton_support import cast as _cast, div as _div, exp as _exp, log as _log, rnd as _rnd

    @triton.jit
    def _rstd(sum_sq, n, inv_n, eps, CUDA: tl.constexpr):
        """rsqrt(mean + eps) as torch computes `xf.pow(2).mean(-1) + eps`: CUDA's
        mean multiplies the sum by fl32(1/n), the CPU's divides it by n."""
        if CUDA:
            return libdevice.rsqrt(sum_sq * inv_n + eps)
        else:
            return tl.math.rsqrt(sum_sq / n + eps)

    # ---- (residual add +) RMSNorm ---------------------------------------------
    @triton.jit
    def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, x_stride, r_stride, out_stride, sum_stride,
                         D, inv_d, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, CUDA: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        if HAS_RES:  # the residual stream: x + r rounded once (torch's add), stored, then normalised
            xf = _rnd(xf + tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0).to(tl.float32),
                      x.dtype, CUDA)
            tl.store(sum_ptr + row * sum_stride + cols, _cast(xf, x.dtype, CUDA), mask=mask)
        r = _rstd(tl.sum(xf * xf, axis=0), D, inv_d, eps, CUDA)
        # Cast the normalised value to x's dtype BEFORE the weight multiply (spec §3.2);
        # a bf16*bf16 product is exact in fp32, so one rounding at the store = torch's.
        y = _rnd(xf * r, x.dtype, CUDA)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, _cast(y * w, out_ptr.dtype.element_ty, CUDA), mask=mask)

    # ---- (residual add +) LayerNorm --------------------------------------------
    @triton.jit
    def _layer_norm_kernel(x_ptr, r_ptr, w_ptr, b_ptr, out_ptr, sum_ptr, x_stride, r_stride, out_stride,
                           sum_stride, D, inv_d, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, CUDA: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        if HAS_RES:
            xf = _rnd(xf + tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0).to(tl.float32),
                      x.dtype, CUDA)
            tl.store(sum_ptr + row * sum_stride + cols, _cast(xf, x.dtype, CUDA), mask=mask)
        # Two passes in fp32 (torch uses Welford: the same value up to an ulp of the variance).
        mean = tl.sum(xf, axis=0) * inv_d
        xc = tl.where(mask, xf - mean, 0.0)
        rstd = _rstd(tl.sum(xc * xc, axis=0), D, inv_d, eps, CUDA)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, _cast(xc * rstd * w + b, out_ptr.dtype.element_ty, CUDA),
                 mask=mask)

    # ---- local transformer attention: interleaved RoPE + cache append + attention ----
    @triton.jit
    def _local_attention_kernel(qkv_ptr, qkv_stride, kc_ptr, vc_ptr, c_sb, c_sh, c_sp, cos_ptr, sin_ptr,
                                out_ptr, out_stride, P, HALF, scale, HAS_ROPE: tl.constexpr,
                                BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, CUDA: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        D = 2 * HALF
        width = tl.num_programs(1) * D  # n_head * head_dim: q, k, v sit at 0, width, 2*width
        # Whole head rows are loaded (contiguous, vectorised) and split into even and odd
        # channels in registers: interleaved RoPE rotates the pairs (2i, 2i+1).
        c = tl.arange(0, 2 * BLOCK_H)
        mc = c < D
        src = qkv_ptr + b * qkv_stride + h * D + c
        # Every load first, the cache's too: they do not depend on this position's k, v (positions
        # < P only), and issued before the store below they overlap instead of waiting on it.
        q = tl.load(src, mask=mc, other=0.0)
        k_new = tl.load(src + width, mask=mc, other=0.0)
        v_new = tl.load(src + 2 * width, mask=mc, other=0.0)
        row = b * c_sb + h * c_sh
        j = tl.arange(0, BLOCK_P)
        cached = (j < P)[:, None] & mc[None, :]
        at = row + j[:, None] * c_sp + c[None, :]
        k_old = tl.load(kc_ptr + at, mask=cached, other=0.0)
        v_old = tl.load(vc_ptr + at, mask=cached, other=0.0)
        dt = q.dtype
        qe, qo = _pairs(q.to(tl.float32), BLOCK_H)
        ke, ko = _pairs(k_new.to(tl.float32), BLOCK_H)
        ve, vo = _pairs(v_new.to(tl.float32), BLOCK_H)
        if HAS_ROPE:
            # model.rotate_interleaved in the activation dtype: x*cos + rot(x)*sin with
            # rot = (-x_odd, x_even) per pair, every product and the sum rounded.
            cs, _ = _pairs(tl.load(cos_ptr + c, mask=mc, other=0.0), BLOCK_H)
            sn, _ = _pairs(tl.load(sin_ptr + c, mask=mc, other=0.0), BLOCK_H)
            cs = _rnd(cs, dt, CUDA)
            sn = _rnd(sn, dt, CUDA)
            qe, qo = (_rnd(_rnd(qe * cs, dt, CUDA) + _rnd(-qo * sn, dt, CUDA), dt, CUDA),
                      _rnd(_rnd(qo * cs, dt, CUDA) + _rnd(qe * sn, dt, CUDA), dt, CUDA))
            ke, ko = (_rnd(_rnd(ke * cs, dt, CUDA) + _rnd(-ko * sn, dt, CUDA), dt, CUDA),
                      _rnd(_rnd(ko * cs, dt, CUDA) + _rnd(ke * sn, dt, CUDA), dt, CUDA))
        # Append this position's k, v; positions < P come from earlier launches.
        tl.store(kc_ptr + row + P * c_sp + c, _cast(_interleave(ke, ko, BLOCK_H), dt, CUDA), mask=mc)
        tl.store(vc_ptr + row + P * c_sp + c, _cast(_interleave(ve, vo, BLOCK_H), dt, CUDA), mask=mc)
        is_new = (j == P)[:, None]
        Ke, Ko = _pairs2(k_old.to(tl.float32), BLOCK_P, BLOCK_H)
        Ke = tl.where(is_new, ke[None, :], Ke)
        Ko = tl.where(is_new, ko[None, :], Ko)
        # Scores and softmax in fp32, probabilities rounded to the activation dtype for P·V.
        sc = tl.sum(Ke * qe[None, :] + Ko * qo[None, :], axis=1) * scale
        sc = tl.where(j <= P, sc, float("-inf"))
        e = _exp(sc - tl.max(sc, axis=0), CUDA)
        p = _rnd(_div(e, tl.sum(e, axis=0)), dt, CUDA)
        Ve, Vo = _pairs2(v_old.to(tl.float32), BLOCK_P, BLOCK_H)
        Ve = tl.where(is_new, ve[None, :], Ve)
        Vo = tl.where(is_new, vo[None, :], Vo)
        o = _interleave(tl.sum(p[:, None] * Ve, axis=0), tl.sum(p[:, None] * Vo, axis=0), BLOCK_H)
        tl.store(out_ptr + b * out_stride + h * D + c, _cast(o, dt, CUDA), mask=mc)

    @triton.jit
    def _pairs(x, BLOCK_H: tl.constexpr):
        """[2*BLOCK_H] -> its even and odd elements, [BLOCK_H] each."""
        return tl.split(tl.reshape(x, [BLOCK_H, 2]))

    @triton.jit
    def _pairs2(x, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
        """[BLOCK_P, 2*BLOCK_H] -> its even and odd columns, [BLOCK_P, BLOCK_H] each."""
        return tl.split(tl.reshape(x, [BLOCK_P, BLOCK_H, 2]))

    @triton.jit
    def _interleave(even, odd, BLOCK_H: tl.constexpr):
        """_pairs' inverse."""
        return tl.reshape(tl.join(even, odd), [2 * BLOCK_H])

    # ---- QK-norm + half-split RoPE + paged KV store ------------------------------
    @triton.jit
    def _qk_norm_rope_store_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr,
                                   slot_ptr, q_sn, q_sh, k_sn, k_sh, v_sn, v_sh, qo_sn, qo_sh, kc_sn, kc_sh,
                                   vc_sn, vc_sh, cs_sn, n_q_heads, HALF, inv_d, eps,
                                   BLOCK_H: tl.constexpr, CUDA: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        i = tl.arange(0, BLOCK_H)
        mask = i < HALF
        # One grid covers the q heads then the k heads, so q and k cost one launch; a k-head
        # program also stores its k and v in the token's KV slot (no separate cache writes).
        if head < n_q_heads:
            src = q_ptr + n * q_sn + head * q_sh
            dst = qo_ptr + n * qo_sn + head * qo_sh
            w_ptr = qw_ptr
        else:
            kh = head - n_q_heads
            slot = tl.load(slot_ptr + n).to(tl.int64)
            src = k_ptr + n * k_sn + kh * k_sh
            dst = kc_ptr + slot * kc_sn + kh * kc_sh
            w_ptr = kw_ptr
            vsrc = v_ptr + n * v_sn + kh * v_sh
            vdst = vc_ptr + slot * vc_sn + kh * vc_sh
            tl.store(vdst + i, tl.load(vsrc + i, mask=mask), mask=mask)
            tl.store(vdst + HALF + i, tl.load(vsrc + HALF + i, mask=mask), mask=mask)
        x1 = tl.load(src + i, mask=mask, other=0.0)
        x2 = tl.load(src + HALF + i, mask=mask, other=0.0)
        dt = x1.dtype
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        r = _rstd(tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0), 2 * HALF, inv_d, eps, CUDA)
        # RMSNorm: cast before the weight multiply, round the product (as torch's bf16 mul).
        w1 = tl.load(w_ptr + i, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + i, mask=mask, other=0.0).to(tl.float32)
        n1 = _rnd(_rnd(f1 * r, dt, CUDA) * w1, dt, CUDA)
        n2 = _rnd(_rnd(f2 * r, dt, CUDA) * w2, dt, CUDA)
        c = tl.load(cos_ptr + n * cs_sn + i, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + n * cs_sn + i, mask=mask, other=0.0).to(tl.float32)
        # torch evaluates x1*c - x2*s as three bf16 ops: round each product, then the difference.
        o1 = _rnd(n1 * c, dt, CUDA) - _rnd(n2 * s, dt, CUDA)
        o2 = _rnd(n2 * c, dt, CUDA) + _rnd(n1 * s, dt, CUDA)
        tl.store(dst + i, _cast(o1, dt, CUDA), mask=mask)
        tl.store(dst + HALF + i, _cast(o2, dt, CUDA), mask=mask)

    # ---- multi-channel row embedding ----------------------------------------------
    @triton.jit
    def _embed_rows_kernel(rows_ptr, rows_stride, text_ptr, text_stride, audio_ptr, audio_stride, audio_rows,
                           out_ptr, out_stride, H, pad, N_VQ: tl.constexpr, BLOCK: tl.constexpr, CUDA: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        text_id = tl.load(rows_ptr + t * rows_stride).to(tl.int64)
        e = tl.load(text_ptr + text_id * text_stride + cols, mask=mask, other=0.0)
        dt = e.dtype
        acc = e.to(tl.float32)
        # In channel order, each add rounded (model.embed_rows in bf16); a pad code adds exactly 0.
        for k in tl.static_range(N_VQ):
            code = tl.load(rows_ptr + t * rows_stride + 1 + k).to(tl.int64)
            valid = code != pad
            row = k * audio_rows + tl.where(valid, code, 0)
            a = tl.load(audio_ptr + row * audio_stride + cols, mask=mask & valid, other=0.0).to(tl.float32)
            acc = _rnd(acc + a, dt, CUDA)
        tl.store(out_ptr + t * out_stride + cols, _cast(acc, dt, CUDA), mask=mask)

    # ---- SiLU(gate) * up --------------------------------------------------------
    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, g_stride, u_stride, out_stride, F,
                         BLOCK: tl.constexpr, CUDA: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < F
        g = tl.load(g_ptr + row * g_stride + cols, mask=mask, other=0.0)
        u = tl.load(u_ptr + row * u_stride + cols, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        # torch's silu: x / (1 + exp(-x)) in fp32, rounded to gate's dtype; then the
        # multiply rounds again (two roundings in bf16).
        act = _rnd(_div(gf, 1.0 + _exp(-gf, CUDA)), g.dtype, CUDA)
        tl.store(out_ptr + row * out_stride + cols,
                 _cast(act * u.to(tl.float32), out_ptr.dtype.element_ty, CUDA), mask=mask)

    # ---- seeded sampler -----------------------------------------------------------
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


    # ---- sampling heads -------------------------------------------------------------
    @triton.jit
    def _head_linear_kernel(x_ptr, w_ptr, out_ptr, B, N, x_stride, w_stride, out_stride, K: tl.constexpr,
                            BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            PRECISION: tl.constexpr, CUDA: tl.constexpr):
        """out[B, N] = x[B, K] @ w[N, K].T with an fp32 accumulator, K in a fixed order."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rb = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # K is constexpr (a model width): the interpreter needs that
            kk = k0 + rk
            xt = tl.load(x_ptr + rb[:, None].to(tl.int64) * x_stride + kk[None, :],
                         mask=(rb[:, None] < B) & (kk[None, :] < K), other=0.0)
            wt = tl.load(w_ptr + rn[:, None].to(tl.int64) * w_stride + kk[None, :],
                         mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
            if CUDA:
                acc += tl.dot(xt, tl.trans(wt), input_precision=PRECISION)
            else:  # the interpreter's dot mishandles bf16; the fp32 products of bf16 inputs are exact
                acc += tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)), input_precision="ieee")
        tl.store(out_ptr + rb[:, None].to(tl.int64) * out_stride + rn[None, :],
                 _cast(acc, out_ptr.dtype.element_ty, CUDA), mask=(rb[:, None] < B) & (rn[None, :] < N))


# =============================================================================
# Public API
# =============================================================================
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
    supported = (logits.dtype in _KERNEL_DTYPES and 0 < B and V <= MAX_SAMPLE_VOCAB and logits.stride(1) == 1
                 and all(t.shape == (B,) and t.stride(0) == 1 for t in params)
                 and (not penalise or (presence.shape == (B, V) and presence.stride(1) == 1)))
    if not _use_kernel(impl, supported, logits, *params, *((presence,) if penalise else ())):
        from gpu_worker.sampler import apply_repetition_penalty, sample
        if penalise:
            logits = apply_repetition_penalty(logits, presence, penalty)
        if position_offset:
            position = position + position_offset
        return sample(logits, temperature, top_k, top_p, seed, position)
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
        CUDA=logits.is_cuda, **_launch_opts(num_warps or (8 if block >= 512 else 1)))
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, *, impl: str = "auto") -> torch.Tensor:
    """model.RMSNorm: `w * (xf * rsqrt(mean(xf^2) + eps)).to(x.dtype)` over the last dim.
    x [..., D] (rows may be strided), w [D]. The kernel path handles fp32/bf16/fp16."""
    return _norm(x, None, w, None, eps, impl)[1]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, *,
                 impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s)) with s = x + residual: a pre-norm layer's residual add and the
    next norm in one launch (s rounds once, as torch's add)."""
    return _norm(x, residual, w, None, eps, impl)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, b: torch.Tensor,
                   eps: float, *, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(s, F.layer_norm(s, w, b)) with s = x + residual (or x when residual is None)."""
    return _norm(x, residual, w, b, eps, impl)


def _norm_torch(x, residual, w, b, eps):
    from gpu_worker.model import rms_norm as model_rms_norm  # the model's math is the reference (lazy import)
    s = x if residual is None else x + residual
    if b is None:
        return s, model_rms_norm(s, w, eps)
    return s, torch.nn.functional.layer_norm(s, (s.shape[-1],), w, b, eps)


def _norm(x, residual, w, b, eps, impl):
    D = x.shape[-1]
    tensors = (x, w) + (() if residual is None else (residual,)) + (() if b is None else (b,))
    supported = (all(t.dtype in _KERNEL_DTYPES for t in tensors) and x.numel() > 0 and D <= 16384
                 and x.stride(-1) == 1 and w.shape == (D,) and w.is_contiguous()
                 and (b is None or (b.shape == (D,) and b.is_contiguous() and b.dtype == w.dtype))
                 and (residual is None or (residual.shape == x.shape and residual.stride(-1) == 1
                                           and residual.dtype == x.dtype)))
    if not _use_kernel(impl, supported, *tensors):
        return _norm_torch(x, residual, w, b, eps)
    x2 = x.reshape(-1, D)  # a view for the usual [N, D] / contiguous inputs
    r2 = x2 if residual is None else residual.reshape(-1, D)
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, w.dtype), device=x.device)
    s = x2 if residual is None else torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(D)
    common = (D, _inv(D), eps)
    opts = dict(HAS_RES=residual is not None, BLOCK=block, CUDA=x.is_cuda,
                **_launch_opts(max(1, min(8, block // 512))))
    if b is None:
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, w, out, s, x2.stride(0), r2.stride(0), out.stride(0),
                                         s.stride(0), *common, **opts)
    else:
        _layer_norm_kernel[(x2.shape[0],)](x2, r2, w, b, out, s, x2.stride(0), r2.stride(0), out.stride(0),
                                           s.stride(0), *common, **opts)
    shape = x.shape[:-1] + (D,)
    return (x if residual is None else s.view(shape)), out.view(shape)


def _qk_norm_rope_store_torch(q, k, v, q_w, k_w, cos, sin, eps, k_cache, v_cache, slots):
    from gpu_worker.model import rms_norm as model_rms_norm, rotate_half_split
    k_cache[slots] = rotate_half_split(model_rms_norm(k, k_w, eps), cos, sin)
    v_cache[slots] = v
    return rotate_half_split(model_rms_norm(q, q_w, eps), cos, sin)


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, eps: float, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slots: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """Qwen3Attention's QK-norm + half-split RoPE, and the paged KV store, in one launch:
    `k_cache[slots] = rotate_half_split(k_norm(k))`, `v_cache[slots] = v`; returns
    `rotate_half_split(q_norm(q))` (new, contiguous).

    q [N, Hq, d], k, v [N, Hk, d] (projection views), q_w/k_w [d], cos/sin [N, d/2]
    in the activation dtype (Qwen3Backbone.rope), caches [slots, Hk, d], slots [N] int64."""
    N, Hq, d = q.shape
    Hk = k.shape[1]
    dt = q.dtype
    supported = (dt in _KERNEL_DTYPES and all(t.dtype == dt for t in (k, v, q_w, k_w, cos, sin, k_cache, v_cache))
                 and N > 0 and d % 2 == 0 and d <= 1024 and k.shape == v.shape == (N, Hk, d)
                 and all(t.stride(-1) == 1 for t in (q, k, v, k_cache, v_cache))
                 and k_cache.shape[1:] == v_cache.shape[1:] == (Hk, d) and slots.shape == (N,)
                 and q_w.is_contiguous() and k_w.is_contiguous()
                 and cos.shape == sin.shape == (N, d // 2) and cos.stride() == sin.stride() and cos.stride(-1) == 1)
    if not _use_kernel(impl, supported, q, k, v, q_w, k_w, cos, sin, k_cache, v_cache, slots):
        return _qk_norm_rope_store_torch(q, k, v, q_w, k_w, cos, sin, eps, k_cache, v_cache, slots)
    qo = torch.empty((N, Hq, d), dtype=dt, device=q.device)
    _qk_norm_rope_store_kernel[(N, Hq + Hk)](
        q, k, v, q_w, k_w, cos, sin, qo, k_cache, v_cache, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), qo.stride(0), qo.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), cos.stride(0), Hq, d // 2,
        _inv(d), eps, BLOCK_H=triton.next_power_of_2(d // 2), CUDA=q.is_cuda, **_launch_opts(1))
    return qo


def _local_attention_torch(qkv, k_cache, v_cache, p, cos, sin, n_head):
    from gpu_worker.model import local_attention
    return local_attention(qkv, k_cache, v_cache, p, cos, sin, n_head)


# local_attention's warps a program. One H200, a frame's 12 calls (local_attention_tune_s12_h200.json):
# 1 warp 160 us at batch 180, 2 warps 192, 4 warps 391; the fewest warps win at every batch, 64 to 256.
LOCAL_ATTENTION_WARPS = 1


def local_attention(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: int,
                    cos: torch.Tensor | None, sin: torch.Tensor | None, n_head: int, *,
                    impl: str = "auto", num_warps: int | None = None) -> torch.Tensor:
    """model.local_attention in one launch: interleaved RoPE of q and k at local position p,
    k/v stored at cache position p, attention over positions 0..p. qkv [B, 3*n_head*d]
    (c_attn's output), caches [B, n_head, P, d], cos/sin the fp32 rows of the RoPE tables
    at p ([d], interleaved; None without RoPE). Returns [B, n_head*d]."""
    B, width3 = qkv.shape
    d = width3 // (3 * n_head)
    dt = qkv.dtype
    supported = (dt in _KERNEL_DTYPES and k_cache.dtype == v_cache.dtype == dt and B > 0 and d % 2 == 0
                 and qkv.stride(1) == 1 and k_cache.shape == v_cache.shape == (B, n_head, k_cache.shape[2], d)
                 and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and p < k_cache.shape[2] <= 64
                 and (cos is None or (cos.shape == sin.shape == (d,) and cos.is_contiguous() and sin.is_contiguous())))
    if not _use_kernel(impl, supported, qkv, k_cache, v_cache):
        return _local_attention_torch(qkv, k_cache, v_cache, p, cos, sin, n_head)
    out = torch.empty((B, n_head * d), dtype=dt, device=qkv.device)
    rope = cos is not None
    _local_attention_kernel[(B, n_head)](
        qkv, qkv.stride(0), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        cos if rope else qkv, sin if rope else qkv, out, out.stride(0), int(p), d // 2, d ** -0.5,
        HAS_ROPE=rope, BLOCK_P=max(16, triton.next_power_of_2(k_cache.shape[2])),
        BLOCK_H=max(16, triton.next_power_of_2(d // 2)), CUDA=qkv.is_cuda,
        **_launch_opts(num_warps or LOCAL_ATTENTION_WARPS))
    return out


def stacked_tables(tables: list[torch.Tensor]) -> torch.Tensor | None:
    """The equal-shaped tables as one [n, V, H] tensor when they are adjacent views of one
    storage (model.fuse_projections puts them so), else None."""
    first = tables[0]
    V, H = first.shape
    ok = all(t.is_contiguous() and t.shape == first.shape and t.dtype == first.dtype
             and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
             and t.storage_offset() == first.storage_offset() + k * V * H for k, t in enumerate(tables))
    return first.as_strided((len(tables), V, H), (V * H, H, 1)) if ok else None


def embed_rows(rows: torch.Tensor, text: torch.Tensor, audio: list[torch.Tensor], pad: int, *,
               impl: str = "auto") -> torch.Tensor | None:
    """model.embed_rows in one launch: `text[rows[:, 0]] + sum_k where(rows[:, 1+k] != pad,
    audio[k][rows[:, 1+k]], 0)`, added in channel order. Returns None where the torch
    path must run (the caller owns that math): the tables are not one fused storage
    of equal-sized codebooks, or no kernel is available."""
    fused = stacked_tables(audio)
    T = rows.shape[0]
    supported = (fused is not None and text.dtype in _KERNEL_DTYPES and text.dtype == audio[0].dtype
                 and rows.dim() == 2 and rows.shape[1] == 1 + len(audio) and T > 0 and text.stride(1) == 1)
    if impl == "torch" or not _use_kernel(impl, supported, rows, text):
        return None
    H = text.shape[1]
    out = torch.empty((T, H), dtype=text.dtype, device=text.device)
    block = min(1024, triton.next_power_of_2(H))
    _embed_rows_kernel[(T, triton.cdiv(H, block))](
        rows, rows.stride(0), text, text.stride(0), fused, fused.stride(1), fused.shape[1], out, out.stride(0),
        H, int(pad),
        N_VQ=len(audio), BLOCK=block, CUDA=text.is_cuda, **_launch_opts(4))
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """`F.silu(gate) * up` for gate, up [N, F] (rows may be strided, e.g. halves of
    a fused gate_up projection)."""
    supported = (gate.dtype in _KERNEL_DTYPES and up.dtype in _KERNEL_DTYPES and gate.dim() == 2
                 and gate.shape == up.shape and gate.numel() > 0 and gate.stride(-1) == 1 and up.stride(-1) == 1)
    if not _use_kernel(impl, supported, gate, up):
        return torch.nn.functional.silu(gate) * up
    N, F = gate.shape
    out = torch.empty((N, F), dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    block = min(1024, triton.next_power_of_2(F))
    _silu_mul_kernel[(N, triton.cdiv(F, block))](
        gate, up, out, gate.stride(0), up.stride(0), out.stride(0), F,
        BLOCK=block, CUDA=gate.is_cuda, **_launch_opts(4))
    return out


# head_linear's tiles: 16 output columns a program (tl.dot's minimum) puts a 1024-code head on
# 64 programs; BLOCK_K is fixed, so a row's sum runs in one order whatever the batch.
HEAD_BLOCK_N, HEAD_BLOCK_K = 16, 256
# From 16 rows on cuBLAS is as fast or faster (kernel_checks_head_s6_h200.json, in a graph:
# 1 row 13.7 us cuBLAS vs 5.5 here; 64 rows 5.6 vs 6.1; 256 rows 7.1 vs 11.5).
HEAD_KERNEL_MAX_ROWS = 15


def head_linear(x: torch.Tensor, w: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """`F.linear(x, w)` (no bias) for x [B, K], w [N, K], output in x's dtype: an audio head of
    the frame decode (N = 1024 codes).

    Why a kernel: for one row cuBLAS picks 8x64 tiles, i.e. 16 thread blocks for the whole
    5 MB weight: 13.7 us per head on the H200 where the bytes take 1.2 us, 12 heads a frame.
    Here each program owns 16 output columns and 16-64 rows and reads its slice of w once,
    fp32 accumulation in a fixed K order, one rounding to x's dtype (as cuBLAS). "auto" runs
    it on CUDA for at most HEAD_KERNEL_MAX_ROWS rows, cuBLAS above."""
    B, Kdim = x.shape
    N = w.shape[0]
    supported = (x.dtype in _KERNEL_DTYPES and w.dtype == x.dtype and w.dim() == 2 and w.shape[1] == Kdim
                 and B > 0 and N > 0 and x.stride(1) == 1 and w.stride(1) == 1)
    if (impl == "auto" and B > HEAD_KERNEL_MAX_ROWS) or not _use_kernel(impl, supported, x, w):
        return torch.nn.functional.linear(x, w)
    out = torch.empty((B, N), dtype=x.dtype, device=x.device)
    block_b = min(64, max(16, triton.next_power_of_2(B)))
    _head_linear_kernel[(triton.cdiv(N, HEAD_BLOCK_N), triton.cdiv(B, block_b))](
        x, w, out, B, N, x.stride(0), w.stride(0), out.stride(0),
        K=Kdim, BLOCK_B=block_b, BLOCK_N=HEAD_BLOCK_N, BLOCK_K=HEAD_BLOCK_K,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 as torch's (no TF32) matmul
        CUDA=x.is_cuda,
        **_launch_opts(4, num_stages=4))
    return out
