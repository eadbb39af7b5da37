"""OmniVoice's packed step on its own: B canvases of one workload, every step of their unmasking
through the worker's CanvasEngine, timed per step. Token generation only (no codec, no services).

    python -m chorus.bench.omnivoice_step --device cuda --batches 1,16,32 --out results.json

On CUDA the engine is the worker's (Triton attention in buckets, CUDA graphs captured at its
warm-up, batched unmasking); --attention torch --no-cuda-graphs gives the torch reference path.

Reports per batch: milliseconds per packed step, the canvases' audio seconds per second of
generation, the step's matrix FLOPs with the time they take at --peak-tflops (the floor), and
host_launch_ms, the host's time in engine.launch a step. Through the services the worker's
loop adds its messages to that, so a step stays GPU-bound only while their sum is under the
GPU's step. Where the GPU's step is the longer one, the host runs ahead until the device's launch
queue is full and then waits in launch, so host_launch_ms reads close to step_ms (32 canvases do).
With --kernels, one more run per batch under the torch profiler adds the GPU's kernel time per
step (so wall minus kernels is the time the GPU waits for the host) and the costliest kernels.
"""

from __future__ import annotations

import argparse
import time

from chorus.bench.common import device_name, write_json
from chorus.bench.workloads import WORKLOADS
from chorus.provenance import git_revision

O1_TEXT = ("The quick brown fox jumps over the lazy dog while the morning sun rises slowly "
           "above the quiet hills and the birds begin to sing their songs.")  # ~25 words


def step_flops(cfg, prefix_rows: int, target_frames: int, guided: bool) -> float:
    """Matrix FLOPs of one canvas in one packed step: body GEMMs over its rows, attention within
    each document, and the audio head over its target rows."""
    h, d = cfg.hidden_size, cfg.head_dim
    per_row = 2 * (h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h + 3 * h * cfg.intermediate_size)
    docs = [prefix_rows + target_frames] + ([target_frames] if guided else [])
    rows = sum(docs)
    attention = sum(4 * n * n * cfg.num_heads * d for n in docs)  # QK^T and PV
    head = 2 * h * cfg.num_codebooks * cfg.audio_vocab_size * (target_frames * (2 if guided else 1))
    return cfg.num_layers * (per_row * rows + attention) + head


def step_ms(engine, text_ids, target_frames: int, knobs, batch: int, sync=lambda: None,
            host: list[float] | None = None) -> float:
    """Milliseconds per packed step of `batch` fresh canvases of one workload, every step of their
    unmasking (the canvases finish, so the engine holds none after). host: appended with the
    milliseconds per step the host spends queueing a step (engine.launch), the part of a step that
    the worker's loop cannot overlap with its messages."""
    import numpy as np

    from gpu_worker.omnivoice.engine import CanvasSpec

    for i in range(batch):
        engine.start(CanvasSpec(i, np.asarray(text_ids), None, target_frames, knobs, seed=i))
    sync()
    launching = 0.0
    t0 = time.perf_counter()
    for k in range(knobs.num_step):
        t = time.perf_counter()
        pending = engine.launch([(i, k) for i in range(batch)])
        launching += time.perf_counter() - t
        engine.finish(pending)
    sync()
    if host is not None:
        host.append(launching * 1000 / knobs.num_step)
    return (time.perf_counter() - t0) * 1000 / knobs.num_step


