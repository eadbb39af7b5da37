"""scheduler_svc: the public TextToSpeech service, as one core process and its frontends.

With frontends = 0 the core is an engine: it binds frontend_link (TCP) for the
processes of a frontend tier (`chorus frontend`, scheduler_svc/frontend_tier.py)
and serves only grpc health and metrics of its own.

The core (this process) owns the Scheduler (queue, admission, KV, radix cache,
lookahead, the ZeroMQ link to the gpu_worker), a CanvasScheduler per OmniVoice
worker and the one Prometheus endpoint (voices live in the frontends' store). It starts --frontends
frontend processes (scheduler_svc/frontend_process.py) that all serve the gRPC port:
validation, prompt building, the vocoder streams and the client's audio, the
per-frame work that one Python process cannot carry at full GPU throughput. They reach the core
over a ZeroMQ ipc socket (protos/chorus/v1/frontend.proto). The core prints
its `ready on` line once every frontend serves; if a frontend dies, the core
stops the rest and exits non-zero, so an orchestrator restarts the whole pod.

SIGTERM drains: the core takes no new requests and tells its frontends (health NOT_SERVING, new
calls refused UNAVAILABLE with a retry hint), steps the running and queued requests to their end
for up to drain_seconds, ends what is left UNAVAILABLE ("engine shutting down"), then stops the
frontends (they relay the last audio) and exits 0. A second signal ends the drain at once.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import logging
import signal
import socket
import subprocess
import sys
import tempfile
import time

import grpc
import zmq
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from chorus.config import add_config_flags, parse_command_line, write_proto
from chorus import curve
from chorus.curve import CurveError
from chorus.moss_config import MossTTSLocalConfig
from chorus.v1 import worker_pb2
from scheduler_svc import frontend, frontend_process, metrics
from scheduler_svc.canvas_scheduler import CanvasScheduler
from scheduler_svc.frontend_link import FrontendLink
from scheduler_svc.model_routing import MOSS, OMNIVOICE, UnknownModel
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.worker_client import WorkerClient

log = logging.getLogger("chorus.scheduler")


# ---- process -----------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_flags(p, SchedulerConfig)
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


def _frontend_argv(config_file: str, endpoint: str, index: int) -> list[str]:
    return [sys.executable, "-m", "scheduler_svc.server", "--core", endpoint, "--frontend-index", str(index),
            "--config-proto", config_file]


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


async def _until_stop_or_frontend_exit(procs: list[subprocess.Popen], link: FrontendLink,
                                       hurry: asyncio.Event) -> int | None:
    """Waits for SIGINT/SIGTERM (None), for a frontend to exit (its index) or for the frontends' ZeroMQ
    link to die (-1). A second signal sets `hurry`: the drain stops waiting."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: hurry.set() if stop.is_set() else stop.set())
    loop.add_signal_handler(signal.SIGHUP, lambda: [p.send_signal(signal.SIGHUP) for p in procs if p.poll() is None])
    while not stop.is_set():
        for i, p in enumerate(procs):
            if p.poll() is not None:
                return i
        if link.broken:
            return -1
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
    return None


async def _drain(link: FrontendLink, schedulers: list, seconds: float, hurry: asyncio.Event) -> None:
    """SIGTERM: take no new requests, step the running and queued ones to their end for up to
    `seconds` (or until `hurry`: a second signal), then end what is left UNAVAILABLE (a client
    retries it on another engine)."""
    log.info("draining: no new requests; the running and queued ones get up to %g s", seconds)
    link.drain("this engine is draining (shutting down for a restart or scale-down); retry: another engine "
               "takes the request")
    deadline = time.monotonic() + seconds
    while not all(s.idle for s in schedulers) and time.monotonic() < deadline and not hurry.is_set():
        await asyncio.sleep(0.05)
    why = "a second signal cut its drain" if hurry.is_set() else f"its drain time ({seconds:g} s) ran out"
    for s in schedulers:
        if not s.idle:
            log.warning("draining: %s; ending the requests still running or queued", why)
            s.end_all(f"engine shutting down: {why} before this request ended; retry the request")


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


async def _hello(endpoint: str, architecture: str, args: SchedulerConfig) -> tuple[WorkerClient, worker_pb2.Hello]:
    """A client of the worker at endpoint and its hello; SystemExit when it serves another architecture."""
    keys = (args.curve_secret_key, args.worker_public_key) if args.curve_secret_key else None
    try:
        worker = WorkerClient(endpoint, curve_keys=keys)
    except CurveError as e:
        raise SystemExit(f"scheduler: {e}") from None
    log.info("waiting for the %s worker at %s", architecture, endpoint)
    hello: worker_pb2.Hello = await worker.hello(timeout=600, release_all=True)  # a previous core's requests
    if hello.architecture != architecture:
        key = "omnivoice_worker" if hello.architecture == OMNIVOICE else "worker"
        raise SystemExit(f"the worker at {endpoint} serves {hello.model_name!r} ({hello.architecture}), not "
                         f"{architecture}: give it as scheduler.{key}")
    return worker, hello


async def _canvas_schedulers(args: SchedulerConfig, sink) -> list[CanvasScheduler]:
    """A CanvasScheduler per OmniVoice worker (workers serving one model share its requests)."""
    out = []
    for endpoint in args.omnivoice_worker:
        client, hello = await _hello(endpoint, OMNIVOICE, args)
        try:
            out.append(CanvasScheduler(client, hello, args, sink=sink))
        except ValueError as e:  # a Hello the policy cannot work with
            raise SystemExit(f"the OmniVoice worker at {endpoint}: {e}") from None
    return out


