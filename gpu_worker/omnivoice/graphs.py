"""The packed step's forward (embedding, body, final norm) over the step padded to its (rows,
documents) bucket (buckets.py), replayed from a CUDA graph per bucket, or (replay False: the
worker's --no-cuda-graphs) run eagerly on the same buffers with the same kernels and plans, so
graphed and eager steps give the same tokens and an eager run can tell a graph bug from rounding.

Why: eager, the step is ~600 launches from Python plus an attention plan, and at small batches
the GPU waits for the host. The graph holds everything up to the final norm over the bucket's
rows; the attention backend (attention.py) gives each graph a wrapper whose plan lives in fixed
device buffers (Triton: the tile table, sized for the bucket; flashinfer: its ragged prefill in
CUDA-graph mode, FA2, fixed document count), planned on the host before each replay with the
step's padded documents. The audio head then runs
eagerly over the gathered rows only (the graph would hold [rows, 8 x 1025] logits per bucket).

Inputs live in static buffers, one set per row bucket (graphs of equal rows share them); each
replay copies the step's ids and audio mask (already on the device) and its positions (host) into
them. A bucket the backend refuses to plan is left out (its steps run eagerly); any other capture
failure turns the graphs off and every step runs eagerly, with the reason logged and kept in
`disabled`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from gpu_worker.cuda_graphs import capture_graph
from gpu_worker.omnivoice.buckets import Bucket, Buckets, filler_lens, padded_layout
from gpu_worker.omnivoice.staging import to_device

log = logging.getLogger("chorus.worker")


class BucketUnusable(RuntimeError):
    """The attention backend refused to plan this bucket: its steps run eagerly, the other buckets keep graphs."""


@dataclass
class _Inputs:
    ids: Tensor         # int64 [C, R]
    audio_mask: Tensor  # bool [R]
    positions: Tensor   # int64 [R]
    holds: int | None = None  # the key of the step whose mask, positions and filler these hold (hidden)


@dataclass
class _StepGraph:
    bucket: Bucket
    graph: object       # torch.cuda.CUDAGraph, None when not replaying
    wrapper: object     # its attention plan's fixed buffers (attention.graph_wrapper)
    inputs: _Inputs
    out: Tensor | None  # [R, hidden] final-norm hidden states (the graph's output)
    planned: int | None = None  # the key of the step the attention plan was made for (hidden)


class BucketedForward:
    def __init__(self, model, attention, max_packed_rows: int, max_batch: int, replay: bool = True):
        self.model, self.attention, self.replay = model, attention, replay
        self.cfg = model.cfg
        self.device = next(model.parameters()).device
        self.buckets = Buckets(max_packed_rows, max_batch)
        self.graphs: dict[Bucket, _StepGraph] = {}
        self.inputs: dict[int, _Inputs] = {}
        self.mempool = torch.cuda.graph_pool_handle() if replay else None
        self.unusable: dict[Bucket, str] = {}
        self.disabled: str | None = None
        self.runs = 0  # steps run in a bucket (replayed, or eagerly without replay)

    def capture_all(self) -> None:
        """Every bucket ahead of serving, largest first (without replay: nothing to capture)."""
        if not self.replay:
            return
        try:
            for b in self.buckets.all():
                try:
                    self._get(b)
                except BucketUnusable as e:
                    log.warning("OmniVoice step graph for %d rows in %d documents left out: %s", b.rows, b.docs, e)
        except Exception as e:  # noqa: BLE001 - steps can always run eagerly
            log.exception("OmniVoice step graph capture failed; steps run eagerly")
            self.disabled = f"capture failed: {e!r}"
            self.graphs.clear()
        log.info("captured %d OmniVoice step graphs (%d buckets left out)", len(self.graphs), len(self.unusable))

    def _inputs(self, rows: int) -> _Inputs:
        i = self.inputs.get(rows)
        if i is None:
            c, dev = self.cfg.num_codebooks, self.device
            i = self.inputs[rows] = _Inputs(torch.full((c, rows), self.cfg.audio_mask_id, dtype=torch.int64, device=dev),
                                            torch.ones(rows, dtype=torch.bool, device=dev),
                                            torch.zeros(rows, dtype=torch.int64, device=dev))
        return i

    def _plan(self, wrapper, doc_lens: list[int], bucket: Bucket) -> None:
        try:
            self.attention.plan_wrapper(wrapper, doc_lens)
        except (ValueError, RuntimeError) as e:
            self.unusable[bucket] = repr(e)
            raise BucketUnusable(repr(e)) from e

    def _get(self, bucket: Bucket) -> _StepGraph:
        g = self.graphs.get(bucket)
        if g is not None:
            return g
        if bucket in self.unusable:
            raise BucketUnusable(self.unusable[bucket])
        inputs = self._inputs(bucket.rows)
        wrapper = self.attention.graph_wrapper(bucket.docs)
        # Planned with the bucket's all-filler layout: the first plan fixes the wrapper's rows.
        self._plan(wrapper, filler_lens(0, 0, bucket), bucket)
        graph = out = None
        if self.replay:
            with torch.inference_mode():
                graph, out = capture_graph(lambda: self._body(inputs, wrapper), self.mempool)
            log.info("captured OmniVoice step graph for %d rows in %d documents", bucket.rows, bucket.docs)
        g = self.graphs[bucket] = _StepGraph(bucket, graph, wrapper, inputs, out)
        return g

    def _body(self, inputs: _Inputs, wrapper) -> Tensor:
        return self.model.hidden(inputs.ids, inputs.audio_mask, inputs.positions, self.attention.attend(wrapper))

    def hidden(self, ids: Tensor, audio_mask: Tensor, positions: np.ndarray, doc_lens: list[int],
               key: int | None = None) -> Tensor | None:
        """Final-norm hidden states [r, hidden] of the packed step (ids [C, r] and audio_mask [r] on
        the device, positions [r] and doc_lens on the host) run in its bucket (its graph replayed),
        or None when no bucket holds it (the caller runs it unpadded). Replayed, the result is a
        view of the graph's output: use it before any graph of this engine replays again.
        key: a number that stands for the step's layout and audio mask (the engine's Packed.key); a
        step with the key of the one before it in its bucket only copies the ids: the attention
        plan, positions and mask are where that step left them."""
        if self.disabled:
            return None
        r = ids.shape[1]
        bucket = self.buckets.pick(r, len(doc_lens))
        if bucket is None or bucket in self.unusable:
            return None
        pos = None
        try:
            g = self._get(bucket)
            if key is None or g.planned != key:
                docs, pos = padded_layout(doc_lens, positions, bucket)
                g.planned = None
                self._plan(g.wrapper, docs, bucket)  # before any copy: a refusal leaves no state behind
                g.planned = key
        except BucketUnusable as e:
            log.warning("OmniVoice step graph for %d rows in %d documents left out: %s", bucket.rows, bucket.docs, e)
            return None
        except Exception as e:  # noqa: BLE001 - a capture on first use failed: every step runs unpadded
            log.exception("OmniVoice step graph capture failed; steps run eagerly")
            self.disabled = f"capture failed: {e!r}"
            self.graphs.clear()
            return None
        inputs = g.inputs
        inputs.ids[:, :r].copy_(ids)
        if key is None or inputs.holds != key:  # buckets of equal rows share their inputs
            if pos is None:
                pos = padded_layout(doc_lens, positions, bucket)[1]
            inputs.holds = None
            inputs.ids[:, r:].fill_(self.cfg.audio_mask_id)
            inputs.audio_mask[:r].copy_(audio_mask)
            inputs.audio_mask[r:].fill_(True)
            inputs.positions.copy_(to_device(pos, self.device))
            inputs.holds = key
        self.runs += 1
        if g.graph is None:
            return self._body(inputs, g.wrapper)[:r]
        g.graph.replay()
        return g.out[:r]
