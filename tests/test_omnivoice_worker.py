"""The OmniVoice worker: choosing the model, plans to journals, and the real ZeroMQ worker process."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch
import zmq

from chorus.config import parse
from chorus.processes import Service
from chorus.omnivoice.config import OmniVoiceConfig, tiny_config
from chorus.omnivoice.knobs import UnmaskKnobs
from chorus.v1 import worker_pb2
from chorus.wire import matrix_array, rows_matrix
from gpu_worker.config import WorkerConfig
from gpu_worker.omnivoice.engine import CanvasEngine, CanvasSpec
from gpu_worker.omnivoice.loader import build_omnivoice
from gpu_worker.omnivoice.service import build_engine, execute, finish, hello, launch, serves_omnivoice

torch.set_num_threads(1)
MASK = 1024
KNOBS = UnmaskKnobs(num_step=4, position_temperature=5.0, class_temperature=0.5)


def _start(rid: int, frames: int, knobs: UnmaskKnobs = KNOBS, reference: np.ndarray | None = None, seed: int = 3):
    m = worker_pb2.CanvasStart(request_id=rid, text_ids=list(range(100, 112)), target_frames=frames,
                               knobs=knobs.to_proto(), seed=seed)
    if reference is not None:
        m.reference_codes.CopyFrom(rows_matrix(reference))
    return m


def _plan(step_id: int, *, start=(), step=(), release=()) -> worker_pb2.StepPlan:
    return worker_pb2.StepPlan(step_id=step_id, canvas_start=list(start), release=list(release),
                               canvas_step=[worker_pb2.CanvasStep(request_id=r, step=k) for r, k in step])


def _args(*flags: str) -> WorkerConfig:
    return parse(WorkerConfig, list(flags))


def test_the_worker_chooses_omnivoice_by_preset_or_checkpoint(tmp_path):
    assert serves_omnivoice(_args("--preset", "omnivoice-tiny"))
    assert not serves_omnivoice(_args("--preset", "tiny"))
    ckpt = tmp_path / "my-omnivoice"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(tiny_config().to_dict() | {"chorus_name": None}))
    args = _args("--model", str(ckpt), "--load-format", "dummy", "--max-packed-rows", "900", "--max-batch", "3")
    assert serves_omnivoice(args) and args.max_packed_rows == 900
    greeting = hello(args, build_engine(args))
    assert greeting.architecture == "omnivoice" and greeting.model_name == "my-omnivoice"
    assert greeting.max_batch == 3 and greeting.max_packed_rows == 900 and greeting.incarnation
    assert OmniVoiceConfig.from_dict(json.loads(greeting.model_config_json)).hidden_size == 64
    (ckpt / "config.json").write_text(json.dumps({"model_type": "moss_tts_local"}))
    assert not serves_omnivoice(args)
    assert _args().max_packed_rows == 24576


def test_plans_become_journals_in_plan_order():
    engine = CanvasEngine(build_omnivoice(preset="tiny", seed=1), max_batch=4, max_packed_rows=400)
    ref = np.random.default_rng(1).integers(0, 1024, (5, 8))
    j = execute(engine, _plan(1, start=[_start(7, 6), _start(3, 9, reference=ref)], step=[(3, 0), (7, 0)]))
    assert not j.error and [(c.request_id, c.step, c.finished) for c in j.canvases] == [(3, 0, False), (7, 0, False)]
    for k in (1, 2):
        j = execute(engine, _plan(k + 1, step=[(7, k), (3, k)]))
    j = execute(engine, _plan(4, step=[(7, 3), (3, 3)]))
    assert [c.finished for c in j.canvases] == [True, True] and len(engine) == 0
    codes = matrix_array(j.canvases[1].codes)
    assert codes.shape == (9, 8) and (codes < MASK).all()

    # A failing plan: an error journal, its canvases dropped, the engine still serves.
    execute(engine, _plan(5, start=[_start(1, 4)], step=[(1, 0)]))
    j = execute(engine, _plan(6, start=[_start(2, 4)], step=[(1, 1), (2, 0), (99, 0)]))
    assert "99" in j.error and not j.canvases and len(engine) == 0
    j = execute(engine, _plan(7, start=[_start(2, 4, knobs=UnmaskKnobs(num_step=0))]))
    assert "num_step" in j.error and len(engine) == 0
    moss = worker_pb2.StepPlan(step_id=8, prefill=[worker_pb2.PrefillItem(request_id=1)])
    assert "OmniVoice" in execute(engine, moss).error
    j = execute(engine, _plan(9, start=[_start(5, 3)], step=[(5, 0)]))
    assert not j.error and len(engine) == 1
    assert not execute(engine, _plan(10, release=[5, 6])).error and len(engine) == 0


def test_a_plan_sent_before_a_failure_was_heard_skips_the_dropped_canvases():
    engine = CanvasEngine(build_omnivoice(preset="tiny", seed=1), max_batch=4, max_packed_rows=400)
    assert not execute(engine, _plan(1, start=[_start(1, 5), _start(2, 5)], step=[(1, 0), (2, 0)])).error
    failed = launch(engine, _plan(2, start=[_start(3, 4, knobs=UnmaskKnobs(num_step=0))], step=[(1, 1), (3, 0)]))
    later = launch(engine, _plan(3, start=[_start(4, 4)], step=[(1, 2), (2, 1), (3, 1), (4, 0)]))
    j = finish(engine, failed)
    assert "num_step" in j.error and not j.canvases and engine.dropped == {1, 3}
    j = finish(engine, later)  # launched before the failure was sent: 1 and 3 skipped, 2 and 4 run
    assert not j.error and sorted(j.skipped) == [1, 3]
    assert [(c.request_id, c.step) for c in j.canvases] == [(2, 1), (4, 0)]
    assert not execute(engine, _plan(4, release=[1, 3], step=[(2, 2), (4, 1)])).error and not engine.dropped
    j = execute(engine, _plan(5, step=[(1, 3)]))  # released: a step of it is a bad plan again
    assert "no canvas is held" in j.error


@pytest.fixture(scope="module")
def worker():
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    service = Service("worker", [sys.executable, "-m", "gpu_worker.server", "--bind", "tcp://127.0.0.1:0",
                                 "--preset", "omnivoice-tiny", "--seed", "4", "--max-batch", "4",
                                 "--max-packed-rows", "600"])
    service.start(echo=False, env=env)
    try:
        endpoint = service.wait_ready(120)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 60_000)
        sock.connect(endpoint)
        try:
            yield sock
        finally:
            sock.close()
            ctx.term()
    finally:
        service.stop()


def _ask(sock, **command) -> worker_pb2.WorkerEvent:
    sock.send(worker_pb2.WorkerCommand(**command).SerializeToString())
    return worker_pb2.WorkerEvent.FromString(sock.recv())


def test_the_worker_process_runs_canvases(worker):
    greeting = _ask(worker, hello=worker_pb2.HelloRequest()).hello
    assert greeting.architecture == "omnivoice" and greeting.model_name == "omnivoice-tiny"
    assert greeting.max_batch == 4 and greeting.max_packed_rows == 600
    assert OmniVoiceConfig.from_dict(json.loads(greeting.model_config_json)) == tiny_config()

    ref = np.random.default_rng(2).integers(0, 1024, (7, 8))
    guided_off = UnmaskKnobs(num_step=3, guidance_scale=0.0, position_temperature=0.0)
    journals = [_ask(worker, step=_plan(1, start=[_start(10, 8, reference=ref), _start(11, 5, knobs=guided_off)],
                                        step=[(11, 0), (10, 0)])).journal]
    journals.append(_ask(worker, step=_plan(2, start=[_start(12, 6)], step=[(10, 1), (12, 0), (11, 1)])).journal)
    for j in journals:
        assert not j.error and j.incarnation == greeting.incarnation and j.step_ms > 0
    assert [(c.request_id, c.step) for c in journals[1].canvases] == [(10, 1), (12, 0), (11, 1)]
    finished = {}
    step_id = 3
    while len(finished) < 3:
        todo = [(10, 2), (11, 2), (12, 1)] if step_id == 3 else [(10, 3), (12, 2)] if step_id == 4 else [(12, 3)]
        j = _ask(worker, step=_plan(step_id, step=[t for t in todo if t[0] not in finished])).journal
        assert not j.error
        finished |= {c.request_id: matrix_array(c.codes) for c in j.canvases if c.finished}
        step_id += 1

    # The same requests in this process, one at a time: the wire changes no token.
    engine = CanvasEngine(build_omnivoice(preset="tiny", seed=4))
    for start in (_start(10, 8, reference=ref), _start(11, 5, knobs=guided_off), _start(12, 6)):
        spec = CanvasSpec(start.request_id, np.asarray(start.text_ids), None if not start.reference_codes.rows
                          else matrix_array(start.reference_codes).astype(np.int64), start.target_frames,
                          UnmaskKnobs.from_proto(start.knobs), start.seed)
        engine.start(spec)
        for k in range(spec.knobs.num_step):
            (outcome,) = engine.step([(spec.request_id, k)])
        assert np.array_equal(finished[spec.request_id], outcome.codes)

    # A failing step: an error journal, and the worker keeps serving; release frees what is held.
    j = _ask(worker, step=_plan(20, start=[_start(30, 4)], step=[(30, 0), (31, 0)])).journal
    assert j.error and "31" in j.error and j.incarnation == greeting.incarnation
    assert _ask(worker, stats=worker_pb2.StatsRequest()).stats.active_requests == 0
    assert not _ask(worker, step=_plan(21, start=[_start(32, 4)], step=[(32, 0)])).journal.error
    assert _ask(worker, stats=worker_pb2.StatsRequest()).stats.active_requests == 1
    assert not _ask(worker, step=_plan(22, release=[32])).journal.error
    assert _ask(worker, stats=worker_pb2.StatsRequest()).stats.active_requests == 0
    assert _ask(worker, hello=worker_pb2.HelloRequest()).hello.incarnation == greeting.incarnation

    # Two plans sent at once, the first failing (41 fits alone, not beside 40): journals in plan order, the
    # second runs what the first did not drop.
    assert not _ask(worker, step=_plan(23, start=[_start(40, 4)], step=[(40, 0)])).journal.error
    for plan in (_plan(24, start=[_start(41, 290)], step=[(40, 1), (41, 0)]),
                 _plan(25, start=[_start(42, 4)], step=[(40, 2), (41, 1), (42, 0)])):
        worker.send(worker_pb2.WorkerCommand(step=plan).SerializeToString())
    first, second = (worker_pb2.WorkerEvent.FromString(worker.recv()).journal for _ in range(2))
    assert (first.step_id, second.step_id) == (24, 25) and first.error.count("canvas_step: ") == 1
    assert not second.error and sorted(second.skipped) == [40, 41] and [c.request_id for c in second.canvases] == [42]
    assert not _ask(worker, step=_plan(26, release=[40, 41, 42])).journal.error
    assert _ask(worker, stats=worker_pb2.StatsRequest()).stats.active_requests == 0
