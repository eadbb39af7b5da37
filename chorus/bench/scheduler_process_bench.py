"""The whole scheduler process on the CPU: the real scheduler service between an instant worker and
an instant vocoder, driven by `chorus bench` clients; its CPU per frame at each concurrency.

The scheduler service here is all of it: public gRPC server, prompt building, radix cache,
scheduling, ZeroMQ to the worker, audio relay over gRPC to the vocoder. CPU per frame is reported
for core and frontend processes together, and for the core alone (the one process that cannot be
multiplied; --scheduler-arg=--frontends=N). Without a GPU the scheduler's own cost can be found and
cut here; the instant services are benchmark fixtures (a real worker or codec would hide it).

    python -m chorus.bench.scheduler_process_bench --concurrency 16,64,256 --duration 10 \\
        --out scheduler_process_bench_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from chorus.bench import cpu_fixture
from chorus.bench.common import write_json
from chorus.processes import Service, free_port, read_metrics
from gpu_worker.loader import PRESETS
from chorus.bench.relay_bench import _serve as instant_vocoder
from chorus.bench.scheduler_bench import _instant_worker as instant_worker


def counters(metrics_port: int) -> tuple[float, float]:
    """(frames generated, worker steps) so far."""
    m = read_metrics(metrics_port)
    return m.get("chorus_frames_generated_total", 0.0), m.get("chorus_step_seconds_count", 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="16,64,256", help="closed-loop streams per level")
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds per level")
    ap.add_argument("--workload", default="W1", help="chorus bench workload (W1, W2, W3)")
    ap.add_argument("--frames", type=int, default=None,
                    help="frames per request instead of the workload's (few frames: per-request costs dominate)")
    ap.add_argument("--step-ms", type=float, default=10.0,
                    help="the stand-in worker's time per step, ms (0 = instant, which makes steps tiny and "
                         "overstates the per-frame cost)")
    ap.add_argument("--scheduler-arg", action="append", default=[], metavar="ARG",
                    help="extra scheduler flag (repeatable; attach with '=')")
    ap.add_argument("--out", metavar="JSON", help="write the results here")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    worker, wport = cpu_fixture.spawn(instant_worker, 1 << 20, max(levels), PRESETS["tiny"]().to_json(),
                                        args.step_ms)
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
            cpu0, core0, (frames0, steps0) = sched.cpu_seconds(), sched.cpu_seconds(children=False), \
                counters(metrics_port)
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                subprocess.run([sys.executable, "-m", "chorus.cli", "bench", "--server", address, "--workload",
                                args.workload, "--concurrency", str(c), "--duration", str(args.duration),
                                "--warmup", "2", "--no-progress", "--out", tmp.name,
                                *(["--frames", str(args.frames)] if args.frames else [])],
                               check=True, stdout=subprocess.DEVNULL)
                level = json.load(open(tmp.name))["levels"][0]
            frames, steps = (a - b for a, b in zip(counters(metrics_port), (frames0, steps0)))
            cpu = sched.cpu_seconds() - cpu0
            core = sched.cpu_seconds(children=False) - core0
            r = {"concurrency": c, "frames": frames, "scheduler_cpu_s": cpu, "cpu_us_per_frame": 1e6 * cpu / frames,
                 "core_cpu_us_per_frame": 1e6 * core / frames, "frames_per_step": frames / steps,
                 "client_frames_per_s": level["frames_per_s"], "audio_s_per_s": level["audio_s_per_s"],
                 "ttfa_p50_ms": level["ttfa_ms"]["p50"], "queue_p50_ms": level["server_queue_ms"]["p50"]}
            results.append(r)
            print(f"c={c:4d}: scheduler {r['cpu_us_per_frame']:6.1f} us CPU per frame (core "
                  f"{r['core_cpu_us_per_frame']:.1f}; {frames:.0f} frames, {r['frames_per_step']:.1f} per step, "
                  f"{cpu:.1f} CPU s), clients got {r['client_frames_per_s']:,.0f} frames/s, TTFA p50 "
                  f"{r['ttfa_p50_ms']:.1f} ms (queue {r['queue_p50_ms']:.1f})", flush=True)
    finally:
        sched.stop()
        worker.terminate()
        vocoder.terminate()
    write_json(args.out, {"benchmark": "scheduler_process", "cpus": os.cpu_count(), "config": vars(args),
                          "levels": results})


if __name__ == "__main__":
    main()
