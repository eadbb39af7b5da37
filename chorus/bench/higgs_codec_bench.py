"""OmniVoice's codec decode on its own: clips of random codes through HiggsCodec (the
vocoder's decode call), alone and in equal-length batches, with the decoder's Snake activations
fused (vocoder_svc/snake.py) and as torch's ops, and how far apart the two decode.

    python -m chorus.bench.higgs_codec_bench --device cuda --frames 150,212 --batches 1,4 --out codec.json

Reports per (frames, batch): milliseconds a forward, seconds of audio decoded per second, and
with --kernels the GPU kernel time of a forward and its costliest kernels.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from chorus.bench.common import device_name, write_json
from chorus.provenance import git_revision


def forward_ms(codec, clips, repeats: int, sync) -> float:
    codec._forward(clips)  # warm-up (cuDNN picks its algorithms per shape)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        codec._forward(clips)
        sync()
        best = min(best, (time.perf_counter() - t0) * 1000)
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m chorus.bench.higgs_codec_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="higgs-full", choices=("higgs-tiny", "higgs-full"), help="random-weight codec")
    p.add_argument("--device", default="cuda", help="torch device")
    p.add_argument("--frames", default="150,212", help="comma-separated clip lengths in frames (25 a second)")
    p.add_argument("--batches", default="1,4", help="comma-separated clips per forward (equal lengths)")
    p.add_argument("--repeats", type=int, default=5, help="timed forwards per point (the best is kept)")
    p.add_argument("--kernels", action="store_true", help="profile one forward per point (CUDA)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    import torch

    from vocoder_svc.higgs_codec import SAMPLE_RATE, SAMPLES_PER_FRAME, HiggsCodec

    sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else (lambda: None)
    codecs = {"fused": HiggsCodec.from_preset(args.preset, device=args.device, fused_snake=True),
              "torch": HiggsCodec.from_preset(args.preset, device=args.device, fused_snake=False)}
    swapped = sum(type(m).__name__ == "FusedSnake" for m in codecs["fused"].model.modules())
    rng = np.random.default_rng(0)
    rows = []
    for frames in (int(f) for f in args.frames.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            clips = [rng.integers(0, 1024, size=(frames, 8)) for _ in range(batch)]
            row = {"frames": frames, "batch": batch}
            waves = {}
            for name, codec in codecs.items():
                ms = forward_ms(codec, clips, args.repeats, sync)
                row[f"{name}_ms"] = round(ms, 2)
                row[f"{name}_audio_s_per_s"] = round(batch * frames * SAMPLES_PER_FRAME / SAMPLE_RATE / ms * 1000, 1)
                waves[name] = codec._forward(clips)
                if args.kernels:
                    from chorus.bench.omnivoice_step import kernel_report

                    report = kernel_report(lambda: codec._forward(clips), 1, top=12)
                    row[f"{name}_kernel_ms"] = report["kernel_ms_per_step"]
                    row[f"{name}_top_kernels_us"] = report["top_kernels_us_per_step"]
            diff = max(float(np.abs(a - b).max()) for a, b in zip(waves["fused"], waves["torch"]))
            row["fused_vs_torch_max_abs"] = diff
            row["fused_equals_torch"] = diff == 0.0
            rows.append(row)
            print({k: v for k, v in row.items() if "top_kernels" not in k}, flush=True)
    write_json(args.out, {"bench": "higgs_codec", "device": device_name(args.device), "preset": args.preset,
                          "snakes_fused": swapped, "git": git_revision(), "results": rows})


if __name__ == "__main__":
    main()
