"""The OmniVoice scheduling driver and the core's canvas path: CanvasScheduler against a worker
over ZeroMQ, and FrontendLink answering a frontend's CanvasSubmit / Abort / hello / voices.

Most tests use a fake worker (a ROUTER answering as gpu_worker does: canvases held between steps,
a result per step in plan order, codes after the last step) so the rules are checked exactly; the
last ones run the real gpu_worker with its omnivoice-tiny preset, two plans in flight."""

from __future__ import annotations

import asyncio
import os
import sys
import types

import numpy as np
import pytest
import zmq
import zmq.asyncio

from chorus.omnivoice.knobs import NUM_CODEBOOKS, UnmaskKnobs
from chorus.v1 import frontend_pb2, worker_pb2
from chorus.wire import matrix_array, rows_matrix
from scheduler_svc import metrics
from scheduler_svc.canvas_policy import canvas_rows
from scheduler_svc.canvas_scheduler import RESTARTED, CanvasScheduler, CanvasSink
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.frontend_link import FrontendLink
from scheduler_svc.worker_client import WorkerClient


def start_msg(text=6, frames=10, num_step=3, guidance=2.0, seed=1) -> worker_pb2.CanvasStart:
    return worker_pb2.CanvasStart(text_ids=[5] * text, target_frames=frames, seed=seed,
                                  knobs=UnmaskKnobs(num_step=num_step, guidance_scale=guidance).to_proto())


class FakeWorker:
    """An OmniVoice worker's wire behaviour, with its canvases kept between steps."""

    def __init__(self, ctx: zmq.asyncio.Context, max_batch=4, max_packed_rows=200):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.hello = worker_pb2.Hello(model_name="omnivoice-tiny", architecture="omnivoice", max_batch=max_batch,
                                      max_packed_rows=max_packed_rows, incarnation=1)
        self.canvases: dict[int, worker_pb2.CanvasStart] = {}
        self.next_step: dict[int, int] = {}
        self.plans: list[worker_pb2.StepPlan] = []
        self.fail_next: str | None = None
        self.gate = asyncio.Event()  # steps wait for it while cleared...
        self.gate.set()
        self.pause_if = lambda plan: False  # ...and a plan this says yes to clears it
        self.paused = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._serve())

    def restart(self) -> None:
        self.hello.incarnation += 1
        self.canvases.clear()
        self.next_step.clear()

    async def _serve(self) -> None:
        while True:
            ident, payload = await self.sock.recv_multipart()
            cmd = worker_pb2.WorkerCommand.FromString(payload)
            if cmd.WhichOneof("kind") == "hello":
                event = worker_pb2.WorkerEvent(hello=self.hello)
            else:
                if self.pause_if(cmd.step):
                    self.gate.clear()
                if not self.gate.is_set():
                    self.paused.set()
                await self.gate.wait()
                event = worker_pb2.WorkerEvent(journal=self._step(cmd.step))
            await self.sock.send_multipart([ident, event.SerializeToString()])

    def _step(self, plan: worker_pb2.StepPlan) -> worker_pb2.Journal:
        self.plans.append(plan)
        j = worker_pb2.Journal(step_id=plan.step_id, incarnation=self.hello.incarnation, step_ms=1.0)
        if self.fail_next:
            j.error, self.fail_next = self.fail_next, None
            return j
        for rid in plan.release:
            self.canvases.pop(rid, None)
        for start in plan.canvas_start:
            assert start.request_id not in self.canvases
            self.canvases[start.request_id] = start
            self.next_step[start.request_id] = 0
        if any(item.request_id not in self.canvases for item in plan.canvas_step):
            j.error = "unknown canvas"
            return j
        assert len(plan.canvas_step) <= self.hello.max_batch
        assert sum(canvas_rows(self.canvases[i.request_id]) for i in plan.canvas_step) <= self.hello.max_packed_rows
        for item in plan.canvas_step:
            start = self.canvases[item.request_id]
            assert item.step == self.next_step[item.request_id]
            self.next_step[item.request_id] += 1
            r = j.canvases.add(request_id=item.request_id, step=item.step,
                               finished=item.step == start.knobs.num_step - 1)
            if r.finished:
                r.codes.CopyFrom(rows_matrix(np.full((start.target_frames, NUM_CODEBOOKS), start.seed, np.int32)))
        return j

    def close(self) -> None:
        self.task.cancel()
        self.sock.close()


