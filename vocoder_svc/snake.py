"""The Snake activation of OmniVoice's codec decoder (transformers' DAC `Snake1d`),
x + 1 / (alpha + 1e-9) * sin(alpha * x)^2 with one alpha per channel, as one Triton launch.

Why: the decoder runs Snake before every convolution, over tensors of up to 32 channels x 960
samples a frame, and torch spends five kernels on it (product, sin, square, product, sum), each a
full pass over the tensor in fp32. One pass reads x once and writes once.

The kernel does torch's operations in torch's order with torch's roundings (no FMA contraction,
IEEE reciprocal, libdevice's sinf on CUDA, square as a product), so on CUDA it gives torch's
bits; under the interpreter numpy's sin may differ from torch-CPU's by an ulp.
The decoder's residual units add each convolution's bias in a pass of its own, a broadcast add
over the whole output; `_residual_unit` hands the first bias to the Snake after it and the second
to the residual add (`add_bias_residual`), each added as torch adds it.

`fuse_snakes(model)` swaps every Snake1d of a model for `FusedSnake` holding the same alpha and
runs the residual units that way (the state dict keeps its names); `kernel_compiles(device)` says
where that is worth doing.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor, nn

from chorus.triton_support import HAVE_TRITON, INTERPRET, div, launch_opts, libdevice, tl, triton, use_kernel

BLOCK = 1024


def snake_torch(x: Tensor, alpha: Tensor) -> Tensor:
    """The reference: transformers' Snake1d.forward. x [B, C, ...], alpha [1, C, 1]."""
    shape = x.shape
    x = x.reshape(shape[0], shape[1], -1)
    return (x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)).reshape(shape)


if HAVE_TRITON:

    @triton.jit
    def _snake_kernel(x_ptr, alpha_ptr, bias_ptr, out_ptr, C, L, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                      CUDA: tl.constexpr):
        row = tl.program_id(0)  # b * C + c
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < L
        channel = row % C + tl.zeros([BLOCK], dtype=tl.int32)  # one channel, as a block
        a = tl.load(alpha_ptr + channel)
        inv = div(tl.full([BLOCK], 1.0, tl.float32), a + 1e-9)
        base = row.to(tl.int64) * L
        x = tl.load(x_ptr + base + offs, mask=keep, other=0.0)
        if HAS_BIAS:  # the convolution's bias, added as torch adds it after the convolution
            x = x + tl.load(bias_ptr + channel)
        ax = a * x
        if CUDA:
            s = libdevice.sin(ax)  # __nv_sinf: the CUDA math library's sinf, as torch's sin kernel
        else:
            s = tl.sin(ax)
        tl.store(out_ptr + base + offs, x + inv * (s * s), mask=keep)

    @triton.jit
    def _bias_residual_kernel(x_ptr, bias_ptr, res_ptr, out_ptr, C, L, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < L
        base = row.to(tl.int64) * L
        bias = tl.load(bias_ptr + row % C + tl.zeros([BLOCK], tl.int32))
        x = tl.load(x_ptr + base + offs, mask=keep, other=0.0) + bias
        tl.store(out_ptr + base + offs, tl.load(res_ptr + base + offs, mask=keep, other=0.0) + x, mask=keep)


def _fits(x: Tensor, *per_channel: Tensor) -> bool:
    return (x.dtype == torch.float32 and x.dim() == 3 and x.is_contiguous() and x.numel() > 0
            and all(t.dtype == torch.float32 and t.numel() == x.shape[1] and t.is_contiguous() for t in per_channel))


def snake(x: Tensor, alpha: Tensor, bias: Tensor | None = None, *, impl: str = "auto") -> Tensor:
    """snake_torch(x + bias per channel, alpha) (bias: a convolution's, left out of it); one
    launch for contiguous fp32 x [B, C, L] on CUDA ("auto")."""
    extra = () if bias is None else (bias,)
    if not use_kernel(impl, _fits(x, alpha, *extra), x, alpha, *extra,
                      unsupported="contiguous fp32 [B, C, L] and alpha [1, C, 1]"):
        return snake_torch(x if bias is None else x + bias[:, None], alpha)
    b, c, n = x.shape
    out = torch.empty_like(x)
    _snake_kernel[(b * c, triton.cdiv(n, BLOCK))](x, alpha, alpha if bias is None else bias, out, c, n,
                                                   HAS_BIAS=bias is not None, BLOCK=BLOCK, CUDA=x.is_cuda,
                                                   **launch_opts(4))
    return out


def add_bias_residual(x: Tensor, bias: Tensor, residual: Tensor, *, impl: str = "auto") -> Tensor:
    """residual + (x + bias per channel): a convolution's bias and the residual add after it, in
    torch's order, one launch for contiguous fp32 [B, C, L] on CUDA ("auto")."""
    fits = _fits(x, bias) and residual.shape == x.shape and residual.is_contiguous() and residual.dtype == x.dtype
    if not use_kernel(impl, fits, x, bias, residual, unsupported="contiguous fp32 [B, C, L] of one shape"):
        return residual + (x + bias[:, None])
    b, c, n = x.shape
    out = torch.empty_like(x)
    _bias_residual_kernel[(b * c, triton.cdiv(n, BLOCK))](x, bias, residual, out, c, n, BLOCK=BLOCK,
                                                           **launch_opts(4))
    return out


def _residual_unit(unit: nn.Module, x: Tensor) -> Tensor:
    """transformers' DacResidualUnit.forward with each convolution's bias added in the launch after
    it (the second snake's; the residual add's)."""
    h = unit.conv1._conv_forward(unit.snake1(x), unit.conv1.weight, None)
    h = unit.conv2._conv_forward(snake(h, unit.snake2.alpha, unit.conv1.bias), unit.conv2.weight, None)
    crop = (x.shape[-1] - h.shape[-1]) // 2
    if crop > 0:
        x = x[..., crop:-crop]
    return add_bias_residual(h, unit.conv2.bias, x)  # a cropped x takes the torch path


class FusedSnake(nn.Module):
    """Snake1d with the same `alpha` parameter, run by `snake`."""

    def __init__(self, alpha: nn.Parameter):
        super().__init__()
        self.alpha = alpha

    def forward(self, x: Tensor) -> Tensor:
        return snake(x, self.alpha)


def kernel_compiles(device: torch.device) -> bool:
    """Whether `snake` runs its kernel on this device (CUDA with triton, not the interpreter)."""
    return device.type == "cuda" and HAVE_TRITON and not INTERPRET


def fuse_snakes(model: nn.Module) -> int:
    """Swap every Snake1d in model for a FusedSnake on the same alpha, and run every residual unit
    (DacResidualUnit) as `_residual_unit`; returns how many Snakes. The state dict keeps its names."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child).__name__ == "Snake1d"]
    for parent, name, child in swaps:
        setattr(parent, name, FusedSnake(child.alpha))
    for unit in model.modules():
        if type(unit).__name__ == "DacResidualUnit" and unit.conv1.bias is not None and unit.conv2.bias is not None:
            unit.forward = types.MethodType(_residual_unit, unit)
    return len(swaps)
