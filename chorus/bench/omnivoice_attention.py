"""OmniVoice's packed attention on its own: flashinfer's ragged prefill against the Triton kernel
(gpu_worker/omnivoice/attention_kernel.py) in several block configurations, on the documents of
B O1 canvases (a guided canvas is two documents: prefix + target rows, and target rows).

    python -m chorus.bench.omnivoice_attention --canvases 1,8,32 --out results.json

Per layout and backend: GPU microseconds per layer (kernel time under the torch profiler, the
median of --repeats calls), the FLOP rate, the largest error against fp32 attention, and whether
the first canvas's rows are bit-equal to the same canvas attended alone (batch invariance, which
the worker's determinism needs).
"""

from __future__ import annotations

import argparse

from chorus.bench.common import cuda_kernels, device_name, write_json
from chorus.provenance import git_revision

CONFIGS = ("32x32w4s2", "64x32w4s2", "32x32w4s3", "32x64w4s2", "64x64w4s2", "16x32w4s2")


def parse_config(text: str) -> dict:
    """'64x64w4s2' -> block_m 64, block_n 64, 4 warps, 2 stages."""
    blocks, rest = text.split("w")
    warps, stages = rest.split("s")
    m, n = blocks.split("x")
    return {"block_m": int(m), "block_n": int(n), "num_warps": int(warps), "num_stages": int(stages)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m chorus.bench.omnivoice_attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--canvases", default="1,8,32", help="comma-separated canvas counts")
    p.add_argument("--prefix-rows", type=int, default=36, help="a canvas's text prefix rows")
    p.add_argument("--target-frames", type=int, default=212, help="a canvas's target rows")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="Triton configurations BMxBNwWARPSsSTAGES (the worker runs attention_kernel's constants)")
    p.add_argument("--repeats", type=int, default=20, help="profiled calls per point (the median is kept)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    import statistics

    import torch

    from chorus.omnivoice.config import OmniVoiceConfig
    from gpu_worker.omnivoice import attention_kernel
    from gpu_worker.omnivoice.attention import FlashInferDocuments
    from gpu_worker.omnivoice.model import document_attention

    cfg = OmniVoiceConfig()  # the full model's shapes
    dev = torch.device("cuda")
    heads, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    fi = FlashInferDocuments(heads, kv, d, torch.float16, dev)

    def gpu_us(fn) -> float:
        fn()
        torch.cuda.synchronize()
        return statistics.median(sum(us for _, us in cuda_kernels(fn)) for _ in range(args.repeats))

    one = [args.prefix_rows + args.target_frames, args.target_frames]
    alone, outputs = {}, {}
    rows_out = []
    for n in [int(c) for c in args.canvases.split(",")]:
        lens = one * n
        rows = sum(lens)
        g = torch.Generator(device=dev).manual_seed(0)
        qkv = torch.randn(rows, (heads + 2 * kv) * d, device=dev, dtype=torch.float16, generator=g)
        q, k, v = qkv.split([heads * d, kv * d, kv * d], dim=1)  # strided, as the fused projection's output
        q, k, v = q.view(rows, heads, d), k.view(rows, kv, d), v.view(rows, kv, d)
        exact = document_attention(q.float(), k.float(), v.float(), lens)
        flops = sum(4 * x * x * heads * d for x in lens)
        point = {"canvases": n, "rows": rows, "documents": len(lens), "mflop": round(flops / 1e6, 1), "backends": {}}

        def record(name, fn):
            out = fn()
            us = gpu_us(fn)
            first = out[:sum(one)].clone()
            if n == 1:
                alone[name] = first
            point["backends"][name] = {"us": round(us, 1), "tflops": round(flops / us / 1e6, 1),
                                       "max_abs_err_vs_fp32": (out.float() - exact).abs().max().item(),
                                       "first_canvas_equals_alone": bool(torch.equal(first, alone[name]))
                                       if name in alone else None}
            if name.startswith("triton"):  # which block sizes change a row's bits (against the first config)
                point["backends"][name]["equals_first_config"] = bool(torch.equal(out, outputs.setdefault(n, out)))
            print(n, name, point["backends"][name], flush=True)

        attend = fi.plan(lens)
        qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
        record("flashinfer", lambda: attend(qc, kc, vc))
        for text in args.configs.split(","):
            c = parse_config(text)
            tiles = torch.from_numpy(attention_kernel.tile_table(lens, block_m=c["block_m"])).to(dev)
            try:
                record(f"triton_{text}", lambda: attention_kernel.document_attention(q, k, v, tiles, **c))
            except Exception as e:  # noqa: BLE001 - a configuration the GPU cannot run (shared memory)
                point["backends"][f"triton_{text}"] = {"error": repr(e)[:300]}
                print(n, text, "failed", repr(e)[:300], flush=True)
        rows_out.append(point)
    write_json(args.out, {"bench": "omnivoice_attention", "device": device_name(dev), "dtype": "float16",
                          "heads": heads, "kv_heads": kv, "head_dim": d, "document_rows": one,
                          "git": git_revision(), "results": rows_out})


if __name__ == "__main__":
    main()
