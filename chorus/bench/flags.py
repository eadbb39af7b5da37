"""chorus bench's flags. The run's settings (workload, levels, duration, ...) default to
argparse.SUPPRESS, so a parsed namespace holds only those given; `settle` fills in the rest
from a named layout's values, then from DEFAULTS."""

from __future__ import annotations

import argparse
from typing import Any

from chorus.bench.workloads import VOICE_FRAMES, WORKLOADS
from chorus.layout import add_layout_flags

# The settings a layout (benchmarks/layouts.toml) may set, by dest, with their defaults.
DEFAULTS: dict[str, Any] = {
    "workload": ["W1"], "frames": None, "num_step": None, "voices": 8, "voice_frames": VOICE_FRAMES, "code_vocab": 1024,
    "seed": None, "language": "English", "sample_rate": 0, "first_chunk_frames": 0, "chunk_frames": 0,
    "concurrency": [1, 4, 16, 64, 256], "rate": None, "duration": 5.0, "requests": None, "warmup": 1.0,
    "timeout": 600.0, "channels": 4, "device_note": None, "server_logs": False,
}

EXAMPLES = """\
examples:
  # CPU smoke run: launch the tiny model locally, two levels, 4 requests each
  chorus bench --launch --workload W1 --concurrency 1,2 --frames 10 --requests 4 \\
      --out /tmp/b.json --plot /tmp/b.png

  # a named layout (benchmarks/layouts.toml) with one of its settings changed
  chorus bench --layout w1-2gpu-high-load --duration 30 --out c256.json
  chorus bench --list-layouts

  # against a running GPU scheduler: clone workload, full sweep, 60 s per level
  chorus bench --server 10.0.0.5:50051 --workload W2 --concurrency 1,4,16,64,256 \\
      --duration 60 --warmup 10 --device-note "1x H200, bf16" --out w2.json --plot w2.png

  # open loop: Poisson arrivals at 2, 5 and 10 req/s for 30 s each
  chorus bench --server 127.0.0.1:50051 --workload W1 --rate 2,5,10 --duration 30

Flags that start with '-' must be attached with '=': --worker-arg=--kv-slots=65536
"""


