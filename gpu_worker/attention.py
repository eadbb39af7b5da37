"""Paged attention for the backbone.

The scheduler owns the KV slot allocator; the worker owns the KV tensors
and is told, per step, where each new token's K/V goes (`write_slots`) and
which slots each sequence attends to. A step is described once, in CSR form
(`AttentionBatch`); each backend turns that into its own plan in `begin()`,
once per step, and then serves every layer's `attend()`.

- `TorchPagedAttention`: the reference (CPU and GPU), padded batched math.
- `FlashInferPagedAttention`: CUDA, flashinfer paged decode (tensor cores)
  for pure-decode steps and paged prefill for mixed steps; decode steps of
  more than TRITON_DECODE_ABOVE requests use the Triton kernel of
  `decode_attention.py` instead (`TritonDecode`), which reads short contexts
  faster, and so do a mixed step's decodes (`PrefillWithDecodes`).

Both keep K/V as [layers, slots, kv_heads, head_dim] and take the same slot
ids. flashinfer reads the cache as pages of `page_size` rows: the scheduler
allocates whole pages (its allocator gets the page size from the worker's
Hello), so a sequence's slots fill its pages in order and the page table is
every page_size-th slot divided by page_size (`page_table`). Pages of 16
rows read KV far faster than pages of one row.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch
from torch import Tensor

from gpu_worker.decode_attention import kernel_supports, paged_decode_attention


@dataclass
class SequenceSpan:
    """One sequence in a step: its new tokens are the last `num_new` of `kv_slots`."""

    kv_slots: Sequence[int] | np.ndarray  # every slot the sequence attends to, in position order
    num_new: int


@dataclass
class AttentionBatch:
    """Everything a backend needs for one forward over packed tokens."""

    positions: Tensor      # [N] int64 (device), backbone position of each packed token
    write_slots: Tensor    # [N] int64 (device), KV slot each token's K/V is written to
    qo_indptr: Tensor      # [S+1] int32 (host): sequence s owns packed tokens [qo[s], qo[s+1])
    kv_indptr: Tensor      # [S+1] int32 (host)
    kv_indices: Tensor     # [nnz] int32 (host): slots of sequence s are kv_indices[kv[s]:kv[s+1]]
    decodes: int = 0       # the last `decodes` sequences are decodes (one row each) beside prefill chunks

    @property
    def num_sequences(self) -> int:
        return self.qo_indptr.numel() - 1

    @property
    def decode_only(self) -> bool:
        return int(self.qo_indptr[-1]) == self.num_sequences

    @staticmethod
    def build(spans: Sequence[SequenceSpan], device: torch.device, decodes: int = 0) -> "AttentionBatch":
        """Packed order = spans in order, each contributing its num_new tokens; the last `decodes`
        spans are decodes."""
        positions, write_slots, q_indptr, kv_indptr, kv_indices = host_layout(spans)
        return AttentionBatch(
            positions=torch.from_numpy(positions).to(device, non_blocking=True),
            write_slots=torch.from_numpy(write_slots).to(device, non_blocking=True),
            qo_indptr=torch.from_numpy(q_indptr.astype(np.int32)),
            kv_indptr=torch.from_numpy(kv_indptr.astype(np.int32)),
            kv_indices=torch.from_numpy(kv_indices.astype(np.int32)),
            decodes=decodes,
        )


def host_layout(spans: Sequence[SequenceSpan]) -> tuple[np.ndarray, ...]:
    """A step's packed layout on the host, int64: (positions, write_slots, q_indptr, kv_indptr,
    kv_indices). Sequence s owns packed tokens [q_indptr[s], q_indptr[s+1]); its new tokens sit at
    the last num_new positions of its kv_slots."""
    q_lens = np.fromiter((sp.num_new for sp in spans), dtype=np.int64, count=len(spans))
    kv_lens = np.fromiter((len(sp.kv_slots) for sp in spans), dtype=np.int64, count=len(spans))
    kv_indices = np.concatenate([np.asarray(sp.kv_slots, dtype=np.int64) for sp in spans])
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)])
    # positions of the new tokens: the last q_len of each sequence's [0, kv_len)
    seq_of = np.repeat(np.arange(len(spans)), q_lens)
    q_indptr = np.concatenate([[0], np.cumsum(q_lens)])
    within = np.arange(q_indptr[-1]) - q_indptr[seq_of]
    positions = (kv_lens - q_lens)[seq_of] + within
    write_slots = kv_indices[kv_indptr[seq_of] + positions]
    return positions, write_slots, q_indptr, kv_indptr, kv_indices


def page_table(kv_indptr: np.ndarray, kv_indices: np.ndarray,
               page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slot CSR -> page CSR: (page_indptr, page ids, last_page_len), int32.

    Position j of a sequence must sit at slot pages[j // P] * P + j % P. Checked cheaply (every
    page starts on a page boundary, every sequence's last slot is where its table says): a
    misaligned allocation would otherwise make attention read other requests' rows."""
    kv_indptr = np.asarray(kv_indptr, dtype=np.int64)
    kv_indices = np.asarray(kv_indices, dtype=np.int64)
    lens = np.diff(kv_indptr)
    if page_size == 1:
        return kv_indptr.astype(np.int32), kv_indices.astype(np.int32), np.ones(lens.size, dtype=np.int32)
    n_pages = -(-lens // page_size)
    page_indptr = np.concatenate([[0], np.cumsum(n_pages)])
    seq = np.repeat(np.arange(lens.size), n_pages)
    first = kv_indptr[:-1][seq] + (np.arange(page_indptr[-1]) - page_indptr[:-1][seq]) * page_size
    starts = kv_indices[first]
    last_len = lens - (n_pages - 1) * page_size
    nonempty = lens > 0
    ends = kv_indices[kv_indptr[1:][nonempty] - 1]
    expect = starts[page_indptr[1:][nonempty] - 1] + last_len[nonempty] - 1
    if (starts % page_size).any() or (ends != expect).any():
        raise ValueError(f"KV slots are not laid out in whole pages of {page_size} rows: the scheduler's "
                         f"allocator page size must be a multiple of the worker's")
    return page_indptr.astype(np.int32), (starts // page_size).astype(np.int32), last_len.astype(np.int32)


class AttentionBackend(Protocol):
    folds_decodes: bool  # whether the engine may fold a mixed step's decodes into its prefill graphs

    def begin(self, batch: AttentionBatch) -> None:
        """Plan the step (once, before the first layer)."""
        ...

    def kv_cache(self, layer: int) -> tuple[Tensor, Tensor]:
        """The layer's K and V caches [slots, n_kv, d]: the model stores each new token's
        k, v at batch.write_slots (fused into its QK-norm/RoPE kernel on CUDA)."""
        ...

    def attend(self, layer: int, q: Tensor, batch: AttentionBatch) -> Tensor:
        """Attention output [N, n_heads, d] for q [N, n_heads, d]; the step's k, v are stored."""
        ...


class _SlotCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, page_size: int = 1):
        if num_slots % page_size:
            raise ValueError(f"{num_slots} KV slots are not a whole number of pages of {page_size}")
        self.page_size = page_size
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.scale = head_dim ** -0.5

    @property
    def num_slots(self) -> int:
        return self.k_cache.shape[1]

    def kv_cache(self, layer: int) -> tuple[Tensor, Tensor]:
        return self.k_cache[layer], self.v_cache[layer]


class TorchPagedAttention(_SlotCache):
    """Reference backend: gathers each sequence's slots into a padded batch."""

    folds_decodes = True  # a mixed step's decodes are sequences like any other here

    def begin(self, batch: AttentionBatch) -> None:
        if self.page_size > 1:  # reads slots directly, but holds the scheduler to flashinfer's layout
            page_table(batch.kv_indptr.numpy(), batch.kv_indices.numpy(), self.page_size)
        dev = self.k_cache.device
        qo, kv = batch.qo_indptr.long(), batch.kv_indptr.long()
        q_lens, kv_lens = qo[1:] - qo[:-1], kv[1:] - kv[:-1]
        i = torch.arange(int(q_lens.max()))[None, :]
        j = torch.arange(int(kv_lens.max()))[None, :]
        self._q_valid = (i < q_lens[:, None]).to(dev)
        self._q_index = (qo[:-1, None] + i).clamp(max=int(qo[-1]) - 1).to(dev)
        kv_valid = j < kv_lens[:, None]
        flat = (kv[:-1, None] + j).clamp(max=max(int(kv[-1]) - 1, 0))
        self._kv_index = torch.where(kv_valid, batch.kv_indices.long()[flat], 0).to(dev)
        q_pos = (kv_lens - q_lens)[:, None, None] + i[:, :, None]          # [S, Q, 1]
        self._attend = ((j[:, None, :] <= q_pos) & kv_valid[:, None, :]).to(dev)  # [S, Q, L], causal

    def attend(self, layer: int, q: Tensor, batch: AttentionBatch) -> Tensor:
        keys = self.k_cache[layer][self._kv_index]      # [S, L, n_kv, d]
        values = self.v_cache[layer][self._kv_index]
        group = q.shape[1] // keys.shape[2]
        keys = keys.repeat_interleave(group, dim=2)     # GQA: query head h uses kv head h // group
        values = values.repeat_interleave(group, dim=2)
        acc = torch.promote_types(q.dtype, torch.float32)  # scores in >= fp32, as the fused kernels do
        queries = q[self._q_index]                      # [S, Q, H, d]
        scores = torch.einsum("sqhd,slhd->shql", queries.to(acc), keys.to(acc)) * self.scale
        scores = scores.masked_fill(~self._attend[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(q.dtype)
        out = torch.einsum("shql,slhd->sqhd", probs, values)
        result = torch.empty_like(q)
        result[self._q_index[self._q_valid]] = out[self._q_valid]
        return result


# Decode batches above this use the Triton kernel (decode_attention="auto"): it beats flashinfer at
# every context for large batches, and loses to flashinfer's split over long contexts for small ones
# (it does not split a context). A bucket boundary of the decode graphs (cuda_graphs.BUCKETS), so a
# batch and its graph bucket always pick the same kernel and graphed frames equal eager ones.
TRITON_DECODE_ABOVE = 48


class TritonDecode:
    """The Triton decode kernel behind a flashinfer decode wrapper's interface: `stage` takes the page
    table a plan would (host arrays), `run(q, (k_pages, v_pages))` attends. The table lives in one
    device buffer (indptr, last page lengths, [rows,] page ids), so a CUDA graph keeps reading the same
    addresses while each step stages its own table, without a plan on the host.

    With rows=True it serves a folded prefill step's decodes (PrefillWithDecodes): up to `batch`
    requests, each at its own row of q and out (staged with the table); entries past the step's
    requests have no pages and are skipped."""

    def __init__(self, batch: int, max_pages: int, page_size: int, device: torch.device, rows: bool = False):
        self.batch, self.page_size = batch, page_size
        fields = 2 * batch + 1 + (batch if rows else 0)
        self.table = torch.zeros(fields + max_pages, dtype=torch.int32, device=device)
        self.indptr, self.last = self.table[:batch + 1], self.table[batch + 1:2 * batch + 1]
        self.rows = self.table[2 * batch + 1:fields] if rows else None
        self.indices = self.table[fields:]

    def stage(self, pages: tuple[np.ndarray, np.ndarray, np.ndarray], rows: np.ndarray | None = None) -> None:
        indptr, indices, last = pages
        n = len(last)
        if self.rows is None:
            if n != self.batch or rows is not None:
                raise ValueError(f"page table of {n} sequences for a decode of {self.batch}")
            parts = [indptr, last]
        else:
            if n > self.batch or rows is None or len(rows) != n:
                raise ValueError(f"{n} decodes (rows {None if rows is None else len(rows)}) for a folded "
                                 f"decode of up to {self.batch}")
            empty = self.batch - n
            parts = [indptr, np.full(empty, indptr[-1]), last, np.zeros(empty), rows, np.zeros(empty)]
        host = torch.from_numpy(np.concatenate(parts + [indices]).astype(np.int32))
        self.table[:host.numel()].copy_(host, non_blocking=True)

    def run(self, q: Tensor, pages: tuple[Tensor, Tensor], out: Tensor | None = None) -> Tensor:
        k, v = (t.view(-1, *t.shape[2:]) for t in pages)  # [pages, P, Hkv, D] -> the slot cache
        return paged_decode_attention(q, k, v, self.indptr, self.indices, self.last, self.page_size,
                                      rows=self.rows, out=out)


class PrefillWithDecodes:
    """A mixed step's attention: flashinfer's batch prefill over its prefill sequences (the leading
    ones), then the Triton decode kernel over its decodes (one-row sequences after them, at the last
    rows of q) into the same output: flashinfer's prefill kernel would give each one-row sequence a
    whole query tile.

    graphed: the wrapper of a CUDA graph of fixed rows. flashinfer then reads every row of q and
    writes the rows its plan covers (its sequences vary in rows from step to step, up to all of
    them); eager, its plan covers exactly the leading `prefill_rows` rows."""

    def __init__(self, prefill, decode: TritonDecode, graphed: bool):
        self.prefill, self.decode, self.graphed = prefill, decode, graphed
        self.prefill_rows = 0

    def run(self, q: Tensor, pages: tuple[Tensor, Tensor]) -> Tensor:
        if self.graphed:
            out = self.prefill.run(q, pages)
        else:
            out = torch.empty_like(q)
            self.prefill.run(q[:self.prefill_rows], pages, out=out[:self.prefill_rows])
        return self.decode.run(q, pages, out=out)


class FlashInferPagedAttention(_SlotCache):
    """CUDA backend over the same slot cache, viewed as pages of page_size rows (NHD)."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, num_qo_heads: int,
                 dtype: torch.dtype, device: torch.device, page_size: int = 1, workspace_bytes: int = 512 << 20,
                 decode_split_kv: bool = True, decode_kernel: str = "auto"):
        """decode_kernel: 'auto' (Triton above TRITON_DECODE_ABOVE requests when the kernel takes the
        model's shapes, else flashinfer), 'flashinfer' or 'triton' (every decode)."""
        import flashinfer  # CUDA-only dependency, imported lazily

        if decode_kernel not in ("auto", "flashinfer", "triton"):
            raise ValueError(f"decode kernel must be auto, flashinfer or triton, got {decode_kernel!r}")
        # Mixed steps attend their decodes with the kernel whenever it takes the model (PrefillWithDecodes);
        # decode_kernel picks the kernel of decode steps.
        self.folds_decodes = kernel_supports(num_qo_heads, num_kv_heads, head_dim, dtype)
        if not self.folds_decodes:
            if decode_kernel == "triton":
                raise ValueError(f"the Triton decode kernel needs triton, fp16/bf16/fp32 and a power-of-two head "
                                 f"dim >= 16 (got {dtype}, head dim {head_dim}): use --decode-kernel flashinfer")
            decode_kernel = "flashinfer"
        super().__init__(num_layers, num_slots, num_kv_heads, head_dim, dtype, device, page_size)
        self.decode_kernel = decode_kernel
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        # Split-KV decode cuts each request's context into chunks on several thread blocks, then
        # merges their partial softmaxes in a second kernel; without it, one block per (request,
        # KV head) reads the whole context, and a row's result no longer depends on how the planner
        # split it (batch invariant).
        self.decode_split_kv = decode_split_kv
        # Shared by every wrapper (their runs are serial on one stream). 512 MB: split-KV partials of
        # a 2,112-row prefill graph plan against it too.
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.active = self.decode_wrapper
        self._plan_copied: dict[int, torch.cuda.Event] = {}  # id(wrapper) -> after its last plan's copy

    def _plan(self, wrapper, *args, **kwargs) -> None:
        """wrapper.plan, without racing its previous one. flashinfer's plan stages its metadata in
        the wrapper's own pinned host buffer and copies it to the device asynchronously, so the
        wrapper's next plan must not rewrite that buffer before the copy ran. The wait is per
        wrapper: waiting for the step's last plan instead also waited for everything queued before
        it (a mixed step's whole eager prefill), and step N+1's host work then stopped overlapping
        step N's GPU work."""
        copied = self._plan_copied.get(id(wrapper))
        if copied is not None:
            copied.synchronize()
        wrapper.plan(*args, **kwargs)
        copied = self._plan_copied[id(wrapper)] = torch.cuda.Event()
        copied.record()

    def _page_tensors(self, pages: tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple[Tensor, Tensor, Tensor]:
        """(indptr, indices, last_len) for a plan: indptr and last_len on the host (the plan reads
        them there), the page ids already on the device. A CUDA-graph wrapper copies host page ids
        into its buffer with a blocking copy, which waits for every kernel queued before it: each
        graphed decode step drained the pipeline (step N+1's plan waited for step N to finish)."""
        indptr, indices, last_len = (torch.from_numpy(a) for a in pages)
        return indptr, indices.to(self.k_cache.device, non_blocking=True), last_len

    def triton_decode(self, batch: int) -> bool:
        """Whether a decode of `batch` requests (or a decode graph of that bucket) uses TritonDecode."""
        return self.decode_kernel == "triton" or (self.decode_kernel == "auto" and batch > TRITON_DECODE_ABOVE)

    def decode_graph_wrapper(self, batch: int):
        """The decode kernel of a CUDA graph of `batch` requests: a TritonDecode, or a flashinfer
        decode wrapper over static page-table buffers."""
        import flashinfer

        dev = self.k_cache.device
        if self.triton_decode(batch):
            return TritonDecode(batch, self.num_slots // self.page_size, self.page_size, dev)
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=torch.zeros(self.num_slots // self.page_size, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buffer=torch.ones(batch, dtype=torch.int32, device=dev))

    def plan_decode(self, wrapper, pages: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        """Plan a decode over a page table from `page_table` (a TritonDecode just stages it)."""
        if isinstance(wrapper, TritonDecode):
            wrapper.stage(pages)
            return
        indptr, indices, last_len = self._page_tensors(pages)
        self._plan(wrapper, indptr, indices, last_len, self.num_qo_heads, self.num_kv_heads, self.head_dim,
                   self.page_size, q_data_type=self.k_cache.dtype, kv_data_type=self.k_cache.dtype,
                   disable_split_kv=not self.decode_split_kv)

    def plan_prefill(self, wrapper, batch: AttentionBatch) -> None:
        """Plan a (mixed) prefill step on a batch-prefill wrapper, or on a PrefillWithDecodes (the batch's
        decodes its decode part)."""
        qo, kv_indptr, kv_indices = batch.qo_indptr.numpy(), batch.kv_indptr.numpy(), batch.kv_indices.numpy()
        if isinstance(wrapper, PrefillWithDecodes):
            s = len(qo) - 1 - batch.decodes
            first = kv_indptr[s]
            wrapper.decode.stage(page_table(kv_indptr[s:] - first, kv_indices[first:], self.page_size), qo[s:-1])
            wrapper.prefill_rows = int(qo[s])
            qo, kv_indptr, kv_indices = qo[:s + 1], kv_indptr[:s + 1], kv_indices[:first]
            wrapper = wrapper.prefill
        elif batch.decodes:
            raise ValueError("decodes in a prefill plan need a PrefillWithDecodes wrapper")
        indptr, indices, last_len = self._page_tensors(page_table(kv_indptr, kv_indices, self.page_size))
        self._plan(wrapper, torch.from_numpy(qo), indptr, indices, last_len, self.num_qo_heads, self.num_kv_heads,
                   self.head_dim, self.page_size, causal=True, q_data_type=self.k_cache.dtype,
                   kv_data_type=self.k_cache.dtype)

    def prefill_graph_wrapper(self, sequences: int, rows: int, decodes: int = 0):
        """A batch-prefill wrapper for a CUDA graph of exactly `sequences` sequences and at most `rows`
        query rows; with decodes, a PrefillWithDecodes whose last rows may also hold up to that many
        decodes. FA2 always: the graph bakes in the kernel, and the auto choice would switch to FA3
        above 64 rows per sequence."""
        import flashinfer

        dev = self.k_cache.device
        prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, backend="fa2", max_total_num_rows=rows,
            qo_indptr_buf=torch.zeros(sequences + 1, dtype=torch.int32, device=dev),
            paged_kv_indptr_buf=torch.zeros(sequences + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buf=torch.zeros(self.num_slots // self.page_size, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buf=torch.ones(sequences, dtype=torch.int32, device=dev))
        if not decodes:
            return prefill
        decode = TritonDecode(decodes, self.num_slots // self.page_size, self.page_size, dev, rows=True)
        return PrefillWithDecodes(prefill, decode, graphed=True)

    def begin(self, batch: AttentionBatch) -> None:
        if batch.decode_only:
            pages = page_table(batch.kv_indptr.numpy(), batch.kv_indices.numpy(), self.page_size)
            n = len(pages[2])
            wrapper = (TritonDecode(n, len(pages[1]), self.page_size, self.k_cache.device)
                       if self.triton_decode(n) else self.decode_wrapper)
            self.plan_decode(wrapper, pages)
            self.active = wrapper
            return
        # A mixed step's decodes take the Triton kernel, as in a folded prefill graph, so eager and
        # graphed mixed steps run the same kernels.
        decodes = batch.decodes if self.folds_decodes else 0
        wrapper = self.prefill_wrapper
        if decodes:
            pages = sum(-(-np.diff(batch.kv_indptr.numpy()[-decodes - 1:]) // self.page_size))
            wrapper = PrefillWithDecodes(wrapper, TritonDecode(decodes, int(pages), self.page_size,
                                                               self.k_cache.device, rows=True), graphed=False)
        self.plan_prefill(wrapper, batch)
        self.active = wrapper

    def attend(self, layer: int, q: Tensor, batch: AttentionBatch) -> Tensor:
        k, v = self.k_cache[layer], self.v_cache[layer]
        pages = (k.view(-1, self.page_size, *k.shape[1:]), v.view(-1, self.page_size, *v.shape[1:]))
        return self.active.run(q.contiguous(), pages)


def make_backend(name: str, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 num_qo_heads: int, dtype: torch.dtype, device: torch.device, page_size: int = 1,
                 decode_split_kv: bool = True, decode_kernel: str = "auto"):
    """'auto' = flashinfer on CUDA when installed, else the torch reference (which ignores
    decode_split_kv and decode_kernel: it never splits, and has one kernel)."""
    if name == "auto":
        name = "torch"
        if device.type == "cuda":
            if importlib.util.find_spec("flashinfer") is not None:
                name = "flashinfer"
    if name == "flashinfer":
        return FlashInferPagedAttention(num_layers, num_slots, num_kv_heads, head_dim, num_qo_heads, dtype, device,
                                        page_size, decode_split_kv=decode_split_kv, decode_kernel=decode_kernel)
    if name == "torch":
        return TorchPagedAttention(num_layers, num_slots, num_kv_heads, head_dim, dtype, device, page_size)
    if name == "triton":
        raise ValueError("attention triton is OmniVoice's document attention: a MOSS worker runs auto, torch or "
                         "flashinfer")
    raise ValueError(f"unknown attention backend {name!r}: choose auto, torch or flashinfer")
