"""OmniVoice's scheduling loop on its own: how long the round trip around one unmasking step takes
(the journal over ZeroMQ, the canvas scheduler applying it and planning, the plan back) with an
instant worker, at each lookahead depth.

With `lookahead_depth` plans in flight, the worker has a plan to launch as soon as the one before is
launched only while this round trip plus the worker's own host work per step stays under
(depth - 1) GPU steps. The instant worker (another process, answering each plan at once with a
result per canvas and zero codes after the last step) is a benchmark fixture: a real worker's step
would hide the loop's own cost, which is what is measured here.

    python -m chorus.bench.canvas_scheduler_bench --streams 1,8 --depths 1,2,3 --out canvas_loop.json
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np

from chorus.bench import cpu_fixture
from chorus.omnivoice.knobs import NUM_CODEBOOKS, UnmaskKnobs
from chorus.v1 import worker_pb2
from chorus.wire import rows_matrix
from scheduler_svc.canvas_policy import Canvas
from scheduler_svc.canvas_scheduler import CanvasScheduler, CanvasSink
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.worker_client import WorkerClient


def _instant_worker(port_q, max_batch: int) -> None:
    """Answers each StepPlan at once: a result per canvas step, zero codes after its last step."""
    import zmq

    sock = zmq.Context().socket(zmq.ROUTER)
    port_q.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    hello = worker_pb2.Hello(model_name="instant", architecture="omnivoice", max_batch=max_batch,
                             max_packed_rows=0, device="cpu", dtype="none", pid=os.getpid(), incarnation=1)
    canvases: dict[int, worker_pb2.CanvasStart] = {}
    while True:
        ident, payload = sock.recv_multipart()
        cmd = worker_pb2.WorkerCommand.FromString(payload)
        reply = worker_pb2.WorkerEvent()
        kind = cmd.WhichOneof("kind")
        if kind == "hello":
            reply.hello.CopyFrom(hello)
        elif kind == "stats":
            reply.stats.active_requests = len(canvases)
        elif kind == "step":
            plan, j = cmd.step, reply.journal
            j.step_id, j.incarnation = plan.step_id, hello.incarnation
            for rid in plan.release:
                canvases.pop(rid, None)
            for start in plan.canvas_start:
                canvases[start.request_id] = start
            for s in plan.canvas_step:
                start = canvases[s.request_id]
                result = j.canvases.add(request_id=s.request_id, step=s.step,
                                        finished=s.step == start.knobs.num_step - 1)
                if result.finished:
                    result.codes.CopyFrom(rows_matrix(np.zeros((start.target_frames, NUM_CODEBOOKS), np.int32)))
                    del canvases[s.request_id]
        elif kind == "shutdown":
            break
        sock.send_multipart([ident, reply.SerializeToString()])


class _Sink(CanvasSink):
    def __init__(self):
        self.ended: dict[int, asyncio.Event] = {}

    def canvas_done(self, canvas: Canvas) -> None:
        self.ended.setdefault(canvas.id, asyncio.Event()).set()


async def _level(scheduler: CanvasScheduler, sink: _Sink, streams: int, requests: int, frames: int,
                 num_step: int) -> dict:
    todo = list(range(requests))
    canvas_ms: list[float] = []
    knobs = UnmaskKnobs(num_step=num_step).to_proto()

    async def client() -> None:
        while todo:
            i = todo.pop()
            t0 = time.perf_counter()
            canvas = scheduler.submit(worker_pb2.CanvasStart(text_ids=[5] * 36, target_frames=frames, knobs=knobs,
                                                             seed=i))
            await sink.ended.setdefault(canvas.id, asyncio.Event()).wait()
            del sink.ended[canvas.id]
            assert canvas.error is None, canvas.error
            canvas_ms.append((time.perf_counter() - t0) * 1000)

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(streams)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    steps = requests * num_step
    return {"streams": streams, "requests": requests, "canvas_ms_p50": float(np.median(canvas_ms)),
            # a canvas's time over its steps: at depth 1 the whole round trip around a step
            "us_per_step": float(np.median(canvas_ms)) / num_step * 1000,
            "canvas_steps_per_s": steps / wall, "cpu_us_per_canvas_step": cpu / steps * 1e6}


async def run(args) -> list[dict]:
    proc, port = cpu_fixture.spawn(_instant_worker, max(args.streams))
    levels = []
    try:
        worker = WorkerClient(f"tcp://127.0.0.1:{port}")
        hello = await worker.hello(timeout=30)
        print(f"{'depth':>6} {'streams':>8} {'canvas p50 ms':>14} {'us a step':>14} {'steps/s':>9} "
              f"{'CPU us/step':>12}", flush=True)
        for depth in args.depths:
            sink = _Sink()
            scheduler = CanvasScheduler(worker, hello, SchedulerConfig(lookahead_depth=depth), sink)
            scheduler.start()
            await _level(scheduler, sink, 1, 4, args.frames, args.num_step)  # warm-up
            for n in args.streams:
                lv = {"depth": depth, **await _level(scheduler, sink, n, max(n * 2, args.requests), args.frames,
                                                     args.num_step)}
                levels.append(lv)
                print(f"{depth:>6} {n:>8} {lv['canvas_ms_p50']:>14.1f} {lv['us_per_step']:>14.0f} "
                      f"{lv['canvas_steps_per_s']:>9,.0f} {lv['cpu_us_per_canvas_step']:>12.1f}", flush=True)
            await scheduler.stop()
        await worker.close()
        return levels
    finally:
        proc.kill()


def main() -> None:
    ap = cpu_fixture.parser(__doc__, "2x --streams")
    ap.set_defaults(streams="1,8", requests=40, frames=150)
    ap.add_argument("--depths", default="1,2,3", help="lookahead depths to run, each against a fresh scheduler")
    ap.add_argument("--num-step", type=int, default=32, help="unmasking steps per canvas (O1: 32)")
    args = cpu_fixture.parse(ap)
    args.depths = [int(d) for d in args.depths.split(",")]
    cpu_fixture.save("canvas_scheduler", args, asyncio.run(run(args)))


if __name__ == "__main__":
    main()
