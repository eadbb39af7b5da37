"""Host-to-device copies that do not stall the step.

A copy from pageable host memory makes CUDA stage it and, above a few tens of KB, wait for the
stream: the host then cannot run ahead of the GPU, and a step's host work adds to its GPU time
instead of overlapping it. Staged through pinned memory (torch's caching host allocator, which
keeps a block until the copy that reads it has run), the copy is queued and the host goes on.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def to_device_together(arrays: list[np.ndarray], device: torch.device) -> list[Tensor]:
    """Several host arrays on the device through one staged copy: each copy costs the host a pinned
    block and a launch, and a step's small tables (indices, knobs, noise) are many. The arrays keep
    their dtypes and shapes, as read-only views of one buffer, each on an 8-byte boundary."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    offsets, size = [], 0
    for a in arrays:
        size = -(-size // 8) * 8
        offsets.append(size)
        size += a.nbytes
    staged = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=device.type == "cuda")
    flat = staged.numpy()
    for a, o in zip(arrays, offsets):
        flat[o:o + a.nbytes] = a.reshape(-1).view(np.uint8)
    on_device = staged.to(device, non_blocking=True)
    return [on_device[o:o + a.nbytes].view(torch.from_numpy(a[:0].reshape(-1)).dtype).view(a.shape)
            for a, o in zip(arrays, offsets)]


def to_device(a: np.ndarray | Tensor, device: torch.device) -> Tensor:
    """One host array (or CPU tensor) on the device, staged as above."""
    return to_device_together([np.asarray(a)], device)[0]


def host(a: np.ndarray | Tensor, device: torch.device) -> Tensor:
    """A host tensor that a later copy to `device` (e.g. inside flashinfer's plan) reads without stalling."""
    t = torch.as_tensor(a)
    return t.pin_memory() if device.type == "cuda" else t
