"""Paged decode attention in Triton: one query row per request over its KV pages, GQA.

Why: at a loaded server's decode shape (batches of ~180, ~150-row contexts) flashinfer's decode
takes about twice its KV-bytes floor, and its cost beyond the floor grows with the batch, not the
context, which points at fixed work per request.
This kernel is the plain design for that regime: one program per (request, KV head) computes
the GROUP query heads that share the KV head, streaming the request's keys and values once in
BLOCK_N-row tiles (online softmax, fp32 accumulation). No split over the context, so a row's
result does not depend on the batch around it (batch invariant).

Layout (the worker's slot cache, gpu_worker/attention.py): k_cache, v_cache [slots, Hkv, D] of
one layer, slot = page * page_size + offset in page; a request's pages are
kv_indices[kv_indptr[b]:kv_indptr[b+1]], its last page holding last_page_len[b] rows (the
flashinfer page table, attention.page_table). All sync-free with shapes fixed by the batch, so
it can be captured in a CUDA graph; the page table is read on the device.

The worker decodes batches above attention.TRITON_DECODE_ABOVE requests with it
(attention.TritonDecode); below that, flashinfer's split over long contexts wins.
chorus/bench/decode_attention_bench.py times it beside flashinfer at several tile configs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from chorus.triton_support import HAVE_TRITON, INTERPRET, KERNEL_DTYPES, triton, tl, use_kernel

__all__ = ["paged_decode_attention", "paged_decode_attention_torch", "kernel_supports", "KERNEL_CONFIG"]

# (BLOCK_N, num_warps, num_stages): of the configs benchmarks/decode_attention_bench.py times, the
# fastest at W1's ~150-row contexts and close to it at longer ones, for the batches the worker gives
# it (above TRITON_DECODE_ABOVE)
KERNEL_CONFIG = (32, 2, 3)


def paged_decode_attention_torch(q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_indptr: Tensor,
                                 kv_indices: Tensor, last_page_len: Tensor, page_size: int,
                                 rows: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """Reference: each request's slots gathered, softmax(q k^T / sqrt(D)) v per query head, in >= fp32.
    With rows, request b's query and output are row rows[b] of q and out; a request without pages is
    skipped (its row of out is left as it was)."""
    hq, d = q.shape[1:]
    hkv = k_cache.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    if out is None:
        out = torch.empty_like(q)
    indptr, indices, last = kv_indptr.tolist(), kv_indices.long(), last_page_len.tolist()
    row_of = rows.tolist() if rows is not None else range(q.shape[0])
    for b, row in enumerate(row_of):
        if indptr[b + 1] == indptr[b]:
            continue
        pages = indices[indptr[b]:indptr[b + 1]]
        slots = (pages[:, None] * page_size + torch.arange(page_size, device=pages.device)).reshape(-1)
        slots = slots[:(len(pages) - 1) * page_size + last[b]]
        k = k_cache[slots].to(acc).repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        v = v_cache[slots].to(acc).repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("hd,lhd->hl", q[row].to(acc), k) / math.sqrt(d)
        out[row] = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), v).to(q.dtype)
    return out


def kernel_supports(num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel takes a model of these shapes and dtype (else paged_decode_attention falls back
    to the torch reference, which syncs the host and cannot run inside a CUDA graph)."""
    return (HAVE_TRITON and dtype in KERNEL_DTYPES and num_qo_heads % num_kv_heads == 0 and head_dim >= 16
            and head_dim & (head_dim - 1) == 0)


def _supported(q: Tensor, k_cache: Tensor, v_cache: Tensor, page_size: int, out: Tensor | None) -> bool:
    if q.dim() != 3 or k_cache.dim() != 3:
        return False
    bsz, hq, d = q.shape
    hkv = k_cache.shape[1]
    return (kernel_supports(hq, hkv, d, q.dtype) and k_cache.dtype == v_cache.dtype == q.dtype
            and k_cache.shape == v_cache.shape and k_cache.shape[2] == d and page_size >= 1
            and q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
            and k_cache.stride() == v_cache.stride() and bsz > 0
            and (out is None or (out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1)))


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_indptr: Tensor, kv_indices: Tensor,
                           last_page_len: Tensor, page_size: int, *, rows: Tensor | None = None,
                           out: Tensor | None = None, impl: str = "auto",
                           config: tuple[int, int, int] | None = None) -> Tensor:
    """Decode attention: q [B, Hq, D] (one row per request), k_cache/v_cache [slots, Hkv, D] (one layer),
    kv_indptr [B+1], kv_indices, last_page_len [B] int32 device tensors (the page table). Returns
    [B, Hq, D] in q's dtype (into `out` if given). Scale 1/sqrt(D).

    rows (int32 [B'], device): request b's query and output are row rows[b] of q and out, which may hold
    other rows (a folded prefill step's, attended by flashinfer into the same out); the table then has B'
    requests, and one without pages (indptr[b + 1] == indptr[b]) is skipped. Without rows every request
    has >= 1 KV row."""
    supported = _supported(q, k_cache, v_cache, page_size, out)
    if not use_kernel(impl, supported, q, k_cache, v_cache, kv_indptr, kv_indices, last_page_len,
                      *(() if rows is None else (rows,)),
                      unsupported="fp16/bf16/fp32, head dim a power of two >= 16, Hq a multiple of Hkv"):
        return paged_decode_attention_torch(q, k_cache, v_cache, kv_indptr, kv_indices, last_page_len, page_size,
                                            rows, out)
    hq, d = q.shape[1:]
    hkv = k_cache.shape[1]
    group = hq // hkv
    if out is None:
        out = torch.empty_like(q)
    block_n, warps, stages = config or KERNEL_CONFIG
    requests = q.shape[0] if rows is None else rows.numel()
    _paged_decode_kernel[(requests, hkv)](
        q, k_cache, v_cache, out, kv_indptr, kv_indices, last_page_len, q if rows is None else rows,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        (1.0 / math.sqrt(d)) * math.log2(math.e),
        PAGE=page_size, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=d, BLOCK_N=block_n,
        HAS_ROWS=rows is not None, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERPRETED=INTERPRET, num_warps=warps, num_stages=stages)
    return out