async def serve(args: SchedulerConfig) -> None:
    worker, hello = await _hello(args.worker, MOSS, args)
    cfg = MossTTSLocalConfig.from_dict(json.loads(hello.model_config_json))
    cache_key = f"{cfg.name}:{hashlib.blake2b(hello.model_config_json.encode(), digest_size=8).hexdigest()}"
    with tempfile.TemporaryDirectory(prefix="chorus-scheduler-") as tmp:
        keys = (args.curve_secret_key, args.frontend_curve_clients) if args.frontend_curve_clients else None
        try:
            link = FrontendLink(args.frontend_link or f"ipc://{tmp}/core",
                                max_message_bytes=args.link_message_bytes(), curve_keys=keys)
        except CurveError as e:
            raise SystemExit(f"scheduler: frontend_link: {e}") from None
        except zmq.ZMQError as e:
            raise SystemExit(f"scheduler: frontend_link {args.frontend_link!r}: {e}") from None
        if keys is None:
            curve.warn_if_open(link.endpoint, None, "frontend link", "curve_secret_key and frontend_curve_clients")
        scheduler = Scheduler(worker, hello, dataclasses.replace(args, cache_key=cache_key), sink=link)
        canvas_schedulers = await _canvas_schedulers(args, link)
        try:
            link.start(scheduler, canvas_schedulers, args.default_model)
        except UnknownModel as e:
            raise SystemExit(f"scheduler.default_model = {args.default_model!r}: {e}") from None
        scheduler.start()
        for s in canvas_schedulers:
            s.start()
        metrics.KV_TOTAL.set(hello.kv_slots)

        async def close() -> None:
            await scheduler.stop()
            for s in canvas_schedulers:
                await s.stop()
                await s.worker.close()
            link.close()
            await worker.close()

        if not args.frontends:
            try:
                await _serve_engine(args, link, [scheduler, *canvas_schedulers], cfg.name)
            finally:
                await close()
            return
        reservation, port = _reserve_port(args.host, args.port)
        config_file = write_proto(dataclasses.replace(args, port=port), f"{tmp}/frontend.pb")
        procs = [subprocess.Popen(_frontend_argv(config_file, link.endpoint, i)) for i in range(args.frontends)]
        failed = None
        try:
            await _wait_frontends(link, procs, timeout=900)
            if args.metrics_port:
                start_http_server(args.metrics_port, addr=args.host, registry=metrics.REGISTRY)
            models = ",".join(dict.fromkeys([cfg.name, *(s.model_name for s in canvas_schedulers)]))
            print(f"scheduler ready on {args.host}:{port} models={models} default={link.default_model} "
                  f"worker={args.worker} frontends={args.frontends} vocoders={','.join(args.vocoder)}",
                  flush=True)
            hurry = asyncio.Event()
            failed = await _until_stop_or_frontend_exit(procs, link, hurry)
            if failed == -1:
                log.error("the link to the frontends failed (%s); stopping the service", link.broken)
            elif failed is not None:
                log.error("scheduler frontend %d exited with code %s; stopping the service", failed,
                          procs[failed].returncode)
            else:
                await _drain(link, [scheduler, *canvas_schedulers], args.drain_seconds, hurry)
        finally:
            await asyncio.get_running_loop().run_in_executor(None, _stop_frontends, procs, args.drain_seconds + 5)
            reservation.close()
            await close()
        if failed is not None:
            raise SystemExit(1)


async def _serve_engine(args: SchedulerConfig, link: FrontendLink, schedulers: list, model: str) -> None:
    """An engine (frontends = 0): frontend tier processes reach the core on its link; the port serves
    grpc health alone (SERVING while the worker answers), for the orchestrator's probes. SIGTERM
    drains it as it drains a core with frontends (_drain): the frontend tiers send new requests to
    other engines meanwhile."""
    scheduler = schedulers[0]
    server = grpc.aio.server()
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    host = args.host.strip("[]")
    port = server.add_insecure_port(f"[{host}]:{args.port}" if ":" in host else f"{host}:{args.port}")
    if args.port and port != args.port:
        raise SystemExit(f"scheduler: could not listen on {args.host}:{args.port} for grpc health")
    await server.start()
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.host, registry=metrics.REGISTRY)
    print(f"scheduler engine ready on {link.endpoint} health={args.host}:{port} model={model} "
          f"worker={args.worker}", flush=True)
    stop, hurry = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: hurry.set() if stop.is_set() else stop.set())
    while not stop.is_set() and not link.broken:
        status = health_pb2.HealthCheckResponse.SERVING if scheduler.heartbeat.up else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", frontend.SERVICE_NAME):
            await health_servicer.set(name, status)
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
    for name in ("", frontend.SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if not link.broken:
        await _drain(link, schedulers, args.drain_seconds, hurry)
    await server.stop(grace=1.0)
    if link.broken:
        log.error("the link to the frontends failed (%s); stopping the engine", link.broken)
        raise SystemExit(1)


def run(args: SchedulerConfig, core: str | None = None, frontend_index: int = 0) -> None:
    """Serve until SIGINT/SIGTERM: the core, or with `core` (its endpoint) one of its frontends."""
    if core:
        frontend_process.run(args, core, frontend_index)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s")
    asyncio.run(serve(args))


def main(argv: list[str] | None = None, prog: str = "python -m scheduler_svc.server") -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    config, ns = parse_command_line(SchedulerConfig, p, argv)
    run(config, ns.core, ns.frontend_index)


if __name__ == "__main__":
    main(sys.argv[1:])
