"""Windowed causal attention over a ring KV cache plus a new chunk (SlotDecoder's attention).

Layout (vocoder_svc/slot_decoder.py): per layer a cache ``k_cache, v_cache`` of
``[rows, H, W, D]`` is a *ring*: the K/V of absolute position p of that stage
lives at ring index ``p mod W``. A step brings ``Tk`` new tokens per row at
positions ``offset + [0, Tk)`` (``q, k, v``: ``[B, H, Tk, D]``, row b reading
cache row ``rows[b]``). A query at position P sees exactly the keys with
positions in ``[max(0, P - W + 1), P]`` (§3.3: causal, the window counts the
query itself, negative positions do not exist): those below ``offset`` come
from the ring, the others from the new chunk. Since a stream has written every
position in ``[0, offset)``, ring index ``p mod W`` holds position p for every
p in ``[offset - W, offset)``, and nothing outside that range is ever read, so
a fresh stream is just ``offset = 0`` (stale ring entries are never looked at).

`window_attention` computes it two ways (``impl`` as in gpu_worker/kernels.py):

- torch (CPU, fp64, fallback): gather the ring into chronological order with
  index arithmetic (one index_select), concatenate the chunk and run dense
  SDPA with the additive [B, 1, Tk, W+Tk] window mask: exactly the math the
  slot decoder ran before the ring (same values in the same order).
- Triton (CUDA; or CPU under TRITON_INTERPRET=1): flash-attention style
  online softmax with fp32 accumulation, one program per (row, head, query
  block). For a block of queries it visits only the key positions its window
  can reach, block by block in chronological order: no gather, no
  concatenation, no mask tensor. Key blocks are aligned to the offset, so each
  comes whole from the ring (positions < offset) or from the chunk (>= offset),
  and only blocks on the window's edges or the diagonal are masked: at head
  dim 64 the kernel is bound by that ALU work, not by its loads (a third
  faster on the H200 than masking every block). Output is written [B, Tk, H, D] and returned
  as a transposed view, so ``o.transpose(1, 2).reshape(B, Tk, H*D)`` is free.

`ring_write_kv` stores the last min(Tk, W) new tokens' K and V at their ring
indices after attention: one Triton launch for both, or (torch) `ring_write`'s
index_copy_ of min(Tk, W) entries per row and head.

Everything is sync-free with shapes fixed by (B, Tk), so it can be captured in
a CUDA graph (after one warm-up call per shape compiles the kernel).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


from chorus.triton_support import HAVE_TRITON, INTERPRET, KERNEL_DTYPES as _KERNEL_DTYPES, triton, tl, use_kernel

__all__ = ["HAVE_TRITON", "INTERPRET", "window_attention", "use_triton", "ring_gather_index", "ring_write_index",
           "ring_write", "ring_write_kv", "chunk_window_mask", "additive_window_mask"]

MAX_KERNEL_HEAD_DIM = 256
# (largest BLOCK_M, BLOCK_N, num_warps, num_stages) of the attention kernel: the fastest of those
# chorus.bench.window_attention_tune tries at every step shape measured (benchmarks/results/window_attention_tune_*)
KERNEL_CONFIG = (64, 32, 4, 3)


# ---- index arithmetic and the torch path ---------------------------------------------------------

def chunk_window_mask(offset: Tensor, window: int, tk: int) -> Tensor:
    """Boolean [B, Tk, W+Tk]: codec.window_mask(pos_q, pos_k, W) for keys (chronological cache of W, then the chunk).

    Key index i holds position offset - W + i and query j sits at key index W + j, so the codec's
    mask is a static band (0 <= W + j - i < W) and a per-row "exists" cut (position >= 0, i.e.
    i >= W - offset), built without [B, Tk, W+Tk] integer temporaries."""
    idx = torch.arange(window + tk, device=offset.device)
    rel = idx[window:].unsqueeze(1) - idx.unsqueeze(0)  # [Tk, W+Tk]
    band = (rel >= 0) & (rel < window)
    exists = idx.unsqueeze(0) >= (window - offset).unsqueeze(1)  # [B, W+Tk]
    return band.unsqueeze(0) & exists.unsqueeze(1)


def additive_window_mask(offset: Tensor, window: int, tk: int, dtype: torch.dtype) -> Tensor:
    """[B, 1, Tk, W+Tk] in `dtype`: 0 where chunk_window_mask allows, -inf elsewhere. Its row stride is
    padded to a multiple of 16 elements so the fused SDPA kernels take it without a copy."""
    bsz = offset.shape[0]
    kp = -(-(window + tk) // 16) * 16
    mask = torch.full((bsz, 1, tk, kp), float("-inf"), dtype=dtype, device=offset.device)[..., :window + tk]
    mask.masked_fill_(chunk_window_mask(offset, window, tk).unsqueeze(1), 0.0)
    return mask


def ring_gather_index(rows: Tensor, offset: Tensor, heads: int, window: int) -> Tensor:
    """Flat index [B*H*W] into ``cache.view(-1, D)`` ([rows, H, W, D] contiguous) that reads each row's
    window in chronological order: entry j is position offset - W + j, ring index (offset + j) mod W.
    Entries of negative positions are whatever the ring holds there (finite, masked)."""
    j = torch.arange(window, device=offset.device)
    slot = torch.remainder(offset.unsqueeze(1) + j, window)  # [B, W]
    base = rows.unsqueeze(1) * (heads * window) + torch.arange(heads, device=offset.device) * window  # [B, H]
    return (base.unsqueeze(2) + slot.unsqueeze(1)).reshape(-1)


def ring_write_index(rows: Tensor, offset: Tensor, heads: int, window: int, tk: int) -> Tensor:
    """Flat index [B*H*n], n = min(Tk, W), into ``cache.view(-1, D)``: the ring slots of the chunk's last n
    tokens (positions offset + Tk - n .. offset + Tk - 1). Distinct within a row, rows distinct."""
    n = min(tk, window)
    p = offset.unsqueeze(1) + torch.arange(tk - n, tk, device=offset.device)  # [B, n]
    base = rows.unsqueeze(1) * (heads * window) + torch.arange(heads, device=offset.device) * window  # [B, H]
    return (base.unsqueeze(2) + torch.remainder(p, window).unsqueeze(1)).reshape(-1)


def ring_write(cache: Tensor, new: Tensor, index: Tensor) -> None:
    """cache [rows, H, W, D] (contiguous) <- the last n tokens of new [B, H, Tk, D] at `index`
    (ring_write_index). Call after the step's attention has read the ring."""
    if not cache.is_contiguous():
        raise ValueError("the ring cache must be contiguous [rows, H, W, D] (flat ring indices)")
    d = cache.shape[-1]
    n = index.numel() // (new.shape[0] * new.shape[1])
    cache.view(-1, d).index_copy_(0, index, new[:, :, new.shape[2] - n:].reshape(-1, d))


