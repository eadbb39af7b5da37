"""chorus bench: a load generator that drives the public gRPC API
(chorus.v1.TextToSpeech/Synthesize).

It runs one asyncio (grpc.aio) client in one process, so hundreds of
concurrent streams cost little. Two modes:

  closed loop (default)  N streams, each sending its next request as soon as
                         the last one finishes, at each level of --concurrency.
  open loop (--rate)     requests arrive as a Poisson process at each rate
                         (req/s) in --rate, however many are already in flight.

`--layout NAME` launches a named layout of benchmarks/layouts.toml (the services' configs and
this run's settings) and runs it; flags given on the command line win over the layout's.

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

from chorus.bench.flags import EXAMPLES, add_arguments, add_launch_flags, settle
from chorus.bench.layouts import BenchLayout, listing, resolve
from chorus.bench.report import level_metrics, percentile, plot, readme_rows
from chorus.bench.sweep import run_levels
from chorus.bench.workloads import VOICE_FRAMES, WORKLOADS, Workload, make_text
from chorus.config import ConfigError, given_fields
from chorus.processes import free_ports
from chorus.layout import SERVICES, given, load
from chorus.provenance import cpu_model, git_revision

__all__ = ["SCHEMA", "WORKLOADS", "VOICE_FRAMES", "Workload", "make_text", "level_metrics", "percentile", "plot",
           "add_arguments", "add_launch_flags", "add_bench_parser", "parse_args", "cmd_bench", "run_bench"]

SCHEMA = "chorus-bench/1"


def add_bench_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="load-test a scheduler over the public gRPC API (closed/open loop sweeps)",
                       description=__doc__, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=cmd_bench)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench flags on their own (for programmatic use and tests); run_bench settles the
    settings not given (flags.settle)."""
    p = argparse.ArgumentParser(prog="chorus bench", description=__doc__, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p.parse_args(argv)


def cmd_bench(args: argparse.Namespace) -> None:
    try:
        if args.list_layouts:
            print(listing(args.layouts))
            return
        results = run_bench(args)
    except ConfigError as e:
        raise SystemExit(f"chorus bench: {e}") from None
    measured = sum(lv["requests"] for lv in results["levels"])
    failed = sum(lv["errors"] for lv in results["levels"])
    if measured and failed == measured:
        sys.exit(1)


def prepare(args: argparse.Namespace) -> BenchLayout | None:
    """The named layout args ask for (None without --layout), and args with every setting: the
    flags given, over the layout's, over the defaults."""
    layout = None
    if args.layout:
        if args.server:
            raise ConfigError("--layout launches its own services; --server names running ones: give one")
        if args.config or args.profile:
            raise ConfigError("--layout names its profile: change its keys with --worker-arg/--vocoder-arg/"
                              "--scheduler-arg, or give --launch --config FILE instead")
        layout = resolve(args.layout, args.layouts)
        args.launch = True
    settle(args, layout.settings if layout else None)
    return layout


# ---- run, JSON, plot --------------------------------------------------------------------

def _host() -> dict[str, Any]:
    import grpc
    return {"hostname": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "grpc": grpc.__version__}


def _launch_cluster(args: argparse.Namespace, named: BenchLayout | None):
    """The services' layout (the named one, or the --config/--profile one, with the flags given
    on top), the cluster to start, and the scheduler's metrics port (a free one unless set)."""
    if named is None:
        layout = load(args)
    else:
        flags = {name: given_fields(cls, list(getattr(args, f"{name}_arg", None) or []))
                 for name, cls in SERVICES.items()}
        layout = named.services(given(args), flags)
    omnivoice_vocoders = layout.cluster.omnivoice_vocoders if layout.omnivoice_worker is not None else 0
    vocoders = layout.cluster.vocoders
    ports = free_ports(1 + vocoders + omnivoice_vocoders)  # distinct: one each for the scheduler and every replica
    metrics_port = layout.scheduler.metrics_port = layout.scheduler.metrics_port or ports[0]
    layout.scheduler.port = 0
    cluster = layout.cluster_launcher(vocoder_metrics_ports=ports[1:1 + vocoders],
                                      omnivoice_vocoder_metrics_ports=ports[1 + vocoders:] or None)
    cluster.echo = args.server_logs
    return layout, cluster, metrics_port


def vocoder_ports(cluster) -> list[int] | None:
    """Every launched vocoder replica's Prometheus port, MOSS's and OmniVoice's codec's (None: none)."""
    if cluster is None:
        return None
    return [*(cluster.vocoder_metrics_ports or []), *(cluster.omnivoice_vocoder_metrics_ports or [])] or None


def _config(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    cfg = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    cfg["seed"] = seed
    cfg["mode"] = "open" if args.rate else "closed"
    cfg["workloads"] = {w: {"frames": args.frames or WORKLOADS[w].frames, "words": WORKLOADS[w].words,
                            "clone": WORKLOADS[w].clone, "description": WORKLOADS[w].description}
                        for w in args.workload}
    return cfg


# The settings a resumed run must share with the run it resumes.
_RESUME_KEYS = ("layout", "workload", "frames", "duration", "warmup", "requests", "channels", "rate", "device",
                "worker_arg", "vocoder_arg", "scheduler_arg")


def _previous_run(args: argparse.Namespace) -> dict[str, Any] | None:
    """--resume: the run in --out to go on from (None: no file yet); ConfigError when it ran other settings."""
    if not getattr(args, "resume", False):
        return None
    if not args.out:
        raise ConfigError("--resume goes on from the run in --out: give --out FILE")
    path = Path(args.out)
    if not path.exists():
        return None
    previous = json.loads(path.read_text())
    for key in _RESUME_KEYS:
        was, now = previous.get("config", {}).get(key), getattr(args, key, None)
        if was != now:
            raise ConfigError(f"--resume: {args.out} ran {key} = {was!r}, this run {now!r}; give the same "
                              f"settings or another --out")
    print(f"resuming {args.out}: {len(previous['levels'])} levels measured", file=sys.stderr, flush=True)
    return previous


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole benchmark described by `args` (see parse_args); print the
    table, write --out/--plot, and return the results dict (the JSON)."""
    named = prepare(args)
    if args.requests is not None and args.requests < 1:
        raise SystemExit("--requests must be >= 1")
    if args.frames is not None and args.frames < 1:
        raise SystemExit("--frames must be >= 1")
    previous = _previous_run(args)
    seed = previous["config"]["seed"] if previous else (
        args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31))
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "started_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "finished_at": None,
        "git": git_revision(),  # CHORUS_GIT_REV wins: see chorus/provenance.py
        "device_note": args.device_note,
        "layout": None if named is None else {"name": named.name, "about": named.about, "file": named.file,
                                              "profile": named.profile, "tables": named.tables},
        "host": _host(),
        "server": {"address": args.server or ("launched" if args.launch else "127.0.0.1:50051"),
                   "launched": bool(args.launch), "models": []},
        "config": _config(args, seed),
        "complete": False,
        "levels": previous["levels"] if previous else [],
        "records": previous["records"] if previous else [],
    }
    cluster = metrics_port = None

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1) + "\n")

    try:
        if args.launch:
            print("starting worker, vocoder and scheduler ...", file=sys.stderr, flush=True)
            layout, cluster, metrics_port = _launch_cluster(args, named)
            cluster.start()
            address = cluster.address
            worker, vocoder, scheduler = cluster.configs()
            results["server"]["launch_configs"] = {"cluster": dataclasses.asdict(layout.cluster),
                                                   "worker": dataclasses.asdict(worker),
                                                   "vocoder": dataclasses.asdict(vocoder),
                                                   "scheduler": dataclasses.asdict(scheduler),
                                                   "colocated_vocoder": cluster.colocate_vocoder}
        else:
            address = args.server or "127.0.0.1:50051"
        results["server"]["address"] = address
        asyncio.run(run_levels(args, address, seed, results, cluster.services if cluster is not None else None,
                               metrics_port, vocoder_ports(cluster), save))
        results["complete"] = True
    except KeyboardInterrupt:
        print("\ninterrupted; writing what was measured", file=sys.stderr)
    finally:
        if cluster is not None:
            cluster.stop()
        results["finished_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        if args.out:
            save()
            print(f"wrote {args.out}", file=sys.stderr)
        if results["levels"]:
            print("\nrows for benchmarks/README.md:\n" + readme_rows(results["levels"]), flush=True)
        if args.plot and results["levels"]:
            plot(results, args.plot)
    return results
