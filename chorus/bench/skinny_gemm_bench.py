"""Could a split-K Triton GEMM beat cuBLAS on the worker's skinny GEMMs? Times, for each GEMM
shape of the backbone and the local transformer at each row count, cuBLAS and the split-K kernel
(chorus/bench/splitk_gemm.py) at several tilings, each in a CUDA graph, checked against cuBLAS.

An experiment, not a kernel the worker uses. At decode batch sizes a GEMM has few output tiles
(M / 64 x N / 64), so most SMs idle through a long K loop; splitting K over more programs
(partials in fp32, summed in a fixed order by a second kernel: deterministic) is the usual cure.

    python -m chorus.bench.skinny_gemm_bench --rows 64,180,256 --out skinny_gemm.json
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from chorus.moss_config import MossTTSLocalConfig
from chorus.bench.common import kernel_ms, write_json


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
    ap.add_argument("--rows", default="64,180,256", help="rows of each GEMM (decode batch sizes), comma-separated")
    ap.add_argument("--out", metavar="JSON", help="write the results here")
    args = ap.parse_args()
    from chorus.bench.splitk_gemm import splitk_linear  # needs triton
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
    write_json(args.out, report, indent=1)


if __name__ == "__main__":
    main()