def ring_write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, rows: Tensor, offset: Tensor,
                  index: Tensor | None = None, *, impl: str = "auto") -> None:
    """Both rings <- the last n = min(Tk, W) tokens of k, v [B, H, Tk, D] (after the step's attention).

    Kernel: one launch for k and v that reads them through their strides (rope_qk's v is a view of
    the QKV projection) and computes each ring slot from offset. Torch path: ring_write twice with
    `index` (ring_write_index, built here when not given: a stage's layers share one), which copies
    a strided source before its index_copy."""
    bsz, heads, tk, d = k.shape
    window = k_cache.shape[2]
    supported = (k.dtype in _KERNEL_DTYPES and all(t.dtype == k.dtype for t in (v, k_cache, v_cache))
                 and k.shape == v.shape and k_cache.shape == v_cache.shape and k_cache.dim() == 4
                 and k_cache.shape[1:] == (heads, window, d) and k_cache.is_contiguous() and v_cache.is_contiguous()
                 and all(t.stride(-1) == 1 for t in (k, v)) and bsz > 0 and tk > 0
                 and rows.shape == offset.shape == (bsz,) and rows.dtype == offset.dtype == torch.long)
    if not use_triton(impl, supported, k, v, k_cache, v_cache, rows, offset):
        if index is None:
            index = ring_write_index(rows, offset, heads, window, tk)
        ring_write(k_cache, k, index)
        ring_write(v_cache, v, index)
        return
    n = min(tk, window)
    block_t = max(1, min(triton.next_power_of_2(n), 64))
    block_d = triton.next_power_of_2(d)
    _ring_write_kernel[(bsz * heads, triton.cdiv(n, block_t))](
        k, v, k_cache, v_cache, rows, offset,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        heads, tk, n, window, d, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4)


