"""The frontend tier: the public TextToSpeech gRPC API in front of many engines.

    chorus frontend --engines dns:///chorus-engine-headless:5570 --vocoder dns:///vocoder-headless:50053

A process of its own (CPU only; a Kubernetes Deployment scales it apart from the GPUs) that does
what a core's own frontend does (scheduler_svc/frontend.py: validation, prompts, vocoder streams,
the client's audio) against every engine (a scheduler core with frontends = 0 and its worker) that
--engines names, picking one per request: the same voice or reference goes to the same engine,
whose radix cache holds its prefix, unless that engine carries too much more than the mean load
(scheduler_svc/engine_picker.py). When the engines schedule OmniVoice, it builds OmniVoice's prompts
and decodes its canvases on --omnivoice-vocoder, and sends each OmniVoice request to an engine whose
OmniVoice worker answers. It takes the [scheduler] settings; grpc health is SERVING while one engine
is up (per model: while one engine's worker for it answers). Several processes may share --port (SO_REUSEPORT); each serves its own Prometheus
metrics on --metrics-port (calls by outcome, time to first audio, picks per engine, live engines).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from prometheus_client import start_http_server

from chorus.config import add_config_flags, parse_command_line
from scheduler_svc import frontend_process, metrics
from scheduler_svc.config import SchedulerConfig


def run(args: SchedulerConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s frontend %(levelname)s %(message)s")
    if args.metrics_port:
        try:
            start_http_server(args.metrics_port, addr=args.host, registry=metrics.FRONTEND_REGISTRY)
        except OSError as e:
            raise SystemExit(f"frontend: scheduler.metrics_port {args.metrics_port}: {e}") from None
    asyncio.run(frontend_process.serve(args, None, 0))


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_flags(p, SchedulerConfig)


def main(argv: list[str] | None = None, prog: str = "python -m scheduler_svc.frontend_tier") -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    config, _ = parse_command_line(SchedulerConfig, p, argv)
    if not config.engines:
        p.error("--engines: give at least one engine (tcp://HOST:PORT of a core's frontend_link, or "
                "dns:///NAME:PORT)")
    run(config)


if __name__ == "__main__":
    main(sys.argv[1:])
