"""chorus bench: a load generator that drives the public gRPC API
(chorus.v1.TextToSpeech/Synthesize).

It runs one asyncio (grpc.aio) client in one process, so hundreds of
concurrent streams cost little. Two modes:

  closed loop (default)  N streams, each sending its next request as soon as
                         the last one finishes, at each level of --concurrency.
  open loop (--rate)     requests arrive as a Poisson process at each rate
                         (req/s) in --rate, however many are already in flight.

Each level runs a --warmup (seconds, not measured), then measures for
--duration seconds, or until --requests requests have been sent. After that
no new request starts, and the ones in flight finish. A request is
"measured" if it was sent after the warm-up. Its latencies count even when it
finishes after the window. Throughput (req/s, audio-s/s, frames/s) counts
what arrived inside the window: [end of warm-up, end of --duration]. With
--requests, the window ends when the last measured request finishes.

Workloads (every request has its own sampling seed; min_frames = max_frames,
so random weights still produce exactly that many frames):
  W1  short: about 25 English words, 75 frames (6 s), no reference
  W2  clone: as W1, plus one of --voices voice references (5 s = 63 frames of
      codec codes each, made from --seed) picked at random per request, so
      radix reuse of the reference prefix shows up
  W3  long:  about 75 English words, 375 frames (30 s), no reference

Per request it measures: TTFA (send to first audio chunk), total time,
audio seconds received, RTF (total time / audio seconds), the gaps between
consecutive audio chunks, frames, and the server summary's prompt/cached rows.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as _dt
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

from chorus.bench.load import _Level, _Progress, _Runner
from chorus.launcher import add_service_flags, free_port, read_metrics
from chorus.provenance import cpu_model, git_revision
from chorus.bench.report import level_metrics, percentile, plot, table_header, table_row, ttfa_breakdown
from chorus.bench.workloads import VOICE_FRAMES, WORKLOADS, Workload, make_text

__all__ = ["SCHEMA", "WORKLOADS", "VOICE_FRAMES", "Workload", "make_text", "level_metrics", "percentile", "plot",
           "add_arguments", "add_bench_parser", "parse_args", "cmd_bench", "run_bench"]

SCHEMA = "chorus-bench/1"
DEFAULT_CONCURRENCY = (1, 4, 16, 64, 256)

EXAMPLES = """\
examples:
  # CPU smoke run: launch the tiny model locally, two levels, 4 requests each
  chorus bench --launch --workload W1 --concurrency 1,2 --frames 10 --requests 4 \\
      --out /tmp/b.json --plot /tmp/b.png

  # against a running GPU scheduler: clone workload, full sweep, 60 s per level
  chorus bench --server 10.0.0.5:50051 --workload W2 --concurrency 1,4,16,64,256 \\
      --duration 60 --warmup 10 --device-note "1x H200, bf16" --out w2.json --plot w2.png

  # open loop: Poisson arrivals at 2, 5 and 10 req/s for 30 s each
  chorus bench --server 127.0.0.1:50051 --workload W1 --rate 2,5,10 --duration 30

