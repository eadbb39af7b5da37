"""Bidirectional attention over a packed step's documents: which kernel, and its plan per step.

A backend's `plan(doc_lens)` returns the step's Attend (model.Attend), the one call every layer
makes; the plan is host work done once per step.

- `TorchDocuments`: the reference, model.document_attention (SDPA per document, grouped heads
  repeated). CPU and GPU, any dtype; the CPU contract (bit-exact with the package) rests on it.
- `FlashInferDocuments`: CUDA, fp16/bf16: flashinfer's batch prefill over a ragged K/V
  (qo_indptr = kv_indptr = the documents' cumulative rows, causal=False), grouped heads native,
  one launch a layer instead of one per document. FA2 always, eager and in CUDA graphs alike, so
  a graphed step and an eager one run the same kernel; split-KV off, so a document's result does
  not depend on how the planner cut the batch (documents are a few hundred rows: one pass over
  their K/V is the cost anyway).
- `TritonDocuments` (the default on CUDA): fp16/bf16, attention_kernel.py's launch a layer, whose
  only plan is a table of query tiles copied to the device; k and v read in place in the q/k/v
  GEMM's output, so the norm/RoPE kernel copies neither.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import torch

from gpu_worker.omnivoice.model import Attend, document_attention
from gpu_worker.omnivoice.staging import host, to_device

FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)  # head sizes flashinfer's prefill kernels are built for


class TorchDocuments:
    name = "torch"
    bucketed = False  # a launch per document: nothing gained by fixed shapes, nothing to capture

    def plan(self, doc_lens: list[int]) -> Attend:
        return lambda q, k, v: document_attention(q, k, v, doc_lens)


def indptr(doc_lens: list[int] | np.ndarray) -> torch.Tensor:
    """[docs + 1] int32 host tensor: where each document's rows start, then the total."""
    return torch.from_numpy(np.concatenate([[0], np.cumsum(doc_lens)]).astype(np.int32))


class FlashInferDocuments:
    name = "flashinfer"
    bucketed = True  # fixed document counts and rows: steps run in buckets, graphed or not

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 workspace_bytes: int = 256 << 20):
        import flashinfer  # CUDA-only dependency, imported lazily

        if dtype not in FLASHINFER_DTYPES:
            raise ValueError(f"attention flashinfer needs float16 or bfloat16 activations, got {dtype}: "
                             "use --attention torch (or --dtype float16)")
        if head_dim not in FLASHINFER_HEAD_DIMS:
            raise ValueError(f"attention flashinfer needs a head dim in {FLASHINFER_HEAD_DIMS}, the model's is "
                             f"{head_dim}: use --attention torch")
        self.num_heads, self.num_kv_heads, self.head_dim, self.dtype = num_heads, num_kv_heads, head_dim, dtype
        self.device = device
        # Shared by every wrapper: their runs are serial on one stream.
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self._plan_copied: dict[int, torch.cuda.Event] = {}
        # disable_split_kv where this flashinfer's ragged plan takes it (it does from 0.2.x on)
        import inspect
        takes = "disable_split_kv" in inspect.signature(self.wrapper.plan).parameters
        self._split_kv = {"disable_split_kv": True} if takes else {}

    def graph_wrapper(self, docs: int):
        """A wrapper for a CUDA graph of exactly `docs` documents: its indptr arrays live in fixed
        device buffers that each plan rewrites (the graph reads them there)."""
        import flashinfer

        return flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, backend="fa2",
            qo_indptr_buf=torch.zeros(docs + 1, dtype=torch.int32, device=self.device),
            kv_indptr_buf=torch.zeros(docs + 1, dtype=torch.int32, device=self.device))

    def plan_wrapper(self, wrapper, doc_lens: list[int] | np.ndarray) -> None:
        """Plan `wrapper` for these documents. flashinfer stages a plan in the wrapper's pinned
        host buffer and copies it to the device asynchronously: the wrapper's next plan waits for
        that copy (per wrapper, so it never waits for the step queued before it)."""
        copied = self._plan_copied.get(id(wrapper))
        if copied is not None:
            copied.synchronize()
        rows = host(indptr(doc_lens), self.device)
        wrapper.plan(rows, rows, self.num_heads, self.num_kv_heads, self.head_dim, causal=False,
                     q_data_type=self.dtype, kv_data_type=self.dtype, **self._split_kv)
        copied = self._plan_copied[id(wrapper)] = torch.cuda.Event()
        copied.record()

    @staticmethod
    def attend(wrapper) -> Attend:
        return lambda q, k, v: wrapper.run(q.contiguous(), k.contiguous(), v.contiguous())

    def plan(self, doc_lens: list[int]) -> Attend:
        self.plan_wrapper(self.wrapper, doc_lens)
        return self.attend(self.wrapper)


