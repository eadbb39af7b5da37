"""CUDA graphs of the decode step and of the frame decode.

`GraphedDecode.run`: one graph per batch-size bucket for a whole pure-decode
step: gather feedback embeddings → backbone (paged decode attention) → frame
decode (12 local steps, 13 seeded samples) → pool commit → journal tensor.
Launch overhead dominates a decode step (hundreds of small kernels), so the
graph is what makes small batches fast. Inputs are copied into static
buffers; the decode kernel of the bucket (attention.py: flashinfer's wrapper,
or TritonDecode above TRITON_DECODE_ABOVE requests) is re-planned with the
step's page table before each replay (plan is host work, outside the graph).
Padding rows read and write only the pool's spare row and the scratch KV page.

`GraphedDecode.sample`: the frame decode alone, one graph per bucket of
sampled rows. A step with prefill ends with it (prefill_graphs.py holds its
backbone pass): the rows it samples, its decodes' and its new requests' first
frames, are the same work as a decode step's frame decode, which run eagerly
would be hundreds of small launches on the request's time to first audio.

`capture_graph` is the capture every graph of the worker goes through.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from gpu_worker.attention import AttentionBatch, SequenceSpan, page_table
from gpu_worker.state_pool import sample_and_commit

log = logging.getLogger("chorus.worker")

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# New requests' first frames sampled in one step (prefills finishing together), beyond the decodes:
# closed-loop load at high concurrency sends requests in bursts (they finish together) of up to ~60.
FRAME_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def capture_graph(fn, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm fn up twice on a side stream (lazy inits, Triton compiles), then
    capture one call; returns the graph and fn's output (static tensors)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


@dataclass
class _FrameGraph:
    size: int
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [size, H] backbone hidden states of the rows to sample
    rows: torch.Tensor    # [size] pool rows
    out: torch.Tensor


@dataclass
class _Graph:
    size: int
    graph: torch.cuda.CUDAGraph
    wrapper: object
    rows: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    out: torch.Tensor


class GraphedDecode:
    def __init__(self, engine):
        self.engine = engine
        cap = engine.max_batch
        self.buckets = [b for b in BUCKETS if b < cap] + [cap]
        self.graphs: dict[int, _Graph] = {}
        self.mempool = torch.cuda.graph_pool_handle()
        # A step with prefill samples its decodes and its new requests' first frames together.
        top = cap + FRAME_BUCKETS[-1]
        self.frame_buckets = sorted({b for b in FRAME_BUCKETS + BUCKETS if b < top} | {top})
        self.frame_graphs: dict[int, _FrameGraph] = {}
        # Its own pool: graphs of one pool may share memory, and a frame graph's output (the step's
        # journal tensor) must not be any decode graph's.
        self.frame_mempool = torch.cuda.graph_pool_handle()

    def fits(self, n: int) -> bool:
        return n <= self.buckets[-1]

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def capture_all(self, sizes: Sequence[int] | None = None) -> None:
        """Capture ahead of serving, largest first so smaller graphs reuse its memory."""
        for b in sorted(set(sizes or self.buckets), reverse=True):
            self._get(self.bucket(b))
        try:
            for b in sorted(self.frame_buckets, reverse=True):
                self._frame_graph(b)
        except Exception:  # noqa: BLE001 - first frames can always be sampled eagerly
            log.exception("frame-decode graph capture failed; first frames of prefills are sampled eagerly")
            self.frame_buckets, self.frame_graphs = [], {}

    def _get(self, b: int) -> _Graph:
        g = self.graphs.get(b)
        if g is None:
            g = self.graphs[b] = self._capture(b)
        return g

    def _capture(self, b: int) -> _Graph:
        e = self.engine
        dev = e.device
        wrapper = e.kv.decode_graph_wrapper(b)
        rows = torch.full((b,), e.pool.spare_row, dtype=torch.int64, device=dev)
        positions = torch.zeros(b, dtype=torch.int64, device=dev)
        write_slots = torch.full((b,), e.scratch_slot, dtype=torch.int64, device=dev)
        indptr = torch.arange(b + 1, dtype=torch.int32)
        e.kv.plan_decode(wrapper, self._padding_pages(b))
        batch = AttentionBatch(positions=positions, write_slots=write_slots, qo_indptr=indptr,
                               kv_indptr=indptr, kv_indices=torch.zeros(b, dtype=torch.int32))

        def body() -> torch.Tensor:
            e.kv.active = wrapper
            hidden = e.model.backbone(e.pool.feedback[rows], batch, e.kv)
            # The penalty path is always on in the graph: a penalty of 1 is a bit-exact no-op.
            return sample_and_commit(e.model, e.pool, hidden, rows, with_presence=True)

        graph, out = capture_graph(body, self.mempool)
        e.kv.active = e.kv.decode_wrapper
        log.info("captured decode graph for batch %d", b)
        return _Graph(b, graph, wrapper, rows, positions, write_slots, out)

    def _frame_graph(self, b: int) -> _FrameGraph:
        g = self.frame_graphs.get(b)
        if g is None:
            e = self.engine
            hidden = torch.zeros(b, e.cfg.hidden_size, dtype=e.dtype, device=e.device)
            rows = torch.full((b,), e.pool.spare_row, dtype=torch.int64, device=e.device)
            graph, out = capture_graph(lambda: sample_and_commit(e.model, e.pool, hidden, rows, with_presence=True),
                                       self.frame_mempool)
            g = self.frame_graphs[b] = _FrameGraph(b, graph, hidden, rows, out)
            log.info("captured frame-decode graph for %d rows", b)
        return g

    def sample(self, hidden: torch.Tensor, rows: Sequence[int]) -> torch.Tensor | None:
        """Frame decode of pool rows `rows` from hidden [n, H] by graph replay (sample_and_commit's
        result, [n, row_width + 2], valid until the next replay of this graph); None when n is
        larger than the largest frame bucket (the caller runs it eagerly)."""
        n = len(rows)
        b = next((x for x in self.frame_buckets if x >= n), None)
        if b is None:
            return None
        g = self._frame_graph(b)
        g.hidden[:n].copy_(hidden)
        staged = torch.from_numpy(np.concatenate([np.asarray(rows, dtype=np.int64),
                                                  np.full(b - n, self.engine.pool.spare_row, dtype=np.int64)]))
        g.rows.copy_(staged.to(self.engine.device, non_blocking=True))
        g.graph.replay()
        return g.out[:n]

    def _padding_pages(self, pad: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Page table of `pad` padding sequences: one row each, on the scratch page."""
        page = self.engine.scratch_slot // self.engine.page_size
        return (np.arange(pad + 1, dtype=np.int32), np.full(pad, page, dtype=np.int32),
                np.ones(pad, dtype=np.int32))

    def run(self, decode_rows: list[int], spans: Sequence[SequenceSpan]) -> torch.Tensor:
        e = self.engine
        n = len(spans)
        g = self._get(self.bucket(n))
        pad = g.size - n
        kv_lens = np.fromiter((len(sp.kv_slots) for sp in spans), dtype=np.int64, count=n)
        kv_indices = np.concatenate([np.asarray(sp.kv_slots, dtype=np.int64) for sp in spans])
        indptr = np.concatenate([[0], np.cumsum(kv_lens)])
        newest = kv_indices[indptr[1:] - 1]  # each request's new row is its last slot
        p_indptr, p_indices, p_last = page_table(indptr, kv_indices, e.page_size)
        q_indptr, q_indices, q_last = self._padding_pages(pad)
        pages = (np.concatenate([p_indptr, p_indptr[-1] + q_indptr[1:]]), np.concatenate([p_indices, q_indices]),
                 np.concatenate([p_last, q_last]))
        host = np.stack([
            np.concatenate([decode_rows, np.full(pad, e.pool.spare_row)]),
            np.concatenate([kv_lens - 1, np.zeros(pad, np.int64)]),
            np.concatenate([newest, np.full(pad, e.scratch_slot)]),
        ]).astype(np.int64)
        staged = torch.from_numpy(host).to(e.device, non_blocking=True)
        g.rows.copy_(staged[0])
        g.positions.copy_(staged[1])
        g.write_slots.copy_(staged[2])
        e.kv.plan_decode(g.wrapper, pages)
        g.graph.replay()
        return g.out
