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


def to_device(a: np.ndarray | Tensor, device: torch.device) -> Tensor:
    t = torch.as_tensor(a)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def host(a: np.ndarray | Tensor, device: torch.device) -> Tensor:
    """A host tensor that a later copy to `device` (e.g. inside flashinfer's plan) reads without stalling."""
    t = torch.as_tensor(a)
    return t.pin_memory() if device.type == "cuda" else t
