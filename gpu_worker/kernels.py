"""Fused Triton kernels for the model's layers, each with a pure-torch path.

A full-size decode step is ~3000 tiny kernels, so it is latency bound even
inside one CUDA graph. These kernels collapse the worst offenders:

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
The seeded sampler's kernel is gpu_worker/sampler_kernel.py.

Every function takes `impl` (chorus/triton_support.py): "auto" runs the
kernel on CUDA tensors and the torch path elsewhere (the CPU tests and the
tiny model never touch Triton); "triton" forces the kernel (CUDA, or CPU
under TRITON_INTERPRET=1); "torch" forces the torch path.
Every launch is sync-free and allocation-only, so it can be captured in a
CUDA graph (after one warm-up call per shape compiles it).

Exactness (the torch paths, gpu_worker/torch_ops.py, are the references):
- Elementwise math mirrors torch op by op: each bf16 op rounds where torch
  rounds, fp32 division is IEEE (`div_rn`: Triton's `/` is div.full.f32), and
  FMA contraction is off (`enable_fp_fusion=False`), so `a*b - c*d` rounds
  twice as in torch. On CUDA the transcendentals are libdevice's (`__nv_expf`,
  `__nv_log`, `__nv_rsqrtf`), i.e. the CUDA math library torch's kernels use,
  compiled without flush-to-zero where Triton allows it (`enable_reflect_ftz`).
  Under the interpreter they are numpy's, which may differ from torch-CPU's
  (SLEEF) by an ulp; tests/test_kernels.py accounts for that.
- Reductions (RMSNorm's sum of squares) run in a fixed order in one program
  per row: batch invariant, but not in torch's order. (Torch's CUDA reduce
  picks its thread layout from the number of rows,
  ReduceConfig.set_block_dimension, so the torch path is not batch invariant
  there.) A sum that rounds differently moves rsqrt by an ulp: fp32 RMSNorm
  outputs of that row then move by an ulp or two, bf16 ones rarely (one bf16
  ulp in a small fraction of elements); with exactly representable sums the
  kernels are bit-exact.
chorus/bench/kernel_checks.py measures all of this on the GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from chorus.triton_support import HAVE_TRITON, INTERPRET, triton, tl, libdevice  # noqa: F401 - re-exported
from chorus.triton_support import KERNEL_DTYPES as _KERNEL_DTYPES, launch_opts as _launch_opts
from chorus.triton_support import use_kernel
from gpu_worker import torch_ops

__all__ = ["HAVE_TRITON", "INTERPRET", "rms_norm", "add_rms_norm", "add_layer_norm",
           "qk_norm_rope_store", "local_attention", "embed_rows", "silu_mul", "head_linear"]


def _use_kernel(impl: str, supported: bool, *tensors: torch.Tensor) -> bool:
    return use_kernel(impl, supported, *tensors, unsupported="dtype, strides or size")


def _inv(n: int) -> float:
    """fl32(1/n) as torch-CUDA's mean computes its factor (fp32 division)."""
    return float(np.float32(1.0) / np.float32(n))


