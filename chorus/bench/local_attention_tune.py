"""Time the local transformer's attention kernel (gpu_worker/kernels.local_attention) on the GPU: one
frame's 12 calls at the real shapes, in a CUDA graph, at each num_warps candidate, and optionally
another tree's kernel beside them.

    git show REV:gpu_worker/kernels.py > kernels_old.py
    python -m chorus.bench.local_attention_tune --batches 64,180,256 --baseline kernels_old.py --out tune.json

The winner goes into kernels.LOCAL_ATTENTION_WARPS by hand.
"""

from __future__ import annotations

import argparse
import importlib.util

import torch

from gpu_worker import kernels
from chorus.bench.common import kernel_ms, write_json
from chorus.moss_config import PRESETS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="64,180,256", help="decode batch sizes, comma-separated")
    ap.add_argument("--warps", default="1,2,4,8", help="num_warps candidates, comma-separated")
    ap.add_argument("--baseline", metavar="FILE",
                    help="a kernels.py of another tree (git show REV:gpu_worker/kernels.py > FILE), timed first")
    ap.add_argument("--out", metavar="JSON", help="write the results here")
    args = ap.parse_args()
    cfg = PRESETS["full"]().local
    heads, d, positions = cfg.n_head, cfg.n_embd // cfg.n_head, 13
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    modules = {"current": kernels}
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_kernels", args.baseline)
        modules["baseline"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules["baseline"])
    angles = torch.arange(positions, device=dev, dtype=torch.float32)[:, None] * torch.rand(d // 2, device=dev)
    cos, sin = (f(angles).repeat_interleave(2, dim=-1).contiguous() for f in (torch.cos, torch.sin))
    report = {"device": torch.cuda.get_device_name(), "heads": heads, "head_dim": d, "points": []}
    for b in (int(x) for x in args.batches.split(",")):
        qkv = torch.randn(b, 3 * heads * d, device=dev, generator=gen, dtype=torch.bfloat16)
        caches = {}

        def frame(module, warps):
            kc, vc = caches.setdefault((id(module), warps), tuple(
                torch.zeros(b, heads, positions, d, device=dev, dtype=torch.bfloat16) for _ in range(2)))
            kw = {} if warps is None else {"num_warps": warps}
            return [module.local_attention(qkv, kc, vc, p, cos[p], sin[p], heads, **kw) for p in range(12)]

        want = [o.float() for o in frame(kernels, None)]
        point = {"batch": b, "us": {}}
        candidates = [("baseline", None)] if args.baseline else []
        candidates += [("current", int(w)) for w in args.warps.split(",")]
        for name, warps in candidates:
            module = modules[name]
            worst = max((o.float() - w).abs().max().item() for o, w in zip(frame(module, warps), want))
            us = kernel_ms(lambda: frame(module, warps), 20) * 1e3  # a frame's 12 calls
            key = name if warps is None else f"{name}_w{warps}"
            point["us"][key] = {"frame_us": us, "max_abs_diff": worst}
            print(f"batch {b} {key}: {us:7.1f} us a frame (12 calls), max |diff| vs current {worst:.2e}", flush=True)
        report["points"].append(point)
    report["default_warps"] = kernels.LOCAL_ATTENTION_WARPS
    write_json(args.out, report)


if __name__ == "__main__":
    main()
