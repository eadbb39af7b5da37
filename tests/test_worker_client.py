"""scheduler_svc.worker_client: journals find their plans by step id."""

import asyncio

import zmq
import zmq.asyncio

from chorus.v1 import worker_pb2
from scheduler_svc.worker_client import WorkerClient, WorkerUnavailable


def test_journals_match_their_steps_by_id_and_late_ones_are_dropped():
    """A journal lost with a dead worker (here: one that comes after its step timed out) must not be
    handed to the next step's waiter; journals that come back out of order still find their steps."""

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        client = WorkerClient(f"tcp://127.0.0.1:{port}", ctx)

        async def recv_step() -> tuple[bytes, int]:
            ident, payload = await router.recv_multipart()
            return ident, worker_pb2.WorkerCommand.FromString(payload).step.step_id

        async def answer(ident: bytes, step_id: int, steps: int) -> None:
            event = worker_pb2.WorkerEvent(journal=worker_pb2.Journal(step_id=step_id, step_ms=steps))
            await router.send_multipart([ident, event.SerializeToString()])

        try:
            lost = asyncio.ensure_future(client.step(worker_pb2.StepPlan(step_id=1), timeout=0.2))
            ident, _ = await recv_step()
            try:
                await lost
                raise AssertionError("step 1 should have timed out")
            except WorkerUnavailable:
                pass
            second = asyncio.ensure_future(client.step(worker_pb2.StepPlan(step_id=2), timeout=5))
            third = asyncio.ensure_future(client.step(worker_pb2.StepPlan(step_id=3), timeout=5))
            await recv_step()
            await recv_step()
            await answer(ident, 1, 1)  # too late: nobody waits for it any more
            await answer(ident, 3, 3)  # out of order
            await answer(ident, 2, 2)
            assert (await second).step_ms == 2 and (await third).step_ms == 3
        finally:
            await client.close()
            router.close()
            ctx.term()

    asyncio.run(run())