# =============================================================================
# Triton kernels
# =============================================================================
if HAVE_TRITON:
    from chorus.triton_support import cast as _cast, div as _div, exp as _exp, rnd as _rnd

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
            # torch_ops.rotate_interleaved in the activation dtype: x*cos + rot(x)*sin with
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
                                   vc_sn, vc_sh, cs_sn, n_q_heads, N, HALF, inv_d, eps,
                                   BLOCK_H: tl.constexpr, ROWS: tl.constexpr, CUDA: tl.constexpr,
                                   STORE_V: tl.constexpr):
        # A program takes one head of ROWS consecutive tokens; each token's sums stay within its
        # own tile row, so a token's result does not depend on the tokens beside it.
        n = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        head = tl.program_id(1)
        i = tl.arange(0, BLOCK_H)
        mask = (n < N)[:, None] & (i < HALF)[None, :]
        # One grid covers the q heads then the k heads, so q and k cost one launch; a k-head
        # program also stores its k and v in the token's KV slot (no separate cache writes).
        if head < n_q_heads:
            src = q_ptr + n[:, None] * q_sn + head * q_sh
            dst = qo_ptr + n[:, None] * qo_sn + head * qo_sh
            w_ptr = qw_ptr
        else:
            kh = head - n_q_heads
            slot = tl.load(slot_ptr + n, mask=n < N, other=0).to(tl.int64)
            src = k_ptr + n[:, None] * k_sn + kh * k_sh
            dst = kc_ptr + slot[:, None] * kc_sn + kh * kc_sh
            w_ptr = kw_ptr
            if STORE_V:
                vsrc = v_ptr + n[:, None] * v_sn + kh * v_sh
                vdst = vc_ptr + slot[:, None] * vc_sn + kh * vc_sh
                tl.store(vdst + i[None, :], tl.load(vsrc + i[None, :], mask=mask), mask=mask)
                tl.store(vdst + HALF + i[None, :], tl.load(vsrc + HALF + i[None, :], mask=mask), mask=mask)
        x1 = tl.load(src + i[None, :], mask=mask, other=0.0)
        x2 = tl.load(src + HALF + i[None, :], mask=mask, other=0.0)
        dt = x1.dtype
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        r = _rstd(tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1), 2 * HALF, inv_d, eps, CUDA)[:, None]
        # RMSNorm: cast before the weight multiply, round the product (as torch's bf16 mul).
        w1 = tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
        n1 = _rnd(_rnd(f1 * r, dt, CUDA) * w1, dt, CUDA)
        n2 = _rnd(_rnd(f2 * r, dt, CUDA) * w2, dt, CUDA)
        c = tl.load(cos_ptr + n[:, None] * cs_sn + i[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + n[:, None] * cs_sn + i[None, :], mask=mask, other=0.0).to(tl.float32)
        # torch evaluates x1*c - x2*s as three bf16 ops: round each product, then the difference.
        o1 = _rnd(n1 * c, dt, CUDA) - _rnd(n2 * s, dt, CUDA)
        o2 = _rnd(n2 * c, dt, CUDA) + _rnd(n1 * s, dt, CUDA)
        tl.store(dst + i[None, :], _cast(o1, dt, CUDA), mask=mask)
        tl.store(dst + HALF + i[None, :], _cast(o2, dt, CUDA), mask=mask)

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
    s = x if residual is None else x + residual
    if b is None:
        return s, torch_ops.rms_norm(s, w, eps)
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
    k_cache[slots] = torch_ops.rotate_half_split(torch_ops.rms_norm(k, k_w, eps), cos, sin)
    if v_cache is not None:
        v_cache[slots] = v
    return torch_ops.rotate_half_split(torch_ops.rms_norm(q, q_w, eps), cos, sin)


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, eps: float, k_cache: torch.Tensor,
                       v_cache: torch.Tensor | None, slots: torch.Tensor, *, impl: str = "auto",
                       rows_per_program: int = 1) -> torch.Tensor:
    """Qwen3Attention's QK-norm + half-split RoPE, and the paged KV store, in one launch:
    `k_cache[slots] = rotate_half_split(k_norm(k))`, `v_cache[slots] = v`; returns
    `rotate_half_split(q_norm(q))` (new, contiguous). v_cache None: v is left where it is (k_cache
    may then be k itself with slots = arange: k is rotated in place, each row read before it is
    written by the same program).

    q [N, Hq, d], k, v [N, Hk, d] (projection views), q_w/k_w [d], cos/sin [N, d/2]
    in the activation dtype (Qwen3Backbone.rope), caches [slots, Hk, d], slots [N] int64.
    rows_per_program (a power of 2): tokens one program normalises; more suits thousands of rows.
    A token's result is the same whatever its neighbours, but may differ by an ulp between values
    of rows_per_program (the reduction's layout changes), so one model keeps to one value."""
    N, Hq, d = q.shape
    Hk = k.shape[1]
    dt = q.dtype
    store_v = v_cache is not None
    vc = v_cache if store_v else k_cache
    supported = (dt in _KERNEL_DTYPES and all(t.dtype == dt for t in (k, v, q_w, k_w, cos, sin, k_cache, vc))
                 and N > 0 and d % 2 == 0 and d <= 1024 and k.shape == v.shape == (N, Hk, d)
                 and all(t.stride(-1) == 1 for t in (q, k, v, k_cache, vc))
                 and k_cache.shape[1:] == vc.shape[1:] == (Hk, d) and slots.shape == (N,)
                 and q_w.is_contiguous() and k_w.is_contiguous()
                 and cos.shape == sin.shape == (N, d // 2) and cos.stride() == sin.stride() and cos.stride(-1) == 1)
    if not _use_kernel(impl, supported, q, k, v, q_w, k_w, cos, sin, k_cache, vc, slots):
        return _qk_norm_rope_store_torch(q, k, v, q_w, k_w, cos, sin, eps, k_cache, v_cache, slots)
    qo = torch.empty((N, Hq, d), dtype=dt, device=q.device)
    _qk_norm_rope_store_kernel[(triton.cdiv(N, rows_per_program), Hq + Hk)](
        q, k, v, q_w, k_w, cos, sin, qo, k_cache, vc, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), qo.stride(0), qo.stride(1),
        k_cache.stride(0), k_cache.stride(1), vc.stride(0), vc.stride(1), cos.stride(0), Hq, N, d // 2,
        _inv(d), eps, BLOCK_H=triton.next_power_of_2(d // 2), ROWS=rows_per_program, CUDA=q.is_cuda,
        STORE_V=store_v, **_launch_opts(1 if rows_per_program == 1 else 4))
    return qo


# local_attention's warps a program: a program's work is one head of at most 13 positions, and the
# fewest warps win at every decode batch (benchmarks/local_attention_tune.py measures it).
LOCAL_ATTENTION_WARPS = 1


def local_attention(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: int,
                    cos: torch.Tensor | None, sin: torch.Tensor | None, n_head: int, *,
                    impl: str = "auto", num_warps: int | None = None) -> torch.Tensor:
    """torch_ops.local_attention in one launch: interleaved RoPE of q and k at local position p,
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
        return torch_ops.local_attention(qkv, k_cache, v_cache, p, cos, sin, n_head)
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
# From 16 rows on cuBLAS is as fast or faster: its tiles then cover the weight with enough blocks.
HEAD_KERNEL_MAX_ROWS = 15


def head_linear(x: torch.Tensor, w: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """`F.linear(x, w)` (no bias) for x [B, K], w [N, K], output in x's dtype: an audio head of
    the frame decode (N = 1024 codes).

    Why a kernel: for one row cuBLAS picks 8x64 tiles, i.e. 16 thread blocks for the whole
    5 MB weight, too few to read it at the memory's speed (12 heads a frame). Here each program
    owns 16 output columns and 16-64 rows and reads its slice of w once, fp32 accumulation in a
    fixed K order, one rounding to x's dtype (as cuBLAS). "auto" runs it on CUDA for at most
    HEAD_KERNEL_MAX_ROWS rows, cuBLAS above."""
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
