"""Fused Triton kernels for the decode step, each with a pure-torch path.

A full-size decode step is ~3000 tiny kernels, so it is latency bound even
inside one CUDA graph. These kernels collapse the worst offenders:

- `fused_sample`: repetition penalty + the whole seeded sampler of
  gpu_worker/sampler.py (greedy, temperature, top-k, top-p, MurmurHash3
  Gumbel noise, argmax) in ONE launch, one program per row (V <= 2048).
- `rms_norm`: model.RMSNorm (fp32 normalise, cast, then the weight multiply).
- `qk_norm_rope`: per-head RMSNorm of q and k + half-split RoPE, one launch.
- `silu_mul`: F.silu(gate) * up with torch's two bf16 roundings.

Every function takes `impl`: "auto" runs the kernel on CUDA tensors and the
torch path elsewhere (the CPU tests and the tiny model never touch Triton);
"triton" forces the kernel (CUDA, or CPU under TRITON_INTERPRET=1, which must
be set before this module is imported); "torch" forces the torch path.
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
benchmarks/kernel_checks.py measures all of this on the GPU.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Import triton only where it can run: with CUDA, or in interpreter mode. A CPU
# process never imports it, which also keeps it free to import triton in
# interpreter mode later (tests/test_kernels.py reloads this module that way).
HAVE_TRITON = False
triton = tl = libdevice = None
if _interpret_env() or "triton" in sys.modules or torch.cuda.is_available():
    try:
        import triton
        import triton.language as tl
        from triton.language.extra import libdevice
        HAVE_TRITON = True
    except ImportError:  # CI has no triton: every function uses its torch path
        pass

__all__ = ["HAVE_TRITON", "INTERPRET", "fused_sample", "rms_norm", "qk_norm_rope", "silu_mul"]

# Triton decides at decoration time whether @triton.jit functions run in the
# interpreter, so this module records the mode it was built in.
INTERPRET = HAVE_TRITON and _interpret_env()

MAX_SAMPLE_VOCAB = 2048
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _use_kernel(impl: str, supported: bool, *tensors: torch.Tensor) -> bool:
    """Kernel or torch path. `supported`: the inputs fit the kernel (dtypes, strides,
    sizes); "auto" falls back to torch when they do not, "triton" raises."""
    if impl == "torch":
        return False
    if impl not in ("auto", "triton"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    if impl == "auto":
        return supported and HAVE_TRITON and all(t.is_cuda for t in tensors)
    if not (HAVE_TRITON and all(t.is_cuda or (INTERPRET and t.device.type == "cpu") for t in tensors)):
        raise RuntimeError("impl='triton' needs triton and CUDA tensors (or TRITON_INTERPRET=1 "
                           "set before gpu_worker.kernels is imported, with CPU tensors)")
    if not supported:
        raise ValueError("impl='triton': these inputs need the torch path (dtype, strides or size)")
    return True


_reflect_ftz_option: bool | None = None


def _launch_opts(num_warps: int) -> dict:
    """No FMA contraction (torch rounds every product before the add or sub), and,
    where this Triton has the option, libdevice without flush-to-zero, as nvcc
    compiles torch's kernels (only denormal inputs/outputs could differ)."""
    global _reflect_ftz_option
    if _reflect_ftz_option is None:
        try:
            from triton.backends.nvidia.compiler import CUDAOptions
            _reflect_ftz_option = "enable_reflect_ftz" in CUDAOptions.__dataclass_fields__
        except Exception:  # pragma: no cover - non-NVIDIA builds
            _reflect_ftz_option = False
    opts = {"num_warps": num_warps, "enable_fp_fusion": False}
    if _reflect_ftz_option and not INTERPRET:
        opts["enable_reflect_ftz"] = False
    return opts


def _inv(n: int) -> float:
    """fl32(1/n) as torch-CUDA's mean computes its factor (fp32 division)."""
    return float(np.float32(1.0) / np.float32(n))


