"""Host-to-device copies on the launch path that never make the host wait for the GPU.

A non-blocking copy from pageable host memory is staged by the CUDA driver through pinned
buffers of its own; past their size (~64 KB) the copy waits for the earlier ones, and those run on
the stream behind every kernel queued before them. In `Engine.launch` that drains the pipeline:
the host waits for step N to finish before it can launch step N+1, and the GPU then idles while
the host finishes the launch. W1 c256's folded prefill steps stage ~87 KB of rows (640 rows x 17
int64), and their launches took 6.1 ms against 3.6 for 192-row ones (worker_mixed_s12_h200.json).
Copies here go through PyTorch's caching pinned allocator instead: the copy returns at once, and
the pinned block is reused only after its copy has run.
"""

from __future__ import annotations

import numpy as np
import torch


def _pinned(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host.pin_memory() if device.type == "cuda" else host


def to_device(values, device: torch.device) -> torch.Tensor:
    """Host values (a tensor, else as int64) on `device` without a host sync."""
    host = values if isinstance(values, torch.Tensor) else torch.from_numpy(np.asarray(values, dtype=np.int64))
    return _pinned(host, device).to(device, non_blocking=True)


def copy_to_device(dst: torch.Tensor, host: torch.Tensor) -> None:
    """dst.copy_(host) from host memory without a host sync."""
    dst.copy_(_pinned(host, dst.device), non_blocking=True)
