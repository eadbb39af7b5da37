"""A split-K Triton GEMM for skinny matrices (few rows): K split over more programs, partials in
fp32, summed in a fixed order by a second kernel (deterministic). Timed against cuBLAS by
chorus.bench.skinny_gemm_bench; not used by the worker."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _splitk_kernel(x_ptr, w_ptr, part_ptr, M, N, K_SPLIT, sxm, swn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """part[s] = x[:, ks] @ w[:, ks]^T over split s's K range (fp32)."""
    pm, pn, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k0 = s * K_SPLIT
    a_ptr = x_ptr + rm[:, None].to(tl.int64) * sxm + (k0 + rk)[None, :]
    b_ptr = w_ptr + rn[None, :].to(tl.int64) * swn + (k0 + rk)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if INTERPRETED:  # the interpreter takes no tensor loop bounds (a CPU smoke test only)
        k = 0
        while k < K_SPLIT:
            acc = tl.dot(tl.load(a_ptr, mask=(rm < M)[:, None], other=0.0).to(tl.float32),
                         tl.load(b_ptr, mask=(rn < N)[None, :], other=0.0).to(tl.float32), acc)
            a_ptr += BLOCK_K
            b_ptr += BLOCK_K
            k += BLOCK_K
    else:
        for _ in range(0, K_SPLIT, BLOCK_K):
            a = tl.load(a_ptr, mask=(rm < M)[:, None], other=0.0)
            b = tl.load(b_ptr, mask=(rn < N)[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptr += BLOCK_K
            b_ptr += BLOCK_K
    out = part_ptr + s.to(tl.int64) * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out, acc, mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _sum_kernel(part_ptr, bias_ptr, out_ptr, MN, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK: tl.constexpr):
    """out = sum_s part[s] (in order) + bias, in out's dtype."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < MN
    acc = tl.load(part_ptr + i, mask=m, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + s * MN + i, mask=m, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + i % N, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=m)


def splitk_linear(x, w, bias, part, out, config):
    bm, bn, bk, splits, warps, stages = config
    M, K = x.shape
    N = w.shape[0]
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), splits)
    _splitk_kernel[grid](x, w, part, M, N, K // splits, x.stride(0), w.stride(0),
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, INTERPRETED=not x.is_cuda, num_warps=warps,
                         num_stages=stages)
    block = 1024
    _sum_kernel[(triton.cdiv(M * N, block),)](part, bias if bias is not None else out, out, M * N, N,
                                              SPLITS=splits, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out
