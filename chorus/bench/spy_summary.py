"""Summarise an e2e_profile.sh archive: per process, the busy threads (CPU from /proc over the
sampling window) and the lines where py-spy found each thread most often (raw stacks, leaf frame).

    python -m chorus.bench.spy_summary DIR [--top 12] [--window-s 10] > summary.txt
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def thread_cpu(d: Path, pid: str, window_s: float) -> list[tuple[str, str, float]]:
    """(tid, name, cores) of each thread busy over the window, busiest first."""
    def read(i: int) -> dict[str, tuple[str, int]]:
        path = d / f"threads_{pid}_{i}.txt"
        out = {}
        for line in path.read_text().splitlines() if path.exists() else []:
            tid, name, ticks = line.split()
            out[tid] = (name, int(ticks))
        return out
    before, after = read(0), read(1)
    rows = [(tid, name, (ticks - before[tid][1]) / 100 / window_s)
            for tid, (name, ticks) in after.items() if tid in before]
    return sorted((r for r in rows if r[2] >= 0.02), key=lambda r: -r[2])


def leaves(path: Path, top: int) -> tuple[int, list[tuple[int, str]]]:
    """Samples in all, and the `top` most frequent leaf frames with their counts."""
    count: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines() if path.exists() else []:
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        total += int(n)
        count[stack.split(";")[-1]] += int(n)
    return total, [(n, f) for f, n in count.most_common(top)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, help="an extracted e2e_profile.tgz")
    p.add_argument("--top", type=int, default=12, help="lines shown per thread")
    p.add_argument("--window-s", type=float, default=10.0, help="seconds between the two /proc reads")
    args = p.parse_args()
    names = (args.dir / "pids.txt").read_text().split()
    role, roles = None, {}
    for word in names:  # "worker 1015 core 1737 frontend 1774 vocoders 1017 1019 decoders 1121 1163"
        if word.isdigit():
            roles[word] = role
        else:
            role = word
    for pid, role in roles.items():
        total, top = leaves(args.dir / f"spy_{pid}.txt", args.top)
        print(f"== {role} (pid {pid}): {total} py-spy samples (active threads only)")
        for tid, name, cores in thread_cpu(args.dir, pid, args.window_s):
            print(f"   thread {tid} {name}: {cores:.2f} cores")
        for n, frame in top:
            print(f"   {n:6d}  {frame}")
        print()


if __name__ == "__main__":
    main()