class Collect(CanvasSink):
    def __init__(self):
        self.done = asyncio.Queue()
        self.ended = []  # every canvas the sink heard of, to check each ends once

    def canvas_done(self, canvas):
        self.ended.append(canvas)
        self.done.put_nowait(canvas)

    def check_once(self) -> None:
        assert len({id(c) for c in self.ended}) == len(self.ended), "a canvas ended twice"


def lookahead_steps(model: str = "omnivoice-tiny") -> float:
    return metrics.REGISTRY.get_sample_value("chorus_canvas_lookahead_steps_total", {"model": model}) or 0.0


def run(test, lookahead=True, **worker_kw):
    """test(fake worker, its CanvasScheduler, the sink) on a fresh event loop."""
    async def main():
        ctx = zmq.asyncio.Context()
        fake = FakeWorker(ctx, **worker_kw)
        client = WorkerClient(fake.endpoint, ctx)
        sink = Collect()
        config = SchedulerConfig(max_queue=8, worker_probe=0.5, restart_wait=1.0, step_timeout=5.0,
                                 lookahead=lookahead)
        sched = CanvasScheduler(client, await client.hello(), config, sink)
        sched.start()
        try:
            await asyncio.wait_for(test(fake, sched, sink), 30)
            sink.check_once()
        finally:
            await sched.stop()
            await client.close()
            fake.close()
            ctx.destroy(0)
    asyncio.run(main())


async def drain(sink: Collect, n: int) -> list:
    return [await sink.done.get() for _ in range(n)]


def turnarounds(model: str = "omnivoice-tiny") -> tuple[float, float]:
    """(count, sum in ms) of the core's journal-to-next-plan turnarounds so far."""
    get = metrics.REGISTRY.get_sample_value
    return (get("chorus_canvas_turnaround_ms_count", {"model": model}) or 0.0,
            get("chorus_canvas_turnaround_ms_sum", {"model": model}) or 0.0)


def test_turnaround_counts_journal_to_next_plan_and_not_the_wait_for_new_canvases():
    async def test(fake, sched, sink):
        n0, ms0 = turnarounds()
        sched.submit(start_msg(num_step=4, seed=1))
        await drain(sink, 1)
        await asyncio.sleep(0.3)  # idle: no canvas; the next plan answers a submit, not a journal
        sched.submit(start_msg(num_step=4, seed=2))
        await drain(sink, 1)
        n1, ms1 = turnarounds()
        assert n1 - n0 >= 2 and ms1 - ms0 < 250

    run(test)


def test_canvases_of_different_lengths_share_steps_and_end_with_their_codes():
    async def test(fake, sched, sink):
        a = sched.submit(start_msg(num_step=2, seed=11))
        b = sched.submit(start_msg(num_step=5, seed=12))
        c = sched.submit(start_msg(num_step=3, frames=150, guidance=0, seed=13))  # 156 rows: waits for a and b
        done = await drain(sink, 3)
        assert [x.start.seed for x in done] == [11, 12, 13]
        for x in done:
            assert x.error is None and x.codes.shape == (x.start.target_frames, NUM_CODEBOOKS)
            assert (x.codes == x.start.seed).all() and x.t_finished >= x.t_started >= x.t_accepted
        assert c.t_started > b.t_started  # queued until the budget had room
        await asyncio.sleep(0.1)
        assert not fake.canvases and sched.policy.used_rows == 0  # every canvas released on the worker
        firsts = {s.request_id: i for i, p in enumerate(fake.plans) for s in p.canvas_start}
        assert firsts[a.id] == firsts[b.id] == 0 and firsts[c.id] > 0
    run(test)


