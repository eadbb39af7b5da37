"""Where a streaming vocoder step's GPU time goes: one eager SlotDecoder step under the torch
profiler, kernels grouped by name and sorted by total time.

    python -m chorus.bench.vocoder_profile --streams 64 --frames 25 --out vocoder_profile.json
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from chorus.bench.common import cuda_kernels, write_json
from vocoder_svc.codec import PRESETS
from vocoder_svc.codec_checkpoint import build_codec
from vocoder_svc.slot_decoder import SlotDecoder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="full", choices=sorted(PRESETS), help="codec shapes")
    ap.add_argument("--device", default="cuda", help="torch device")
    ap.add_argument("--streams", type=int, default=64, help="streams in the step")
    ap.add_argument("--frames", type=int, default=25, help="frames of each stream in the step")
    ap.add_argument("--n-q", type=int, default=12, help="codebooks decoded")
    ap.add_argument("--out", metavar="JSON", help="write the results here")
    args = ap.parse_args()
    if torch.device(args.device).index is not None:
        torch.cuda.set_device(torch.device(args.device))  # Triton launches on the current device
    codec = build_codec(PRESETS[args.preset](), seed=0, dtype=torch.bfloat16, device=args.device)
    decoder = SlotDecoder(codec, slots=args.streams, n_q=args.n_q, compute_dtype=torch.bfloat16, graphs=False)
    slots = [decoder.acquire() for _ in range(args.streams)]
    gen = torch.Generator().manual_seed(1)

    def step() -> None:
        codes = torch.randint(0, codec.codebook_size, (args.n_q, args.streams, args.frames), generator=gen)
        decoder.step({s: codes[:, i] for i, s in enumerate(slots)}, eager=True)

    for _ in range(3):  # compile kernels and fill the windows past W at the slow stages
        step()
    torch.cuda.synchronize()
    kernels = cuda_kernels(step)
    busy: Counter = Counter()
    count: Counter = Counter()
    for name, us in kernels:
        busy[name[:90]] += us
        count[name[:90]] += 1
    total = sum(busy.values())
    report = {"streams": args.streams, "frames": args.frames, "kernels": len(kernels), "busy_ms": total / 1e3,
              "top": [(n, round(t, 1), count[n]) for n, t in busy.most_common(30)]}
    print(f"{args.streams} streams x {args.frames} frames: {len(kernels)} kernels, {total / 1e3:.2f} ms busy")
    for n, t, c in report["top"][:20]:
        print(f"{t:10.1f} us {100 * t / total:5.1f}% {c:5d}x {n}")
    write_json(args.out, report)


if __name__ == "__main__":
    main()
