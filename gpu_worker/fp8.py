"""FP8 (e4m3) weights for the backbone's GEMMs: `--quantization fp8`, off by default.

A decode step at a large batch reads every backbone weight once; e4m3 halves those bytes and
Hopper's FP8 tensor cores double the matrix rate against bf16. Each weight row (output
channel) has its own scale, fixed at load. Activations are quantized per row at every call:
a scale shared by the whole batch would make a row's result depend on the rows beside it,
breaking the promise that a seeded request gives the same frames alone or batched.

On random weights only the frames' agreement with bf16 can be measured; whether the audio
stays as good needs a real checkpoint to judge.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from chorus.triton_support import HAVE_TRITON, cast, launch_opts, triton, tl, use_kernel

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
MIN_SCALE = 1e-12  # an all-zero row quantizes to zeros, not to 0/0


def quantize_rows_torch(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, 1]) with x ~ q * scale, each row's largest
    magnitude mapped to FP8_MAX."""
    xf = x.to(torch.float32)
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


if HAVE_TRITON:

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, x_stride, q_stride, FP8_MAX: tl.constexpr,
                              MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr, CUDA: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * x_stride + k + cols, mask=k + cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX), MIN_SCALE)
        tl.store(s_ptr + row, scale)
        for k in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * x_stride + k + cols, mask=k + cols < K, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
            tl.store(q_ptr + row * q_stride + k + cols, cast(q, tl.float8e4nv, CUDA), mask=k + cols < K)


def quantize_rows(x: Tensor, *, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """quantize_rows_torch in one launch on CUDA (x [M, K], rows contiguous)."""
    supported = x.dim() == 2 and x.shape[0] > 0 and x.stride(-1) == 1 and x.dtype in (torch.bfloat16, torch.float16,
                                                                                      torch.float32)
    if not use_kernel(impl, supported, x, unsupported="2-D, rows contiguous, a float dtype"):
        return quantize_rows_torch(x)
    M, K = x.shape
    q = torch.empty((M, K), dtype=FP8, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(M,)](x, q, scale, K, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
                                BLOCK=min(2048, triton.next_power_of_2(K)), CUDA=x.is_cuda, **launch_opts(4))
    return q, scale


def fp8_linear(x: Tensor, weight: Tensor, weight_scale: Tensor) -> Tensor:
    """F.linear(x, weight * weight_scale[:, None]) in x's dtype, the product in FP8: x [..., K],
    weight e4m3 [N, K], weight_scale fp32 [N]."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.shape[0] == 0:
        return x.new_empty((*lead, weight.shape[0]))
    q, scale = quantize_rows(rows)
    out = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale[None], out_dtype=x.dtype)
    return out.reshape(*lead, weight.shape[0])


class Fp8Linear(nn.Module):
    """A bias-free Linear holding its weight in e4m3 with one fp32 scale per output row."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("Fp8Linear: a Linear with a bias is not quantized")
        q, scale = quantize_rows_torch(linear.weight.data)  # a weight row is an output channel
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale[:, 0], requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.weight_scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3"


def check_device(device: torch.device) -> None:
    """FP8 GEMMs need e4m3 tensor cores: compute capability 8.9 (Ada) or later on CUDA."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"quantization fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper); "
                         f"{torch.cuda.get_device_name(device)} is {major}.{minor}: run without it")


def quantize_linears(module: nn.Module) -> int:
    """Replace every Linear under module by an Fp8Linear, one at a time (the bf16 weight is freed
    as its e4m3 copy lands); returns how many. The caller checks the device (check_device)."""
    targets = [(parent, name) for parent in module.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    for parent, name in targets:
        setattr(parent, name, Fp8Linear(getattr(parent, name)))
    return len(targets)