def test_a_failed_step_fails_its_canvases_only():
    async def test(fake, sched, sink):
        fake.fail_next = "out of memory"
        a = sched.submit(start_msg())
        [done] = await drain(sink, 1)
        assert done is a and a.error == "OmniVoice worker step failed: out of memory"
        b = sched.submit(start_msg(seed=5))
        [done] = await drain(sink, 1)
        assert done is b and b.error is None
    run(test)


def test_a_restarted_worker_fails_the_running_canvases_and_serves_the_next():
    """One plan in flight (lookahead off): the canvases the plan that met the new process started
    are kept."""
    async def test(fake, sched, sink):
        fake.gate.clear()
        a = sched.submit(start_msg(num_step=4))
        await asyncio.sleep(0.2)  # a's first step is held by the worker
        fake.restart()
        fake.gate.set()
        [done] = await drain(sink, 1)  # the journal of a's first step ran on the new process: a is kept...
        assert done is a and a.error is None
        fake.paused.clear()
        b = sched.submit(start_msg(num_step=4, seed=3))
        fake.pause_if = lambda plan: any(i.request_id == b.id and i.step == 1 for i in plan.canvas_step)
        await fake.paused.wait()  # b's second step waits
        fake.restart()  # ...but b's later steps find nothing on the next one
        fake.gate.set()
        [done] = await drain(sink, 1)
        assert done is b and b.error == RESTARTED and "unavailable" in b.error
        c = sched.submit(start_msg(seed=4))
        [done] = await drain(sink, 1)
        assert done is c and c.error is None
    run(test, lookahead=False)


def test_a_restart_with_two_plans_in_flight_fails_the_running_once_and_runs_the_waiting():
    async def test(fake, sched, sink):
        before = lookahead_steps()
        fake.gate.clear()
        a = sched.submit(start_msg(num_step=6, seed=2))                     # 26 rows
        w = sched.submit(start_msg(num_step=2, frames=170, guidance=0, seed=3))  # 176 rows: waits for a
        await fake.paused.wait()
        while lookahead_steps() == before:  # plan 2 is sent while plan 1 waits at the worker
            await asyncio.sleep(0.01)
        assert lookahead_steps() == before + 1 and w in sched.policy.waiting
        fake.restart()  # the new process meets plan 1 (a's start and step 0) and then plan 2 (a's step 1)
        fake.gate.set()
        [done] = await drain(sink, 1)
        assert done is a and a.error == RESTARTED  # plan 2 names a too: nothing is kept
        [done] = await drain(sink, 1)
        assert done is w and w.error is None and (w.codes == 3).all()
        await asyncio.sleep(0.1)
        assert not fake.canvases and sink.done.empty()
    run(test)


def test_cancel_releases_on_the_worker_and_tells_nobody():
    async def test(fake, sched, sink):
        a = sched.submit(start_msg(num_step=64))
        while not fake.canvases:
            await asyncio.sleep(0.01)
        sched.cancel(a)
        sched.cancel(a)
        b = sched.submit(start_msg(num_step=1, seed=9))
        [done] = await drain(sink, 1)
        assert done is b
        while fake.canvases:
            await asyncio.sleep(0.01)
        assert a.id in [rid for p in fake.plans for rid in p.release] and sched.policy.used_rows == 0
    run(test)


def test_random_cancellations_leave_no_canvas_on_the_worker():
    async def test(fake, sched, sink):
        rng = np.random.default_rng(0)
        live = []
        for i in range(100):
            live.append(sched.submit(start_msg(frames=int(rng.integers(1, 40)), num_step=int(rng.integers(1, 8)),
                                               guidance=float(rng.choice([0.0, 2.0])), seed=i)))
            if rng.random() < 0.7:
                sched.cancel(live.pop(int(rng.integers(len(live)))))
            await asyncio.sleep(float(rng.choice([0, 0.002])))
        for c in live:
            if rng.random() < 0.5:
                sched.cancel(c)
        p = sched.policy
        while p.running or p.waiting or p.pending_release or fake.canvases:  # run() times out if never
            await asyncio.sleep(0.01)
        assert p.used_rows == 0
        ended = [sink.done.get_nowait() for _ in range(sink.done.qsize())]
        assert all(c.error is None and not c.cancelled for c in ended) and len(ended) > 5
    run(test, max_packed_rows=300)