def _window_attention_torch(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, rows: Tensor,
                            offset: Tensor, window: int, mask: Tensor | None, index: Tensor | None) -> Tensor:
    bsz, heads, tk, d = q.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the ring caches must be contiguous [rows, H, W, D] (flat ring indices)")
    if index is None:
        index = ring_gather_index(rows, offset, heads, window)
    if mask is None:
        mask = additive_window_mask(offset, window, tk, q.dtype)
    kc = torch.cat((k_cache.view(-1, d).index_select(0, index).view(bsz, heads, window, d), k), dim=2)
    vc = torch.cat((v_cache.view(-1, d).index_select(0, index).view(bsz, heads, window, d), v), dim=2)
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)  # [B, H, Tk, D]


# ---- dispatch ------------------------------------------------------------------------------------------

def _supported(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, rows: Tensor,
               offset: Tensor, window: int) -> bool:
    if q.dim() != 4 or k_cache.dim() != 4:
        return False
    bsz, heads, tk, d = q.shape
    return (q.dtype in _KERNEL_DTYPES and all(t.dtype == q.dtype for t in (k, v, k_cache, v_cache))
            and k.shape == v.shape == q.shape and k_cache.shape == v_cache.shape
            and k_cache.shape[1:] == (heads, window, d) and 1 <= d <= MAX_KERNEL_HEAD_DIM
            and bsz > 0 and tk > 0 and window >= 1
            and all(t.stride(-1) == 1 for t in (q, k, v, k_cache, v_cache))
            and rows.shape == offset.shape == (bsz,) and rows.dtype == offset.dtype == torch.long)


def use_triton(impl: str, supported: bool, *tensors: Tensor) -> bool:
    """Kernel or torch path (chorus/triton_support.py's rule)."""
    return use_kernel(impl, supported, *tensors, unsupported=f"dtype fp16/bf16/fp32, head dim <= "
                      f"{MAX_KERNEL_HEAD_DIM}, unit stride in the head dim, matching shapes")