# =============================================================================
# Triton kernels
# =============================================================================
if HAVE_TRITON:

    @triton.jit
    def _div(a, b):
        """IEEE division. Triton's `/` on fp32 lowers to the approximate div.full.f32;
        div_rn gives div.rn.f32 (and, unlike libdevice's, keeps denormals as torch does).
        fp64 `/` is already div.rn.f64."""
        if a.dtype == tl.float64:
            return a / b
        else:
            return tl.math.div_rn(a, b)

    @triton.jit
    def _exp(x, CUDA: tl.constexpr):
        if CUDA:
            return libdevice.exp(x)  # __nv_expf / __nv_exp, as torch's exp kernels
        else:
            return tl.exp(x)

    @triton.jit
    def _log(x, CUDA: tl.constexpr):
        if CUDA:
            return libdevice.log(x)
        else:
            return tl.log(x)

    @triton.jit
    def _cast(x, dtype: tl.constexpr, CUDA: tl.constexpr):
        """fp32 x rounded to dtype, to nearest even (as torch rounds)."""
        if CUDA:
            return x.to(dtype)
        elif dtype == tl.bfloat16:
            # The interpreter's fp32 -> bf16 cast truncates: round on the bits instead.
            b = x.to(tl.uint32, bitcast=True)
            r = tl.where(x != x, 0x7FC0, (b + 0x7FFF + ((b >> 16) & 1)) >> 16)
            return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dtype)

    @triton.jit
    def _rnd(x, dtype: tl.constexpr, CUDA: tl.constexpr):
        """x rounded through dtype and back to fp32: one torch op's output rounding."""
        return _cast(x, dtype, CUDA).to(tl.float32)

    @triton.jit
    def _rstd(sum_sq, n, inv_n, eps, CUDA: tl.constexpr):
        """rsqrt(mean + eps) as torch computes `xf.pow(2).mean(-1) + eps`: CUDA's
        mean multiplies the sum by fl32(1/n), the CPU's divides it by n."""
        if CUDA:
            return libdevice.rsqrt(sum_sq * inv_n + eps)
        else:
            return tl.math.rsqrt(sum_sq / n + eps)

    # ---- RMSNorm ------------------------------------------------------------
    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_stride, out_stride, D, inv_d, eps,
                         BLOCK: tl.constexpr, CUDA: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        r = _rstd(tl.sum(xf * xf, axis=0), D, inv_d, eps, CUDA)
        # Cast the normalised value to x's dtype BEFORE the weight multiply (spec §3.2);
        # a bf16*bf16 product is exact in fp32, so one rounding at the store = torch's.
        y = _rnd(xf * r, x.dtype, CUDA)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, _cast(y * w, out_ptr.dtype.element_ty, CUDA), mask=mask)

    # ---- QK-norm + half-split RoPE --------------------------------------------
    @triton.jit
    def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
                             q_sn, q_sh, k_sn, k_sh, qo_sn, qo_sh, ko_sn, ko_sh, cs_sn,
                             n_q_heads, HALF, inv_d, eps,
                             BLOCK_H: tl.constexpr, CUDA: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        # One grid covers the q heads then the k heads, so q and k cost one launch.
        if head < n_q_heads:
            src = q_ptr + n * q_sn + head * q_sh
            dst = qo_ptr + n * qo_sn + head * qo_sh
            w_ptr = qw_ptr
        else:
            src = k_ptr + n * k_sn + (head - n_q_heads) * k_sh
            dst = ko_ptr + n * ko_sn + (head - n_q_heads) * ko_sh
            w_ptr = kw_ptr
        i = tl.arange(0, BLOCK_H)
        mask = i < HALF
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
    def _sort_descending(x, N_DIMS: tl.constexpr):
        """Bitonic sort of a 2**N_DIMS vector, largest first. Each compare-exchange takes
        the min and max over one axis of size 2 of the hypercube view; plain min/max
        reductions (not tl.sort's xor-swap) keep the interpreter fast enough for tests."""
        h = tl.reshape(x, [2] * N_DIMS)
        for s in tl.static_range(1, N_DIMS + 1):
            for i in tl.static_range(s - 1, -1, -1):  # compare-exchange along bit i
                lo = tl.min(h, axis=N_DIMS - 1 - i, keep_dims=True)
                hi = tl.max(h, axis=N_DIMS - 1 - i, keep_dims=True)
                # Blocks of 2**s alternate direction by bit s (the last merge is all
                # descending); an element takes the larger value iff its bit i equals
                # its block's "ascending" bit.
                if s < N_DIMS:
                    takes_hi = _bit(N_DIMS, i) == _bit(N_DIMS, s)
                else:
                    takes_hi = _bit(N_DIMS, i) == 0
                h = tl.where(takes_hi, hi, lo)
        return tl.reshape(h, [2 ** N_DIMS])

    @triton.jit
    def _first_index(cond, j, BLOCK: tl.constexpr):
        """Smallest j where cond holds, BLOCK if none."""
        return tl.min(tl.where(cond, j, BLOCK), axis=0)

    @triton.jit
    def _fused_sample_kernel(logits_ptr, logits_stride, V,
                             temp_ptr, topk_ptr, topp_ptr, seed_ptr, pos_ptr, pos_offset,
                             pres_ptr, pres_stride, pen_ptr, out_ptr,
                             HAS_PENALTY: tl.constexpr, BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr,
                             CUDA: tl.constexpr):
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

        # -- one descending sort of (score, -index) keys serves top-k and top-p --
        # fp32 -> int32 with the same order (flip the magnitude bits of negatives), the
        # index below it so equal scores keep the lower index first (torch's stable sort).
        s_key = tl.where(s_nan, NEG_INF, s)
        s_key = tl.where(s_key == 0.0, 0.0, s_key)  # -0.0 == +0.0: one key for both
        bits = s_key.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = (ordered.to(tl.int64) << 32) | (BLOCK - 1 - j).to(tl.int64)
        skey = _sort_descending(key, LOG_BLOCK)
        hi = (skey >> 32).to(tl.int32)
        s_sorted = (hi ^ ((hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

        # top-k (0 < k < V): drop scores below the k-th largest; ties with it survive.
        k = tl.load(topk_ptr + row).to(tl.int64)
        k_active = (k > 0) & (k < V)
        kth = tl.max(tl.where(j == tl.minimum(tl.maximum(k, 1), V) - 1, s_sorted, NEG_INF), axis=0)
        drop_k_sorted = k_active & (s_sorted < kth)

        # top-p (0 < p < 1) over the top-k-masked sorted scores, in torch's formula:
        # P = exp(x - max) / sum, C = cumsum(P); keep sorted i iff i == 0 or C[i-1] <= p.
        # C is non-decreasing, so the kept set is the prefix up to and including the
        # first i with !(C[i] <= p) (a NaN C, from +inf scores, keeps index 0 only).
        p = tl.load(topp_ptr + row).to(tl.float32)
        p_active = (p > 0) & (p < 1)
        masked = tl.where(drop_k_sorted, NEG_INF, s_sorted)
        e = _exp(masked - tl.max(masked, axis=0), CUDA)
        total = tl.sum(e, axis=0)
        if CUDA:
            probs = _div(e, total)  # torch-CUDA softmax divides by the sum
        else:
            probs = e * (1.0 / total)  # torch-CPU softmax multiplies by its reciprocal
        cum = tl.cumsum(probs, axis=0)
        n_keep = tl.where(p_active, _first_index(~(cum <= p), j, BLOCK) + 1, BLOCK)
        # Back to columns without a scatter: sorted rank < n_keep <=> key >= the key at
        # rank n_keep-1 (keys are unique); n_keep > BLOCK-1 matches nothing: keep all.
        thr = tl.max(tl.where(j == n_keep - 1, skey, -9223372036854775807 - 1), axis=0)
        keep = valid & (key >= thr) & ~(k_active & (s_key < kth))
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


# =============================================================================
# Public API
# =============================================================================
def fused_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 seed: torch.Tensor, position: torch.Tensor, presence: torch.Tensor | None = None,
                 penalty: torch.Tensor | None = None, *, position_offset: int = 0,
                 impl: str = "auto") -> torch.Tensor:
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
        HAS_PENALTY=penalise, BLOCK=block, LOG_BLOCK=block.bit_length() - 1, CUDA=logits.is_cuda,
        **_launch_opts(4 if block >= 512 else 1))
    return out


def _rms_norm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    from gpu_worker.model import rms_norm  # the model's math is the reference (lazy: model imports us)
    return rms_norm(x, w, eps)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, *, impl: str = "auto") -> torch.Tensor:
    """model.RMSNorm: `w * (xf * rsqrt(mean(xf^2) + eps)).to(x.dtype)` over the last dim.
    x [..., D] (rows may be strided), w [D]. The kernel path handles fp32/bf16/fp16."""
    D = x.shape[-1]
    supported = (x.dtype in _KERNEL_DTYPES and w.dtype in _KERNEL_DTYPES and x.numel() > 0 and D <= 16384
                 and x.stride(-1) == 1 and w.shape == (D,) and w.is_contiguous())
    if not _use_kernel(impl, supported, x, w):
        return _rms_norm_torch(x, w, eps)
    x2 = x.reshape(-1, D)  # a view for the usual [N, D] / contiguous inputs
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, w.dtype), device=x.device)
    block = triton.next_power_of_2(D)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, w, out, x2.stride(0), out.stride(0), D, _inv(D), eps,
        BLOCK=block, CUDA=x.is_cuda, **_launch_opts(max(1, min(8, block // 512))))
    return out.view(x.shape[:-1] + (D,))


def _qk_norm_rope_torch(q, k, q_w, k_w, cos, sin, eps):
    from gpu_worker.model import rms_norm, rotate_half_split
    return rotate_half_split(rms_norm(q, q_w, eps), cos, sin), rotate_half_split(rms_norm(k, k_w, eps), cos, sin)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, eps: float, *, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3Attention's `rotate_half_split(q_norm(q))` and the same for k, in one launch.

    q [N, Hq, d], k [N, Hk, d] (the projection views), q_w/k_w [d], cos/sin [N, d/2]
    in the activation dtype (Qwen3Backbone.rope). Returns new contiguous (q, k)."""
    N, Hq, d = q.shape
    Hk = k.shape[1]
    dt = q.dtype
    supported = (dt in _KERNEL_DTYPES and all(t.dtype == dt for t in (k, q_w, k_w, cos, sin)) and N > 0
                 and d % 2 == 0 and d <= 1024 and k.shape[::2] == (N, d) and q.stride(-1) == 1
                 and k.stride(-1) == 1 and q_w.is_contiguous() and k_w.is_contiguous()
                 and cos.shape == sin.shape == (N, d // 2) and cos.stride() == sin.stride() and cos.stride(-1) == 1)
    if not _use_kernel(impl, supported, q, k, q_w, k_w, cos, sin):
        return _qk_norm_rope_torch(q, k, q_w, k_w, cos, sin, eps)
    qo = torch.empty((N, Hq, d), dtype=dt, device=q.device)
    ko = torch.empty((N, Hk, d), dtype=dt, device=q.device)
    half = d // 2
    _qk_norm_rope_kernel[(N, Hq + Hk)](
        q, k, q_w, k_w, cos, sin, qo, ko,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), qo.stride(0), qo.stride(1),
        ko.stride(0), ko.stride(1), cos.stride(0), Hq, half, _inv(d), eps,
        BLOCK_H=triton.next_power_of_2(half), CUDA=q.is_cuda, **_launch_opts(1))
    return qo, ko


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
