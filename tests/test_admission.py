"""Admission with a latency promise: the estimate and its admit / queue / refuse decisions, on the
bare policy with rates given as numbers (no worker, no clock)."""

import math

import numpy as np
import pytest

from chorus.v1 import worker_pb2
from scheduler_svc.admission import Decision, Ewma, Rates, decide, expected_wait
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.policy import Policy
from scheduler_svc.request import EventSink, QueueFull, Request

# One H200 at c256-like load: a W1 request lives ~6.5 s from prefill to end, steps take ~11 ms,
# its first frame comes ~40 ms after its prefill is sent.
LOADED = Rates(lifetime_s=6.4, step_s=0.01, service_s=0.04)


def test_a_free_place_waits_only_for_the_next_prefill_step():
    assert expected_wait(ahead=0, running=10, max_running=256, interval=1, rates=LOADED) == pytest.approx(0.01)
    assert expected_wait(ahead=0, running=100, max_running=256, interval=4, rates=LOADED) == pytest.approx(0.04)
    # places still free for everyone ahead of it
    assert expected_wait(ahead=5, running=250, max_running=256, interval=1, rates=LOADED) == pytest.approx(0.01)


def test_a_full_batch_waits_for_departures_at_max_running_over_lifetime():
    # 256 places, each freed every 6.4 s: a place every 25 ms; the 10th request in line needs 10
    wait = expected_wait(ahead=9, running=256, max_running=256, interval=4, rates=LOADED)
    assert wait == pytest.approx(10 * 6.4 / 256 + 4 * 0.01)
    # the same line behind a batch of 64 waits four times as long per place
    assert expected_wait(ahead=9, running=64, max_running=64, interval=1, rates=LOADED) == \
        pytest.approx(10 * 6.4 / 64 + 0.01)


def test_nothing_measured_means_an_unknown_wait_but_no_refusal():
    cold = Rates(step_s=0.01)
    assert math.isinf(expected_wait(ahead=300, running=256, max_running=256, interval=1, rates=cold))
    est = decide(300, 256, 256, 1, cold, objective_s=1.0, bound_s=5.0)
    assert est.decision is Decision.QUEUE  # accepted: a cold start's burst is not turned away by a guess


def test_admit_queue_refuse_bands():
    def at(ahead: int):
        return decide(ahead, 256, 256, 1, LOADED, objective_s=1.0, bound_s=5.0)
    # place k+1 frees after (k + 1) * 25 ms; plus a step and the 40 ms service
    assert at(0).decision is Decision.ADMIT
    assert at(30).decision is Decision.ADMIT        # 0.775 + 0.01 + 0.04 s
    assert at(40).decision is Decision.QUEUE        # ~1.04 s to the first frame: beyond the objective
    assert at(150).decision is Decision.QUEUE       # 3.8 s of waiting: within the 5 s bound
    refused = at(250)                               # 6.3 s of waiting
    assert refused.decision is Decision.REFUSE
    assert refused.retry_after_s == pytest.approx(refused.wait_s - 5.0 + 0.01)
    assert refused.wait_s == pytest.approx(251 * 0.025 + 0.01)


def test_a_free_place_is_never_refused_however_slow_the_steps():
    slow = Rates(lifetime_s=60.0, step_s=2.0, service_s=3.0)
    assert decide(0, 3, 4, 4, slow, objective_s=1.0, bound_s=1.0).decision is Decision.QUEUE
    assert decide(1, 3, 4, 4, slow, objective_s=1.0, bound_s=1.0).decision is Decision.REFUSE


def test_zero_objective_and_zero_bound_turn_the_bands_off():
    assert decide(250, 256, 256, 1, LOADED, objective_s=0, bound_s=0).decision is Decision.ADMIT
    assert decide(250, 256, 256, 1, LOADED, objective_s=1.0, bound_s=0).decision is Decision.QUEUE


def test_ewma_starts_at_its_first_sample_and_follows_later_ones():
    e = Ewma(0.5)
    assert not e.measured and e.value == 0
    assert e.add(4.0) == 4.0
    assert e.add(2.0) == 3.0
    for _ in range(40):
        e.add(1.0)
    assert e.value == pytest.approx(1.0)


