"""gpu_worker process: binds a ZeroMQ ROUTER, answers hello/stats, executes
step plans in arrival order and sends one journal per plan.

Messages are chorus.v1.WorkerCommand / WorkerEvent protobufs, one per frame.
A step is launched as soon as its plan arrives, even while the previous
step still runs on the GPU; journals still go out one per plan, in order.
The worker never decides anything: a plan it cannot execute gets a journal
with `error` set, and the worker keeps serving.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import secrets
import sys
import time
from typing import Callable

import torch

from chorus.config import add_config_flags, parse_command_line
from chorus.sizing import (CPU_KV_SLOTS, CPU_MAX_BATCH, CPU_VOCODER_SLOTS, CodecFootprint, ModelFootprint, Sizing,
                           size_worker)
from chorus.v1 import worker_pb2
from chorus.watchdog import StallWatchdog, stall_limit
from gpu_worker.config import WorkerConfig
from gpu_worker.worker_socket import WorkerSocket
from gpu_worker.engine import Engine, PendingStep
from gpu_worker.loader import build_model
from gpu_worker.omnivoice import service as omnivoice

log = logging.getLogger("chorus.worker")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_flags(p, WorkerConfig)



def size(args: WorkerConfig, model, free: tuple[int, int] | None, hosted: CodecFootprint | None,
         hosted_slots: int) -> Sizing:
    """max_batch, kv_slots and the hosted decoder's slots, for those left at 0: from the device's memory
    (free: (free, total) bytes before the model was loaded; None on the CPU, where they take the CPU
    defaults)."""
    if free is None:
        return Sizing(args.max_batch or CPU_MAX_BATCH, args.kv_slots or CPU_KV_SLOTS,
                      hosted_slots or (CPU_VOCODER_SLOTS if hosted else 0), ["the CPU's defaults"])
    bb = model.cfg.backbone
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    footprint = ModelFootprint(bb.num_hidden_layers, bb.num_key_value_heads, bb.head_dim,
                               torch.empty((), dtype=getattr(torch, args.dtype)).element_size(), weights)
    return size_worker(free[0], free[1], args.memory_fraction, footprint, args.max_context, hosted,
                       args.max_batch, args.kv_slots, hosted_slots)


def run(args: WorkerConfig, sidecar: Callable[[str, int], None] | None = None, hosted: CodecFootprint | None = None,
        hosted_slots: int = 0) -> None:
    """Serve until SIGINT/SIGTERM. sidecar(device, slots): starts the vocoder decoder this process hosts
    (args.host_vocoder_decoder; chorus.colocate passes it, with its footprint `hosted` and its slots,
    0 = sized here), once the worker is warm."""
    if args.host_vocoder_decoder and sidecar is None:
        raise SystemExit("worker.host_vocoder_decoder: start the worker with `chorus worker` (python -m "
                         "chorus.colocate), which hosts the vocoder's decoder; this module runs the model alone")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    if torch.device(args.device).index is not None:
        torch.cuda.set_device(torch.device(args.device))  # Triton launches on the current device
    if sidecar is not None and torch.device(args.device).type == "cuda":
        # Steps run on a high-priority stream: where the hosted codec's work (low priority) and a
        # step both wait for SMs, the step's blocks go first. Set before anything is queued.
        torch.cuda.set_stream(torch.cuda.Stream(torch.device(args.device), priority=-100))
    if omnivoice.serves_omnivoice(args):
        return omnivoice.run(args, sidecar)
    auto = not (args.max_batch and args.kv_slots and (hosted is None or hosted_slots))
    free = torch.cuda.mem_get_info(torch.device(args.device)) if auto and torch.device(args.device).type == "cuda" \
        else None
    try:
        model = build_model(model_dir=args.model, preset=args.preset, load_format=args.load_format,
                            dtype=args.dtype, device=args.device, seed=args.seed)
    except ValueError as e:  # a setting the model cannot take
        raise SystemExit(f"worker: {e}") from None
    sizing = size(args, model, free, hosted, hosted_slots)
    if auto:
        print(f"sized: max_batch {sizing.max_batch}, kv_slots {sizing.kv_slots}"
              + (f", vocoder slots {sizing.vocoder_slots}" if hosted else "") + f" ({sizing.explain()})", flush=True)
    if sizing.kv_slots < 2 * args.page_size:
        raise SystemExit(f"worker: {sizing.kv_slots} KV slots fit on {args.device} ({sizing.explain()}); free memory "
                         f"on the device, or give --max-batch, --kv-slots or --memory-fraction")
    args = dataclasses.replace(args, max_batch=sizing.max_batch, kv_slots=sizing.kv_slots)
    engine = Engine(model, num_kv_slots=args.kv_slots, max_batch=args.max_batch, max_context=args.max_context,
                    attention=args.attention, cuda_graphs=args.cuda_graphs, page_size=args.page_size,
                    decode_split_kv=args.decode_split_kv, decode_kernel=args.decode_kernel)
    if engine.graphs is not None and args.capture_graphs:
        print("capturing CUDA graphs for decode batches up to", args.max_batch, flush=True)
        engine.graphs.capture_all()
        t0 = time.perf_counter()
        engine.prefill_graphs.capture_all()
        print(f"captured {len(engine.prefill_graphs.graphs)} prefill graphs in {time.perf_counter() - t0:.1f}s"
              + (f" ({engine.prefill_graphs.disabled}: prefill runs eagerly)" if engine.prefill_graphs.disabled else ""),
              flush=True)
    if engine.kv_capacity >= engine.warm_up_slots and engine.pool.capacity >= 2:
        print(f"warmed up every step kind in {engine.warm_up():.1f}s (kernel compiles)", flush=True)
    if sidecar is not None:
        t0 = time.perf_counter()
        sidecar(args.device, sizing.vocoder_slots)
        # The decoder's threads and this loop share the GIL: hand it over within 0.5 ms, not 5.
        sys.setswitchinterval(0.0005)
        print(f"hosting the vocoder's decoder under {args.host_vocoder_decoder} "
              f"(built in {time.perf_counter() - t0:.1f}s)", flush=True)
    hello = worker_pb2.Hello(
        model_name=model.cfg.name, architecture="moss_tts_local", model_config_json=model.cfg.to_json(),
        kv_slots=engine.kv_capacity, max_batch=args.max_batch, max_context=args.max_context,
        device=str(engine.device), dtype=args.dtype, pid=os.getpid(), page_size=engine.page_size,
        incarnation=secrets.randbits(63) | 1)

    link = WorkerSocket(args)
    sock, endpoint = link.sock, link.endpoint
    print(f"worker ready on {endpoint} model={model.cfg.name} device={engine.device} dtype={args.dtype}", flush=True)
    pending: tuple[bytes, PendingStep] | None = None  # a launched step whose journal is not sent yet
    watchdog = StallWatchdog(stall_limit(args.stall_exit_s, engine.device.type), "a worker step")

    def send_journal(ident: bytes, journal: worker_pb2.Journal) -> None:
        journal.incarnation = hello.incarnation
        reply = worker_pb2.WorkerEvent()
        reply.journal.CopyFrom(journal)
        sock.send_multipart([ident, reply.SerializeToString()])

    def flush() -> None:
        nonlocal pending
        if pending is not None:
            ident, step = pending
            pending = None
            journal = engine.finish(step)
            watchdog.end()
            send_journal(ident, journal)

    try:
        while not link.stopping:
            # While a step runs on the GPU, wait for whichever comes first: its journal or the
            # next plan (the scheduler's lookahead), which is launched before the journal is read.
            if pending is not None and pending[1].ready():
                flush()
            if not sock.poll(0 if pending is not None else 200):
                if pending is not None:
                    time.sleep(0.0001)
                continue
            ident, payload = sock.recv_multipart()
            reply = worker_pb2.WorkerEvent()
            try:
                cmd = worker_pb2.WorkerCommand.FromString(payload)
            except Exception as e:  # noqa: BLE001 - a bad frame must not kill the worker
                flush()
                reply.error = f"unparseable WorkerCommand: {e}"
                sock.send_multipart([ident, reply.SerializeToString()])
                continue
            kind = cmd.WhichOneof("kind")
            if kind == "step":
                try:
                    launched = engine.launch(cmd.step)
                except Exception as e:  # noqa: BLE001
                    log.exception("step %d failed", cmd.step.step_id)
                    flush()  # journals go out in plan order
                    failed = worker_pb2.Journal(step_id=cmd.step.step_id, error=f"{type(e).__name__}: {e}")
                    for item in list(cmd.step.prefill) + list(cmd.step.decode):
                        engine.pool.release(item.request_id)
                    send_journal(ident, failed)
                    continue
                watchdog.begin()
                flush()
                pending = (ident, launched)
                continue
            flush()
            if kind == "hello":
                if cmd.hello.release_all:
                    for request_id in list(engine.pool.requests):
                        engine.pool.release(request_id)
                reply.hello.CopyFrom(hello)
            elif kind == "stats":
                reply.stats.active_requests = len(engine.pool)
                reply.stats.steps = engine.steps
                reply.stats.prefill_rows = engine.prefill_rows
                reply.stats.decode_rows = engine.decode_rows
            elif kind == "shutdown":
                break
            else:
                reply.error = f"unknown command {kind!r}"
            sock.send_multipart([ident, reply.SerializeToString()])
    finally:
        link.close()


def main(argv: list[str] | None = None, prog: str = "python -m gpu_worker.server") -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    add_arguments(p)
    config, _ = parse_command_line(WorkerConfig, p, argv)
    run(config)


if __name__ == "__main__":
    main(sys.argv[1:])
