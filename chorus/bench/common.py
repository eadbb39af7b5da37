"""What the bench scripts share: GPU time of CUDA work, the kernels a call runs, the device's name,
and writing a result file. torch is imported inside each function, so a script's --help runs
without it."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def replay_ms(graph, iters: int = 50) -> float:
    """Milliseconds per replay of a captured CUDA graph (after one untimed replay)."""
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def graph_time(fn, iters: int = 50) -> float:
    """Milliseconds per replay of fn captured in a CUDA graph (as the worker captures its steps)."""
    from gpu_worker.cuda_graphs import capture_graph
    return replay_ms(capture_graph(fn)[0], iters)


def kernel_ms(call, iters: int) -> float:
    """GPU time of one call: `iters` calls captured in a CUDA graph, replayed (as the worker and vocoder run them).
    Timing eager calls would time their launches: the small stages' kernels take less than that."""
    import torch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (3 * iters)


def cuda_kernels(fn) -> list[tuple[str, float]]:
    """(name, GPU microseconds) of every CUDA kernel one call of fn runs, under the torch profiler."""
    import torch
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name, getattr(e, "device_time", None) or e.cuda_time)
            for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def device_name(device) -> str:
    """The GPU's name, or the host CPU's model and core count."""
    import torch
    from chorus.provenance import cpu_model
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = cpu_model()
    return f"{model} ({os.cpu_count()} cpus)" if model else platform.processor() or platform.machine()


def write_json(path: str | os.PathLike | None, data, indent: int = 2) -> None:
    """Write data as JSON to path (its folder made if missing); nothing when path is empty."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=indent, default=str) + "\n")