def _policy(**config) -> Policy:
    return Policy(SchedulerConfig(**config), worker_pb2.Hello(kv_slots=1 << 16, max_batch=4, page_size=16),
                  EventSink())


def _request() -> Request:
    return Request(prompt_rows=np.zeros((8, 13), np.int32), sampling=worker_pb2.SamplingConfig(), max_frames=50)


def _fill(p: Policy, n: int) -> None:
    for _ in range(n):
        p.add(_request())
    p.schedule()  # admits up to max_running


def test_the_policy_refuses_past_the_bound_with_a_retry_hint():
    p = _policy(max_expected_wait_s=2.5, ttfa_objective_ms=500)
    _fill(p, 4)
    assert len(p.running) == 4 and not p.waiting
    p.rates = Rates(lifetime_s=4.0, step_s=0.01, service_s=0.05)  # a place a second
    p.add(_request())   # 1.01 s of waiting + 0.05: beyond the objective, queued
    p.add(_request())   # 2.01 s: within the bound, queued
    assert p.counts.admitted == 4 and p.counts.queued == 2 and p.counts.refused == 0
    with pytest.raises(QueueFull) as refused:
        p.add(_request())   # 3.01 s
    assert refused.value.retry_after == pytest.approx(3.01 - 2.5 + 0.01)
    assert "expected wait" in str(refused.value) and len(p.waiting) == 2
    assert p.counts.refused == 1


def test_a_full_queue_refuses_with_the_queue_estimate_as_hint():
    p = _policy(max_expected_wait_s=0)
    _fill(p, 4)
    p.config.max_queue = 1
    p.rates = Rates(lifetime_s=4.0, step_s=0.01)
    p.add(_request())
    with pytest.raises(QueueFull) as refused:
        p.add(_request())
    assert refused.value.retry_after == pytest.approx(2.01)  # behind one: two places to free
    assert p.counts.refused == 1


def test_finished_requests_are_handed_to_the_driver_for_their_lifetimes():
    p = _policy()
    _fill(p, 1)
    req = next(iter(p.running.values()))
    p._finish(req, "stop")
    assert p.finished == [req]
    p.abort(_request_running(p))
    assert p.finished == [req]  # an aborted request's lifetime says nothing about the service


def _request_running(p: Policy) -> Request:
    _fill(p, 1)
    return next(iter(p.running.values()))


def test_an_overloaded_cluster_refuses_with_a_retry_hint_and_exports_the_expected_wait():
    """Real processes: one place (max batch 1), a bound of 10 ms. Once a request has finished (its
    lifetime measured), a burst finds the place taken: those expected to wait past the bound are refused
    RESOURCE_EXHAUSTED with retry-after-ms, and /metrics carries the gauge and the decisions."""
    import re
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from chorus.client import channel
    from chorus.retry_hint import retry_hint
    from chorus.v1 import tts_pb2_grpc
    from helpers import make_cluster, seeded_request

    with make_cluster(worker_args=["--max-batch", "1"], scheduler_args=["--max-expected-wait-s", "0.01"]) as c:
        stub = tts_pb2_grpc.TextToSpeechStub(channel(c.address))

        def run(frames: int):
            try:
                return sum(1 for _ in stub.Synthesize(seeded_request(frames=frames), timeout=120))
            except grpc.RpcError as e:
                return e

        assert isinstance(run(4), int)  # measures a lifetime
        with ThreadPoolExecutor(6) as pool:
            outcomes = list(pool.map(run, [12] * 6))
        refused = [o for o in outcomes if isinstance(o, grpc.RpcError)]
        assert refused and len(refused) < 6, outcomes
        for e in refused:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "expected wait" in e.details()
            assert retry_hint(e) > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{c.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert re.search(r"^chorus_expected_wait_seconds \S+$", text, re.M)
        refusals = re.search(r'^chorus_admissions_total\{decision="refuse"\} (\S+)$', text, re.M)
        assert refusals and float(refusals.group(1)) >= len(refused)
