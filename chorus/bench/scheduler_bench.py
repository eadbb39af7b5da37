"""The scheduler's loop on its own: frames per second, and CPU per frame, that one scheduler
process can plan, send, receive and hand to its requests.

It runs the real Scheduler (radix cache, KV allocator, lookahead, prefill, journals over ZeroMQ)
against an instant worker in another process that answers every StepPlan at once with random
codes, and consumes each request's frame events as the relay would. The instant worker is a
benchmark fixture: a real worker's step time would hide the scheduler's own cost, which is what is
measured here.

    python -m chorus.bench.scheduler_bench --streams 16,64,256 --frames 75 --out scheduler_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import time

import numpy as np

from chorus.bench import cpu_fixture
from chorus.v1 import common_pb2, worker_pb2
from scheduler_svc.request import FinishEvent, Request
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.worker_client import WorkerClient

N_VQ, PROMPT = 12, 90


def _instant_worker(port_q: mp.Queue, kv_slots: int, max_batch: int, config_json: str = "",
                    step_ms: float = 0.0) -> None:
    """Answers every StepPlan at once (or after step_ms, a GPU's step time) with random codes.
    config_json: the model config its Hello carries (the scheduler service builds prompts from
    it; the bare Scheduler does not need one)."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    port_q.put(port)
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 1024, (max_batch * 4, 1 + N_VQ)).astype("<i4")
    steps: dict[int, int] = {}  # request id -> frames sampled
    while True:
        ident, payload = sock.recv_multipart()
        cmd = worker_pb2.WorkerCommand.FromString(payload)
        reply = worker_pb2.WorkerEvent()
        kind = cmd.WhichOneof("kind")
        if kind == "hello":
            reply.hello.CopyFrom(worker_pb2.Hello(model_name="instant", architecture="moss_tts_local",
                                                  kv_slots=kv_slots, max_batch=max_batch, max_context=1 << 16,
                                                  device="cpu", dtype="none", pid=os.getpid(),
                                                  model_config_json=config_json))
        elif kind == "stats":
            reply.stats.CopyFrom(worker_pb2.WorkerStats(active_requests=len(steps)))
        elif kind == "step":
            plan = cmd.step
            if step_ms:
                time.sleep(step_ms / 1e3)
            for rid in plan.release:
                steps.pop(rid, None)
            ids = [it.request_id for it in plan.prefill if it.last_chunk] + [it.request_id for it in plan.decode]
            j = reply.journal
            j.step_id = plan.step_id
            j.request_ids.extend(ids)
            j.rows.CopyFrom(common_pb2.IntMatrix(rows=len(ids), cols=1 + N_VQ, data=codes[:len(ids)].tobytes()))
            j.stopped.extend([False] * len(ids))
            gen = []
            for rid in ids:
                n = steps.get(rid, 0)
                gen.append(n)
                steps[rid] = n + 1
            j.generation_steps.extend(gen)
        elif kind == "shutdown":
            break
        sock.send_multipart([ident, reply.SerializeToString()])


async def _level(scheduler: Scheduler, streams: int, requests: int, frames: int, prompts: list[np.ndarray]) -> dict:
    todo = list(range(requests))
    done_frames = 0

    async def client() -> None:
        nonlocal done_frames
        while todo:
            i = todo.pop()
            req = scheduler.submit(Request(prompt_rows=prompts[i % len(prompts)], max_frames=frames,
                                           sampling=worker_pb2.SamplingConfig(seed=i, min_frames=frames)))
            while True:
                event = await req.events.get()
                if isinstance(event, FinishEvent):
                    break
                done_frames += 1

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(streams)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"streams": streams, "requests": requests, "frames": done_frames, "wall_s": wall, "cpu_s": cpu,
            "frames_per_s": done_frames / wall, "cpu_us_per_frame": cpu / done_frames * 1e6}


async def run(args: argparse.Namespace) -> list[dict]:
    max_batch = max(args.streams)
    proc, port = cpu_fixture.spawn(_instant_worker, 1 << 20, max_batch)
    try:
        worker = WorkerClient(f"tcp://127.0.0.1:{port}")
        hello = await worker.hello(timeout=30)
        scheduler = Scheduler(worker, hello, SchedulerConfig(max_queue=4096, max_running=max_batch,
                                                             lookahead=not args.no_lookahead))
        scheduler.start()
        rng = np.random.default_rng(1)
        prompts = [np.concatenate([rng.integers(0, 150000, (PROMPT, 1)), np.full((PROMPT, N_VQ), 1024)],
                                  1).astype(np.int32) for _ in range(64)]
        await _level(scheduler, 4, 8, args.frames, prompts)  # warm-up
        print(f"{'streams':>8} {'requests':>9} {'frames/s':>9} {'CPU us/frame':>13} {'CPU %':>6}", flush=True)
        levels = []
        for n in args.streams:
            lv = await _level(scheduler, n, max(n * 2, args.requests), args.frames, prompts)
            levels.append(lv)
            print(f"{n:>8} {lv['requests']:>9} {lv['frames_per_s']:>9,.0f} {lv['cpu_us_per_frame']:>13.1f} "
                  f"{100 * lv['cpu_s'] / lv['wall_s']:>6.0f}", flush=True)
        await scheduler.stop()
        await worker.close()
        return levels
    finally:
        proc.kill()


def main() -> None:
    ap = cpu_fixture.parser(__doc__, "2x --streams")
    ap.add_argument("--no-lookahead", action="store_true", help="wait for each step's journal before planning the next")
    args = cpu_fixture.parse(ap)
    cpu_fixture.save("scheduler", args, asyncio.run(run(args)))


if __name__ == "__main__":
    main()