def kernel_selected(dtype: torch.dtype, device: torch.device, head_dim: int, impl: str = "auto") -> bool:
    """Whether window_attention(impl=impl) takes the kernel for well-formed inputs of this dtype, device and
    head dim, so a caller can skip building the torch path's mask and index (it builds them itself when
    needed anyway)."""
    if impl == "torch":
        return False
    if impl not in ("auto", "triton"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    ok = dtype in _KERNEL_DTYPES and 1 <= head_dim <= MAX_KERNEL_HEAD_DIM and HAVE_TRITON
    if impl == "auto":
        return ok and torch.device(device).type == "cuda"
    return ok and (torch.device(device).type == "cuda" or INTERPRET)


def window_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, rows: Tensor,
                     offset: Tensor, window: int, *, impl: str = "auto", mask: Tensor | None = None,
                     index: Tensor | None = None, config: tuple[int, int, int, int] | None = None) -> Tensor:
    """Softmax attention of the chunk's queries over (ring window + chunk), scale 1/sqrt(D).

    q, k, v: [B, H, Tk, D] (rotated q/k of positions offset + [0, Tk); any strides with a unit last one).
    k_cache, v_cache: [R, H, W, D] rings (W = window); row b reads ring row rows[b].
    rows, offset: [B] long (device tensors; offset >= 0).
    mask, index: optional precomputed additive_window_mask / ring_gather_index for the torch path
        (shared by all layers of a stage); ignored by the kernel.
    Returns [B, H, Tk, D] in q's dtype (from the kernel: a transposed view of a [B, Tk, H, D] buffer).
    config: (BLOCK_M, BLOCK_N, num_warps, num_stages) for the kernel instead of KERNEL_CONFIG
        (chorus/bench/window_attention_tune.py).
    Does not write the ring: call ring_write_kv afterwards."""
    supported = _supported(q, k, v, k_cache, v_cache, rows, offset, window)
    if not use_triton(impl, supported, q, k, v, k_cache, v_cache, rows, offset):
        return _window_attention_torch(q, k, v, k_cache, v_cache, rows, offset, window, mask, index)
    bsz, heads, tk, d = q.shape
    out = torch.empty((bsz, tk, heads, d), dtype=q.dtype, device=q.device)
    block_d = max(16, triton.next_power_of_2(d))
    max_m, block_n, warps, stages = config or KERNEL_CONFIG
    block_m = min(max_m, max(16, triton.next_power_of_2(tk)))
    if block_d > 128:
        block_n = min(block_n, 32)
    grid = (triton.cdiv(tk, block_m), bsz * heads)
    _window_attention_kernel[grid](
        q, k, v, k_cache, v_cache, rows, offset, out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        heads, tk, window, d, (1.0 / math.sqrt(d)) * math.log2(math.e),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, EVEN_D=block_d == d,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", INTERPRETED=INTERPRET,
        num_warps=warps, num_stages=stages)
    return out.transpose(1, 2)


# ---- the kernel ------------------------------------------------------------------------------------------

