"""The whole scheduler process on the CPU: the real scheduler service (public gRPC server,
prompt building, radix cache, scheduling, ZeroMQ to the worker, audio relay over gRPC to the
vocoder) between an instant worker and an instant vocoder, driven by `chorus bench` clients.
Reports the scheduler process's CPU per frame at each concurrency.

Why: at c256 on the two-GPU H200 machine the scheduler process spent ~120 us of CPU per frame
(benchmarks/README.md, "What limits c256"), 2.5x its loop (scheduler_bench.py) plus its relay
(relay_bench.py) measured apart. This bench reproduces the whole process without a GPU, so the
cost can be found and cut here. The instant services are benchmark fixtures (a real worker or
codec would hide the scheduler's own cost).

    python benchmarks/scheduler_process_bench.py --concurrency 16,64,256 --duration 10 \\
        --out results/scheduler_process_bench_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import cpu_fixture  # benchmarks/cpu_fixture.py (this script's directory is on sys.path)
from chorus.launcher import Service, free_port, read_metrics
from gpu_worker.loader import PRESETS
from relay_bench import _serve as instant_vocoder
from scheduler_bench import _instant_worker as instant_worker


def frames_generated(metrics_port: int) -> float:
    return read_metrics(metrics_port).get("chorus_frames_generated_total", 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="16,64,256", help="closed-loop streams per level")
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds per level")
    ap.add_argument("--workload", default="W1")
    ap.add_argument("--frames", type=int, default=None,
                    help="frames per request instead of the workload's (few frames: per-request costs dominate)")
    ap.add_argument("--scheduler-arg", action="append", default=[], metavar="ARG",
                    help="extra scheduler flag (repeatable; attach with '=')")
    ap.add_argument("--out", help="JSON results path")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    worker, wport = cpu_fixture.spawn(instant_worker, 1 << 20, max(levels), PRESETS["tiny"]().to_json())
    vocoder, vport = cpu_fixture.spawn(instant_vocoder, 5, 25, False)
    metrics_port = free_port()
    sched = Service("scheduler", [sys.executable, "-m", "scheduler_svc.server", "--port", "0", "--worker",
                                  f"tcp://127.0.0.1:{wport}", "--vocoder", f"127.0.0.1:{vport}",
                                  "--metrics-port", str(metrics_port), "--max-queue", "4096",
                                  *args.scheduler_arg])
    sched.start(echo=False, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    results = []
    try:
        address = sched.wait_ready(120)
        for c in levels:
            cpu0, frames0 = sched.cpu_seconds(), frames_generated(metrics_port)
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                subprocess.run([sys.executable, "-m", "chorus.cli", "bench", "--server", address, "--workload",
                                args.workload, "--concurrency", str(c), "--duration", str(args.duration),
                                "--warmup", "2", "--no-progress", "--out", tmp.name,
                                *(["--frames", str(args.frames)] if args.frames else [])],
                               check=True, stdout=subprocess.DEVNULL)
                level = json.load(open(tmp.name))["levels"][0]
            cpu, frames = sched.cpu_seconds() - cpu0, frames_generated(metrics_port) - frames0
            r = {"concurrency": c, "frames": frames, "scheduler_cpu_s": cpu, "cpu_us_per_frame": 1e6 * cpu / frames,
                 "client_frames_per_s": level["frames_per_s"], "audio_s_per_s": level["audio_s_per_s"],
                 "ttfa_p50_ms": level["ttfa_ms"]["p50"], "queue_p50_ms": level["server_queue_ms"]["p50"]}
            results.append(r)
            print(f"c={c:4d}: scheduler {r['cpu_us_per_frame']:6.1f} us CPU per frame ({frames:.0f} frames, "
                  f"{cpu:.1f} CPU s), clients got {r['client_frames_per_s']:,.0f} frames/s, TTFA p50 "
                  f"{r['ttfa_p50_ms']:.1f} ms (queue {r['queue_p50_ms']:.1f})", flush=True)
    finally:
        sched.stop()
        worker.terminate()
        vocoder.terminate()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "scheduler_process", "cpus": os.cpu_count(), "config": vars(args),
                       "levels": results}, f, indent=2)


if __name__ == "__main__":
    main()
