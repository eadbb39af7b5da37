"""Could a split-K Triton GEMM beat cuBLAS on the worker's skinny GEMMs? An experiment, not a kernel
the worker uses.

At W1 c256's decode shape (M ~ 180 rows) cuBLAS leaves several of the model's GEMMs far above their
bytes floor (profile_step_bs180_ctx150_s10_h200.json): the local transformer's c_proj (2560 x 2560)
takes ~17.6 us against ~3 us, its c_attn (7680 x 2560) ~21.6 against ~9; they run 12 times a frame.
With few output tiles (M / 64 x N / 64) most SMs idle through a long K loop; splitting K over more
programs (partials in fp32, summed in a fixed order by a second kernel: deterministic) is the usual
cure. This times, for each GEMM shape of the backbone and the local transformer at each M, cuBLAS
(F.linear, with the bias where the model has one) and the split-K kernel at several tilings, each
in a CUDA graph, and checks each result against cuBLAS.

    python benchmarks/skinny_gemm_bench.py --rows 64,180,256 --out skinny_gemm.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from chorus.moss_config import MossTTSLocalConfig
from chorus.bench.profile_step import kernel_ms


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


def shapes() -> dict[str, tuple[int, int, bool]]:
    """name -> (N, K, bias) of each GEMM the worker runs per row."""
    cfg = MossTTSLocalConfig()
    bb, lc = cfg.backbone, cfg.local
    return {
        "backbone_qkv": ((bb.num_attention_heads + 2 * bb.num_key_value_heads) * bb.head_dim, bb.hidden_size, False),
        "backbone_o": (bb.hidden_size, bb.num_attention_heads * bb.head_dim, False),
        "backbone_gate_up": (2 * bb.intermediate_size, bb.hidden_size, False),
        "backbone_down": (bb.hidden_size, bb.intermediate_size, False),
        "local_c_attn": (3 * lc.n_embd, lc.n_embd, True),
        "local_c_proj": (lc.n_embd, lc.n_embd, True),
        "local_fc_in": (lc.n_inner, lc.n_embd, True),
        "local_fc_out": (lc.n_embd, lc.n_inner, True),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="64,180,256")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    configs = [(bm, bn, 64, s, w, st) for bm, bn, s, w, st in
               itertools.product((64, 128), (64, 128), (1, 2, 4, 8), (4, 8), (4,))]
    report = {"device": torch.cuda.get_device_name(), "points": []}
    for m in (int(r) for r in args.rows.split(",")):
        for name, (n, k, has_bias) in shapes().items():
            x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) * k ** -0.5
            bias = torch.randn(n, device=dev, generator=gen, dtype=torch.bfloat16) if has_bias else None
            want = F.linear(x, w, bias)
            cublas = kernel_ms(lambda: F.linear(x, w, bias), 20) * 1e3
            floor_us = max(2 * (n * k + m * k + m * n) / 4.3e12, 2 * m * n * k / 790e12) * 1e6
            part = torch.empty(8 * m * n, device=dev, dtype=torch.float32)
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            best = None
            tried = []
            for cfg in configs:
                if k % (cfg[2] * cfg[3]):
                    continue
                try:
                    got = splitk_linear(x, w, bias, part, out, cfg)
                    err = (got.float() - want.float()).abs().max().item()
                    us = kernel_ms(lambda: splitk_linear(x, w, bias, part, out, cfg), 20) * 1e3
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: not a candidate
                    tried.append({"config": cfg, "error": type(e).__name__})
                    continue
                tried.append({"config": cfg, "us": us, "max_abs_diff": err})
                if best is None or us < best["us"]:
                    best = tried[-1]
            point = {"rows": m, "gemm": name, "n": n, "k": k, "cublas_us": cublas, "floor_us": floor_us,
                     "best": best, "tried": tried}
            report["points"].append(point)
            print(f"M {m:4d} {name:17s} N {n:5d} K {k:5d}: cuBLAS {cublas:6.1f} us, split-K best {best['us']:6.1f} "
                  f"{best['config']} (|diff| {best['max_abs_diff']:.1e}); floor {floor_us:5.1f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