# ---- the core's link --------------------------------------------------------------------------

class Frontend:
    """A frontend's DEALER end of the core link."""

    def __init__(self, ctx, endpoint):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    async def send(self, call=0, **kind) -> None:
        await self.sock.send(frontend_pb2.FrontendMessage(call=call, **kind).SerializeToString())

    async def recv(self) -> frontend_pb2.CoreMessage:
        return frontend_pb2.CoreMessage.FromString(await asyncio.wait_for(self.sock.recv(), 10))


def moss_stub():
    hello = worker_pb2.Hello(model_name="moss-tiny", architecture="moss_tts_local")
    return types.SimpleNamespace(hello=hello, kv=types.SimpleNamespace(num_pages=4, page_size=16),
                                 heartbeat=types.SimpleNamespace(up=True),
                                 policy=types.SimpleNamespace(waiting=[], running={}))


def test_the_core_link_routes_canvases_by_model_and_aborts_by_ticket(tmp_path):
    async def test(fake, sched, sink):
        ctx = zmq.asyncio.Context.instance()
        link = FrontendLink(f"ipc://{tmp_path}/core")
        sched.sink = link
        link.start(moss_stub(), [sched], "omnivoice")
        fe = Frontend(ctx, link.endpoint)
        try:
            await fe.send(call=1, hello=frontend_pb2.CoreHelloRequest())
            hello = (await fe.recv()).hello
            assert [w.model_name for w in hello.canvas_workers] == ["omnivoice-tiny"]
            assert hello.default_model == "omnivoice-tiny" and hello.worker.model_name == "moss-tiny"
            health = await fe.recv()  # which models have no worker answering: none
            assert health.WhichOneof("kind") == "health" and list(health.health.down) == []

            for ticket, model in ((1, "omnivoice"), (2, "omnivoice-tiny"), (3, "")):  # alias, name, default
                await fe.send(call=10 + ticket, canvas_submit=frontend_pb2.CanvasSubmit(
                    ticket=ticket, model=model, canvas=start_msg(seed=ticket)))
                sub = (await fe.recv()).submitted
                assert (sub.ticket, sub.queue_full) == (ticket, "") and sub.request_id
                done = (await fe.recv()).canvas_done
                assert done.ticket == ticket and not done.error and done.generate_ms > 0
                assert (matrix_array(done.codes) == ticket).all()

            await fe.send(call=20, canvas_submit=frontend_pb2.CanvasSubmit(ticket=4, model="moss",
                                                                          canvas=start_msg()))
            msgs = [await fe.recv(), await fe.recv()]
            assert msgs[0].submitted.ticket == 4 and msgs[0].call == 20
            assert msgs[1].canvas_done.ticket == 4 and "not an OmniVoice model" in msgs[1].canvas_done.error

            await fe.send(call=21, canvas_submit=frontend_pb2.CanvasSubmit(ticket=5, canvas=start_msg(frames=300)))
            assert "budget of 200" in (await fe.recv()).submitted.queue_full

            fake.gate.clear()
            await fe.send(call=22, canvas_submit=frontend_pb2.CanvasSubmit(ticket=6, canvas=start_msg(num_step=9)))
            assert (await fe.recv()).submitted.request_id
            await fe.send(abort=frontend_pb2.Abort(ticket=6))
            fake.gate.set()
            await fe.send(call=23, canvas_submit=frontend_pb2.CanvasSubmit(ticket=7, canvas=start_msg(seed=7)))
            assert (await fe.recv()).submitted.ticket == 7
            assert (await fe.recv()).canvas_done.ticket == 7  # nothing came for the aborted ticket 6
            assert not link._canvases and not link._canvas_origin

        finally:
            fe.sock.close()
            link.close()
    run(test)


