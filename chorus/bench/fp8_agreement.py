"""FP8 backbone weights (`--quantization fp8`) against bf16, on the same random weights.

Reports how far the backbone's hidden states move (relative L2 against an fp32 run of the same
weights, beside bf16's own distance), how many seeded frames come out identical, where each
request's frames first differ, and whether FP8 keeps the determinism promise (the same frames
graphed and eager, alone and batched). Random weights say how much the numbers move, not
whether the audio stays good: judge that on a real checkpoint.

    python -m chorus.bench.fp8_agreement --out fp8_agreement.json          # one GPU, full-size shapes
    python -m chorus.bench.fp8_agreement --device cpu --preset tiny        # the CPU's kernels
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import numpy as np

from chorus.bench.common import device_name, write_json
from chorus.provenance import git_revision


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def hidden_error(bf16, fp8, device: str, rows: int = 256, seed: int = 0) -> dict:
    """Backbone hidden states of one prefill, each model against an fp32 copy of the bf16 weights."""
    import torch
    from gpu_worker.attention import AttentionBatch, SequenceSpan, TorchPagedAttention

    bb = bf16.cfg.backbone
    rng = np.random.default_rng(seed)
    ids = np.concatenate([rng.integers(0, bb.vocab_size, (rows, 1)),
                          rng.integers(0, bf16.cfg.audio_vocab_size, (rows, bf16.cfg.n_vq))], 1)
    ids = torch.from_numpy(ids).to(device)
    batch = AttentionBatch.build([SequenceSpan(list(range(rows)), rows)], torch.device(device))
    fp32 = copy.deepcopy(bf16).float()
    out = []
    with torch.inference_mode():
        for model, dtype in ((bf16, torch.bfloat16), (fp8, torch.bfloat16), (fp32, torch.float32)):
            backend = TorchPagedAttention(bb.num_hidden_layers, -(-rows // 16) * 16, bb.num_key_value_heads,
                                          bb.head_dim, dtype, torch.device(device))
            backend.begin(batch)
            out.append(model.backbone(model.embed_rows(ids), batch, backend).float())
    del fp32
    return {"rows": rows, "rel_l2_bf16_vs_fp32": _rel(out[0], out[2]), "rel_l2_fp8_vs_fp32": _rel(out[1], out[2]),
            "rel_l2_fp8_vs_bf16": _rel(out[1], out[0])}


def quantize_kernel_check(device: str) -> bool:
    """gpu_worker/fp8.py's Triton quantize kernel against its torch path, bit for bit, on rows of
    the backbone's widths (subnormal e4m3 values included)."""
    import torch
    from gpu_worker.fp8 import quantize_rows, quantize_rows_torch

    gen = torch.Generator(device=device).manual_seed(5)
    for width in (2560, 9728, 4096):
        x = torch.randn(37, width, generator=gen, device=device).to(torch.bfloat16)
        x[3, :300] *= 1e-4
        q, scale = quantize_rows(x, impl="triton")
        q_ref, scale_ref = quantize_rows_torch(x)
        if not (torch.equal(scale, scale_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))):
            return False
    return True


def _compare(a, b) -> dict:
    from chorus.bench.gpu_checks import first_divergence

    frames = sum(len(f) for f in a)
    same = sum(x == y for fa, fb in zip(a, b) for x, y in zip(fa, fb))
    cells = sum(len(x) for fa in a for x in fa)
    same_cells = sum(u == v for fa, fb in zip(a, b) for x, y in zip(fa, fb) for u, v in zip(x, y))
    return {"identical_frames": same, "frames": frames, "identical_cells": same_cells, "cells": cells,
            "first_differing_frame": first_divergence(a, b)}


def frame_agreement(bf16, fp8, device: str, requests: int, steps: int, seed: int = 1) -> dict:
    """Seeded requests decoded by both models (graphed on CUDA), and the FP8 model's own promises."""
    from chorus.bench.gpu_checks import run_requests
    from gpu_worker.engine import Engine

    rng = np.random.default_rng(seed)
    prompts = [np.concatenate([rng.integers(0, bf16.cfg.backbone.vocab_size, (n, 1)),
                               np.full((n, bf16.cfg.n_vq), bf16.cfg.audio_pad_code)], 1).astype(np.int32)
               for n in rng.integers(40, 120, requests)]
    cuda = device.startswith("cuda")

    def engine(model, graphs: bool) -> Engine:  # each run releases its requests: an engine serves many runs
        return Engine(model, num_kv_slots=requests * 1024 + 1024, max_batch=max(4, requests), max_context=1024,
                      cuda_graphs=graphs, page_size=16)

    engines = {"bf16": engine(bf16, cuda), "fp8": engine(fp8, cuda)}
    base = run_requests(engines["bf16"], prompts, steps)
    quant = run_requests(engines["fp8"], prompts, steps)
    report = {"requests": requests, "steps": steps, "fp8_vs_bf16": _compare(base, quant)}
    # A request's seed follows its place in run_requests' batch: each one compared leads its batch.
    for name, e in engines.items():
        alone, batched = [], []
        for i in range(min(2, requests)):
            alone.append(run_requests(e, [prompts[i]], steps)[0])
            batched.append(run_requests(e, [prompts[i]] + prompts[:i] + prompts[i + 1:], steps)[0])
        report[f"{name}_alone_vs_batched"] = _compare(alone, batched)
    if cuda:
        report["fp8_graphed_vs_eager"] = _compare(quant, run_requests(engine(fp8, False), prompts, steps))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="torch device")
    p.add_argument("--preset", default="full", choices=["tiny", "full"], help="model shapes (random weights)")
    p.add_argument("--requests", type=int, default=8, help="seeded requests decoded together")
    p.add_argument("--steps", type=int, default=48, help="frames each request decodes")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--out", metavar="JSON", help="write the results here")
    args = p.parse_args(argv)

    import torch
    from gpu_worker.loader import build_model

    print(f"building the {args.preset} model twice on {args.device} (bf16, fp8)", flush=True)
    bf16, fp8 = (build_model(preset=args.preset, load_format="dummy", dtype="bfloat16", device=args.device,
                             seed=args.seed, quantization=q) for q in ("none", "fp8"))
    report = {"device": device_name(args.device), "torch": torch.__version__, "git": git_revision(),
              "preset": args.preset, "weight_seed": args.seed}
    print("hidden states of one prefill against fp32", flush=True)
    report["hidden"] = hidden_error(bf16, fp8, args.device)
    print(json.dumps(report["hidden"]), flush=True)
    if args.device.startswith("cuda"):
        report["quantize_kernel_equals_torch"] = quantize_kernel_check(args.device)
        print(f"quantize kernel equals the torch path: {report['quantize_kernel_equals_torch']}", flush=True)
    print(f"decoding {args.requests} seeded requests x {args.steps} frames with each", flush=True)
    with torch.inference_mode():
        report["frames"] = frame_agreement(bf16, fp8, args.device, args.requests, args.steps)
    write_json(args.out, report)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