if HAVE_TRITON:

    @triton.jit
    def _kv_block(start, q, m_i, l_i, acc, k_head, v_head, indices_ptr, p0, kv_len, sk_s, d, qk_scale,
                  PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
        """One online-softmax update with the request's KV rows [start, start + BLOCK_N)."""
        t = start + tl.arange(0, BLOCK_N)
        tmask = t < kv_len
        page = tl.load(indices_ptr + p0 + t // PAGE, mask=tmask, other=0).to(tl.int64)
        slot = (page * PAGE + t % PAGE)[:, None]
        kb = tl.load(k_head + slot * sk_s + d, mask=tmask[:, None], other=0.0)
        if INTERPRETED:  # the interpreter's bf16 tl.dot returns garbage (Triton 3.6): fp32 operands
            s = tl.dot(q.to(tl.float32), tl.trans(kb.to(tl.float32)), input_precision=PRECISION)
        else:
            s = tl.dot(q, tl.trans(kb), input_precision=PRECISION)
        s = tl.where(tmask[None, :], s * qk_scale, float("-inf"))  # log2 domain
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every block has a key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vb = tl.load(v_head + slot * sk_s + d, mask=tmask[:, None], other=0.0)
        if INTERPRETED:
            pv = tl.dot(p.to(vb.dtype).to(tl.float32), vb.to(tl.float32), input_precision=PRECISION)
        else:
            pv = tl.dot(p.to(vb.dtype), vb, input_precision=PRECISION)  # P rounded to the KV dtype
        return m_new, l_i, acc * alpha[:, None] + pv

    @triton.jit
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, indptr_ptr, indices_ptr, last_ptr, rows_ptr,
                             sq_b, sq_h, sk_s, sk_h, so_b, so_h, qk_scale,
                             PAGE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                             BLOCK_N: tl.constexpr, HAS_ROWS: tl.constexpr, PRECISION: tl.constexpr,
                             INTERPRETED: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        hk = tl.program_id(1).to(tl.int64)
        p0 = tl.load(indptr_ptr + b)
        n_pages = tl.load(indptr_ptr + b + 1) - p0
        kv_len = (n_pages - 1) * PAGE + tl.load(last_ptr + b)  # <= 0 for a request without pages: skipped
        row = b
        if HAS_ROWS:
            row = tl.load(rows_ptr + b).to(tl.int64)

        g = tl.arange(0, BLOCK_G)  # query heads of this KV head, padded to a tl.dot tile
        gmask = (g < GROUP)[:, None]
        d = tl.arange(0, D)[None, :]
        heads = hk * GROUP + g
        q = tl.load(q_ptr + row * sq_b + heads[:, None] * sq_h + d, mask=gmask, other=0.0)

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        k_head = k_ptr + hk * sk_h
        v_head = v_ptr + hk * sk_h
        # The interpreter cannot take tensor loop bounds (numpy 2 refuses int() of its 1-element
        # scalars): there the same blocks run as a while loop.
        if INTERPRETED:
            start = 0
            while start < kv_len:
                m_i, l_i, acc = _kv_block(start, q, m_i, l_i, acc, k_head, v_head, indices_ptr, p0, kv_len, sk_s, d,
                                          qk_scale, PAGE, BLOCK_N, PRECISION, INTERPRETED)
                start += BLOCK_N
        else:
            for start in range(0, kv_len, BLOCK_N):
                m_i, l_i, acc = _kv_block(start, q, m_i, l_i, acc, k_head, v_head, indices_ptr, p0, kv_len, sk_s, d,
                                          qk_scale, PAGE, BLOCK_N, PRECISION, INTERPRETED)
        o = acc / tl.where(kv_len > 0, l_i, 1.0)[:, None]  # l_i >= 1 for a request with rows
        tl.store(o_ptr + row * so_b + heads[:, None] * so_h + d, o.to(o_ptr.dtype.element_ty),
                 mask=gmask & (kv_len > 0))