def test_workers_serving_one_model_share_its_canvases(tmp_path):
    """Each canvas goes to the least loaded worker of its model that can take it."""
    async def main():
        ctx = zmq.asyncio.Context()
        fakes = [FakeWorker(ctx, max_packed_rows=200), FakeWorker(ctx, max_packed_rows=1000)]
        link = FrontendLink(f"ipc://{tmp_path}/core", ctx=ctx)
        clients = [WorkerClient(f.endpoint, ctx) for f in fakes]
        scheds = [CanvasScheduler(c, await c.hello(), SchedulerConfig(), link) for c in clients]
        for s in scheds:
            s.start()
        link.start(moss_stub(), scheds)
        fe = Frontend(ctx, link.endpoint)
        try:
            for f in fakes:
                f.gate.clear()  # nothing finishes: each canvas adds to its worker's load
            for ticket in range(1, 5):  # alternating: a tie goes to the first worker
                await fe.send(call=ticket, canvas_submit=frontend_pb2.CanvasSubmit(ticket=ticket, model="omnivoice",
                                                                                  canvas=start_msg(num_step=2)))
                assert (await fe.recv()).submitted.request_id
            await fe.send(call=9, canvas_submit=frontend_pb2.CanvasSubmit(ticket=9, canvas=start_msg(frames=300),
                                                                         model="omnivoice-tiny"))
            assert (await fe.recv()).submitted.request_id  # 606 rows: only the second worker's budget holds it
            for f in fakes:
                f.gate.set()
            tickets = sorted([(await fe.recv()).canvas_done.ticket for _ in range(5)])
            assert tickets == [1, 2, 3, 4, 9]
            starts = [[s.target_frames for p in f.plans for s in p.canvas_start] for f in fakes]
            assert len(starts[0]) == 2 and len(starts[1]) == 3 and 300 in starts[1]
        finally:
            fe.sock.close()
            link.close()
            for s, c, f in zip(scheds, clients, fakes):
                await s.stop()
                await c.close()
                f.close()
            ctx.destroy(0)
    asyncio.run(asyncio.wait_for(main(), 30))


def test_the_core_process_greets_its_omnivoice_workers():
    """scheduler_svc.server with a fake OmniVoice worker beside the tiny MOSS one: its `ready on` line
    names both models and the default; the canvas metrics are served."""
    import threading
    import urllib.request

    from helpers import make_cluster

    ready = threading.Event()
    box = {}

    def serve_fake():
        async def main():
            ctx = zmq.asyncio.Context()
            box["fake"] = FakeWorker(ctx)
            box["stop"] = asyncio.Event()
            ready.set()
            await box["stop"].wait()
            box["fake"].close()
            ctx.destroy(0)
        box["loop"] = asyncio.new_event_loop()
        box["loop"].run_until_complete(main())

    from test_vocoder_service import start_vocoder

    thread = threading.Thread(target=serve_fake, daemon=True)
    thread.start()
    assert ready.wait(10)
    codec, codec_address, _, _ = start_vocoder("--preset", "higgs-tiny", "--metrics-port", "0", "--grace", "1")
    try:
        with make_cluster(scheduler_args=["--omnivoice-worker", box["fake"].endpoint, "--omnivoice-vocoder",
                                          codec_address, "--default-model", "omnivoice"]) as c:
            line = next(x for x in c.service("scheduler").lines if "ready on" in x)
            models = line.split("models=")[1].split()[0].split(",")
            assert models[1:] == ["omnivoice-tiny"] and " default=omnivoice-tiny " in line
            with urllib.request.urlopen(f"http://127.0.0.1:{c.metrics_port}/metrics", timeout=10) as r:
                assert 'chorus_canvas_queue_depth{model="omnivoice-tiny"} 0.0' in r.read().decode()
    finally:
        codec.terminate()
        codec.wait(20)
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(10)


# ---- the real worker --------------------------------------------------------------------------