def add_launch_flags(p) -> None:
    """chorus bench --launch's cluster flags: the layout's (--config, --profile, --model, ...) plus
    --worker-arg/--vocoder-arg/--scheduler-arg, service flags set on top of the layout's configs.
    p is a parser or an argument group."""
    add_layout_flags(p, ("model", "codec", "device", "vocoder_device", "dtype", "vocoders", "shared_vocoder_decoder"))
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
    unset = argparse.SUPPRESS  # see settle()
    t = p.add_argument_group("target (one of)")
    g = t.add_mutually_exclusive_group()
    g.add_argument("--server", metavar="HOST:PORT",
                   help="address of a running scheduler (default 127.0.0.1:50051 unless --launch)")
    g.add_argument("--launch", action="store_true",
                   help="start a local worker + vocoder + scheduler (chorus.launcher.Cluster) for the run and "
                        "stop them at the end; tiny random-weight model on the CPU unless --model/--codec/--device")

    n = p.add_argument_group("named layouts")
    n.add_argument("--layout", metavar="NAME",
                   help="launch the named layout of --layouts and run its settings (implies --launch; flags "
                        "given here win)")
    n.add_argument("--layouts", metavar="FILE", help="the layouts file (default benchmarks/layouts.toml)")
    n.add_argument("--list-layouts", action="store_true", help="print each layout's name and what it runs, then exit")

    la = p.add_argument_group("with --launch or --layout")
    add_launch_flags(la)
    la.add_argument("--server-logs", action="store_true", default=unset, help="relay the launched services' logs")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", type=_workloads, default=unset, metavar="W[,W...]",
                   help="W1 short, W2 clone, W3 long (MOSS); O1 short, O2 clone, O3 mixed knobs (OmniVoice); a "
                        "comma list runs each in turn (default W1)")
    w.add_argument("--frames", type=int, default=unset, metavar="N",
                   help="frames per request (min = max), overriding the workload's 75/375 (O*: 150 at 25 a second); "
                        "for quick smoke runs")
    w.add_argument("--num-step", type=int, default=unset, metavar="N",
                   help="O*: unmasking steps of every request, overriding the workload's; for quick smoke runs")
    w.add_argument("--voices", type=int, default=unset, metavar="N", help="W2: distinct voice references; O2: stored voices (default 8)")
    w.add_argument("--voice-frames", type=int, default=unset, metavar="N",
                   help=f"W2: frames per reference (default {VOICE_FRAMES} = 5 s)")
    w.add_argument("--code-vocab", type=int, default=unset, metavar="N",
                   help="W2: reference codes are drawn from [0, N) (default 1024, the model's audio vocab)")
    w.add_argument("--seed", type=int, default=unset,
                   help="base seed: request k uses sampling seed SEED+k, and texts and voices come from it "
                        "(default: random, recorded in the JSON)")
    w.add_argument("--language", default=unset, metavar="NAME",
                   help="language field of each request (default English)")
    w.add_argument("--sample-rate", type=int, default=unset, metavar="HZ",
                   help="output sample rate to ask for (0 = native)")
    w.add_argument("--first-chunk-frames", type=int, default=unset, metavar="N",
                   help="frames in the first audio chunk (0 = server default)")
    w.add_argument("--chunk-frames", type=int, default=unset, metavar="N",
                   help="frames per later audio chunk (0 = server default)")

    m = p.add_argument_group("load")
    mg = m.add_mutually_exclusive_group()
    mg.add_argument("--concurrency", type=_int_list, default=unset, metavar="N[,N...]",
                    help="closed loop: concurrent streams per level (default 1,4,16,64,256)")
    mg.add_argument("--rate", type=_float_list, default=unset, metavar="R[,R...]",
                    help="open loop instead: Poisson arrivals at R req/s per level")
    m.add_argument("--duration", type=float, default=unset, metavar="S",
                   help="measured seconds per level, after the warm-up (default 5)")
    m.add_argument("--requests", type=int, default=unset, metavar="N",
                   help="measure N requests per level instead of --duration seconds")
    m.add_argument("--warmup", type=float, default=unset, metavar="S",
                   help="seconds of unmeasured load at the start of each level, also with --requests (default 1)")
    m.add_argument("--timeout", type=float, default=unset, metavar="S", help="per-request deadline (default 600)")
    m.add_argument("--channels", type=int, default=unset, metavar="N",
                   help="gRPC channels (TCP connections) the streams are spread over (default 4)")

    o = p.add_argument_group("output")
    o.add_argument("--out", metavar="JSON", help="write config, git revision, per-level metrics and raw records")
    o.add_argument("--plot", metavar="PNG",
                   help="plot audio-s/s and TTFA p50/p99 against concurrency (or rate); needs matplotlib "
                        "(pip install -e '.[bench]')")
    o.add_argument("--device-note", default=unset, metavar="TEXT",
                   help="free text describing the server's host/device, stored in the JSON and the plot title")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    o.add_argument("--resume", action="store_true",
                   help="with --out: keep the levels the file holds from an interrupted run of the same settings "
                        "and run only the missing ones (the file is rewritten after every level)")


def settle(args: argparse.Namespace, layout_values: dict[str, Any] | None = None) -> argparse.Namespace:
    """Every setting of DEFAULTS not given as a flag: the layout's value, else the default. A
    --concurrency or --rate given replaces the layout's levels of either kind."""
    layout_values = dict(layout_values or {})
    if hasattr(args, "concurrency") or hasattr(args, "rate"):
        layout_values.pop("concurrency", None)
        layout_values.pop("rate", None)
    for key, default in DEFAULTS.items():
        if not hasattr(args, key):
            value = layout_values.get(key, default)
            setattr(args, key, list(value) if isinstance(value, list) else value)
    return args