Flags that start with '-' must be attached with '=': --worker-arg=--kv-slots=65536
"""


# ---- argument parsing ------------------------------------------------------------------

def _int_list(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {s!r}")
    return out


def _float_list(s: str) -> list[float]:
    try:
        out = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"expected rates > 0, got {s!r}")
    return out


def _workloads(s: str) -> list[str]:
    out = [w.strip().upper() for w in s.split(",") if w.strip()]
    bad = [w for w in out if w not in WORKLOADS]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"workloads are {', '.join(WORKLOADS)}; got {s!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target (one of)")
    g = t.add_mutually_exclusive_group()
    g.add_argument("--server", metavar="HOST:PORT",
                   help="address of a running scheduler (default 127.0.0.1:50051 unless --launch)")
    g.add_argument("--launch", action="store_true",
                   help="start a local worker + vocoder + scheduler (chorus.launcher.Cluster) for the run and "
                        "stop them at the end; tiny random-weight model on the CPU unless --model/--codec/--device")

    la = p.add_argument_group("with --launch")
    add_service_flags(la)
    la.add_argument("--vocoders", type=int, default=1, metavar="N", help="vocoder replicas to start (default 1)")
    la.add_argument("--server-logs", action="store_true", help="relay the launched services' logs")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", type=_workloads, default=["W1"], metavar="W[,W...]",
                   help="W1 short, W2 clone, W3 long; a comma list runs each in turn (default W1)")
    w.add_argument("--frames", type=int, default=None, metavar="N",
                   help="frames per request (min = max), overriding the workload's 75/375; for quick smoke runs")
    w.add_argument("--voices", type=int, default=8, metavar="N", help="W2: distinct voice references (default 8)")
    w.add_argument("--voice-frames", type=int, default=VOICE_FRAMES, metavar="N",
                   help=f"W2: frames per reference (default {VOICE_FRAMES} = 5 s)")
    w.add_argument("--code-vocab", type=int, default=1024, metavar="N",
                   help="W2: reference codes are drawn from [0, N) (default 1024, the model's audio vocab)")
    w.add_argument("--seed", type=int, default=None,
                   help="base seed: request k uses sampling seed SEED+k, and texts and voices come from it "
                        "(default: random, recorded in the JSON)")
    w.add_argument("--language", default="English", metavar="NAME", help="language field of each request (default English)")
    w.add_argument("--sample-rate", type=int, default=0, metavar="HZ", help="output sample rate to ask for (0 = native)")
    w.add_argument("--first-chunk-frames", type=int, default=0, metavar="N", help="frames in the first audio chunk "
                                                                      "(0 = server default)")
    w.add_argument("--chunk-frames", type=int, default=0, metavar="N", help="frames per later audio chunk (0 = server default)")

    m = p.add_argument_group("load")
    mg = m.add_mutually_exclusive_group()
    mg.add_argument("--concurrency", type=_int_list, default=list(DEFAULT_CONCURRENCY), metavar="N[,N...]",
                    help="closed loop: concurrent streams per level (default 1,4,16,64,256)")
    mg.add_argument("--rate", type=_float_list, default=None, metavar="R[,R...]",
                    help="open loop instead: Poisson arrivals at R req/s per level")
    m.add_argument("--duration", type=float, default=5.0, metavar="S",
                   help="measured seconds per level, after the warm-up (default 5)")
    m.add_argument("--requests", type=int, default=None, metavar="N",
                   help="measure N requests per level instead of --duration seconds")
    m.add_argument("--warmup", type=float, default=1.0, metavar="S",
                   help="seconds of unmeasured load at the start of each level, also with --requests (default 1)")
    m.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per-request deadline (default 600)")
    m.add_argument("--channels", type=int, default=4, metavar="N",
                   help="gRPC channels (TCP connections) the streams are spread over (default 4)")

    o = p.add_argument_group("output")
    o.add_argument("--out", metavar="JSON", help="write config, git revision, per-level metrics and raw records")
    o.add_argument("--plot", metavar="PNG",
                   help="plot audio-s/s and TTFA p50/p99 against concurrency (or rate); needs matplotlib "
                        "(pip install -e '.[bench]')")
    o.add_argument("--device-note", metavar="TEXT", help="free text describing the server's host/device, "
                                                          "stored in the JSON and the plot title")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_bench_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="load-test a scheduler over the public gRPC API (closed/open loop sweeps)",
                       description=__doc__, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=cmd_bench)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench flags on their own (for programmatic use and tests)."""
    p = argparse.ArgumentParser(prog="chorus bench", description=__doc__, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p.parse_args(argv)


def cmd_bench(args: argparse.Namespace) -> None:
    results = run_bench(args)
    measured = sum(lv["requests"] for lv in results["levels"])
    failed = sum(lv["errors"] for lv in results["levels"])
    if measured and failed == measured:
        sys.exit(1)


def _service_cpu(services: list) -> dict[str, float | None]:
    return {s.name: s.cpu_seconds() for s in services}


_STEP_COUNTERS = {"chorus_step_seconds_count": "steps", "chorus_step_seconds_sum": "step_seconds",
                  "chorus_lookahead_steps_total": "lookahead_steps", "chorus_frames_generated_total": "frames",
                  "chorus_worker_decode_step_ms_count": "decode_steps", "chorus_worker_decode_step_ms_sum": "decode_ms",
                  "chorus_worker_prefill_step_ms_count": "prefill_steps",
                  "chorus_worker_prefill_step_ms_sum": "prefill_ms", "chorus_prefill_rows_total": "prefill_rows",
                  "chorus_scheduler_turnaround_ms_count": "turnarounds",
                  "chorus_scheduler_turnaround_ms_sum": "turnaround_ms"}


def _scheduler_counters(port: int | None) -> dict[str, float] | None:
    """The scheduler's step counters from its Prometheus endpoint (None when there is none)."""
    if port is None:
        return None
    try:
        samples = read_metrics(port, timeout=2)
    except OSError:
        return None
    return {key: samples[name] for name, key in _STEP_COUNTERS.items() if name in samples}


_VOCODER_COUNTERS = {"chorus_vocoder_decode_step_ms_count": "steps", "chorus_vocoder_decode_step_ms_sum": "step_ms",
                     "chorus_vocoder_decode_batch_streams_sum": "streams",
                     "chorus_vocoder_audio_seconds_total": "audio_s",
                     "chorus_vocoder_decode_step_frames_sum": "frames",
                     "chorus_vocoder_queue_wait_ms_sum": "queue_wait_ms",
                     "chorus_vocoder_steps_launched_ahead_total": "launched_ahead"}


def _vocoder_counters(ports: list[int] | None) -> dict[str, float] | None:
    """The vocoders' step counters, summed over the replicas (None when there are none)."""
    if not ports:
        return None
    out = dict.fromkeys(_VOCODER_COUNTERS.values(), 0.0)
    for port in ports:
        try:
            samples = read_metrics(port, timeout=2)
        except OSError:
            return None
        for name, key in _VOCODER_COUNTERS.items():
            out[key] += samples.get(name, 0.0)
    return out


def _vocoder_stats(before: dict[str, float] | None, after: dict[str, float] | None, wall: float) -> dict | None:
    """What the vocoders' decode steps did over a level, all replicas together: steps per second,
    streams per step and the mean step time from launch to PCM (a step launched while the previous
    one runs includes that wait)."""
    if not before or not after or wall <= 0:
        return None
    d = {k: after[k] - before[k] for k in _VOCODER_COUNTERS.values()}
    steps = d["steps"]
    return {"steps_per_s": steps / wall, "streams_per_step": d["streams"] / steps if steps else None,
            "step_ms": d["step_ms"] / steps if steps else None, "audio_s_per_s": d["audio_s"] / wall,
            # frames per stream in a step, and how long a step's oldest chunk waited for it (0 from
            # vocoders that predate these metrics)
            "frames_per_step": d["frames"] / steps if steps else None,
            "queue_wait_ms": d["queue_wait_ms"] / steps if steps else None,
            # the share of steps launched while the one before still ran (0 before this metric existed)
            "launched_ahead_share": d["launched_ahead"] / steps if steps else None}


def _step_stats(before: dict[str, float] | None, after: dict[str, float] | None, wall: float) -> dict | None:
    """What the scheduler's steps did over a level: how many per second, the mean time the core
    waited for the oldest journal in flight ("round trip"; with lookahead less than a plan's whole
    round trip), the core's mean turnaround (a journal in to the next plan out), frames per step
    and the share sent by lookahead."""
    if not before or not after or wall <= 0:
        return None
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _STEP_COUNTERS.values()}
    steps = d["steps"]
    per = lambda a, b: d[a] / d[b] if d[b] else None  # noqa: E731
    return {"steps_per_s": steps / wall, "round_trip_ms": 1e3 * d["step_seconds"] / steps if steps else None,
            "frames_per_step": d["frames"] / steps if steps else None,
            "lookahead_share": d["lookahead_steps"] / steps if steps else None,
            "core_turnaround_ms": per("turnaround_ms", "turnarounds"),
            # the worker's own time per step (launch to journal), decode-only steps and steps with prefill
            "worker_decode_step_ms": per("decode_ms", "decode_steps"),
            "worker_prefill_step_ms": per("prefill_ms", "prefill_steps"),
            "prefill_step_share": d["prefill_steps"] / steps if steps else None,
            "prefill_rows_per_prefill_step": per("prefill_rows", "prefill_steps")}


