"""--priority-first-chunks on the GPU: checks that the PCM is byte-identical with and without it, and
times a first chunk launched beside a steady step in each.

Two decoders of the same codec, one with first-chunk steps on the high-priority stream
(SlotDecoder(priority_frames=[5])), one without. In each round a steady 25-frame step of the
long-running streams is launched and, while it runs, a new stream's 5-frame first chunk (on a slot
released by the previous round's new stream, so the fresh-slot path is exercised too). Reports
whether every stream's PCM is byte-identical between the two and the first chunk's time from
launch to PCM on the host (p50, p90) in each: without priority it queues behind the steady step,
with priority it should not.

    python -m chorus.bench.vocoder_priority_check --device cuda --streams 32 --rounds 20 \\
        --out vocoder_priority_check.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from chorus.bench.common import write_json
from vocoder_svc.codec import full_v2, tiny_v2
from vocoder_svc.codec_checkpoint import build_codec
from vocoder_svc.slot_decoder import SlotDecoder


def run(codec, priority: bool, streams: int, rounds: int, dtype) -> tuple[dict[int, bytes], list[float]]:
    decoder = SlotDecoder(codec, slots=streams + 1, n_q=12, compute_dtype=dtype, graph_frames=[5, 25],
                           priority_frames=[5] if priority else [])
    decoder.capture()
    rng = np.random.default_rng(0)
    steady = [decoder.acquire() for _ in range(streams)]
    pcm: dict[int, bytes] = {s: b"" for s in steady}
    new_pcm = b""
    first = decoder.launch_pcm({s: torch.from_numpy(rng.integers(0, 1024, (12, 5))) for s in steady},
                               int16=steady).result()
    for s in steady:
        pcm[s] += first[s]
    waits = []
    for _ in range(rounds):
        chunk = {s: torch.from_numpy(rng.integers(0, 1024, (12, 25))) for s in steady}
        newcomer = decoder.acquire()
        codes = torch.from_numpy(rng.integers(0, 1024, (12, 5)))
        big = decoder.launch_pcm(chunk, int16=steady)
        t0 = time.perf_counter()
        small = decoder.launch_pcm({newcomer: codes}, int16=[newcomer])
        new_pcm += small.result()[newcomer]
        waits.append((time.perf_counter() - t0) * 1e3)
        for s, b in big.result().items():
            pcm[s] += b
        decoder.release(newcomer)
    pcm[-1] = new_pcm
    return pcm, waits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="torch device")
    ap.add_argument("--preset", default=None, help="default full on CUDA, tiny on CPU")
    ap.add_argument("--streams", type=int, default=32, help="long-running streams in each steady step")
    ap.add_argument("--rounds", type=int, default=20, help="first chunks timed, one a round")
    ap.add_argument("--out", metavar="JSON", help="write the results here")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    config = (full_v2() if (args.preset or ("full" if cuda else "tiny")) == "full" else tiny_v2())
    codec = build_codec(config, seed=0, dtype=torch.float32, device=args.device)
    dtype = torch.bfloat16 if cuda else None
    with torch.inference_mode():
        plain, plain_waits = run(codec, False, args.streams, args.rounds, dtype)
        fast, fast_waits = run(codec, True, args.streams, args.rounds, dtype)
    same = sum(plain[k] == fast[k] for k in plain)
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "streams": args.streams,
              "rounds": args.rounds, "streams_identical": same, "streams_total": len(plain),
              "first_chunk_ms_shared": {"p50": float(np.percentile(plain_waits, 50)),
                                        "p90": float(np.percentile(plain_waits, 90))},
              "first_chunk_ms_priority": {"p50": float(np.percentile(fast_waits, 50)),
                                          "p90": float(np.percentile(fast_waits, 90))}}
    print(f"bytes identical for {same}/{len(plain)} streams; first chunk beside a {args.streams}-stream steady "
          f"step: shared stream p50 {result['first_chunk_ms_shared']['p50']:.1f} ms, priority stream p50 "
          f"{result['first_chunk_ms_priority']['p50']:.1f} ms", flush=True)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
