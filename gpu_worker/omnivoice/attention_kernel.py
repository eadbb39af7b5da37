"""Bidirectional attention inside each document of a packed step, as one Triton launch a layer.

A program takes one tile of BLOCK_M query rows of one document and one kv head, with the query
heads that share that kv head stacked into one [GROUPS x BLOCK_M, d] operand, so each K/V block
is read once for the whole group; it walks the document's keys in BLOCK_N blocks with the online
softmax (exp2, scores pre-scaled by log2 e) and writes its rows once.

Why: an OmniVoice document is a few hundred rows. flashinfer's ragged prefill plans 128-row query
tiles for such lengths and spends most of each tile on its pipeline's fill: 16 us a layer for one
canvas, where the FLOPs need ~1 us. Here the tile table is the only plan: the host lists the
tiles, one copy puts them on the device.

Batch invariance: a row's result depends on its document's keys, on BLOCK_N (the order of the
online softmax) and on the matrix instruction the dots compile to, and the block sizes are fixed
(not tuned per shape), so a document's attention is the same alone or packed beside others, in
any bucket. (On the H200, 32- and 64-row tiles give equal bits; 16-row tiles, whose 32-row operand
is too short for Hopper's warpgroup instruction, do not.) q, k and v are read through
their strides: the fused q/k/v GEMM's output needs no copy.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from chorus.triton_support import HAVE_TRITON, tl, triton

# Fixed for batch invariance (above). python -m chorus.bench.omnivoice_attention times the
# alternatives: 32-row tiles (64 operand rows with the two grouped heads) are the fastest at one
# canvas and at 32; 32-key blocks beat 64 at 32 canvases, lose a little at one.
BLOCK_M = 32
BLOCK_N = 32
NUM_WARPS = 4
NUM_STAGES = 2

if HAVE_TRITON:

    @triton.jit
    def _document_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, tiles_ptr, scale_log2e,
                                   stride_qr, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
                                   stride_or, stride_oh,
                                   GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr,
                                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        q_start = tl.load(tiles_ptr + 3 * tile)
        doc_start = tl.load(tiles_ptr + 3 * tile + 1)
        doc_end = tl.load(tiles_ptr + 3 * tile + 2)
        if q_start < doc_end:  # unused tiles (q_start == doc_end) pad the table to its graph's size
            # operand row i: query head kv_head * GROUPS + i // BLOCK_M, packed row q_start + i % BLOCK_M
            i = tl.arange(0, GROUPS * BLOCK_M)
            row = q_start + i % BLOCK_M
            head = kv_head * GROUPS + i // BLOCK_M
            row_ok = row < doc_end
            d = tl.arange(0, HEAD_DIM)
            q = tl.load(q_ptr + row.to(tl.int64)[:, None] * stride_qr + head[:, None] * stride_qh + d[None, :],
                        mask=row_ok[:, None], other=0.0)
            m = tl.full((GROUPS * BLOCK_M,), -float("inf"), tl.float32)
            total = tl.zeros((GROUPS * BLOCK_M,), tl.float32)
            acc = tl.zeros((GROUPS * BLOCK_M, HEAD_DIM), tl.float32)
            for start in range(doc_start, doc_end, BLOCK_N):
                key = start + tl.arange(0, BLOCK_N)
                key_ok = key < doc_end
                k = tl.load(k_ptr + key.to(tl.int64)[None, :] * stride_kr + kv_head * stride_kh + d[:, None],
                            mask=key_ok[None, :], other=0.0)
                s = tl.where(key_ok[None, :], tl.dot(q, k) * scale_log2e, -float("inf"))
                m_new = tl.maximum(m, tl.max(s, axis=1))
                p = tl.math.exp2(s - m_new[:, None])
                shrink = tl.math.exp2(m - m_new)
                total = total * shrink + tl.sum(p, axis=1)
                v = tl.load(v_ptr + key.to(tl.int64)[:, None] * stride_vr + kv_head * stride_vh + d[None, :],
                            mask=key_ok[:, None], other=0.0)
                acc = tl.dot(p.to(v.dtype), v, acc * shrink[:, None])
                m = m_new
            out = acc / total[:, None]
            tl.store(o_ptr + row.to(tl.int64)[:, None] * stride_or + head[:, None] * stride_oh + d[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def fits(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether a model's heads fit the kernel: its operands' sides (the head dim, and the grouped
    heads times BLOCK_M) must be powers of two."""
    operand = num_heads // num_kv_heads * BLOCK_M
    return not head_dim & (head_dim - 1) and not operand & (operand - 1)


def tile_table(doc_lens: list[int] | np.ndarray, size: int | None = None, block_m: int | None = None) -> np.ndarray:
    """int32 [size, 3]: (first query row, document start, document end) of each BLOCK_M tile of
    every document, then unused tiles (first row = end = 0) up to `size` (default: no padding)."""
    block_m = block_m or BLOCK_M
    lens = np.asarray(doc_lens, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    per_doc = -(-lens // block_m)
    doc = np.repeat(np.arange(len(lens)), per_doc)
    first = starts[doc] + block_m * (np.arange(per_doc.sum()) - np.repeat(np.cumsum(per_doc) - per_doc, per_doc))
    table = np.stack([first, starts[doc], starts[doc] + lens[doc]], axis=1)
    if size is not None:
        if size < len(table):
            raise ValueError(f"{len(table)} attention tiles do not fit a table of {size}")
        table = np.concatenate([table, np.zeros((size - len(table), 3), dtype=np.int64)])
    return np.ascontiguousarray(table, dtype=np.int32)


def max_tiles(rows: int, docs: int, block_m: int | None = None) -> int:
    """The most tiles `rows` rows in `docs` documents can need (each document rounds up once)."""
    return -(-rows // (block_m or BLOCK_M)) + docs


def document_attention(q: Tensor, k: Tensor, v: Tensor, tiles: Tensor, out: Tensor | None = None,
                       block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                       num_stages: int | None = None) -> Tensor:
    """q [rows, H, d], k/v [rows, KV, d] (any row and head strides, d contiguous), tiles int32
    [T, 3] on q's device (tile_table) -> [rows, H, d]. Runs under the interpreter too (CPU
    tensors, TRITON_INTERPRET=1) for the tests; the block sizes are parameters for the benchmark
    only (the worker keeps the module's)."""
    block_m, block_n = block_m or BLOCK_M, block_n or BLOCK_N
    num_warps, num_stages = num_warps or NUM_WARPS, num_stages or NUM_STAGES
    rows, heads, d = q.shape
    kv_heads = k.shape[1]
    if heads % kv_heads or q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("document_attention needs H a multiple of KV and contiguous head dims")
    if out is None:
        out = torch.empty((rows, heads, d), dtype=q.dtype, device=q.device)
    _document_attention_kernel[(tiles.shape[0], kv_heads)](
        q, k, v, out, tiles, d ** -0.5 * 1.4426950408889634,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        GROUPS=heads // kv_heads, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps, num_stages=num_stages)
    return out
