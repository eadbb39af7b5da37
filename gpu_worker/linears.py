"""Projections that read one input as one GEMM.

q/k/v read the same normed rows, as do gate/up: with their weights re-homed into one tensor
(each module's weight a view of its rows) a layer runs two GEMMs where it ran five, the
state-dict names and the memory unchanged. At a decode step's batch the step is launch-bound;
at a packed OmniVoice step one wide GEMM fills the GPU better than three narrow ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def fuse_linears(modules: tuple[nn.Module, ...]) -> None:
    """Re-home the weights of bias-free modules that read the same input into one tensor (also
    embedding tables, for one-launch lookups); call after the weights are in place."""
    joined = nn.Parameter(torch.cat([m.weight.data for m in modules]), requires_grad=False)
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(joined.data[start:start + rows], requires_grad=False)
        start += rows


def joined(tensors: list[Tensor]) -> Tensor | None:
    """The one tensor these are consecutive row blocks of (fuse_linears), else None."""
    first = tensors[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset:
            return None
        offset += t.numel()
    return first.as_strided((sum(t.shape[0] for t in tensors), *first.shape[1:]), first.stride())


def fused_linear(x: Tensor, modules: tuple[nn.Module, ...]) -> tuple[Tensor, ...]:
    """x through every module: one GEMM when their weights are joined (fuse_linears), else one each."""
    weight = joined([m.weight for m in modules])
    if weight is None:
        return tuple(m(x) for m in modules)
    return F.linear(x, weight).split([m.weight.shape[0] for m in modules], dim=-1)
