"""How busy each GPU was in each measured level of a `chorus bench` run.

    nvidia-smi --query-gpu=timestamp,index,utilization.gpu --format=csv,noheader,nounits -lms 200 > gpu.csv &
    chorus bench --launch ... --out bench.json; kill %1
    python -m chorus.bench.gpu_busy gpu.csv bench.json

nvidia-smi's utilization is the share of time any kernel ran, so a GPU at 100% may still have idle
SMs, but one well under 100% is waiting for its host or for work. The bench JSON's `window_unix`
(each level's measured window on the wall clock) picks the samples that belong to a level.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gzip
import json


def read_samples(path: str) -> list[tuple[float, str, float]]:
    """(unix time, GPU index, utilization %) from nvidia-smi's csv (local-time timestamps)."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                t, i, u = (x.strip() for x in line.split(","))
                rows.append((datetime.datetime.strptime(t, "%Y/%m/%d %H:%M:%S.%f").timestamp(), i, float(u)))
            except ValueError:
                continue  # a header, or a line cut off when the sampler was stopped
    return rows


def busy_by_level(samples: list[tuple[float, str, float]], levels: list[dict]) -> list[dict[str, float]]:
    """Per level: GPU index -> mean utilization % over the level's measured window."""
    out = []
    for lv in levels:
        t0, t1 = lv["window_unix"]
        per_gpu = collections.defaultdict(list)
        for t, i, u in samples:
            if t0 <= t <= t1:
                per_gpu[i].append(u)
        out.append({i: sum(v) / len(v) for i, v in sorted(per_gpu.items())})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gpu_csv", help="nvidia-smi samples: timestamp, index, utilization.gpu (csv, no header)")
    ap.add_argument("bench_json", help="the chorus bench --out file (.gz read too)")
    args = ap.parse_args(argv)
    opener = gzip.open if args.bench_json.endswith(".gz") else open
    with opener(args.bench_json, "rt") as f:
        levels = json.load(f)["levels"]
    for lv, busy in zip(levels, busy_by_level(read_samples(args.gpu_csv), levels)):
        print(f"  c={lv['concurrency']} GPU busy: " + ", ".join(f"cuda:{i} {u:.0f}%" for i, u in busy.items()))


if __name__ == "__main__":
    main()
