"""Fused elementwise glue of SlotDecoder's Transformer layers (vocoder_svc/slot_decoder.py), Triton with torch paths.

A 64-stream x 25-frame bf16 step of the full codec spent more GPU time in elementwise glue than in
its GEMMs and attention together: RoPE as ~10 generic kernels per tensor (promote, slice, 4 muls,
sub/add, stack, flatten, cast back) for q and for k, LayerScale residuals as separate mul and add,
and every LayerNorm followed by a cast kernel. These functions do each group in one launch:

- `layer_norm_cast(y, w, b, eps, out_dtype)`:
  ``F.layer_norm(y, (d,), w, b, eps).to(out_dtype)``.
- `scaled_add_layer_norm(y, u, s, w, b, eps, out_dtype)` -> ``(y_new, normed)``:
  ``y_new = y + (u if s is None else s * u)``, ``normed = layer_norm_cast(y_new, ...)``: a LayerScale
  residual and the next pre-norm (LN2 after attention; LN1 of the next layer after the FFN).
- `scaled_add(y, u, s)`: ``y + (u if s is None else s * u)`` (the last FFN residual of a stage).
- `rope_qk(qkv, cos, sin, nh, hd)` -> ``(q, k, v)`` ``[B, H, Tk, D]``: the fused QKV projection
  ``[B, Tk, 3*H*D]`` split into heads, q and k rotated as codec.apply_rope rotates them (v stays a view).
- `pcm16(x)`: a step's audio ``[B, C, L]`` as the wire's interleaved int16 ``[B, L, C]``
  (chorus.audio.encode_pcm16's values), one pass instead of six torch kernels over strided views.

Every function takes ``impl`` as gpu_worker/kernels.py's do: "auto" runs the kernel for supported CUDA
inputs and the torch path elsewhere; "triton" forces the kernel (CUDA, or CPU tensors under
TRITON_INTERPRET=1 set before this module is imported); "torch" forces the torch path. The torch paths
ARE the slot decoder's math, op for op (so CPU / fp64 results do not change by a bit).

Numerics of the kernels (fp32 residual stream y, u in the compute dtype, s/w/b fp32):
- ``s * u`` and the add round in fp32 exactly as torch's promoted ops do (FMA contraction is off,
  ``enable_fp_fusion=False``), so ``y_new`` is bit-identical to the torch path.
- RoPE: ``x0*cos - x1*sin`` and ``x0*sin + x1*cos`` in fp32, each product and the sum rounded, then one
  rounding to the activation dtype: bit-identical to apply_rope (cos/sin are the slot decoder's fp32 tables).
- LayerNorm: two passes in fp32 in one program per row (torch uses Welford): the same value up to fp32
  rounding of the mean / variance, so after the cast to bf16 an element differs by at most one bf16
  ulp, and rarely at all. fp32 outputs differ at the 1e-7 relative level.
- Under the interpreter fp32 -> bf16 casts truncate; `_cast` rounds to nearest even on the bits there.

Outputs are fresh tensors (y_new: [B, Tk, d] fp32; q, k, v: contiguous [B, H, Tk, D] views of one
[3, B, H, Tk, D] buffer, which window_attention and ring_write take; ring_write's reshape of the chunk
is then a view whenever Tk <= W). Launches are sync-free, so a step can be captured in a CUDA graph
(after a warm-up call per shape compiles the kernels).

Safety: `select_impl` (used by SlotDecoder(glue=...)) runs `self_test` (each kernel against its torch
path on small inputs of the slot decoder's widths) before the kernels are used on CUDA; "auto" falls back
to the torch path, with a warning on the "chorus.vocoder" logger, when a kernel fails to compile or
disagrees beyond rounding.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from vocoder_svc.codec import apply_rope

log = logging.getLogger("chorus.vocoder")


from chorus.triton_support import HAVE_TRITON, INTERPRET, KERNEL_DTYPES as _KERNEL_DTYPES, triton, tl, use_kernel
from chorus.triton_support import launch_opts as _launch_opts

__all__ = ["HAVE_TRITON", "INTERPRET", "layer_norm_cast", "scaled_add_layer_norm", "scaled_add", "rope_qk",
           "pcm16", "kernels_usable", "select_impl", "self_test"]

MAX_KERNEL_WIDTH = 16384
# Device types on which glue="auto" takes the kernels, and on which select_impl self-tests them first
# (tests add "cpu" to exercise both under the interpreter).
AUTO_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
SELF_TEST_DEVICE_TYPES: tuple[str, ...] = ("cuda",)


def _use_kernel(impl: str, supported: bool, *tensors: Tensor) -> bool:
    return use_kernel(impl, supported, *tensors, unsupported="fp32 residual / norm parameters, fp32/bf16/fp16 "
                      "activations, unit stride in the last dim, matching shapes")


# =============================================================================
# Triton kernels
# =============================================================================
if HAVE_TRITON:

    from chorus.triton_support import cast as _cast, libdevice

    @triton.jit
    def _pcm16_value(x, CUDA: tl.constexpr):
        """encode_pcm16 of one sample: scale by 32767 in fp32, clip, round half to even."""
        v = tl.minimum(tl.maximum(x.to(tl.float32) * 32767.0, -32767.0), 32767.0)
        if CUDA:
            v = libdevice.rint(v)
        else:  # the interpreter has no rint: 1.5 * 2**23 added and taken away rounds half to even
            v = (v + 12582912.0) - 12582912.0
        return v.to(tl.int16)

    @triton.jit
    def _pcm16_kernel(x_ptr, out_ptr, s_b, s_c, L, C: tl.constexpr, BLOCK: tl.constexpr, CUDA: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        src = x_ptr + b * s_b + t
        if C == 2:  # both channels, interleaved in registers: one contiguous store
            y = tl.join(_pcm16_value(tl.load(src, mask=t < L, other=0.0), CUDA),
                        _pcm16_value(tl.load(src + s_c, mask=t < L, other=0.0), CUDA))
            o = 2 * tl.program_id(1) * BLOCK + tl.arange(0, 2 * BLOCK)
            tl.store(out_ptr + b * (2 * L) + o, tl.reshape(y, [2 * BLOCK]), mask=o < 2 * L)
        else:
            tl.store(out_ptr + b * L + t, _pcm16_value(tl.load(src, mask=t < L, other=0.0), CUDA), mask=t < L)

    @triton.jit
    def _residual_norm_kernel(y_ptr, u_ptr, s_ptr, w_ptr, b_ptr, ynew_ptr, out_ptr,
                              y_stride, u_stride, ynew_stride, out_stride, D, inv_d, eps,
                              HAS_U: tl.constexpr, HAS_S: tl.constexpr, HAS_NORM: tl.constexpr,
                              BLOCK: tl.constexpr, CUDA: tl.constexpr):
        """One row: [y_new = y + (s *) u, stored], then LayerNorm(y_new) cast to out's dtype."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(y_ptr + row * y_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_U:
            u = tl.load(u_ptr + row * u_stride + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_S:  # torch: (s * u) in fp32 (u promoted), rounded, then the fp32 add
                u = tl.load(s_ptr + cols, mask=mask, other=0.0) * u
            x = x + u
            tl.store(ynew_ptr + row * ynew_stride + cols, x, mask=mask)
        if HAS_NORM:
            # Two passes in fp32 (torch: Welford, the same value up to fp32 rounding).
            mean = tl.sum(x, axis=0) * inv_d
            xc = tl.where(mask, x - mean, 0.0)
            rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=0) * inv_d + eps)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0)
            b = tl.load(b_ptr + cols, mask=mask, other=0.0)
            tl.store(out_ptr + row * out_stride + cols, _cast(w * (xc * rstd) + b, out_ptr.dtype.element_ty, CUDA),
                     mask=mask)

    @triton.jit
    def _rope_qk_kernel(qkv_ptr, cos_ptr, sin_ptr, out_ptr, s_b, s_t, c_b, c_t, o_2, o_b, o_h, o_t,
                        TK, HD, HALF, WIDTH,
                        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, CUDA: tl.constexpr):
        """BLOCK_T tokens of one head of q (axis 2 = 0) or k (= 1), rotated: every load and store is a
        run of whole head rows (the pairs are split and re-joined in registers, not read with stride 2)."""
        n_tb = tl.cdiv(TK, BLOCK_T)
        pid = tl.program_id(0)
        b = (pid // n_tb).to(tl.int64)
        t = (pid % n_tb) * BLOCK_T + tl.arange(0, BLOCK_T)
        h = tl.program_id(1).to(tl.int64)
        which = tl.program_id(2).to(tl.int64)
        tm = (t < TK)[:, None]
        t = t.to(tl.int64)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        i = tl.arange(0, BLOCK_D // 2)[None, :]
        x = tl.load(qkv_ptr + b * s_b + t * s_t + which * WIDTH + h * HD + d, mask=tm & (d < HD), other=0.0)
        x0, x1 = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_T, BLOCK_D // 2, 2)))
        c = tl.load(cos_ptr + b * c_b + t * c_t + i, mask=tm & (i < HALF), other=0.0)  # fp32
        s = tl.load(sin_ptr + b * c_b + t * c_t + i, mask=tm & (i < HALF), other=0.0)
        # apply_rope's fp32 math, one rounding to the activation dtype
        y = tl.reshape(tl.join(x0 * c - x1 * s, x0 * s + x1 * c), (BLOCK_T, BLOCK_D))
        dst = out_ptr + which * o_2 + b * o_b + h * o_h + t * o_t + d
        tl.store(dst, _cast(y, out_ptr.dtype.element_ty, CUDA), mask=tm & (d < HD))


# =============================================================================
# Public API
# =============================================================================
def _norm_supported(y: Tensor, u: Tensor | None, s: Tensor | None, w: Tensor | None, b: Tensor | None,
                    out_dtype: torch.dtype | None) -> bool:
    d = y.shape[-1] if y.dim() else 0
    vec_ok = all(p is None or (p.dtype == torch.float32 and p.shape == (d,) and p.is_contiguous())
                 for p in (s, w, b))
    return (y.dtype == torch.float32 and y.dim() >= 1 and y.numel() > 0 and 1 <= d <= MAX_KERNEL_WIDTH
            and y.stride(-1) == 1 and vec_ok and (out_dtype is None or out_dtype in _KERNEL_DTYPES)
            and (u is None or (u.dtype in _KERNEL_DTYPES and u.shape == y.shape and u.stride(-1) == 1)))


def _residual_norm(y: Tensor, u: Tensor | None, s: Tensor | None, w: Tensor | None, b: Tensor | None,
                   eps: float, out_dtype: torch.dtype | None) -> tuple[Tensor, Tensor | None]:
    d = y.shape[-1]
    y2 = y.reshape(-1, d)  # a view for the slot decoder's contiguous [B, Tk, d]
    u2 = y2 if u is None else u.reshape(-1, d)
    n = y2.shape[0]
    y_new = torch.empty((n, d), dtype=torch.float32, device=y.device) if u is not None else y2
    out = torch.empty((n, d), dtype=out_dtype, device=y.device) if w is not None else y2
    block = triton.next_power_of_2(d)
    _residual_norm_kernel[(n,)](
        y2, u2, y2 if s is None else s, y2 if w is None else w, y2 if b is None else b, y_new, out,
        y2.stride(0), u2.stride(0), y_new.stride(0), out.stride(0), d, 1.0 / d, float(eps),
        HAS_U=u is not None, HAS_S=s is not None, HAS_NORM=w is not None, BLOCK=block, CUDA=y.is_cuda,
        **_launch_opts(max(1, min(8, block // 256))))
    return (y_new.view(y.shape) if u is not None else y), (out.view(y.shape) if w is not None else None)


def layer_norm_cast(y: Tensor, w: Tensor, b: Tensor, eps: float, out_dtype: torch.dtype, *,
                    impl: str = "auto") -> Tensor:
    """``F.layer_norm(y, (d,), w, b, eps).to(out_dtype)`` (y [..., d] fp32 for the kernel, w/b [d] fp32)."""
    if not _use_kernel(impl, _norm_supported(y, None, None, w, b, out_dtype), y, w, b):
        return F.layer_norm(y, (y.shape[-1],), w, b, eps).to(out_dtype)
    return _residual_norm(y, None, None, w, b, eps, out_dtype)[1]


def scaled_add_layer_norm(y: Tensor, u: Tensor, s: Tensor | None, w: Tensor, b: Tensor, eps: float,
                          out_dtype: torch.dtype, *, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """``y_new = y + (u if s is None else s * u)`` and ``F.layer_norm(y_new, (d,), w, b, eps).to(out_dtype)``.

    y [..., d] fp32 (the residual stream), u [..., d] (a projection's output, fp32/bf16/fp16), s [d] fp32
    (LayerScale) or None: torch's promotion, i.e. ``s * u`` in fp32 then an fp32 add. Returns (y_new, normed)."""
    tensors = (y, u, w, b) + (() if s is None else (s,))
    if not _use_kernel(impl, _norm_supported(y, u, s, w, b, out_dtype), *tensors):
        y = y + (u if s is None else s * u)
        return y, F.layer_norm(y, (y.shape[-1],), w, b, eps).to(out_dtype)
    return _residual_norm(y, u, s, w, b, eps, out_dtype)


def scaled_add(y: Tensor, u: Tensor, s: Tensor | None, *, impl: str = "auto") -> Tensor:
    """``y + (u if s is None else s * u)`` (as scaled_add_layer_norm, without the norm)."""
    tensors = (y, u) + (() if s is None else (s,))
    if not _use_kernel(impl, _norm_supported(y, u, s, None, None, None), *tensors):
        return y + (u if s is None else s * u)
    return _residual_norm(y, u, s, None, None, 0.0, None)[0]


def _rope_qk_torch(qkv: Tensor, cos: Tensor, sin: Tensor, nh: int, hd: int) -> tuple[Tensor, Tensor, Tensor]:
    bsz, tk = qkv.shape[0], qkv.shape[1]
    qkv = qkv.reshape(bsz, tk, 3, nh, hd).permute(2, 0, 3, 1, 4)
    return apply_rope(qkv[0], cos, sin), apply_rope(qkv[1], cos, sin), qkv[2]


def rope_qk(qkv: Tensor, cos: Tensor, sin: Tensor, nh: int, hd: int, *,
            impl: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v [B, H, Tk, D] from the fused QKV projection qkv [B, Tk, 3*H*D] (channel order (3, H, D)),
    q and k rotated by codec.apply_rope at the angles behind cos/sin [B, 1, Tk, D/2] (fp32).

    Torch path: the slot decoder's ``qkv.reshape(B, Tk, 3, H, D).permute(2, 0, 3, 1, 4)`` views, q and k through
    apply_rope. Kernel: q and k contiguous [B, H, Tk, D] (views of one [2, B, H, Tk, D] buffer), the same
    values. v is the same strided view of qkv on both paths (attention and the ring write take strides)."""
    supported = (qkv.dim() == 3 and qkv.dtype in _KERNEL_DTYPES and qkv.numel() > 0 and hd % 2 == 0 and hd >= 2
                 and qkv.shape[2] == 3 * nh * hd and qkv.stride(2) == 1
                 and cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape
                 and tuple(cos.shape) == (qkv.shape[0], 1, qkv.shape[1], hd // 2)
                 and cos.stride() == sin.stride() and cos.stride(3) == 1)
    if not _use_kernel(impl, supported, qkv, cos, sin):
        return _rope_qk_torch(qkv, cos, sin, nh, hd)
    bsz, tk, _ = qkv.shape
    out = torch.empty((2, bsz, nh, tk, hd), dtype=qkv.dtype, device=qkv.device)
    block_d = triton.next_power_of_2(hd)
    block_t = max(1, min(triton.next_power_of_2(tk), 4096 // block_d))  # about 4k elements per program
    _rope_qk_kernel[(bsz * triton.cdiv(tk, block_t), nh, 2)](
        qkv, cos, sin, out, qkv.stride(0), qkv.stride(1), cos.stride(0), cos.stride(2),
        out.stride(0), out.stride(1), out.stride(2), out.stride(3), tk, hd, hd // 2, nh * hd,
        BLOCK_T=block_t, BLOCK_D=block_d, CUDA=qkv.is_cuda,
        **_launch_opts(max(1, min(8, block_t * block_d // 512))))
    v = qkv.reshape(bsz, tk, 3, nh, hd)[:, :, 2].transpose(1, 2)
    return out[0], out[1], v


def _pcm16_torch(x: Tensor) -> Tensor:
    x = x.to(torch.float32).transpose(1, 2)  # [B, L, C]: interleaved channels
    return (x * 32767.0).clamp_(-32767.0, 32767.0).round_().to(torch.int16).contiguous()


def pcm16(x: Tensor, *, impl: str = "auto") -> Tensor:
    """x [B, C, L] (float, C 1 or 2) -> contiguous int16 [B, L, C]: chorus.audio.encode_pcm16's values
    (x * 32767 in fp32, clipped to +-32767, rounded half to even), channels interleaved."""
    supported = (x.dim() == 3 and x.dtype in _KERNEL_DTYPES and x.shape[1] in (1, 2) and x.stride(2) == 1
                 and x.numel() > 0)
    if not _use_kernel(impl, supported, x):
        return _pcm16_torch(x)
    B, C, L = x.shape
    out = torch.empty((B, L, C), dtype=torch.int16, device=x.device)
    block = 1024
    _pcm16_kernel[(B, triton.cdiv(L, block))](x, out, x.stride(0), x.stride(1), L, C=C, BLOCK=block,
                                              CUDA=x.is_cuda, **_launch_opts(4))
    return out


# =============================================================================
# Selection and the self-test
# =============================================================================
def kernels_usable(device: torch.device | str, compute_dtype: torch.dtype) -> bool:
    """Whether the kernels can run for a slot decoder of this compute dtype on this device (fp32 residual
    stream: compute dtype fp32, bf16 or fp16; CUDA, or CPU under the interpreter)."""
    dev = torch.device(device)
    return (HAVE_TRITON and compute_dtype in _KERNEL_DTYPES
            and (dev.type == "cuda" or (INTERPRET and dev.type == "cpu")))


def _close(out: Tensor, ref: Tensor, what: str) -> str | None:
    """None when out equals ref up to the rounding the kernels may differ by, else why not."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return f"{what}: got {out.dtype} {list(out.shape)}, want {ref.dtype} {list(ref.shape)}"
    o, r = out.double(), ref.double()
    if not bool(torch.isfinite(o).all()):
        return f"{what}: non-finite output"
    # Two ulps of the output dtype relative, plus a small absolute floor (LayerNorm's mean and variance
    # round differently from torch's Welford, which may move a bf16 output by one ulp; the rest is exact).
    rel = {torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9}.get(out.dtype, 1e-5)
    err = (o - r).abs()
    bound = rel * r.abs() + rel * max(1.0, r.abs().max().item()) * 1e-2
    if bool((err > bound).any()):
        return f"{what}: max abs diff {err.max().item():.3e} from the torch path (max |ref| {r.abs().max().item():.3e})"
    return None


def self_test(device: torch.device | str, compute_dtype: torch.dtype, shapes: Iterable[tuple[int, int, int]],
              batch: int = 2, tokens: int = 3, seed: int = 0) -> str | None:
    """Run every kernel against its torch path on small random inputs of each (d, heads, head_dim) in
    `shapes`, in `compute_dtype` on `device`. Returns None when all agree up to rounding, else a reason
    (a kernel that raised, e.g. failed to compile, or disagreed)."""
    dev = torch.device(device)
    cd, f32 = compute_dtype, torch.float32
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0, shift: float = 0.0) -> Tensor:
        return (torch.randn(*shape, generator=gen) * scale + shift).to(dev)

    for d, nh, hd in sorted(set((int(d), int(nh), int(hd)) for d, nh, hd in shapes)):
        where = f"d={d}, heads={nh}, head_dim={hd}, {cd}"
        try:
            y = rnd(batch, tokens, d, scale=2.0, shift=0.5)
            u = rnd(batch, tokens, d).to(cd)
            s = rnd(d, scale=0.1)
            w = rnd(d, scale=0.2, shift=1.0)
            b = rnd(d, scale=0.1)
            checks = [("layer_norm_cast", layer_norm_cast(y, w, b, 1e-5, cd, impl="triton"),
                       layer_norm_cast(y, w, b, 1e-5, cd, impl="torch"))]
            for scale in (s, None):
                tag = "scaled_add_layer_norm" + ("" if scale is not None else " (no scale)")
                got = scaled_add_layer_norm(y, u, scale, w, b, 1e-5, cd, impl="triton")
                ref = scaled_add_layer_norm(y, u, scale, w, b, 1e-5, cd, impl="torch")
                checks += [(tag + " y", got[0], ref[0]), (tag + " normed", got[1], ref[1])]
            checks.append(("scaled_add", scaled_add(y, u, s, impl="triton"), scaled_add(y, u, s, impl="torch")))
            if hd % 2 == 0:
                qkv = rnd(batch, tokens, 3 * nh * hd).to(cd)
                offsets = torch.tensor([1000 * (r % 2) for r in range(batch)], device=dev)  # fresh / far
                pos = offsets.unsqueeze(1) + torch.arange(tokens, device=dev)
                freq = torch.exp(torch.arange(hd // 2, dtype=f32, device=dev) * (-2.0 * 9.21 / hd))
                angle = pos.to(f32).unsqueeze(-1) * freq
                cos, sin = torch.cos(angle).unsqueeze(1), torch.sin(angle).unsqueeze(1)
                got = rope_qk(qkv, cos, sin, nh, hd, impl="triton")
                ref = rope_qk(qkv, cos, sin, nh, hd, impl="torch")
                checks += [(f"rope_qk {n}", g, r) for n, g, r in zip("qkv", got, ref)]
            audio = rnd(batch, 2, 300, scale=0.7).to(cd)
            audio[0, 0, :4] = torch.tensor([1.5, -1.5, 0.5 / 32767, 1.5 / 32767])  # clipped; halves to even
            got, ref = pcm16(audio, impl="triton"), pcm16(audio, impl="torch")
            if not torch.equal(got, ref):
                return f"{where}: pcm16 differs from the torch path in {int((got != ref).sum())} samples"
            for name, got, ref in checks:
                why = _close(got, ref, name)
                if why is not None:
                    return f"{where}: {why}"
        except Exception as e:  # noqa: BLE001 - a compile or launch error means: do not use the kernels
            return f"{where}: {e!r}"
    return None


def select_impl(glue: str, device: torch.device | str, compute_dtype: torch.dtype,
                shapes: Iterable[tuple[int, int, int]]) -> tuple[str, str | None]:
    """The glue path of a slot decoder: ("triton" | "torch", why the kernels were rejected or None).

    "torch": the torch path. "auto": the kernels on CUDA for fp32/bf16/fp16 compute when triton is
    importable, after `self_test` passes (else a warning and the torch path). "triton": the kernels
    (ValueError when they cannot run here; RuntimeError when the self-test fails on CUDA)."""
    if glue not in ("auto", "triton", "torch"):
        raise ValueError(f"glue must be 'auto', 'triton' or 'torch', got {glue!r}")
    if glue == "torch":
        return "torch", None
    dev = torch.device(device)
    usable = kernels_usable(dev, compute_dtype)
    if glue == "auto" and not (usable and dev.type in AUTO_DEVICE_TYPES):
        return "torch", None
    if not usable:
        raise ValueError("glue='triton' needs triton, compute dtype fp32/bf16/fp16 and a CUDA device (or CPU "
                         f"with TRITON_INTERPRET=1 set before import); got {compute_dtype} on {dev}")
    if dev.type in SELF_TEST_DEVICE_TYPES:
        shapes = list(shapes)
        why = self_test(dev, compute_dtype, shapes)
        if why is not None:
            if glue == "triton":
                raise RuntimeError(f"glue='triton': the fused glue kernels failed their self-test: {why}")
            log.warning("fused slot decoder glue kernels failed their self-test, using the torch path: %s", why)
            return "torch", why
        log.info("fused slot decoder glue kernels passed their self-test (%s, widths %s)", compute_dtype,
                 sorted({d for d, _, _ in shapes}))
    return "triton", None
