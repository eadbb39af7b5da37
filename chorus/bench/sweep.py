"""chorus bench's sweep: each workload at each concurrency (or rate) in turn, one level at a time,
with what the client, the launched services and their counters measured over it."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from chorus.bench.load import Level, Progress, Runner
from chorus.bench.report import level_metrics, server_lines, table_header, table_row, ttfa_breakdown
from chorus.bench.server_counters import (canvas_stats, scheduler_counters, step_stats, vocoder_counters,
                                          vocoder_stats)
from chorus.bench.workloads import WORKLOADS


def _service_cpu(services: list) -> dict[str, float | None]:
    return {s.name: s.cpu_seconds() for s in services}


def measured(results: dict, workload: str, mode: str, value: float) -> bool:
    """Does results hold this level already (a resumed run skips it)?"""
    key = "concurrency" if mode == "closed" else "rate"
    return any(lv["workload"] == workload and lv["mode"] == mode and lv[key] == value for lv in results["levels"])


async def run_levels(args: argparse.Namespace, address: str, seed: int, results: dict,
                     services: list | None = None, metrics_port: int | None = None,
                     vocoder_metrics_ports: list[int] | None = None, saved=None) -> None:
    """services: the launched processes (chorus.processes.Service), whose CPU use each level records;
    metrics_port: the scheduler's Prometheus port, whose step counters each level records;
    vocoder_metrics_ports: the vocoders' ones, whose decode-step counters each level records;
    saved(): called after each level (the JSON is rewritten). Levels results holds already are
    skipped (--resume)."""
    services = services or []
    runner = Runner(args, address, seed)
    progress = Progress(not args.no_progress)
    await runner.connect()
    results["server"]["models"] = runner.models
    print(table_header(), flush=True)
    mode = "open" if args.rate else "closed"
    values = args.rate if args.rate else args.concurrency
    todo = [(w, v) for w in args.workload for v in values if not measured(results, w, mode, v)]
    for lv in results["levels"]:  # resumed
        print(table_row(lv), flush=True)
    try:
        for n, (wname, value) in enumerate(todo, 1):
            wl = WORKLOADS[wname]
            print(f"level {n}/{len(todo)}: {wname} {'c=' if mode == 'closed' else 'rate='}{value:g}, "
                  f"{args.warmup:g} s warm-up + {args.duration:g} s", file=sys.stderr, flush=True)
            level = Level(wl, mode, value, runner.now(), max(0.0, args.warmup), args.duration, args.requests)
            cpu0, wall0, server_cpu0 = time.process_time(), runner.now(), _service_cpu(services)
            steps0 = scheduler_counters(metrics_port)
            vsteps0 = vocoder_counters(vocoder_metrics_ports)
            bar = asyncio.create_task(progress.run(runner, level))
            try:
                await (runner.closed_level(level) if mode == "closed" else runner.open_level(level))
            finally:
                bar.cancel()
                try:
                    await bar
                except asyncio.CancelledError:
                    pass
            wall = runner.now() - wall0
            steps1 = scheduler_counters(metrics_port)
            if args.requests is not None:
                ends = [r["t_end_s"] for r in level.records if r["measured"]]
                window = (level.t_warm, max(ends) if ends else level.t_warm)
            else:
                window = (level.t_warm, level.t_warm + args.duration)
            idx = len(results["levels"])
            lv = {"workload": wl.name, "mode": mode,
                  "concurrency": int(value) if mode == "closed" else None,
                  "rate": value if mode == "open" else None,
                  "frames_per_request": args.frames or wl.frames,
                  **level_metrics(level.records, window),
                  # the measured window on the wall clock, to line up samples taken outside (nvidia-smi)
                  "window_unix": [time.time() - runner.now() + t for t in window],
                  "wall_s": wall, "client_cpu": (time.process_time() - cpu0) / wall if wall > 0 else None,
                  # cores each launched service kept busy over the level (warm-up and drain included)
                  "server_cpu": {name: (t - server_cpu0[name]) / wall if t is not None and wall > 0
                                 and server_cpu0[name] is not None else None
                                 for name, t in _service_cpu(services).items()},
                  "scheduler_steps": step_stats(steps0, steps1, wall),
                  "canvas_steps": canvas_stats(steps0, steps1, wall),
                  "vocoder_steps": vocoder_stats(vsteps0, vocoder_counters(vocoder_metrics_ports), wall)}
            results["levels"].append(lv)
            for r in level.records:
                r["level"] = idx
                del r["_chunks"]
            results["records"].extend(level.records)
            print(table_row(lv), flush=True)
            if (breakdown := ttfa_breakdown(lv)) is not None:
                print("           " + breakdown, flush=True)
            for line in server_lines(lv):
                print("           " + line, flush=True)
            if saved is not None:
                saved()
    finally:
        await runner.close()
