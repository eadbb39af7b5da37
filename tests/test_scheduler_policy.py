"""The scheduler's step-composition rules, without a worker (the frames they lead to are covered by
tests/test_determinism.py: no rule may change a frame)."""

import re

import pytest

from chorus.v1 import worker_pb2
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.config import SchedulerConfig


def due_pattern(config: SchedulerConfig, decoding: int, steps: int = 7) -> list[bool]:
    """Which of `steps` consecutive steps with `decoding` requests decoding would prefill."""
    s = Scheduler(None, worker_pb2.Hello(kv_slots=1024, max_batch=256, page_size=16), config)
    out = []
    for _ in range(steps):
        due = s._steps_since_prefill + 1 >= s._prefill_interval(decoding)  # as _build_plan decides
        out.append(due)
        s._steps_since_prefill = 0 if due else s._steps_since_prefill + 1  # as _build_plan does with prefill work
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
    from scheduler_svc.scheduler import Phase, Request

    s = Scheduler(None, worker_pb2.Hello(kv_slots=1 << 16, max_batch=64, page_size=16),
                  SchedulerConfig(prefill_chunk=100, loaded_batch=1, loaded_prefill_interval=3))

    def submit(rows: int) -> None:
        s.submit(Request(prompt_rows=np.zeros((rows, 13), np.int32), sampling=worker_pb2.SamplingConfig(),
                         max_frames=100))

    def prefill_rows(plan) -> int:
        return sum(item.rows.rows for item in plan.prefill)

    submit(50)
    assert prefill_rows(s._build_plan()[0]) == 50  # nothing decodes: prefilled at once
    next(iter(s.running.values())).phase = Phase.DECODE  # as its first frame's journal would
    for _ in range(10):  # a burst of 1,000 rows while one request decodes (loaded_batch 1)
        submit(100)
    plans = [s._build_plan()[0] for _ in range(6)]
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
