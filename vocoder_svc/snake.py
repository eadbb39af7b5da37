"""The Snake activation of OmniVoice's codec decoder (transformers' DAC `Snake1d`),
x + 1 / (alpha + 1e-9) * sin(alpha * x)^2 with one alpha per channel, as one Triton launch.

Why: the decoder runs Snake before every convolution, over tensors of up to 32 channels x 960
samples a frame, and torch spends five kernels on it (product, sin, square, product, sum), each a
full pass over the tensor in fp32. One pass reads x once and writes once.

The kernel does torch's operations in torch's order with torch's roundings (no FMA contraction,
IEEE reciprocal, libdevice's sinf on CUDA, square as a product), so on CUDA it gives torch's
bits; under the interpreter numpy's sin may differ from torch-CPU's by an ulp.
`fuse_snakes(model)` swaps every Snake1d of a model for `FusedSnake` holding the same alpha (the
state dict keeps its names); `kernel_compiles(device)` says where that is worth doing.
"""

from __future__ import annotations

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
    def _snake_kernel(x_ptr, alpha_ptr, out_ptr, C, L, BLOCK: tl.constexpr, CUDA: tl.constexpr):
        row = tl.program_id(0)  # b * C + c
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < L
        a = tl.load(alpha_ptr + row % C + tl.zeros([BLOCK], dtype=tl.int32))  # one alpha, as a block
        inv = div(tl.full([BLOCK], 1.0, tl.float32), a + 1e-9)
        base = row.to(tl.int64) * L
        x = tl.load(x_ptr + base + offs, mask=keep, other=0.0)
        ax = a * x
        if CUDA:
            s = libdevice.sin(ax)  # __nv_sinf: the CUDA math library's sinf, as torch's sin kernel
        else:
            s = tl.sin(ax)
        tl.store(out_ptr + base + offs, x + inv * (s * s), mask=keep)


def snake(x: Tensor, alpha: Tensor, *, impl: str = "auto") -> Tensor:
    """snake_torch's result; one launch for contiguous fp32 x [B, C, L] on CUDA ("auto")."""
    supported = (x.dtype == torch.float32 and alpha.dtype == torch.float32 and x.dim() == 3
                 and x.is_contiguous() and alpha.numel() == x.shape[1] and alpha.is_contiguous() and x.numel() > 0)
    if not use_kernel(impl, supported, x, alpha, unsupported="contiguous fp32 [B, C, L] and alpha [1, C, 1]"):
        return snake_torch(x, alpha)
    b, c, n = x.shape
    out = torch.empty_like(x)
    _snake_kernel[(b * c, triton.cdiv(n, BLOCK))](x, alpha, out, c, n, BLOCK=BLOCK, CUDA=x.is_cuda,
                                                   **launch_opts(4))
    return out


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
    """Swap every Snake1d in model for a FusedSnake on the same alpha; returns how many."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child).__name__ == "Snake1d"]
    for parent, name, child in swaps:
        setattr(parent, name, FusedSnake(child.alpha))
    return len(swaps)
