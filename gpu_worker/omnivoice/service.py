"""The gpu_worker process serving OmniVoice: binds a ZeroMQ ROUTER, answers hello/stats/shutdown and
runs each StepPlan when it arrives (release, then canvas_start, then one packed canvas_step), one
Journal per plan, in plan order, with a CanvasResult per canvas_step in plan order.

As the MOSS worker does (gpu_worker/server.py), a plan is launched as soon as it arrives, even
while the previous step still runs on the GPU, and the previous plan's journal is sent after it:
with the scheduler's lookahead the GPU never waits for the round trip. On the CPU a launch runs
the whole step, and the journal goes out before the socket is read again. Hello and stats are
answered as they arrive, not behind a plan waiting its turn.

Like the MOSS worker it decides nothing: a plan it cannot run gets a Journal with `error`, and the
canvases that plan named are dropped (the scheduler fails their requests). A plan sent before the
scheduler heard of that failure may still name them: their steps are skipped (listed in the
journal's `skipped`, no result) and the rest of that plan runs, until a plan releases them.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from chorus.omnivoice.config import ARCHITECTURE
from chorus.omnivoice.knobs import UnmaskKnobs
from chorus.v1 import worker_pb2
from chorus.wire import matrix_array, rows_matrix
from gpu_worker.config import WorkerConfig
from gpu_worker.worker_socket import WorkerSocket
from gpu_worker.omnivoice.engine import CanvasEngine, CanvasError, CanvasSpec, PendingStep

log = logging.getLogger("chorus.worker")

PRESETS = {"omnivoice-tiny": "tiny", "omnivoice-full": "full"}  # worker preset -> OmniVoiceConfig preset


def serves_omnivoice(args: WorkerConfig) -> bool:
    """--model's config.json says model_type omnivoice, or (no --model) an omnivoice-* preset."""
    if args.model:
        try:
            return json.loads((Path(args.model) / "config.json").read_text()).get("model_type") == ARCHITECTURE
        except (OSError, ValueError, AttributeError):
            return False  # the MOSS loader reports what is wrong with the directory
    return args.preset in PRESETS


def build_engine(args: WorkerConfig) -> CanvasEngine:
    from gpu_worker.omnivoice.loader import build_omnivoice

    model = build_omnivoice(model_dir=args.model, preset=PRESETS.get(args.preset, "tiny"),
                            load_format=args.load_format, dtype=args.dtype, device=args.device, seed=args.seed)
    engine = CanvasEngine(model, max_batch=args.max_batch or 64, max_packed_rows=args.max_packed_rows,
                          attention=args.attention, cuda_graphs=args.cuda_graphs)
    if engine.device.type == "cuda":
        # The host's torch work here is staging copies and noise, too small to share out; a pool of
        # one thread per core spins after each parallel copy, taking cores from the codec's
        # post-processing and the frontends.
        torch.set_num_threads(1)
        if engine.attention.name == "torch":
            log.warning("OmniVoice on %s in %s runs torch attention, unbucketed and without CUDA graphs: "
                        "--dtype float16 (with triton or flashinfer installed) for bucketed attention and graphs",
                        engine.device, args.dtype)
        seconds = engine.warm_up(capture=args.capture_graphs)
        b = engine.bucketed
        log.info("OmniVoice worker warm (%.1f s): attention %s, %s", seconds, engine.attention.name,
                 "unbucketed" if b is None else b.disabled or (f"{len(b.graphs)} step graphs" if b.replay
                                                               else "bucketed, eager (no CUDA graphs)"))
    return engine


def hello(args: WorkerConfig, engine: CanvasEngine) -> worker_pb2.Hello:
    cfg = engine.cfg
    return worker_pb2.Hello(
        model_name=cfg.name, architecture=ARCHITECTURE, model_config_json=cfg.to_json(), max_batch=engine.max_batch,
        max_context=min(engine.max_packed_rows, cfg.max_position_embeddings), device=str(engine.device),
        dtype=str(next(engine.model.parameters()).dtype).removeprefix("torch."), pid=os.getpid(),
        incarnation=secrets.randbits(63) | 1, max_packed_rows=engine.max_packed_rows)


def canvas_spec(m: worker_pb2.CanvasStart) -> CanvasSpec:
    ref = matrix_array(m.reference_codes).astype(np.int64) if m.reference_codes.rows else None
    return CanvasSpec(request_id=m.request_id, text_ids=np.asarray(m.text_ids, dtype=np.int64), reference_codes=ref,
                      target_frames=m.target_frames, knobs=UnmaskKnobs.from_proto(m.knobs), seed=m.seed)


@dataclass
class PendingPlan:
    """A launched plan: its journal so far, and its step on the way (None: nothing to step, or failed)."""

    journal: worker_pb2.Journal
    step: PendingStep | None
    t0: float

    def ready(self) -> bool:
        return self.step is None or self.step.ready()


