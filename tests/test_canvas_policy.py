"""The OmniVoice scheduling rules on the bare policy: no worker, no event loop. A fake worker
answers each plan the way a real one does (a result per step, codes at the last step)."""

import random

import numpy as np
import pytest

from chorus.omnivoice.knobs import NUM_CODEBOOKS, UnmaskKnobs
from chorus.v1 import worker_pb2
from chorus.wire import rows_matrix
from scheduler_svc.canvas_policy import Canvas, CanvasPhase, CanvasPolicy, CanvasTooLarge, canvas_rows
from scheduler_svc.request import QueueFull


def canvas(text=10, frames=20, num_step=4, guidance=2.0, reference=0) -> Canvas:
    start = worker_pb2.CanvasStart(text_ids=list(range(text)), target_frames=frames, seed=7,
                                   knobs=UnmaskKnobs(num_step=num_step, guidance_scale=guidance).to_proto())
    if reference:
        start.reference_codes.CopyFrom(rows_matrix(np.zeros((reference, NUM_CODEBOOKS), np.int32)))
    return Canvas(start)


def policy(rows=1000, batch=16, queue=8) -> CanvasPolicy:
    return CanvasPolicy(queue, worker_pb2.Hello(max_batch=batch, max_packed_rows=rows))


def journal(plan: worker_pb2.StepPlan, p: CanvasPolicy) -> worker_pb2.Journal:
    """What a worker answers: each step's result in plan order, the final canvas after the last step."""
    j = worker_pb2.Journal(step_id=plan.step_id)
    starts = {s.request_id: s for s in plan.canvas_start}
    for item in plan.canvas_step:
        c = p.running.get(item.request_id)
        start = starts.get(item.request_id) or (c.start if c else None)
        last = start is not None and item.step == start.knobs.num_step - 1
        r = j.canvases.add(request_id=item.request_id, step=item.step, finished=last)
        if last:
            r.codes.CopyFrom(rows_matrix(np.full((start.target_frames, NUM_CODEBOOKS), item.request_id, np.int32)))
    return j


def run_step(p: CanvasPolicy) -> tuple[worker_pb2.StepPlan | None, list[Canvas]]:
    plan = p.schedule()
    return plan, (p.apply(journal(plan, p)) if plan else [])


def test_cost_is_the_packed_rows_of_cond_and_uncond_documents():
    assert canvas_rows(canvas(text=10, frames=20).start) == 10 + 20 + 20
    assert canvas_rows(canvas(text=10, frames=20, guidance=0).start) == 10 + 20
    assert canvas_rows(canvas(text=10, frames=20, reference=30).start) == 10 + 30 + 20 + 20


def test_admission_by_row_budget_is_fifo():
    p = policy(rows=120)
    a, b, c = p.add(canvas()), p.add(canvas()), p.add(canvas(text=1, frames=1, guidance=0))  # 50, 50, 2
    big = p.add(canvas(frames=40))  # 90: does not fit beside the others
    plan, _ = run_step(p)
    assert [s.request_id for s in plan.canvas_start] == [a.id, b.id, c.id]
    assert p.used_rows == 102 and list(p.waiting) == [big]
    later = p.add(canvas(text=1, frames=1, guidance=0))  # would fit, but FIFO: waits behind `big`
    run_step(p)
    assert list(p.waiting) == [big, later]


def test_admission_by_max_batch():
    p = policy(rows=10_000, batch=2)
    cs = [p.add(canvas()) for _ in range(3)]
    plan, _ = run_step(p)
    assert [s.request_id for s in plan.canvas_start] == [cs[0].id, cs[1].id]
    assert cs[2].phase is CanvasPhase.WAITING


def test_canvases_at_different_step_indices_share_steps_and_each_finishes_after_its_own_num_step():
    p = policy()
    a = p.add(canvas(num_step=3))
    plan, _ = run_step(p)
    assert [(s.request_id, s.step) for s in plan.canvas_step] == [(a.id, 0)]
    b = p.add(canvas(num_step=2))
    plan, done = run_step(p)
    assert [s.request_id for s in plan.canvas_start] == [b.id]
    assert [(s.request_id, s.step) for s in plan.canvas_step] == [(a.id, 1), (b.id, 0)]
    assert done == []
    plan, done = run_step(p)
    assert [(s.request_id, s.step) for s in plan.canvas_step] == [(a.id, 2), (b.id, 1)]
    assert done == [a, b] and a.error is None and b.error is None
    assert a.codes.shape == (20, NUM_CODEBOOKS) and (a.codes == a.id).all() and (b.codes == b.id).all()
    assert (a.steps_done, b.steps_done) == (3, 2) and p.used_rows == 0 and not p.running
    plan, _ = run_step(p)  # the finished canvases are released, nothing else
    assert sorted(plan.release) == sorted([a.id, b.id]) and not plan.canvas_step
    assert p.schedule() is None