class _Tiles:
    """A Triton plan's device tile table. A graph's table keeps its buffer (the graph reads it
    there): its size is fixed by its first plan (the bucket's rows and documents)."""

    def __init__(self, fixed: bool):
        self.fixed = fixed
        self.table: torch.Tensor | None = None


class TritonDocuments:
    name = "triton"
    bucketed = True  # fixed tile tables: steps run in buckets, graphed or not

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        from gpu_worker.omnivoice import attention_kernel

        if dtype not in FLASHINFER_DTYPES:
            raise ValueError(f"attention triton needs float16 or bfloat16 activations, got {dtype}: "
                             "use --attention torch (or --dtype float16)")
        if not attention_kernel.fits(num_heads, num_kv_heads, head_dim):
            raise ValueError(f"attention triton needs a power-of-two head dim and heads per kv head, the model has "
                             f"{head_dim} and {num_heads // num_kv_heads}: use --attention torch")
        self.kernel = attention_kernel
        self.device = device
        self.wrapper = _Tiles(fixed=False)

    def graph_wrapper(self, docs: int) -> _Tiles:
        return _Tiles(fixed=True)

    def plan_wrapper(self, wrapper: _Tiles, doc_lens: list[int] | np.ndarray) -> None:
        if wrapper.fixed and wrapper.table is not None:  # a graph's: rewritten where the graph reads it
            table = self.kernel.tile_table(doc_lens, wrapper.table.shape[0])
            wrapper.table.copy_(host(torch.from_numpy(table), self.device), non_blocking=True)
            return
        size = self.kernel.max_tiles(int(np.sum(doc_lens)), len(doc_lens)) if wrapper.fixed else None
        wrapper.table = to_device(self.kernel.tile_table(doc_lens, size), self.device)

    def attend(self, wrapper: _Tiles) -> Attend:
        def attend(q, k, v):
            return self.kernel.document_attention(q, k, v, wrapper.table)
        attend.reads_strided = True  # the model leaves k and v in the q/k/v GEMM's output
        return attend

    def plan(self, doc_lens: list[int]) -> Attend:
        self.plan_wrapper(self.wrapper, doc_lens)
        return self.attend(self.wrapper)


def flashinfer_usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    return (device.type == "cuda" and dtype in FLASHINFER_DTYPES and head_dim in FLASHINFER_HEAD_DIMS
            and importlib.util.find_spec("flashinfer") is not None)


def triton_usable(device: torch.device, dtype: torch.dtype, cfg) -> bool:
    """Compiled Triton on CUDA (not the interpreter the CPU tests run), fp16/bf16, and power-of-two
    head dim and heads per kv head (the kernel's operand shapes)."""
    from chorus.triton_support import HAVE_TRITON, INTERPRET
    from gpu_worker.omnivoice import attention_kernel

    return (device.type == "cuda" and HAVE_TRITON and not INTERPRET and dtype in FLASHINFER_DTYPES
            and attention_kernel.fits(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))


def make_document_attention(name: str, cfg, dtype: torch.dtype, device: torch.device):
    """'auto' = the Triton kernel on CUDA with fp16/bf16 where it compiles (faster than flashinfer's
    ragged prefill at 1, 8 and 32 canvases: docs/performance-notes.md), else flashinfer where
    installed, else the torch reference."""
    if name == "auto":
        name = ("triton" if triton_usable(device, dtype, cfg) else
                "flashinfer" if flashinfer_usable(device, dtype, cfg.head_dim) else "torch")
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError(f"attention flashinfer runs on CUDA, the worker's device is {device}: "
                             "use --attention torch or auto")
        return FlashInferDocuments(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    if name == "triton":
        from chorus.triton_support import HAVE_TRITON
        if device.type != "cuda" or not HAVE_TRITON:
            raise ValueError(f"attention triton runs on CUDA with triton installed, the worker's device is {device}: "
                             "use --attention torch or auto")
        return TritonDocuments(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    if name == "torch":
        return TorchDocuments()
    raise ValueError(f"unknown attention backend {name!r}: choose auto, torch, flashinfer or triton")