def kernel_report(fn, num_step: int, top: int = 25) -> dict:
    """GPU kernel time per step of one profiled run of fn (all its steps) and its costliest
    kernels by name, in microseconds per step."""
    from collections import Counter

    from chorus.bench.common import cuda_kernels

    per_name, launches = Counter(), Counter()
    for name, us in cuda_kernels(fn):
        per_name[name] += us / num_step
        launches[name] += 1
    return {"kernel_ms_per_step": round(sum(per_name.values()) / 1000, 3),
            "kernel_launches_per_step": round(sum(launches.values()) / num_step, 1),
            "top_kernels_us_per_step": [{"name": n[:120], "us": round(us, 1), "launches": launches[n] // num_step}
                                        for n, us in per_name.most_common(top)]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m chorus.bench.omnivoice_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="full", choices=("tiny", "full"), help="random-weight model size")
    p.add_argument("--device", default="cuda", help="torch device")
    p.add_argument("--dtype", default=None, help="compute dtype (default: float16 on CUDA, float32 on CPU)")
    p.add_argument("--batches", default="1,16,32", help="comma-separated canvas counts per packed step")
    p.add_argument("--num-step", type=int, default=32, help="unmasking steps per canvas")
    p.add_argument("--guidance-scale", type=float, default=2.0, help="classifier-free guidance (0 = off)")
    p.add_argument("--text", default=O1_TEXT, help="the text every canvas says")
    p.add_argument("--frames", type=int, default=WORKLOADS["O1"].frames,
                   help="target frames of each canvas (default: O1's 6 s; 0: the text's estimated duration)")
    p.add_argument("--repeats", type=int, default=2,
                   help="timed runs per batch after one warm-up run (step_ms: the best; canvas_ms_p50 / _max: "
                        "the spread)")
    p.add_argument("--attention", default="auto", choices=("auto", "torch", "flashinfer", "triton"),
                   help="attention backend (gpu_worker/omnivoice/attention.py; auto: the worker's default)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="replay the bucketed forward from CUDA graphs (flashinfer or triton attention)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense matrix rate for the floor")
    p.add_argument("--kernels", action="store_true",
                   help="profile one more run per batch: kernel time per step and the costliest kernels (CUDA)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    import torch

    from chorus.omnivoice.knobs import FRAME_RATE, UnmaskKnobs
    from chorus.omnivoice.prompt import plan_pieces
    from chorus.omnivoice.tokenizer import load_omnivoice_tokenizer
    from gpu_worker.omnivoice.engine import CanvasEngine
    from gpu_worker.omnivoice.loader import build_omnivoice

    model = build_omnivoice(preset=args.preset, load_format="dummy", dtype=args.dtype, device=args.device)
    cfg = model.cfg
    piece = plan_pieces(load_omnivoice_tokenizer(None), args.text, language="en")[0]
    knobs = UnmaskKnobs(num_step=args.num_step, guidance_scale=args.guidance_scale)
    prefix, target = len(piece.text_ids), args.frames or piece.target_frames
    batches = [int(b) for b in args.batches.split(",")]
    engine = CanvasEngine(model, max_batch=max(batches), max_packed_rows=max(batches) * (prefix + 2 * target),
                          attention=args.attention, cuda_graphs=args.cuda_graphs)
    warm_s = engine.warm_up()
    sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else (lambda: None)

    host: list[float] = []

    def run(batch: int) -> float:
        return step_ms(engine, piece.text_ids, target, knobs, batch, sync, host)

    rows = []
    for batch in batches:
        run(batch)  # warm-up
        host.clear()
        runs = sorted(run(batch) for _ in range(args.repeats))
        ms = runs[0]  # the best run: the step's cost without the host's interruptions
        flops = batch * step_flops(cfg, prefix, target, args.guidance_scale != 0)
        floor_ms = flops / (args.peak_tflops * 1e12) * 1000
        audio_s = batch * target / FRAME_RATE
        rows.append({"batch": batch, "step_ms": round(ms, 3), "floor_ms": round(floor_ms, 3),
                     "x_floor": round(ms / floor_ms, 2), "audio_s_per_s": round(audio_s / (ms * args.num_step / 1000), 1),
                     "canvas_ms": round(ms * args.num_step, 1),
                     # the spread over the runs: how far interruptions (host, clocks) move a canvas
                     "canvas_ms_p50": round(runs[len(runs) // 2] * args.num_step, 1),
                     "canvas_ms_max": round(runs[-1] * args.num_step, 1),
                     "host_launch_ms": round(sorted(host)[len(host) // 2], 3)})
        if args.kernels:
            rows[-1].update(kernel_report(lambda: run(batch), args.num_step))
        print(rows[-1], flush=True)
    write_json(args.out, {"bench": "omnivoice_step", "device": device_name(args.device), "preset": args.preset,
                          "dtype": str(next(model.parameters()).dtype), "num_step": args.num_step,
                          "guidance_scale": args.guidance_scale, "prefix_rows": prefix, "target_frames": target,
                          "attention": engine.attention.name, "bucketed": engine.bucketed is not None,
                          "cuda_graphs": engine.bucketed is not None and engine.bucketed.replay,
                          "warm_up_s": round(warm_s, 1),
                          "peak_tflops": args.peak_tflops, "git": git_revision(), "results": rows})


if __name__ == "__main__":
    main()
