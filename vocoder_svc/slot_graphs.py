"""The slot decoder's CUDA graphs (a mixin of SlotDecoder, vocoder_svc/slot_decoder.py).

CUDA graphs: one per (bucket, T), captured lazily on first use (for T in
``graph_frames``) or up front with ``capture()``, largest first, into one
shared memory pool. Warm-up and capture run on scratch rows only, so
capturing while streams are live is safe (the warm-up also compiles the
attention and glue kernels for the shape before capture). Replay copies codes, row ids and
the valid mask into the graph's static input buffers. A (bucket, T) without a
graph runs eagerly with the same bucket (same GEMM shapes). A capture or
replay failure disables graphs for the slot decoder (``graphs_disabled`` says
why). Frames are never padded: padding would advance the causal state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import Tensor


@dataclass
class StepGraph:
    """A captured (bucket, T) step and its static inputs/output."""

    replay: Callable[[], None]  # CUDAGraph.replay, or an eager re-run in emulation mode
    codes: Tensor  # [n_q, B, T] long
    rows: Tensor  # [B] long
    valid: Tensor  # [B] bool
    out: Tensor  # [B, C, T*hop]


class GraphCapture:
    """Capture and look up the (bucket, T) graphs of SlotDecoder's step (its _run, on scratch rows)."""

    def _static_inputs(self, bucket: int, t: int) -> tuple[Tensor, Tensor, Tensor]:
        dev = self.device
        codes = torch.zeros(self.n_q, bucket, t, dtype=torch.long, device=dev)
        rows = torch.arange(self.slots, self.slots + bucket, dtype=torch.long, device=dev)  # scratch rows
        valid = torch.zeros(bucket, dtype=torch.bool, device=dev)
        return codes, rows, valid

    def _capture(self, bucket: int, t: int) -> StepGraph:
        codes, rows, valid = self._static_inputs(bucket, t)
        if self.graph_mode == "emulate":
            for _ in range(self.warmup):  # the same scratch-row warm-up the CUDA path does
                self._run(codes, rows, valid)
            out = self._run(codes, rows, valid)

            def replay(gr_out: Tensor = out) -> None:
                gr_out.copy_(self._run(codes, rows, valid))

            return StepGraph(replay, codes, rows, valid, out)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):  # scratch rows only: live slots are untouched
                self._run(codes, rows, valid)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if t in self.priority_frames:
            if self._priority_pool is None:
                self._priority_pool = torch.cuda.graph_pool_handle()
            pool = self._priority_pool
        else:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            pool = self._pool
        # Captured on a stream of the slot decoder's own, one for priority graphs and one for the rest: a
        # graph bakes in the cuBLAS workspace of the stream it was captured on, and torch.cuda.graph's
        # default capture stream is one per process. Graphs that replay concurrently (a priority first
        # chunk beside a steady step; a decoder hosted in the worker's process beside the worker's
        # graphs) must not share a workspace: on an H200 the hosted decoder and the worker hung the
        # GPU at c16 with their graphs captured on the default stream.
        priority = t in self.priority_frames
        if priority not in self._capture_streams:
            self._capture_streams[priority] = torch.cuda.Stream(device=self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=self._capture_streams[priority],
                              capture_error_mode="thread_local"):
            out = self._run(codes, rows, valid)
        self._keep.append(graph)
        return StepGraph(graph.replay, codes, rows, valid, out)

    def capture(self, buckets: Iterable[int] | None = None, frames: Iterable[int] | None = None) -> int:
        """Capture graphs for every (bucket, T) given (default: all buckets x graph_frames), largest
        first so the shared pool is sized once. Returns how many are captured now in total."""
        if self.graph_mode is None or self.graphs_disabled:
            return 0
        buckets = self.buckets if buckets is None else tuple(self.bucket_for(int(b)) for b in buckets)
        frames = sorted(self.graph_frames) if frames is None else [int(t) for t in frames]
        with self._lock, torch.inference_mode():
            for b, t in sorted({(b, t) for b in buckets for t in frames}, key=lambda bt: (-bt[0] * bt[1], -bt[0])):
                if (b, t) not in self._graphs:
                    try:
                        self._graphs[(b, t)] = self._capture(b, t)
                    except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager
                        self.graphs_disabled = f"capture of (bucket {b}, T {t}) failed: {e!r}"
                        self._graphs.clear()
                        self._keep.clear()
                        return 0
        return len(self._graphs)

    def graphed_frames(self) -> list[int]:
        """The step sizes T that run as graphs (emulated ones too); [] when every step runs eagerly."""
        return [] if self.graph_mode is None or self.graphs_disabled else sorted(self.graph_frames)

    def _graph_for(self, bucket: int, t: int) -> StepGraph | None:
        if self.graph_mode is None or self.graphs_disabled:
            return None
        if (bucket, t) not in self._graphs and t in self.graph_frames:
            self.capture([bucket], [t])  # lazily, on first use
        return self._graphs.get((bucket, t))
