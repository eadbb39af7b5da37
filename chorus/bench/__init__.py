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
from pathlib import Path
from typing import Any

from chorus.bench.sweep import run_levels
from chorus.launcher import free_port
from chorus.layout import add_layout_flags
from chorus.provenance import cpu_model, git_revision
from chorus.bench.report import level_metrics, percentile, plot
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


def add_launch_flags(p) -> None:
    """chorus bench --launch's cluster flags: the layout's (--config, --profile, --model, ...) plus
    --worker-arg/--vocoder-arg/--scheduler-arg, service flags set on top of the layout's configs.
    p is a parser or an argument group."""
    add_layout_flags(p, ("model", "codec", "device", "vocoder_device", "dtype", "shared_vocoder_decoder"))
    p.add_argument("--colocate-vocoder", dest="cluster.colocate_vocoder", nargs="?", choices=("auto", "on", "off"),
                   const="on", default=argparse.SUPPRESS,
                   help="run the vocoder's decoder in the worker's process (bare flag = on; default auto)")
    p.add_argument("--worker-arg", action="append", default=[], metavar="FLAG",
                   help="a gpu_worker flag on top of the layout, repeatable: --worker-arg=--kv-slots=65536")
    p.add_argument("--vocoder-arg", action="append", default=[], metavar="FLAG",
                   help="a vocoder flag on top of the layout, repeatable: --vocoder-arg=--step-frames=5")
    p.add_argument("--scheduler-arg", action="append", default=[], metavar="FLAG",
                   help="a scheduler flag on top of the layout, repeatable: --scheduler-arg=--max-queue=1024")

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
    add_launch_flags(la)
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
        asyncio.run(run_levels(args, address, seed, results, cluster.services if cluster is not None else None,
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
