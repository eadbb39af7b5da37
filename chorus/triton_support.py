"""Where Chorus's Triton kernels run, and the pieces they share
(gpu_worker/kernels.py, vocoder_svc/window_attention.py, vocoder_svc/slot_kernels.py).

Triton is imported only where it can run: with CUDA, or in interpreter mode
(TRITON_INTERPRET=1, which runs kernels on CPU tensors; tests/conftest.py sets
it before anything imports triton, where triton is installed). A CPU process
never imports it otherwise, and CI, which has no triton, takes every torch path.
Triton decides at decoration time whether @triton.jit functions are
interpreted, so `INTERPRET` records the mode this process runs in.

Every kernel function takes `impl`: "auto" runs the kernel for supported
CUDA inputs and the torch path otherwise; "triton" forces the kernel (CUDA,
or CPU tensors under the interpreter) and raises when it cannot run; "torch"
forces the torch path.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["HAVE_TRITON", "INTERPRET", "KERNEL_DTYPES", "triton", "tl", "libdevice", "use_kernel", "launch_opts",
           "cast", "rnd", "div", "exp", "log"]


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


HAVE_TRITON = False
triton = tl = libdevice = None
if _interpret_env() or "triton" in sys.modules or torch.cuda.is_available():
    try:
        import triton
        import triton.language as tl
        from triton.language.extra import libdevice
        HAVE_TRITON = True
    except ImportError:  # no triton (CI): every function takes its torch path
        pass

INTERPRET = HAVE_TRITON and _interpret_env()

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def use_kernel(impl: str, supported: bool, *tensors: torch.Tensor, unsupported: str = "") -> bool:
    """Kernel or torch path for these inputs. `supported`: the inputs fit the kernel (dtypes,
    strides, sizes); "auto" falls back to torch when they do not, "triton" raises with
    `unsupported` (what the kernel needs) in the message."""
    if impl == "torch":
        return False
    if impl not in ("auto", "triton"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    if impl == "auto":
        return supported and HAVE_TRITON and all(t.is_cuda for t in tensors)
    if not (HAVE_TRITON and all(t.is_cuda or (INTERPRET and t.device.type == "cpu") for t in tensors)):
        raise RuntimeError("impl='triton' needs triton and CUDA tensors (or TRITON_INTERPRET=1 set before "
                           "triton is first imported, with CPU tensors)")
    if not supported:
        raise ValueError("impl='triton': these inputs need the torch path" + (f" ({unsupported})" if unsupported else ""))
    return True


_reflect_ftz_option: bool | None = None


def launch_opts(num_warps: int, **extra) -> dict:
    """No FMA contraction (torch rounds every product before the add or sub), and, where
    this Triton has the option, libdevice without flush-to-zero, as nvcc compiles torch's
    kernels (only denormal inputs/outputs could differ)."""
    global _reflect_ftz_option
    if _reflect_ftz_option is None:
        try:
            from triton.backends.nvidia.compiler import CUDAOptions
            _reflect_ftz_option = "enable_reflect_ftz" in CUDAOptions.__dataclass_fields__
        except Exception:  # pragma: no cover - non-NVIDIA builds
            _reflect_ftz_option = False
    opts = {"num_warps": num_warps, "enable_fp_fusion": False, **extra}
    if _reflect_ftz_option and not INTERPRET:
        opts["enable_reflect_ftz"] = False
    return opts


if HAVE_TRITON:

    @triton.jit
    def cast(x, dtype: tl.constexpr, CUDA: tl.constexpr):
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
    def rnd(x, dtype: tl.constexpr, CUDA: tl.constexpr):
        """x rounded through dtype and back to fp32: one torch op's output rounding."""
        return cast(x, dtype, CUDA).to(tl.float32)

    @triton.jit
    def div(a, b):
        """IEEE division. Triton's `/` on fp32 lowers to the approximate div.full.f32;
        div_rn gives div.rn.f32 (and, unlike libdevice's, keeps denormals as torch does).
        fp64 `/` is already div.rn.f64."""
        if a.dtype == tl.float64:
            return a / b
        else:
            return tl.math.div_rn(a, b)

    @triton.jit
    def exp(x, CUDA: tl.constexpr):
        if CUDA:
            return libdevice.exp(x)  # __nv_expf / __nv_exp, as torch's exp kernels
        else:
            return tl.exp(x)

    @triton.jit
    def log(x, CUDA: tl.constexpr):
        if CUDA:
            return libdevice.log(x)
        else:
            return tl.log(x)
else:
    cast = rnd = div = exp = log = None