def test_a_finished_canvas_frees_its_rows_for_the_next():
    p = policy(rows=60)
    a, b = p.add(canvas(num_step=1)), p.add(canvas(num_step=1))
    plan, done = run_step(p)
    assert [s.request_id for s in plan.canvas_start] == [a.id] and done == [a]
    plan, done = run_step(p)
    assert list(plan.release) == [a.id] and [s.request_id for s in plan.canvas_start] == [b.id] and done == [b]


def test_cancel_frees_the_budget_and_releases_on_the_worker():
    p = policy(rows=60)
    a, b = p.add(canvas()), p.add(canvas())
    run_step(p)
    p.cancel(a)
    p.cancel(a)  # idempotent
    assert p.used_rows == 0 and a.cancelled and a.phase is CanvasPhase.DONE
    plan, _ = run_step(p)
    assert list(plan.release) == [a.id] and [s.request_id for s in plan.canvas_start] == [b.id]
    p.cancel(p.add(canvas()))  # cancelled while waiting: never on the worker, nothing to release
    assert not p.waiting and not p.pending_release


def test_a_result_for_a_canvas_cancelled_while_its_step_ran_is_dropped():
    p = policy()
    a = p.add(canvas(num_step=1))
    plan = p.schedule()
    p.cancel(a)
    assert p.apply(journal(plan, p)) == [] and a.codes is None


def test_queue_full_and_too_large():
    p = policy(rows=100, queue=2)
    with pytest.raises(CanvasTooLarge, match="needs 101 packed rows.*budget of 100"):
        p.add(canvas(text=1, frames=50))
    p.add(canvas()), p.add(canvas())
    with pytest.raises(QueueFull, match="queue is full"):
        p.add(canvas())
    run_step(p)  # admits both: room in the queue again
    p.add(canvas())


def test_a_bad_result_fails_only_its_canvas():
    p = policy()
    a, b = p.add(canvas(num_step=1)), p.add(canvas(num_step=1))
    plan = p.schedule()
    j = journal(plan, p)
    j.canvases[0].codes.CopyFrom(rows_matrix(np.zeros((3, NUM_CODEBOOKS), np.int32)))
    done = p.apply(j)
    assert done == [a, b] and "expected (20, 8)" in a.error and b.error is None
    assert p.used_rows == 0


def test_a_restarted_worker_fails_the_running_canvases_and_keeps_the_waiting():
    p = policy(rows=60)
    a, b = p.add(canvas()), p.add(canvas())
    p.schedule()
    assert p.forget_worker("gone") == [a] and a.error == "gone"
    assert list(p.waiting) == [b] and p.used_rows == 0
    plan = p.schedule()  # the release is a no-op unless a plan in flight started `a` on the new process
    assert [s.request_id for s in plan.canvas_start] == [b.id] and list(plan.release) == [a.id]


def test_random_cancellations_leave_nothing_held():
    rng = random.Random(0)
    p = policy(rows=400, batch=6, queue=1000)
    live: list[Canvas] = []
    finished = cancelled = 0
    for i in range(100):
        for _ in range(rng.randint(0, 3)):
            live.append(p.add(canvas(text=rng.randint(1, 30), frames=rng.randint(1, 60), num_step=rng.randint(1, 6),
                                     guidance=rng.choice([0.0, 2.0]))))
        victim = rng.choice(live) if live and rng.random() < 0.6 else None
        plan = p.schedule()
        if victim is not None and victim.phase is not CanvasPhase.DONE:  # cancel while the step runs
            p.cancel(victim)
            cancelled += 1
        if plan is not None:
            finished += len(p.apply(journal(plan, p)))
        live = [c for c in live if c.phase is not CanvasPhase.DONE]
        assert p.used_rows == sum(c.cost for c in p.running.values()) <= 400
        assert len(p.running) <= 6
    for c in list(live):
        p.cancel(c)
        cancelled += 1
    plan = p.schedule()
    assert plan is None or not (plan.canvas_start or plan.canvas_step)
    assert p.used_rows == 0 and not p.running and not p.waiting and not p.pending_release
    assert finished > 10 and cancelled > 10