class RealWorker:
    """The tiny OmniVoice worker process, in float64, on one endpoint."""

    def __init__(self):
        from chorus.processes import Service, free_port

        self.service = Service("omnivoice-worker", [
            sys.executable, "-m", "gpu_worker.server", "--preset", "omnivoice-tiny", "--bind",
            f"tcp://127.0.0.1:{free_port()}", "--dtype", "float64"])
        self.endpoint = self._start()

    def _start(self) -> str:
        self.service.start(echo=False, env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
        return self.service.wait_ready(300)

    def kill(self) -> None:
        self.service.proc.kill()
        self.service.proc.wait(10)

    def start_again(self) -> None:
        """A new process (another incarnation) on the same endpoint."""
        from chorus.processes import Service

        self.service = Service(self.service.name, self.service.argv)
        assert self._start() == self.endpoint


@pytest.fixture(scope="module")
def real_worker():
    worker = RealWorker()
    try:
        yield worker
    finally:
        worker.service.stop()


def run_real(worker: RealWorker, test, max_batch: int | None = None, **config):
    """test(its CanvasScheduler, the sink, the plans sent) against the real worker, which first drops
    whatever an earlier scheduler left (as the core's first hello does). max_batch: the scheduler's
    own, below the worker's."""
    async def main():
        client = WorkerClient(worker.endpoint)
        sent: list[worker_pb2.StepPlan] = []
        step = client.step

        def record(plan, timeout=None):
            sent.append(plan)
            return step(plan, timeout=timeout)

        client.step = record
        hello = await client.hello(timeout=60, release_all=True)
        assert hello.architecture == "omnivoice" and hello.max_packed_rows > 0
        if max_batch is not None:
            hello.max_batch = max_batch
        sink = Collect()
        sched = CanvasScheduler(client, hello, SchedulerConfig(**config), sink)
        sched.start()
        try:
            await asyncio.wait_for(test(sched, sink, sent), 240)
            sink.check_once()
            while (await client.stats()).active_requests:  # every canvas released on the worker
                await asyncio.sleep(0.02)
        finally:
            await sched.stop()
            await client.close()

    asyncio.run(main())


def test_canvases_through_a_real_omnivoice_worker_with_and_without_lookahead(real_worker):
    """Canvases of different lengths, steps and guidance packed together each end with a full canvas,
    and a seeded one (position noise on) gets the same codes alone, packed beside canvases at other
    step indices, with one plan in flight or two."""
    from chorus.omnivoice.prompt import plan_pieces
    from chorus.omnivoice.tokenizer import load_omnivoice_tokenizer

    tokenizer = load_omnivoice_tokenizer(None)
    pieces = [plan_pieces(tokenizer, text)[0] for text in ("Hello there.", "你好，世界。", "A short one.")]
    starts = [worker_pb2.CanvasStart(
        text_ids=p.text_ids, target_frames=p.target_frames, seed=40 + i, knobs=UnmaskKnobs(
            num_step=[16, 4, 3][i], guidance_scale=[2.0, 0.0, 1.5][i], position_temperature=[0, 5, 0][i]).to_proto())
        for i, p in enumerate(pieces)]
    codes = {}

    def copy(start):
        return worker_pb2.CanvasStart.FromString(start.SerializeToString())

    for lookahead in (False, True):
        async def test(sched, sink, sent):
            before = lookahead_steps()
            alone = sched.submit(copy(starts[1]))
            await drain(sink, 1)
            neighbours = [sched.submit(copy(starts[i])) for i in (0, 2)]
            while neighbours[0].steps_done < 2:  # the seeded canvas joins them at other step indices
                await asyncio.sleep(0.005)
            packed = sched.submit(copy(starts[1]))
            await drain(sink, 3)
            assert neighbours[0].t_started < packed.t_started < neighbours[0].t_finished
            for c in [alone, packed, *neighbours]:
                assert c.error is None, c.error
                assert c.codes.shape == (c.start.target_frames, NUM_CODEBOOKS)
                assert ((0 <= c.codes) & (c.codes < 1024)).all()  # no mask token left
            codes[lookahead] = (alone.codes, packed.codes, neighbours[0].codes)
            assert (lookahead_steps() > before) == lookahead  # two plans in flight exactly when on

        run_real(real_worker, test, lookahead=lookahead)
    seeded = codes[False][0]
    for c in (codes[False][1], codes[True][0], codes[True][1]):
        assert np.array_equal(c, seeded)
    assert np.array_equal(codes[True][2], codes[False][2])


def test_a_failed_plan_with_the_next_in_flight_fails_only_its_canvases(real_worker):
    """Plan 1 starts a canvas the worker refuses (a text id past the vocabulary) beside x; plan 2,
    sent before plan 1's journal, steps x again and starts z in the slot the refused canvas's only
    step left: the worker skips x's step and runs z's; x and the refused canvas fail once each."""
    async def test(sched, sink, sent):
        before = lookahead_steps()
        bad = worker_pb2.CanvasStart(text_ids=[5, 10**6], target_frames=8, seed=1,
                                     knobs=UnmaskKnobs(num_step=1).to_proto())
        y = sched.submit(bad)
        x = sched.submit(start_msg(num_step=3, seed=2))
        z = sched.submit(start_msg(num_step=2, seed=3))
        done = await drain(sink, 3)
        assert [s.request_id for s in sent[0].canvas_start] == [y.id, x.id]
        assert [s.request_id for s in sent[1].canvas_start] == [z.id]
        assert [(s.request_id, s.step) for s in sent[1].canvas_step] == [(x.id, 1), (z.id, 0)]
        assert lookahead_steps() > before
        assert set(map(id, done)) == {id(x), id(y), id(z)}
        for c in (x, y):
            assert c.error.startswith("OmniVoice worker step failed") and "text_ids" in c.error
        assert z.error is None and z.codes.shape == (10, NUM_CODEBOOKS) and (z.codes < 1024).all()
        assert {x.id, y.id} <= {rid for p in sent for rid in p.release}

    run_real(real_worker, test, max_batch=2)


def test_cancelling_a_canvas_whose_next_step_is_in_flight(real_worker):
    async def test(sched, sink, sent):
        x = sched.submit(start_msg(num_step=64, seed=5))
        while x.steps_done < 2:
            await asyncio.sleep(0.005)
        assert any(s.request_id == x.id for f in sched.inflight for s in f.plan.canvas_step)
        cancelled_at = len(sent)
        sched.cancel(x)
        z = sched.submit(start_msg(num_step=2, seed=6))
        [done] = await drain(sink, 1)
        assert done is z and z.error is None and x.cancelled and x.codes is None
        assert any(x.id in p.release for p in sent[cancelled_at:])
        assert not any(s.request_id == x.id for p in sent[cancelled_at:] for s in p.canvas_step)

    run_real(real_worker, test)


def test_a_worker_restart_with_two_plans_in_flight(real_worker):
    """The worker process dies with two plans out and another takes its endpoint: the running canvas
    ends RESTARTED once, the waiting one runs on the new process. (Heartbeat off: the late journal's
    hello finds the new process.)"""
    async def test(sched, sink, sent):
        x = sched.submit(start_msg(num_step=64, seed=7))
        w = sched.submit(start_msg(num_step=3, seed=8))  # waits: the scheduler runs one canvas at a time
        before = lookahead_steps()
        while x.steps_done < 1 or lookahead_steps() == before:
            await asyncio.sleep(0.005)
        assert sched.inflight and w in sched.policy.waiting
        real_worker.kill()
        await asyncio.get_running_loop().run_in_executor(None, real_worker.start_again)
        [done] = await drain(sink, 1)
        assert done is x and x.error == RESTARTED
        [done] = await drain(sink, 1)
        assert done is w and w.error is None and w.codes.shape == (10, NUM_CODEBOOKS)

    run_real(real_worker, test, max_batch=1, worker_heartbeat=0, worker_probe=0.3)


def test_canvas_scheduler_bench_runs_its_levels():
    """chorus.bench.canvas_scheduler_bench: the real scheduler against its instant worker process,
    every canvas ending with its codes, at each depth asked."""
    from chorus.bench.canvas_scheduler_bench import run

    args = types.SimpleNamespace(streams=[1, 2], depths=[1, 2], requests=3, frames=10, num_step=3)
    levels = asyncio.run(run(args))
    assert [(lv["depth"], lv["streams"]) for lv in levels] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert [lv["requests"] for lv in levels] == [3, 4, 3, 4] and all(lv["us_per_step"] > 0 for lv in levels)
