"""OmniVoice's post-processing of one decoded clip on the CPU: the silence search
(vocoder_svc/silence.py) against pydub's, which it equals to the sample, and the whole of
`finish_piece` as a DecodeClip runs it.

    python -m chorus.bench.postprocess_bench --out benchmarks/results/postprocess_cpu.json

The clip is noise at -20 dBFS with two quiet runs (0.5 s and 0.8 s at -100 dBFS), 24 kHz; each
figure is the median of --repeats timed runs after one untimed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import numpy as np

from chorus.bench.common import device_name, write_json
from chorus.provenance import git_revision
from vocoder_svc import omnivoice_audio, silence

RATE = 24000


def clip(seconds: float, seed: int = 0) -> np.ndarray:
    x = (np.random.default_rng(seed).standard_normal(int(seconds * RATE)) * 0.1).astype(np.float32)
    x[RATE:RATE + RATE // 2] *= 1e-4
    x[3 * RATE:3 * RATE + int(0.8 * RATE)] *= 1e-4
    return x


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=6.0, help="clip length (O1 is ~6 s)")
    p.add_argument("--repeats", type=int, default=30, help="timed runs per figure")
    p.add_argument("--out", metavar="JSON", help="write the results here")
    args = p.parse_args(argv)
    with warnings.catch_warnings():  # pydub looks for ffmpeg on import and imports the deprecated audioop
        warnings.simplefilter("ignore")
        from pydub import AudioSegment
        from pydub import silence as pydub_silence

    wave = clip(args.seconds)
    samples = omnivoice_audio._to_int16(wave)
    pcm = silence.Pcm(samples, RATE)
    segment = AudioSegment(data=samples.astype("<i2").tobytes(), sample_width=2, frame_rate=RATE, channels=1)
    internal = omnivoice_audio.OUTPUT_SILENCE_MS[0]
    search = {"ours": lambda: (silence.split_on_silence(pcm, internal, -50.0, internal, 10),
                               silence.detect_leading_silence(pcm, -50.0)),
              "pydub": lambda: (pydub_silence.split_on_silence(segment, min_silence_len=internal, silence_thresh=-50.0,
                                                               keep_silence=internal, seek_step=10),
                                pydub_silence.detect_leading_silence(segment, silence_threshold=-50.0))}
    result = {"device": device_name("cpu"), "git": git_revision(), "seconds": args.seconds, "repeats": args.repeats,
              "silence_search_ms": {name: median_ms(fn, args.repeats) for name, fn in search.items()},
              "finish_piece_ms": median_ms(lambda: omnivoice_audio.finish_piece(
                  wave, postprocess=True, reference_rms=None, fade_seconds=0.1, pad_seconds=0.1), args.repeats),
              "finish_piece_no_postprocess_ms": median_ms(lambda: omnivoice_audio.finish_piece(
                  wave, postprocess=False, reference_rms=None, fade_seconds=0.1, pad_seconds=0.1), args.repeats)}
    ours, theirs = search["ours"](), search["pydub"]()
    result["equal"] = ([k.samples.tolist() for k in ours[0]] == [np.frombuffer(k.raw_data, "<i2").tolist()
                                                                  for k in theirs[0]] and ours[1] == theirs[1])
    print(f"silence search: {result['silence_search_ms']['ours']:.2f} ms (pydub "
          f"{result['silence_search_ms']['pydub']:.2f}), results equal: {result['equal']}; finish_piece "
          f"{result['finish_piece_ms']:.2f} ms ({result['finish_piece_no_postprocess_ms']:.2f} without trimming)")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
