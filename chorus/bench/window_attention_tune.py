"""Pick the vocoder's windowed-attention kernel config on the GPU: time every (BLOCK_M, BLOCK_N,
num_warps, num_stages) candidate on the attention shapes of one steady streaming step, and check
each against the default.

The shapes are those of the full v2 codec (every Transformer stage, weighted by its layer count;
kernel time inside a CUDA graph).

    python -m chorus.bench.window_attention_tune --streams 64 --frames 25 --out tune.json

The winner goes into vocoder_svc/window_attention.py's KERNEL_CONFIG by hand (one config for all
shapes keeps CUDA-graph capture and the bitwise graph == eager property simple).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools

import torch

from chorus.bench.common import kernel_ms, write_json
from vocoder_svc import window_attention as wa
from vocoder_svc.codec_config import PRESETS


def stage_shapes(preset: str, frames: int) -> list[dict]:
    """(heads, head_dim, Tk, W, layers) of every Transformer stage of the decoder, in order."""
    cfg = PRESETS[preset]()
    frame_rate = cfg.sampling_rate / cfg.downsample_rate
    shapes, tokens_per_frame = [], 1  # each patch stage multiplies the tokens per frame on the way up
    for st in cfg.decoder:
        if st.module_type == "Transformer":
            w = int(round(st.context_duration * frame_rate * tokens_per_frame))
            shapes.append({"heads": st.num_heads, "head_dim": st.d_model // st.num_heads,
                           "tk": frames * tokens_per_frame, "window": w, "layers": st.num_layers})
        else:
            tokens_per_frame *= st.patch_size
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="full_v2", help="codec shapes")
    ap.add_argument("--streams", type=int, default=64, help="streams in the step")
    ap.add_argument("--frames", type=int, default=25, help="frames of each stream in the step")
    ap.add_argument("--iters", type=int, default=20, help="calls captured in each timed graph")
    ap.add_argument("--baseline", metavar="FILE",
                    help="a window_attention.py of another tree (git show REV:vocoder_svc/window_attention.py > "
                         "FILE): its kernel at its own default config is timed first, as 'baseline'")
    ap.add_argument("--out", metavar="JSON", help="write the results here")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    cases = []
    for sh in stage_shapes(args.preset, args.frames):
        b, h, d, tk, w = args.streams, sh["heads"], sh["head_dim"], sh["tk"], sh["window"]
        q, k, v = (torch.randn(b, h, tk, d, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(3))
        kc, vc = (torch.randn(b, h, w, d, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(2))
        rows = torch.arange(b, device=dev)
        offset = torch.full((b,), 1000 * (tk // args.frames), device=dev)  # steady state, ring full
        cases.append((sh, (q, k, v, kc, vc, rows, offset, w)))
    ref = [wa.window_attention(*a, impl="triton").float() for _, a in cases]

    def time_config(config, module=wa) -> tuple[float, float, list[float]]:
        per_stage, worst = [], 0.0
        for (sh, a), r in zip(cases, ref):
            kw = {} if config is None else {"config": config}
            out = module.window_attention(*a, impl="triton", **kw)
            worst = max(worst, (out.float() - r).abs().max().item())
            per_stage.append(kernel_ms(lambda: module.window_attention(*a, impl="triton", **kw), args.iters))
        total = sum(ms * sh["layers"] for (sh, _), ms in zip(cases, per_stage))
        return total, worst, per_stage

    results, baseline = [], None
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_window_attention", args.baseline)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        total, worst, per_stage = time_config(None, module)
        baseline = {"file": args.baseline, "config": module.KERNEL_CONFIG, "step_ms": total,
                    "max_abs_diff_vs_default": worst, "per_stage_ms": per_stage}
        print(f"baseline {module.KERNEL_CONFIG}: {total:7.2f} ms per step (all layers), max |diff| vs default "
              f"{worst:.3e}, per stage {[round(x, 3) for x in per_stage]}", flush=True)
    for config in itertools.product((64, 128), (32, 64), (4, 8), (2, 3)):
        try:
            total, worst, per_stage = time_config(config)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: not a candidate
            print(f"{config}: failed ({type(e).__name__})", flush=True)
            continue
        results.append({"config": config, "step_ms": total, "max_abs_diff_vs_default": worst,
                        "per_stage_ms": per_stage})
        print(f"{config}: {total:7.2f} ms per step (all layers), max |diff| vs default {worst:.3e}, "
              f"per stage {[round(x, 3) for x in per_stage]}", flush=True)
    results.sort(key=lambda r: r["step_ms"])
    print(f"default {wa.KERNEL_CONFIG}; best {results[0]['config']} at {results[0]['step_ms']:.2f} ms", flush=True)
    write_json(args.out, {"shapes": [sh for sh, _ in cases], "streams": args.streams, "frames": args.frames,
                          "default": wa.KERNEL_CONFIG, "baseline": baseline, "results": results,
                          "device": torch.cuda.get_device_name()})


if __name__ == "__main__":
    main()
