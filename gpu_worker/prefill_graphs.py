"""A step's prefill chunks, and the decodes beside them, replayed from a CUDA graph, one per
(rows, sequences) bucket.

Why: eager, the prefill is about 400 kernel launches from Python (the row embedding sum, then 36
layers), far more host work than GPU work per row, and a new request's first frame waits for it.
The graph holds the embedding sum and the whole backbone; attention is flashinfer's batch prefill
in CUDA-graph mode (a fixed number of sequences, FA2), planned on the host before each replay
like the decode graphs' wrappers.

Padding. r rows in s sequences run in the smallest bucket (R, S) with S > s and
R >= r + (S - s): the S - s padding sequences get one row each, the last of them all the rows
left over. A padding sequence reads and writes only the worker's scratch page (positions 0, 1, ...
on its slots, repeated past one page), so it never touches a request's KV; its rows are token 0
with code 0 in every channel. The real rows come first in the packed order, so their hidden
states are the output's first r rows. As in the eager path, what else shares the step changes
the GEMM shapes, and in bf16 a row's hidden state may move by rounding with them (the prefill
is not batch-invariant on the GPU; the CPU float64 contract does not involve graphs).

Folded decodes. A step that prefills beside decodes would otherwise run two passes over the
backbone's weights, this graph and the decode graph. Folded, its decodes ride in this graph's last
rows, reading their feedback embedding from the pool (as the decode graph does), and every row the
step samples (decodes and new requests' first frames) goes through one frame-decode graph
afterwards (cuda_graphs.GraphedDecode.sample): the eager path's layout, graphed. The decodes'
attention is the Triton decode kernel (attention.PrefillWithDecodes), up to min(max batch, R) of
them in any (R, S) graph: flashinfer's prefill kernel would give each one-row sequence a query tile
of its own. So the packed order is [prefill rows][padding sequences][decode rows], S counts the
prefill and padding sequences only, and a step without decodes uses the same graphs. Where the
Triton kernel cannot take the model (attention backend's `folds_decodes` false) the graphs hold no
decodes, and a step with prefill and decodes runs eagerly (engine.Engine._run).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from gpu_worker import cuda_graphs
from gpu_worker.attention import AttentionBatch, SequenceSpan, host_layout

log = logging.getLogger("chorus.worker")

# Every 64 rows up to 768, then coarser: a step runs in its bucket's graph, padding included, and
# each padding row costs as much as a real one; gathered prefill steps under load carry a few
# hundred rows, up to 4 x --prefill-chunk. The largest holds a --prefill-chunk of 2048 plus padding
# sequences.
ROW_BUCKETS = tuple(range(64, 769, 64)) + (896, 1024, 1280, 1536, 1792, 2112)
SEQUENCE_BUCKETS = (2, 4, 8, 16, 32, 64)


class PrefillBucketUnusable(RuntimeError):
    """flashinfer refused to plan this bucket (e.g. its workspace is too small for the rows):
    prefills of that bucket run eagerly, the other buckets keep their graphs."""


@dataclass
class _PrefillGraph:
    rows: int
    sequences: int
    graph: object  # torch.cuda.CUDAGraph (or a test's stand-in)
    wrapper: object
    tokens: torch.Tensor     # [rows, 1 + n_vq] int64: the packed prompt rows
    positions: torch.Tensor  # [rows] int64
    write_slots: torch.Tensor  # [rows] int64
    out: torch.Tensor        # [rows, hidden]: final-norm hidden states
    feedback_rows: torch.Tensor | None = None  # [rows] int64 pool row of each decode row (spare elsewhere)
    is_decode: torch.Tensor | None = None      # [rows] bool, the rows that read feedback embeddings
    decodes: int = 0                           # the most decodes its last rows hold (0: none folded)


class GraphedPrefill:
    def __init__(self, engine):
        self.engine = engine
        self.graphs: dict[tuple[int, int], _PrefillGraph] = {}
        self.mempool = torch.cuda.graph_pool_handle()  # its own: the output is read after other graphs run
        self.disabled: str | None = None
        self.unusable: dict[tuple[int, int], str] = {}  # bucket -> why flashinfer refused to plan it

    def bucket(self, rows: int, sequences: int, decodes: int = 0) -> tuple[int, int] | None:
        """(R, S) for r rows in s prefill sequences (`decodes` of the rows decodes after them), or
        None: no graph holds the step (it runs eagerly)."""
        s = next((b for b in SEQUENCE_BUCKETS if b > sequences), None)
        if s is None or self.disabled or decodes > self.engine.max_batch:
            return None
        r = next((b for b in ROW_BUCKETS if b >= rows + s - sequences), None)
        return None if r is None or (r, s) in self.unusable else (r, s)

    def capture_all(self) -> None:
        """Every bucket ahead of serving, largest first so smaller graphs reuse its memory. A bucket
        flashinfer cannot plan is left out (logged); any other failure leaves every prefill eager."""
        try:
            for r, s in sorted(((r, s) for r in ROW_BUCKETS for s in SEQUENCE_BUCKETS if s <= r),
                               key=lambda rs: (-rs[0], -rs[1])):
                try:
                    self._get(r, s)
                except PrefillBucketUnusable as e:
                    log.warning("prefill graph for %d rows in %d sequences left out: %s", r, s, e)
        except Exception as e:  # noqa: BLE001 - prefill can always run eagerly
            log.exception("prefill graph capture failed; prefill runs eagerly")
            self.disabled = f"capture failed: {e!r}"
            self.graphs.clear()

    def _padding(self, real: Sequence[SequenceSpan], rows: int, sequences: int) -> list[SequenceSpan]:
        """real plus the padding sequences that fill (rows, sequences), on the scratch page."""
        e = self.engine
        left = rows - sum(sp.num_new for sp in real)
        extra = sequences - len(real)
        sizes = [1] * (extra - 1) + [left - (extra - 1)]
        return list(real) + [SequenceSpan(e.scratch_slot + np.arange(n) % e.page_size, n) for n in sizes]

    def _get(self, rows: int, sequences: int) -> _PrefillGraph:
        g = self.graphs.get((rows, sequences))
        if g is not None:
            return g
        e = self.engine
        dev = e.device
        tokens = torch.zeros(rows, e.cfg.row_width, dtype=torch.int64, device=dev)
        positions = torch.zeros(rows, dtype=torch.int64, device=dev)
        write_slots = torch.full((rows,), e.scratch_slot, dtype=torch.int64, device=dev)
        feedback_rows = is_decode = None
        decodes = min(e.max_batch, rows) if e.kv.folds_decodes else 0
        if decodes:
            feedback_rows = torch.full((rows,), e.pool.spare_row, dtype=torch.int64, device=dev)
            is_decode = torch.zeros(rows, dtype=torch.bool, device=dev)
        wrapper = e.kv.prefill_graph_wrapper(sequences, rows, decodes)
        batch = self._plan(wrapper, host_layout(self._padding([], rows, sequences)), positions, write_slots,
                           (rows, sequences), 0)

        def body() -> torch.Tensor:
            e.kv.active = wrapper
            x = e.model.embed_rows(tokens)
            if is_decode is not None:  # decode rows read their feedback embedding, as in the decode graph
                x = torch.where(is_decode[:, None], e.pool.feedback[feedback_rows], x)
            return e.model.backbone(x, batch, e.kv)

        graph, out = cuda_graphs.capture_graph(body, self.mempool)
        g = self.graphs[(rows, sequences)] = _PrefillGraph(rows, sequences, graph, wrapper, tokens, positions,
                                                          write_slots, out, feedback_rows, is_decode, decodes)
        log.info("captured prefill graph for %d rows in %d sequences", rows, sequences)
        return g

    def _plan(self, wrapper, layout: tuple[np.ndarray, ...], positions: torch.Tensor,
              write_slots: torch.Tensor, bucket: tuple[int, int], decodes: int) -> AttentionBatch:
        """Plan the wrapper for a padded step's host layout (attention.host_layout), its last `decodes`
        sequences decodes. Nothing is launched before the plan, so a refusal leaves no state
        behind: PrefillBucketUnusable."""
        _, _, q_indptr, kv_indptr, kv_indices = layout
        batch = AttentionBatch(positions=positions, write_slots=write_slots,
                               qo_indptr=torch.from_numpy(q_indptr.astype(np.int32)),
                               kv_indptr=torch.from_numpy(kv_indptr.astype(np.int32)),
                               kv_indices=torch.from_numpy(kv_indices.astype(np.int32)), decodes=decodes)
        try:
            self.engine.kv.plan_prefill(wrapper, batch)
        except (ValueError, RuntimeError) as e:
            self.unusable[bucket] = repr(e)
            raise PrefillBucketUnusable(repr(e)) from e
        return batch

    def run(self, rows: np.ndarray, spans: Sequence[SequenceSpan], bucket: tuple[int, int],
            decode_rows: Sequence[int] = ()) -> torch.Tensor:
        """Final-norm hidden states [n, hidden] of the packed prefill rows [r, 1 + n_vq] (sequences
        `spans`, in order) and of the decodes after them (the last len(decode_rows) spans, one
        row each, pool rows decode_rows), by replaying the bucket's graph. Without decodes the result is
        a view of the graph's output: read it before this graph (or another of this pool) replays again."""
        e = self.engine
        g = self._get(*bucket)
        r, d = rows.shape[0], len(decode_rows)
        if d > g.decodes:
            raise ValueError(f"{d} decodes in a prefill graph that holds {g.decodes} (folding needs an "
                             f"attention backend that folds decodes)")
        prefill_spans, decode_spans = spans[:len(spans) - d], spans[len(spans) - d:]
        layout = host_layout(self._padding(prefill_spans, g.rows - d, g.sequences) + list(decode_spans))
        self._plan(g.wrapper, layout, g.positions, g.write_slots, bucket, d)  # before any copy: may refuse
        positions, write_slots = layout[:2]
        width = rows.shape[1]
        staged = np.zeros((g.rows, width + (4 if g.is_decode is not None else 2)), dtype=np.int64)
        staged[:r, :width] = rows
        staged[:, width] = positions
        staged[:, width + 1] = write_slots
        if g.is_decode is not None:
            staged[:, width + 2] = e.pool.spare_row
            staged[g.rows - d:, width + 2] = decode_rows
            staged[g.rows - d:, width + 3] = 1
        staged = torch.from_numpy(staged).to(e.device, non_blocking=True)
        g.tokens.copy_(staged[:, :width])
        g.positions.copy_(staged[:, width])
        g.write_slots.copy_(staged[:, width + 1])
        if g.is_decode is not None:
            g.feedback_rows.copy_(staged[:, width + 2])
            g.is_decode.copy_(staged[:, width + 3] != 0)
        g.graph.replay()
        return torch.cat((g.out[:r], g.out[g.rows - d:])) if d else g.out[:r]