async def _run_levels(args: argparse.Namespace, address: str, seed: int, results: dict,
                      services: list | None = None, metrics_port: int | None = None,
                      vocoder_metrics_ports: list[int] | None = None) -> None:
    """services: the launched processes (chorus.launcher.Service), whose CPU use each level records;
    metrics_port: the scheduler's Prometheus port, whose step counters each level records;
    vocoder_metrics_ports: the vocoders' ones, whose decode-step counters each level records."""
    services = services or []
    runner = _Runner(args, address, seed)
    progress = _Progress(not args.no_progress)
    await runner.connect()
    results["server"]["models"] = runner.models
    print(table_header(), flush=True)
    mode = "open" if args.rate else "closed"
    values = args.rate if args.rate else args.concurrency
    try:
        for wname in args.workload:
            wl = WORKLOADS[wname]
            for value in values:
                level = _Level(wl, mode, value, runner.now(), max(0.0, args.warmup), args.duration, args.requests)
                cpu0, wall0, server_cpu0 = time.process_time(), runner.now(), _service_cpu(services)
                steps0 = _scheduler_counters(metrics_port)
                vsteps0 = _vocoder_counters(vocoder_metrics_ports)
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
                      "scheduler_steps": _step_stats(steps0, _scheduler_counters(metrics_port), wall),
                      "vocoder_steps": _vocoder_stats(vsteps0, _vocoder_counters(vocoder_metrics_ports), wall)}
                results["levels"].append(lv)
                for r in level.records:
                    r["level"] = idx
                    del r["_chunks"]
                results["records"].extend(level.records)
                print(table_row(lv), flush=True)
                if (breakdown := ttfa_breakdown(lv)) is not None:
                    print("           " + breakdown, flush=True)
                if any(v is not None for v in lv["server_cpu"].values()):
                    print("           server CPU (cores busy): " + ", ".join(
                        f"{name} {v:.2f}" for name, v in lv["server_cpu"].items() if v is not None), flush=True)
                st = lv["scheduler_steps"]
                if st and st["round_trip_ms"] is not None:
                    turnaround = st.get("core_turnaround_ms")
                    print(f"           scheduler steps: {st['steps_per_s']:.0f}/s, round trip {st['round_trip_ms']:.1f} ms, "
                          f"{st['frames_per_step']:.1f} frames/step, lookahead {100 * st['lookahead_share']:.0f}%"
                          + (f", core turnaround {turnaround:.1f} ms" if turnaround is not None else ""), flush=True)
                    if st.get("worker_prefill_step_ms") is not None and st.get("worker_decode_step_ms") is not None:
                        print(f"           worker: decode steps {st['worker_decode_step_ms']:.1f} ms, steps with prefill "
                              f"{st['worker_prefill_step_ms']:.1f} ms ({100 * st['prefill_step_share']:.0f}% of steps, "
                              f"{st['prefill_rows_per_prefill_step']:.0f} rows each)", flush=True)
                vs = lv["vocoder_steps"]
                if vs and vs["step_ms"] is not None:
                    print(f"           vocoder steps: {vs['steps_per_s']:.0f}/s, {vs['streams_per_step']:.1f} streams/step, "
                          f"{vs['step_ms']:.1f} ms launch to PCM, {vs['audio_s_per_s']:.0f} s of audio per s"
                          + (f"; {vs['frames_per_step']:.1f} frames a stream, oldest chunk waited "
                             f"{vs['queue_wait_ms']:.1f} ms" if vs.get("frames_per_step") else "")
                          + (f", {100 * vs['launched_ahead_share']:.0f}% launched ahead"
                             if vs.get("launched_ahead_share") is not None else ""),
                          flush=True)
    finally:
        await runner.close()