def launch(engine: CanvasEngine, plan: worker_pb2.StepPlan) -> PendingPlan:
    """Start one plan; never raises for a bad plan (its journal says what failed, and the canvases
    it named are dropped)."""
    t0 = time.perf_counter()
    journal = worker_pb2.Journal(step_id=plan.step_id)
    try:
        if plan.prefill or plan.decode:
            raise CanvasError("this worker serves OmniVoice: a StepPlan carries canvas_start / canvas_step, "
                              "not prefill / decode")
        for rid in plan.release:
            engine.release(rid)
        for start in plan.canvas_start:
            engine.start(canvas_spec(start))
        items = [(s.request_id, s.step) for s in plan.canvas_step if s.request_id not in engine.dropped]
        journal.skipped.extend(s.request_id for s in plan.canvas_step if s.request_id in engine.dropped)
        step = engine.launch(items) if items else None
    except Exception as e:  # noqa: BLE001 - a failing plan must not take the worker down
        if not isinstance(e, CanvasError):
            log.exception("canvas step %d failed", plan.step_id)
        for rid in [s.request_id for s in plan.canvas_start] + [s.request_id for s in plan.canvas_step]:
            engine.drop(rid)
        failed = worker_pb2.Journal(step_id=plan.step_id, error=f"{type(e).__name__}: {e}")
        return PendingPlan(failed, None, t0)
    return PendingPlan(journal, step, t0)


def finish(engine: CanvasEngine, pending: PendingPlan) -> worker_pb2.Journal:
    """Wait for the plan's step and complete its journal."""
    journal = pending.journal
    if journal.error:
        return journal
    for o in engine.finish(pending.step) if pending.step is not None else []:
        result = journal.canvases.add(request_id=o.request_id, step=o.step, finished=o.finished)
        if o.codes is not None:
            result.codes.CopyFrom(rows_matrix(o.codes))
    journal.step_ms = (time.perf_counter() - pending.t0) * 1000
    return journal


def execute(engine: CanvasEngine, plan: worker_pb2.StepPlan) -> worker_pb2.Journal:
    """launch + finish: one plan, synchronously."""
    return finish(engine, launch(engine, plan))


def run(args: WorkerConfig, sidecar: Callable[[str, int], object] | None = None) -> None:
    """Serve until SIGINT/SIGTERM or a Shutdown command. sidecar(device, 0): starts the OmniVoice codec
    this process hosts (args.host_vocoder_decoder, vocoder_svc/clip_host.py), once the engine is warm.
    gpu_worker.server.run has set the device and, with a sidecar, the steps' high-priority stream."""
    engine = build_engine(args)
    if sidecar is not None:
        sidecar(str(engine.device), 0)
    greeting = hello(args, engine)
    link = WorkerSocket(args)
    sock, endpoint = link.sock, link.endpoint
    print(f"worker ready on {endpoint} model={greeting.model_name} device={greeting.device} dtype={greeting.dtype}",
          flush=True)
    pending: tuple[bytes, PendingPlan] | None = None  # a launched plan whose journal is not sent yet
    plans: deque[tuple[bytes, worker_pb2.StepPlan]] = deque()  # arrived, not launched yet

    def flush() -> None:
        nonlocal pending
        if pending is not None:
            ident, launched = pending
            pending = None
            journal = finish(engine, launched)
            journal.incarnation = greeting.incarnation
            sock.send_multipart([ident, worker_pb2.WorkerEvent(journal=journal).SerializeToString()])

    def answer(ident: bytes, cmd: worker_pb2.WorkerCommand) -> None:
        reply = worker_pb2.WorkerEvent()
        kind = cmd.WhichOneof("kind")
        if kind == "hello":
            if cmd.hello.release_all:  # a scheduler starting: nothing sent before it is wanted
                plans.clear()
                for request_id in list(engine.canvases) + list(engine.dropped):
                    engine.release(request_id)
            reply.hello.CopyFrom(greeting)
        elif kind == "stats":
            reply.stats.active_requests = len(engine)
            reply.stats.steps = engine.steps
        else:
            reply.error = f"unknown command {kind!r}"
        sock.send_multipart([ident, reply.SerializeToString()])

    try:
        while not link.stopping:
            # Take in everything that arrived: plans wait their turn, in order; hello and stats are
            # answered now (behind a queued plan they would wait a whole step).
            timeout = 0 if pending is not None or plans else 200
            while sock.poll(timeout):
                timeout = 0
                ident, payload = sock.recv_multipart()
                try:
                    cmd = worker_pb2.WorkerCommand.FromString(payload)
                except Exception as e:  # noqa: BLE001 - a bad frame must not kill the worker
                    sock.send_multipart([ident, worker_pb2.WorkerEvent(
                        error=f"unparseable WorkerCommand: {e}").SerializeToString()])
                    continue
                if cmd.WhichOneof("kind") == "step":
                    plans.append((ident, cmd.step))
                elif cmd.WhichOneof("kind") == "shutdown":
                    flush()
                    return
                else:
                    answer(ident, cmd)
            # A step that finishes no canvas is reported once the GPU has started it (engine.py,
            # PendingStep.ready): the scheduler plans the step after next while the GPU runs this
            # one, so the round trip around a step overlaps two steps, not one. A step that finishes
            # canvases waits for whichever comes first: its codes or the next plan (the scheduler's
            # lookahead), which is launched before the journal is built.
            if pending is not None and pending[1].ready():
                flush()
            if plans:
                ident, plan = plans.popleft()
                launched = launch(engine, plan)
                flush()  # journals go out in plan order
                pending = (ident, launched)
            elif pending is not None:
                time.sleep(0.0001)
    finally:
        link.close()