if HAVE_TRITON:

    @triton.jit
    def _ring_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, rows_ptr, off_ptr,
                           sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sc_r, sc_h, sc_w,
                           H, TK, N, W, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """Row b, head h, BLOCK_T of the chunk's last N tokens: k and v to ring slot (offset + t) mod W."""
        bh = tl.program_id(0)
        b = bh // H
        h = (bh % H).to(tl.int64)
        t = TK - N + tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = (t < TK)[:, None]
        off = tl.load(off_ptr + b)
        row = tl.load(rows_ptr + b)
        slot = ((off + t) % W).to(tl.int64)[:, None]
        t = t.to(tl.int64)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        m = tm & (d < D)
        b = b.to(tl.int64)
        dst = row * sc_r + h * sc_h + slot * sc_w + d
        tl.store(kc_ptr + dst, tl.load(k_ptr + b * sk_b + h * sk_h + t * sk_t + d, mask=m), mask=m)
        tl.store(vc_ptr + dst, tl.load(v_ptr + b * sv_b + h * sv_h + t * sv_t + d, mask=m), mask=m)

    @triton.jit
    def _key_block(start, q, pq, off, k_lo, new_end, m_i, l_i, acc, kc_base, vc_base, k_base, v_base,
                   skc_w, svc_w, sk_t, sv_t, W, qk_scale, dd, dmask,
                   FROM_RING: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
                   PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
        """One online-softmax update with the keys at positions [start, start + BLOCK_N), all from the ring
        (positions < off) or all from the chunk (>= off). An unmasked block is one every real query of the
        block sees whole, so it needs no load masks, no band mask and no all-masked guard."""
        t = tl.arange(0, BLOCK_N)
        p = start + t
        if FROM_RING:
            if MASKED:
                idx = tl.where(p >= 0, p % W, 0)
            else:  # [start, start + BLOCK_N) lies in [off - W, off): the ring index wraps at most once
                idx = start % W + t
                idx = tl.where(idx >= W, idx - W, idx)
            k_ptrs, v_ptrs = kc_base + idx[:, None] * skc_w, vc_base + idx[:, None] * svc_w
        else:
            k_ptrs, v_ptrs = k_base + (p - off)[:, None] * sk_t, v_base + (p - off)[:, None] * sv_t
        if MASKED:
            exists = (p >= k_lo) & (p < new_end)
            lmask = exists[:, None] & dmask[None, :]
            kb = tl.load(k_ptrs + dd[None, :], mask=lmask, other=0.0)
        elif EVEN_D:
            kb = tl.load(k_ptrs + dd[None, :])
        else:
            kb = tl.load(k_ptrs + dd[None, :], mask=dmask[None, :], other=0.0)
        if INTERPRETED:  # the interpreter's bf16 tl.dot returns garbage (Triton 3.6): same operands in fp32
            s = tl.dot(q.to(tl.float32), tl.trans(kb.to(tl.float32)), input_precision=PRECISION)
        else:
            s = tl.dot(q, tl.trans(kb), input_precision=PRECISION)
        s = s * qk_scale  # log2 domain
        if MASKED:
            rel = pq[:, None] - p[None, :]
            s = tl.where((rel >= 0) & (rel < W) & exists[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = m_new
        alpha = tl.exp2(m_i - m_safe)
        pr = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        if MASKED:
            vb = tl.load(v_ptrs + dd[None, :], mask=lmask, other=0.0)
        elif EVEN_D:
            vb = tl.load(v_ptrs + dd[None, :])
        else:
            vb = tl.load(v_ptrs + dd[None, :], mask=dmask[None, :], other=0.0)
        if INTERPRETED:
            pv = tl.dot(pr.to(vb.dtype).to(tl.float32), vb.to(tl.float32), input_precision=PRECISION)
        else:
            pv = tl.dot(pr.to(vb.dtype), vb, input_precision=PRECISION)  # P rounded to the input dtype, as SDPA
        acc = acc * alpha[:, None] + pv
        return m_new, l_i, acc

    @triton.jit
    def _window_attention_kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, rows_ptr, off_ptr, o_ptr,
                                 sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                                 skc_r, skc_h, skc_w, svc_r, svc_h, svc_w,
                                 so_b, so_t, so_h,
                                 H, TK, W, D, qk_scale,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                                 EVEN_D: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
        mb = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        off = tl.load(off_ptr + b).to(tl.int32)  # positions stay < 2**24 (slot_decoder.MAX_POSITION)
        row = tl.load(rows_ptr + b).to(tl.int64)

        i = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # query index in the chunk
        dd = tl.arange(0, BLOCK_D)
        dmask = dd < D
        qmask = i < TK
        q = tl.load(q_ptr + b * sq_b + h * sq_h + i[:, None] * sq_t + dd[None, :],
                    mask=qmask[:, None] & dmask[None, :], other=0.0)
        pq = off + i  # absolute query positions

        n_q = tl.minimum(mb * BLOCK_M + BLOCK_M, TK)  # one past the block's last real query, from off
        q_end = off + n_q
        k_lo = tl.maximum(off + mb * BLOCK_M - W + 1, 0)  # the first key any query of the block can see
        new_end = off + TK

        kc_base = kc_ptr + row * skc_r + h * skc_h
        vc_base = vc_ptr + row * svc_r + h * svc_h
        k_base = k_ptr + b * sk_b + h * sk_h
        v_base = v_ptr + b * sv_b + h * sv_h

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Key blocks are aligned to off, so each is all ring (counted back from off) or all chunk; in
        # chronological order. Ring blocks at or after e = max(q_end - W, 0) are seen whole by every
        # real query of the block (they precede all of them); chunk blocks too if they also end at or
        # before the block's first query. Only the band's edges and the diagonal take masks.
        e = tl.maximum(q_end - W, 0)
        n_ring = tl.cdiv(tl.maximum(off - k_lo, 0), BLOCK_N)
        n_ring_whole = tl.minimum(tl.maximum(off - e, 0) // BLOCK_N, n_ring)
        n_new = tl.cdiv(n_q, BLOCK_N)
        first_new = tl.maximum(k_lo - off, 0) // BLOCK_N
        whole_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(n_q - W, 0), BLOCK_N), first_new), n_new)
        whole_hi = tl.minimum(tl.maximum((mb * BLOCK_M + 1) // BLOCK_N, whole_lo), n_new)
        # Five runs of blocks: masked ring (the band's lower edge), whole ring, masked chunk (the lower
        # edge when Tk > W), whole chunk, masked chunk (the diagonal). The interpreter cannot take
        # tensor loop bounds (numpy 2 refuses int() of its 1-element scalars), so there each run is a
        # while loop; compiled, each is an scf.for (software pipelined).
        if INTERPRETED:
            runs_ring = ((0, n_ring - n_ring_whole, n_ring, True), (0, n_ring_whole, n_ring_whole, False))
            runs_new = ((first_new, whole_lo, True), (whole_lo, whole_hi, False), (whole_hi, n_new, True))
            for lo, hi, back, masked in runs_ring:
                j = lo
                while j < hi:
                    m_i, l_i, acc = _key_block(off - (back - j) * BLOCK_N, q, pq, off, k_lo, new_end, m_i, l_i, acc,
                                               kc_base, vc_base, k_base, v_base, skc_w, svc_w, sk_t, sv_t, W,
                                               qk_scale, dd, dmask, True, masked, BLOCK_N, EVEN_D, PRECISION,
                                               INTERPRETED)
                    j += 1
            for lo, hi, masked in runs_new:
                j = lo
                while j < hi:
                    m_i, l_i, acc = _key_block(off + j * BLOCK_N, q, pq, off, k_lo, new_end, m_i, l_i, acc, kc_base,
                                               vc_base, k_base, v_base, skc_w, svc_w, sk_t, sv_t, W, qk_scale, dd,
                                               dmask, False, masked, BLOCK_N, EVEN_D, PRECISION, INTERPRETED)
                    j += 1
        else:
            for j in range(0, n_ring - n_ring_whole):
                m_i, l_i, acc = _key_block(off - (n_ring - j) * BLOCK_N, q, pq, off, k_lo, new_end, m_i, l_i, acc,
                                           kc_base, vc_base, k_base, v_base, skc_w, svc_w, sk_t, sv_t, W, qk_scale,
                                           dd, dmask, True, True, BLOCK_N, EVEN_D, PRECISION, INTERPRETED)
            for j in range(0, n_ring_whole):
                m_i, l_i, acc = _key_block(off - (n_ring_whole - j) * BLOCK_N, q, pq, off, k_lo, new_end, m_i, l_i,
                                           acc, kc_base, vc_base, k_base, v_base, skc_w, svc_w, sk_t, sv_t, W,
                                           qk_scale, dd, dmask, True, False, BLOCK_N, EVEN_D, PRECISION, INTERPRETED)
            for j in range(first_new, whole_lo):
                m_i, l_i, acc = _key_block(off + j * BLOCK_N, q, pq, off, k_lo, new_end, m_i, l_i, acc, kc_base,
                                           vc_base, k_base, v_base, skc_w, svc_w, sk_t, sv_t, W, qk_scale, dd,
                                           dmask, False, True, BLOCK_N, EVEN_D, PRECISION, INTERPRETED)
            for j in range(whole_lo, whole_hi):
                m_i, l_i, acc = _key_block(off + j * BLOCK_N, q, pq, off, k_lo, new_end, m_i, l_i, acc, kc_base,
                                           vc_base, k_base, v_base, skc_w, svc_w, sk_t, sv_t, W, qk_scale, dd,
                                           dmask, False, False, BLOCK_N, EVEN_D, PRECISION, INTERPRETED)
            for j in range(whole_hi, n_new):
                m_i, l_i, acc = _key_block(off + j * BLOCK_N, q, pq, off, k_lo, new_end, m_i, l_i, acc, kc_base,
                                           vc_base, k_base, v_base, skc_w, svc_w, sk_t, sv_t, W, qk_scale, dd,
                                           dmask, False, True, BLOCK_N, EVEN_D, PRECISION, INTERPRETED)
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # only padding queries (i >= TK): every real one sees itself
        o = acc / l_i[:, None]
        tl.store(o_ptr + b * so_b + i[:, None] * so_t + h * so_h + dd[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=qmask[:, None] & dmask[None, :])
