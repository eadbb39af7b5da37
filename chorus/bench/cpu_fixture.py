"""What relay_bench and scheduler_bench share: an instant service in a spawned process (so the
measured process's CPU is its own), the common flags, and the JSON result."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform

from chorus.bench.common import write_json


def spawn(target, *args) -> tuple[mp.Process, int]:
    """Run target(port_queue, *args) in a new process; it puts the port it listens on."""
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    proc = ctx.Process(target=target, args=(port_q, *args), daemon=True)
    proc.start()
    return proc, port_q.get(timeout=60)


def parser(doc: str, min_requests: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="16,64,256", help="concurrent requests per level")
    ap.add_argument("--requests", type=int, default=256, help=f"requests per level (at least {min_requests})")
    ap.add_argument("--frames", type=int, default=75, help="frames per request (75 = W1's 6 s)")
    ap.add_argument("--out", help="JSON results path")
    return ap


def parse(ap: argparse.ArgumentParser) -> argparse.Namespace:
    args = ap.parse_args()
    args.streams = [int(x) for x in args.streams.split(",")]
    return args


def save(name: str, args: argparse.Namespace, levels: list[dict]) -> dict:
    result = {"benchmark": name, "host": platform.node(), "cpus": os.cpu_count(),
              "python": platform.python_version(), "config": vars(args), "levels": levels}
    write_json(args.out, result)
    return result
