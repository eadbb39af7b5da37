"""Executes one StepPlan: releases, prefill chunks and decode steps packed
into a single backbone forward, then one batched frame decode for every
request that samples this step. Returns the step's Journal.

A step runs on one of three paths, chosen in `Engine._run` (CUDA graphs on
CUDA, gpu_worker/cuda_graphs.py and prefill_graphs.py; eager everywhere):
a step with prefill replays a prefill graph with its decodes folded in, a
pure-decode step replays a decode graph, and anything no graph holds runs
eagerly. The eager path is the reference: every graphed path computes its
layout with the same kernels, so their frames are equal. The only host sync
per step is the one copy of the journal tensor.

A step runs in two halves so the server can overlap them: `launch` does the
host work and queues the GPU work (ending with an async copy of the journal
tensor into pinned memory), `finish` waits for that copy and builds the
Journal. With the scheduler's lookahead, step N+1 is launched while step N
still runs, so the GPU never waits for the host. A request that stopped in
step N may then be decoded once more in step N+1; `finish` reports it as
skipped, and its extra frame is never seen.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from chorus.moss_config import MossTTSLocalConfig
from chorus.v1 import worker_pb2
from chorus.wire import matrix_array, rows_matrix
from gpu_worker.attention import AttentionBatch, FlashInferPagedAttention, SequenceSpan, make_backend
from gpu_worker.cuda_graphs import GraphedDecode
from gpu_worker.model import MossTTSLocal
from gpu_worker.prefill_graphs import GraphedPrefill, PrefillBucketUnusable
from gpu_worker.state_pool import DecodeStatePool, RequestState, sample_and_commit

log = logging.getLogger("chorus.worker")


def to_device(values, device: torch.device) -> torch.Tensor:
    """int64 host values on `device` without a host sync. A blocking copy (`.to(device)`,
    `torch.as_tensor(..., device=cuda)`) waits for every kernel already queued on the stream:
    in `launch` that drains the pipeline, so step N+1's host work stops overlapping step N's GPU
    work. From pageable memory, a non-blocking copy returns once its bytes are staged."""
    t = values if isinstance(values, torch.Tensor) else torch.from_numpy(np.asarray(values, dtype=np.int64))
    return t.to(device, non_blocking=True)


class StepError(RuntimeError):
    """A plan the worker cannot execute (a scheduler bug or a lost message)."""


@dataclass
class PendingStep:
    """A launched step whose journal tensor is on its way to the host."""

    journal: worker_pb2.Journal
    samplers: list[tuple[int, RequestState]] = field(default_factory=list)
    out: torch.Tensor | None = None          # host tensor [len(samplers), row_width + 2] once `done`
    done: torch.cuda.Event | None = None     # None: already on the host (CPU)
    t0: float = 0.0

    def ready(self) -> bool:
        return self.done is None or self.done.query()


class Engine:
    def __init__(self, model: MossTTSLocal, num_kv_slots: int, max_batch: int, max_context: int,
                 attention: str = "auto", cuda_graphs: bool = True, page_size: int = 1, decode_split_kv: bool = True,
                 decode_kernel: str = "auto"):
        """decode_kernel: the flashinfer backend's decode attention (attention.FlashInferPagedAttention)."""
        self.model = model
        self.cfg: MossTTSLocalConfig = model.cfg
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        bb = self.cfg.backbone
        if page_size < 1 or num_kv_slots < 2 * page_size:
            raise ValueError(f"need page_size >= 1 and at least two pages of KV slots, got page_size {page_size} "
                             f"and {num_kv_slots} slots")
        num_kv_slots -= num_kv_slots % page_size
        self.page_size = page_size
        self.kv = make_backend(attention, bb.num_hidden_layers, num_kv_slots, bb.num_key_value_heads,
                               bb.head_dim, bb.num_attention_heads, self.dtype, self.device, page_size,
                               decode_split_kv=decode_split_kv, decode_kernel=decode_kernel)
        # The last page is the worker's scratch (padding rows write and read its first slot);
        # the scheduler never sees it.
        self.kv_capacity = num_kv_slots - page_size
        self.scratch_slot = self.kv_capacity
        self.pool = DecodeStatePool(max_batch, self.cfg.hidden_size, self.cfg.n_vq,
                                    max(self.cfg.codebook_sizes), self.dtype, self.device)
        self.max_batch = max_batch
        self.max_context = max_context
        self.graphs: GraphedDecode | None = None
        self.prefill_graphs: GraphedPrefill | None = None
        if cuda_graphs and self.device.type == "cuda" and isinstance(self.kv, FlashInferPagedAttention):
            self.graphs = GraphedDecode(self)
            self.prefill_graphs = GraphedPrefill(self)
        self.steps = 0
        self.prefill_rows = 0
        self.decode_rows = 0
        # Journal tensors land in pinned host buffers, one per step in flight (launch N+1 may
        # run before finish N: two), so a later step's copy never overwrites an unread one.
        self._host_bufs: list[torch.Tensor] = []
        self._next_buf = 0

    def _to_host(self, out: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if self.device.type != "cuda":
            return out[:n], None
        if not self._host_bufs:
            shape = (self.max_batch, out.shape[1])
            self._host_bufs = [torch.empty(shape, dtype=out.dtype, pin_memory=True) for _ in range(3)]
        buf = self._host_bufs[self._next_buf][:n]
        self._next_buf = (self._next_buf + 1) % len(self._host_bufs)
        buf.copy_(out[:n], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return buf, done

    # Prompt rows of warm_up's two requests. flashinfer's prefill picks its FA2 kernels for chunks of
    # at most 64 query rows and FA3 above (each JIT-compiled on first use): warm both.
    WARM_UP_PROMPTS = (80, 16)

    @property
    def warm_up_slots(self) -> int:
        """KV slots `warm_up` writes: one page-aligned run per request (prompt + 2 decodes)."""
        return sum(-(-(n + 2) // self.page_size) * self.page_size for n in self.WARM_UP_PROMPTS)

    def warm_up(self) -> float:
        """Run every kernel variant serving uses once, then forget the requests: Triton compiles
        a kernel per specialisation on first use (the fused sampler alone takes seconds per
        variant) and flashinfer JIT-compiles its prefill kernels, which must not land on the first
        user's request. Steps: a long prefill, a mixed short prefill + decode with a
        repetition penalty, a decode, a release. Uses KV slots [0, warm_up_slots): call before
        serving. Returns seconds."""
        t0 = time.perf_counter()
        cfg = self.cfg
        ids = (1 << 63, (1 << 63) + 1)

        def prefill(plan: worker_pb2.StepPlan, rid: int, first_slot: int, n: int, penalty: float) -> None:
            rows = np.full((n, cfg.row_width), cfg.audio_pad_code, dtype=np.int32)
            rows[:, 0] = np.arange(n) + 100
            rows[n // 2:, 1:] = np.arange(n - n // 2)[:, None] % min(cfg.codebook_sizes)
            item = plan.prefill.add(request_id=rid, first_chunk=True, last_chunk=True, prompt_length=n)
            item.rows.CopyFrom(rows_matrix(rows))
            item.kv_slots.extend(range(first_slot, first_slot + n))
            item.sampling.CopyFrom(worker_pb2.SamplingConfig(
                text_temperature=1.0, text_top_k=50, text_top_p=1.0, audio_temperature=1.7, audio_top_k=25,
                audio_top_p=0.8, audio_repetition_penalty=penalty, seed=rid & 0xFFFF, min_frames=1 << 20))

        # Each request owns a page-aligned run of slots, so any page size lays them out right.
        (na, nb), p = self.WARM_UP_PROMPTS, self.page_size
        a, b = 0, -(-(na + 2) // p) * p
        plans = [worker_pb2.StepPlan(), worker_pb2.StepPlan(), worker_pb2.StepPlan(), worker_pb2.StepPlan()]
        prefill(plans[0], ids[0], a, na, 1.0)
        prefill(plans[1], ids[1], b, nb, 1.1)
        plans[1].decode.add(request_id=ids[0], kv_slot=a + na)
        plans[2].decode.add(request_id=ids[0], kv_slot=a + na + 1)
        plans[2].decode.add(request_id=ids[1], kv_slot=b + nb)
        plans[3].release.extend(ids)
        # Eagerly first (prefill graphs off): a prefill that fits no graph bucket runs eagerly, and
        # its flashinfer kernels (FA2 up to 64 rows a chunk, FA3 above) must be built now too.
        graphed = self.prefill_graphs
        try:
            for self.prefill_graphs in [None] + ([graphed] if graphed is not None else []):
                for plan in plans:
                    journal = self.execute(plan)
                    if journal.error:
                        raise StepError(f"warm-up failed: {journal.error}")
        finally:
            self.prefill_graphs = graphed
        self.steps = self.prefill_rows = self.decode_rows = 0
        return time.perf_counter() - t0

    @torch.inference_mode()
    def execute(self, plan: worker_pb2.StepPlan) -> worker_pb2.Journal:
        """launch + finish: one step, synchronously."""
        return self.finish(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: worker_pb2.StepPlan) -> PendingStep:
        """Host work and GPU launches of one step; no host sync (but see FlashInferPagedAttention._plan)."""
        t0 = time.perf_counter()
        for rid in plan.release:
            self.pool.release(rid)
        prompt_rows: list[np.ndarray] = []  # each prefill chunk's rows [n, 1 + n_vq], on the host
        spans, samplers, skipped = [], [], []
        sample_at: list[int] = []  # indices into spans whose last token samples a frame
        decode_rows: list[int] = []
        for item in plan.prefill:
            if item.first_chunk:
                state = self.pool.acquire(item.request_id, item.sampling, item.generation_step,
                                          item.prompt_length)
                state.kv_slots.extend(item.prefix_slots)
            else:
                state = self.pool.get(item.request_id)
            rows = matrix_array(item.rows).astype(np.int64)
            if rows.shape[0] != len(item.kv_slots) or rows.shape[0] == 0:
                raise StepError(f"request {item.request_id}: {rows.shape[0]} rows but {len(item.kv_slots)} kv slots")
            if state.prompt_length > 0:  # re-prefill: rows past the prompt are our own output
                past = rows[max(0, state.prompt_length - len(state.kv_slots)):, 1:]
                if past.size:
                    self.pool.record_history(state.row, to_device(past, self.device))
            state.kv_slots.extend(item.kv_slots)
            prompt_rows.append(rows)
            self.prefill_rows += rows.shape[0]
            spans.append(SequenceSpan(state.kv_slots.view(), rows.shape[0]))
            if item.last_chunk:
                sample_at.append(len(spans) - 1)
                samplers.append((item.request_id, state))
        for item in plan.decode:
            state = self.pool.requests.get(item.request_id)
            if state is None:
                raise StepError(f"decode for request {item.request_id} that holds no decode state")
            if state.stopped:  # lookahead sent this before it knew the request had stopped
                skipped.append(item.request_id)
                continue
            state.kv_slots.append(item.kv_slot)
            decode_rows.append(state.row)
            spans.append(SequenceSpan(state.kv_slots.view(), 1))
            sample_at.append(len(spans) - 1)
            samplers.append((item.request_id, state))
        self.decode_rows += len(decode_rows)
        pending = PendingStep(worker_pb2.Journal(step_id=plan.step_id, skipped=skipped), t0=t0)
        if spans:
            out = self._run(prompt_rows, spans, sample_at, [st.row for _, st in samplers], decode_rows)
            if out is not None:
                pending.samplers = samplers
                pending.out, pending.done = self._to_host(out, len(samplers))
        self.steps += 1
        return pending

    def _run(self, prompt_rows: list[np.ndarray], spans: list[SequenceSpan], sample_at: list[int],
             rows_list: list[int], decode_rows: list[int]) -> torch.Tensor | None:
        """The step on one of three paths, chosen here. spans: the prefill chunks (their rows prompt_rows)
        then the decodes (pool rows decode_rows); the spans in sample_at sample a frame for pool rows
        rows_list. Returns the sampled rows (sample_and_commit's), None if none samples."""
        # Decodes fold into a prefill graph only where the Triton decode kernel takes the model.
        can_fold = self.prefill_graphs is not None and (not decode_rows or self.kv.folds_decodes)
        if prompt_rows and can_fold:
            # Folded: eager, a step with prefill is hundreds of launches from Python; graphed, it is one
            # prefill-graph replay over its chunks and decodes, then one frame-decode replay.
            hidden = self._folded(prompt_rows, spans, decode_rows)
            if hidden is not None:
                return self._sample(hidden, spans, sample_at, rows_list)
        elif not prompt_rows and self.graphs is not None and self.graphs.fits(len(decode_rows)):
            # Pure decode: launch overhead dominates a decode step, and one graph replays all of it.
            return self.graphs.run(decode_rows, spans)[:len(decode_rows)]
        # Eager: the reference every graphed path equals; also any step no graph holds (too many rows or
        # sequences for a bucket, a graph that failed, decodes beside prefill that cannot fold).
        return self._eager(prompt_rows, spans, sample_at, rows_list, decode_rows)

    def _folded(self, prompt_rows: list[np.ndarray], spans: list[SequenceSpan],
                decode_rows: list[int]) -> torch.Tensor | None:
        """Hidden states of the packed prompt rows and the decodes after them (one row each) from a
        prefill graph replay; None when no bucket holds them, flashinfer refuses the bucket (that bucket
        only) or a capture or replay fails (prefill graphs are then off for good)."""
        prefill = self.prefill_graphs
        rows = sum(r.shape[0] for r in prompt_rows) + len(decode_rows)
        bucket = prefill.bucket(rows, len(spans) - len(decode_rows), len(decode_rows))
        if bucket is None:
            return None
        try:
            return prefill.run(np.concatenate(prompt_rows), spans, bucket, decode_rows)
        except PrefillBucketUnusable as e:  # this bucket only: the others keep their graphs
            log.warning("prefill graph (%d rows, %d sequences) left out: %s", *bucket, e)
        except Exception as e:  # noqa: BLE001 - a capture or replay failure: serve on without prefill graphs
            log.exception("prefill graph (%d rows, %d sequences) failed; prefill graphs are off from now on", *bucket)
            prefill.disabled = f"replay failed: {e!r}"
        return None

    def _eager(self, prompt_rows: list[np.ndarray], spans: list[SequenceSpan], sample_at: list[int],
               rows_list: list[int], decode_rows: list[int]) -> torch.Tensor | None:
        """One eager forward over prefill chunks (their rows) then decodes (their feedback rows), and
        the frame decode of the spans in sample_at (pool rows rows_list). None if none samples."""
        embeds = [self.model.embed_rows(to_device(np.concatenate(prompt_rows), self.device))] if prompt_rows else []
        if decode_rows:
            embeds.append(self.pool.feedback[to_device(decode_rows, self.device)])
        batch = AttentionBatch.build(spans, self.device, decodes=len(decode_rows))
        self.kv.begin(batch)
        hidden = self.model.backbone(torch.cat(embeds) if len(embeds) > 1 else embeds[0], batch, self.kv)
        return self._sample(hidden, spans, sample_at, rows_list)

    def _sample(self, hidden: torch.Tensor, spans: list[SequenceSpan], sample_at: list[int],
                rows_list: list[int]) -> torch.Tensor | None:
        """Frame decode of the spans in sample_at (pool rows rows_list) from the step's hidden
        states; None if none samples."""
        if not rows_list:  # a step of non-final prefill chunks samples nothing
            return None
        ends = np.cumsum([sp.num_new for sp in spans]) - 1
        last = to_device(ends[sample_at], self.device)
        if self.graphs is not None:  # the frame-decode graph, as a decode step's, where a bucket holds the rows
            out = self.graphs.sample(hidden[last], rows_list)
            if out is not None:
                return out
        rows_t = to_device(rows_list, self.device)
        return sample_and_commit(self.model, self.pool, hidden[last], rows_t, self.pool.any_penalised(rows_list))

    def finish(self, pending: PendingStep) -> worker_pb2.Journal:
        """Wait for the step's journal tensor and build its Journal."""
        journal = pending.journal
        if pending.samplers:
            if pending.done is not None:
                pending.done.synchronize()
            out = pending.out.numpy()
            # A request that stopped in the previous step (finished after this one launched)
            # was decoded once more: report it as skipped, as launch would have.
            late = np.fromiter((s.stopped for _, s in pending.samplers), dtype=bool, count=len(pending.samplers))
            journal.skipped.extend(rid for (rid, _), gone in zip(pending.samplers, late) if gone)
            keep = ~late
            out = out[keep]
            samplers = [sm for sm, k in zip(pending.samplers, keep) if k]
            width = self.cfg.row_width
            stop_list = out[:, width].astype(bool).tolist()
            for (_, state), stopped in zip(samplers, stop_list):
                state.stopped = stopped
            journal.request_ids.extend(rid for rid, _ in samplers)
            journal.rows.CopyFrom(rows_matrix(out[:, :width]))
            journal.stopped.extend(stop_list)
            journal.generation_steps.extend(out[:, width + 1].tolist())
        journal.step_ms = (time.perf_counter() - pending.t0) * 1e3
        return journal