# ---- run, JSON, plot --------------------------------------------------------------------

def _host() -> dict[str, Any]:
    import grpc
    return {"hostname": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "grpc": grpc.__version__}


def _launch_cluster(args: argparse.Namespace):
    """The cluster to start, and the scheduler's metrics port (a free one unless the layout gives one)."""
    from chorus.layout import load
    if hasattr(args, "vocoders"):
        setattr(args, "cluster.vocoders", args.vocoders)
    layout = load(args)
    metrics_port = layout.scheduler.metrics_port or None
    if metrics_port is None:
        metrics_port = layout.scheduler.metrics_port = free_port()
    layout.scheduler.port = 0
    cluster = layout.cluster_launcher(vocoder_metrics_ports=[free_port() for _ in range(layout.cluster.vocoders)])
    cluster.echo = args.server_logs
    return cluster, metrics_port


def _config(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    cfg = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    cfg["seed"] = seed
    cfg["mode"] = "open" if args.rate else "closed"
    cfg["workloads"] = {w: {"frames": args.frames or WORKLOADS[w].frames, "words": WORKLOADS[w].words,
                            "clone": WORKLOADS[w].clone, "description": WORKLOADS[w].description}
                        for w in args.workload}
    return cfg


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole benchmark described by `args` (see parse_args); print the
    table, write --out/--plot, and return the results dict (the JSON)."""
    if args.requests is not None and args.requests < 1:
        raise SystemExit("--requests must be >= 1")
    if args.frames is not None and args.frames < 1:
        raise SystemExit("--frames must be >= 1")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "started_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "finished_at": None,
        "git": git_revision(),  # CHORUS_GIT_REV wins: see chorus/provenance.py
        "device_note": args.device_note,
        "host": _host(),
        "server": {"address": args.server or ("launched" if args.launch else "127.0.0.1:50051"),
                   "launched": bool(args.launch), "models": []},
        "config": _config(args, seed),
        "complete": False,
        "levels": [],
        "records": [],
    }
    cluster = metrics_port = None
    try:
        if args.launch:
            print("starting worker, vocoder and scheduler ...", file=sys.stderr, flush=True)
            cluster, metrics_port = _launch_cluster(args)
            cluster.start()
            address = cluster.address
            worker, vocoder, scheduler = cluster.configs()
            results["server"]["launch_configs"] = {"worker": dataclasses.asdict(worker),
                                                   "vocoder": dataclasses.asdict(vocoder),
                                                   "scheduler": dataclasses.asdict(scheduler),
                                                   "colocated_vocoder": cluster.colocate_vocoder}
        else:
            address = args.server or "127.0.0.1:50051"
        results["server"]["address"] = address
        asyncio.run(_run_levels(args, address, seed, results, cluster.services if cluster is not None else None,
                                metrics_port, cluster.vocoder_metrics_ports if cluster is not None else None))
        results["complete"] = True
    except KeyboardInterrupt:
        print("\ninterrupted; writing what was measured", file=sys.stderr)
    finally:
        if cluster is not None:
            cluster.stop()
        results["finished_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
            print(f"wrote {args.out}", file=sys.stderr)
        if args.plot and results["levels"]:
            plot(results, args.plot)
    return results