def test_plans_ahead_of_their_journals_follow_the_state_the_earlier_plans_leave():
    p = policy(rows=100, batch=2)
    a, b, c, d = (p.add(canvas(num_step=n)) for n in (1, 3, 2, 2))  # 50 rows each: two fit
    first = p.schedule()
    assert [(s.request_id, s.step) for s in first.canvas_step] == [(a.id, 0), (b.id, 0)]
    second = p.schedule()  # a's only step is in flight: its rows and slot go to c
    assert [s.request_id for s in second.canvas_start] == [c.id]
    assert [(s.request_id, s.step) for s in second.canvas_step] == [(b.id, 1), (c.id, 0)]
    assert p.apply(journal(first, p)) == [a] and (a.codes == a.id).all()
    third = p.schedule()  # b's last step is in `second`'s successor: planned here, then d takes its place
    assert list(third.release) == [a.id] and not third.canvas_start
    assert [(s.request_id, s.step) for s in third.canvas_step] == [(b.id, 2), (c.id, 1)]
    fourth = p.schedule()
    assert [s.request_id for s in fourth.canvas_start] == [d.id] and p.used_slots == 1
    assert p.apply(journal(second, p)) == []
    assert p.apply(journal(third, p)) == [b, c]
    assert p.apply(journal(fourth, p)) == []
    fifth = p.schedule()
    assert sorted(fifth.release) == sorted([b.id, c.id]) and [(s.request_id, s.step) for s in fifth.canvas_step] \
        == [(d.id, 1)]
    assert p.apply(journal(fifth, p)) == [d] and list(p.schedule().release) == [d.id]
    assert p.used_rows == 0 and p.used_slots == 0 and p.schedule() is None


def test_a_cancel_between_plans_in_flight_releases_in_the_next_plan_built():
    p = policy()
    a, b = p.add(canvas(num_step=4)), p.add(canvas(num_step=4))
    first, second = p.schedule(), p.schedule()
    p.cancel(a)  # both plans in flight step it
    third = p.schedule()
    assert list(third.release) == [a.id] and [s.request_id for s in third.canvas_step] == [b.id]
    for plan in (first, second, third):
        assert p.apply(journal(plan, p)) == []  # a's results are dropped, b goes on
    assert b.steps_done == 3 and a.codes is None and p.used_rows == b.cost


def test_a_failed_plan_ends_its_canvases_once_while_the_next_is_in_flight():
    p = policy()
    a, b = p.add(canvas(num_step=3)), p.add(canvas(num_step=3))
    first = p.schedule()
    c = p.add(canvas(num_step=1))
    second = p.schedule()
    assert p.fail([s.request_id for s in first.canvas_step], "boom") == [a, b]
    assert p.fail([s.request_id for s in first.canvas_step], "boom") == []
    j = journal(second, p)  # the worker skips the dropped canvases' steps
    del j.canvases[:]
    j.canvases.add(request_id=c.id, step=0, finished=True).codes.CopyFrom(
        rows_matrix(np.zeros((20, NUM_CODEBOOKS), np.int32)))
    assert p.apply(j) == [c] and c.error is None
    assert sorted(p.schedule().release) == sorted([a.id, b.id, c.id]) and p.used_rows == 0


def test_random_cancellations_two_plans_in_flight_leave_nothing_held():
    rng = random.Random(1)
    p = policy(rows=400, batch=6, queue=1000)
    inflight: list[worker_pb2.StepPlan] = []
    live: list[Canvas] = []
    finished = 0
    for _ in range(150):
        for _ in range(rng.randint(0, 2)):
            live.append(p.add(canvas(text=rng.randint(1, 30), frames=rng.randint(1, 60),
                                     num_step=rng.randint(1, 6))))
        if live and rng.random() < 0.3:
            p.cancel(rng.choice(live))
        plan = p.schedule()
        if plan is not None:
            inflight.append(plan)
            stepped = [p.running[s.request_id] for s in plan.canvas_step]
            assert sum(c.cost for c in stepped) <= 400 and len(stepped) <= 6
        if len(inflight) == 2 or (plan is None and inflight):
            finished += len(p.apply(journal(inflight.pop(0), p)))
        live = [c for c in live if c.phase is not CanvasPhase.DONE]
        booked = [c for c in p.running.values() if c.steps_planned < c.num_step]
        assert p.used_rows == sum(c.cost for c in booked) and p.used_slots == len(booked)
    for plan in inflight:
        finished += len(p.apply(journal(plan, p)))
    for c in live:
        p.cancel(c)
    while (plan := p.schedule()) is not None:
        assert not plan.canvas_start
        p.apply(journal(plan, p))
    assert p.used_rows == 0 and not p.running and not p.waiting and not p.pending_release and finished > 10
