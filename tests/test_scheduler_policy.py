"""The scheduler's step-composition rules, run on the bare policy: no worker, no event loop (the
frames they lead to are covered by tests/test_determinism.py: no rule may change a frame)."""

import re

import pytest

from chorus.v1 import worker_pb2
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.policy import Policy
from scheduler_svc.request import EventSink


def due_pattern(config: SchedulerConfig, decoding: int, steps: int = 7) -> list[bool]:
    """Which of `steps` consecutive steps with `decoding` requests decoding would prefill."""
    s = Policy(config, worker_pb2.Hello(kv_slots=1024, max_batch=256, page_size=16), EventSink())
    out = []
    for _ in range(steps):
        due = s._steps_since_prefill + 1 >= s.prefill_interval(decoding)  # as schedule() decides
        out.append(due)
        s._steps_since_prefill = 0 if due else s._steps_since_prefill + 1  # as schedule() does with prefill work
    return out


def test_prefill_is_gathered_only_under_load():
    config = SchedulerConfig()  # loaded_batch 64, loaded_prefill_interval 4, prefill_interval 1
    assert due_pattern(config, 0) == [True] * 7       # nothing decodes: nothing to gather beside
    assert due_pattern(config, 16) == [True] * 7      # light load (one-GPU c16): every step, for TTFA
    assert due_pattern(config, 160) == [False, False, False, True, False, False, False]


def test_the_larger_interval_wins_and_one_turns_gathering_off():
    assert due_pattern(SchedulerConfig(prefill_interval=5), 160)[:5] == [False, False, False, False, True]
    assert due_pattern(SchedulerConfig(prefill_interval=2), 16)[:4] == [False, True, False, True]
    assert due_pattern(SchedulerConfig(loaded_prefill_interval=1), 160) == [True] * 7
    assert due_pattern(SchedulerConfig(loaded_batch=0), 160) == [True] * 7


def test_a_gathered_prefill_step_takes_the_rows_of_the_steps_it_gathered():
    """Gathering must not cut the admission rate: prefilling every 3rd step under load, a step takes up
    to 3 x --prefill-chunk rows, so a burst drains as fast as when every step prefilled."""
    import numpy as np
    from scheduler_svc.request import Phase, Request

    s = Policy(SchedulerConfig(prefill_chunk=100, loaded_batch=1, loaded_prefill_interval=3),
               worker_pb2.Hello(kv_slots=1 << 16, max_batch=64, page_size=16), EventSink())

    def submit(rows: int) -> None:
        s.add(Request(prompt_rows=np.zeros((rows, 13), np.int32), sampling=worker_pb2.SamplingConfig(),
                         max_frames=100))

    def prefill_rows(plan) -> int:
        return sum(item.rows.rows for item in plan.prefill)

    submit(50)
    assert prefill_rows(s.schedule().plan) == 50  # nothing decodes: prefilled at once
    next(iter(s.running.values())).phase = Phase.DECODE  # as its first frame's journal would
    for _ in range(10):  # a burst of 1,000 rows while one request decodes (loaded_batch 1)
        submit(100)
    plans = [s.schedule().plan for _ in range(6)]
    assert all(len(p.decode) >= 1 for p in plans)  # under load throughout
    assert [prefill_rows(p) for p in plans] == [0, 0, 300, 0, 0, 300]


@pytest.mark.parametrize("flags,needle", [
    (["--loaded-batch", "-1"], "--loaded-batch = -1: must be >= 0"),
    (["--prefill-interval-loaded", "0"], "--prefill-interval-loaded = 0: must be >= 1"),
    (["--first-chunk-frames-loaded", "999"], "--first-chunk-frames-loaded = 999: must be <= 250"),
])
def test_bad_scheduling_flags_stop_the_scheduler_with_what_to_fix(flags, needle):
    from chorus.config import ConfigError, parse

    with pytest.raises(ConfigError, match=re.escape(needle)):
        parse(SchedulerConfig, ["--worker", "tcp://127.0.0.1:1", *flags])


class _Recorder(EventSink):
    def __init__(self):
        self.events = []

    def emit(self, req, event):
        self.events.append((req.id, event))


def _fake_worker_step(plan, generation: dict[int, int]):
    """What a worker's journal says about a plan: a frame for every decode and every last prefill
    chunk, sampled at the request's generation step; frame g of request r is all (100 r + g)."""
    import numpy as np

    from chorus.wire import rows_matrix

    for rid in plan.release:
        generation.pop(rid, None)
    ids = []
    for item in plan.prefill:
        if item.last_chunk:
            generation[item.request_id] = item.generation_step
            ids.append(item.request_id)
    ids += [item.request_id for item in plan.decode]
    steps = [generation[rid] for rid in ids]
    for rid in ids:
        generation[rid] += 1
    rows = np.array([[100 * rid + g] * 13 for rid, g in zip(ids, steps)], np.int32).reshape(len(ids), 13)
    return worker_pb2.Journal(step_id=plan.step_id, request_ids=ids, generation_steps=steps,
                              stopped=[False] * len(ids), rows=rows_matrix(rows))


@pytest.mark.parametrize("in_flight", [1, 2])
def test_requests_retracted_for_kv_resume_at_the_same_frame(in_flight):
    """The whole policy on a fake worker, steps planned `in_flight` ahead of their journals (as with
    lookahead): four requests outgrow a 48-slot KV, get retracted and re-prefilled, and each still
    gets frames 0..max_frames-1 in order, once each; at the end every slot is free or cached."""
    import numpy as np

    from scheduler_svc.request import FinishEvent, FrameEvent, Phase, Request

    sink = _Recorder()
    s = Policy(SchedulerConfig(), worker_pb2.Hello(kv_slots=48, max_batch=8, page_size=4), sink)
    reqs = [s.add(Request(prompt_rows=np.full((5, 13), i, np.int32), sampling=worker_pb2.SamplingConfig(),
                          max_frames=12)) for i in range(4)]
    generation: dict[int, int] = {}
    pending = []
    for _ in range(500):
        step = s.schedule(len(pending))
        if step is not None:
            pending.append(step)
        if pending and (step is None or len(pending) >= in_flight):
            done = pending.pop(0)
            s.apply(_fake_worker_step(done.plan, generation), done.writes)
        if step is None and not pending and not s.running and not s.waiting:
            break
    assert s.counts.retractions > 0
    for req in reqs:
        frames = [e.row[0] for rid, e in sink.events if rid == req.id and isinstance(e, FrameEvent)]
        assert frames == [100 * req.id + g for g in range(12)]
        assert [e.reason for rid, e in sink.events if rid == req.id and isinstance(e, FinishEvent)] == ["max_frames"]
        assert req.phase is Phase.DONE
    assert s.kv.used_slots == s.cache.cached_slots
