"""The determinism contract, through the real services in float64 on CPU: a
seeded request yields the same frames alone or batched, with lookahead on or
off, with any prefill chunking, cold or radix-warm, retracted or not."""

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from chorus.client import channel, synthesize
from chorus.v1 import common_pb2, tts_pb2, tts_pb2_grpc
from helpers import make_cluster, metric, wait_until_idle, worker_stats

WORKER = ["--dtype", "float64", "--max-batch", "8"]
VOICE = np.random.default_rng(0).integers(0, 1024, size=(20, 12), dtype=np.int32)


def workload() -> list[tts_pb2.SynthesizeRequest]:
    """Three seeded requests; the stop head is free after min_frames, so stops are exercised too."""
    out = []
    for i, text in enumerate(["The quick brown fox jumps over the lazy dog.", "Chorus keeps every frame.",
                              "One more sentence, spoken with a cloned voice."]):
        req = tts_pb2.SynthesizeRequest(text=text, language="English", min_frames=14, max_frames=30,
                                        return_codes=True)
        req.sampling.seed = 100 + i
        if i == 2:
            req.references.add(codes=common_pb2.IntMatrix(rows=VOICE.shape[0], cols=12, data=VOICE.tobytes()))
        out.append(req)
    return out


def run(cluster, concurrent: bool) -> list[np.ndarray]:
    stub = tts_pb2_grpc.TextToSpeechStub(channel(cluster.address))
    reqs = workload()
    if concurrent:
        with ThreadPoolExecutor(len(reqs)) as pool:
            results = list(pool.map(lambda r: synthesize(stub, r, timeout=120), reqs))
    else:
        results = [synthesize(stub, r, timeout=120) for r in reqs]
    for r in results:
        assert r.summary.frames == len(r.code_frames()) >= 14
    return [r.code_frames() for r in results]


@pytest.fixture(scope="module")
def baseline():
    """Each request alone, no lookahead, whole-prompt prefill, no radix cache."""
    with make_cluster(WORKER, ["--no-lookahead", "--prefill-chunk", "0", "--no-radix-cache"]) as c:
        return run(c, concurrent=False)


def assert_same(frames, baseline):
    for got, want in zip(frames, baseline):
        assert got.shape == want.shape and np.array_equal(got, want)


@pytest.mark.parametrize("scheduler_args", [
    ["--no-lookahead", "--prefill-chunk", "0"],
    ["--prefill-chunk", "0"],            # lookahead on (the default: 2 steps in flight)
    ["--prefill-chunk", "0", "--lookahead-depth", "3"],
    ["--prefill-chunk", "1"],
    ["--prefill-chunk", "7"],
    ["--prefill-chunk", "64"],
    ["--prefill-chunk", "7", "--prefill-interval", "3"],  # prefill only every 3rd step while decoding
    ["--prefill-chunk", "7", "--loaded-batch", "1", "--prefill-interval-loaded", "2"],  # gathered under load
], ids=["batched", "lookahead", "lookahead3", "chunk1", "chunk7", "chunk64", "interval3", "loaded2"])
def test_batched_variants_equal_alone(baseline, scheduler_args):
    with make_cluster(WORKER, scheduler_args) as c:
        assert_same(run(c, concurrent=True), baseline)
        assert wait_until_idle(c) == (0, 0, 0, 0)


def test_radix_warm_equals_cold_and_prefills_only_the_rest(baseline):
    with make_cluster(WORKER) as c:
        stub = tts_pb2_grpc.TextToSpeechStub(channel(c.address))
        clone = workload()[2]
        cold = synthesize(stub, clone, timeout=120)
        before = worker_stats(c).prefill_rows
        warm = synthesize(stub, clone, timeout=120)
        prefilled = worker_stats(c).prefill_rows - before
        assert cold.summary.cached_prompt_rows == 0
        assert warm.summary.cached_prompt_rows > VOICE.shape[0]  # the reference rows came from the cache
        assert prefilled == warm.summary.prompt_rows - warm.summary.cached_prompt_rows
        assert np.array_equal(cold.code_frames(), baseline[2]) and np.array_equal(warm.code_frames(), baseline[2])
        other = workload()[0]
        other.references.add(codes=clone.references[0].codes)  # same voice, other text: shares the prefix
        shared = synthesize(stub, other, timeout=120)
        assert shared.summary.cached_prompt_rows > VOICE.shape[0]
        assert metric(c, "chorus_radix_hit_rows_total") > 0


def test_a_restarted_worker_never_serves_a_stale_prefix(baseline):
    """A worker that restarts has lost its KV, but the scheduler's radix cache still points at it. The
    new process's first journal says so (another incarnation): the scheduler drops that step, which
    attended to rows the new worker never wrote, empties its cache and re-prefills. The request's
    frames equal the baseline's."""
    from chorus.processes import Service, free_port

    with make_cluster(WORKER, worker_port=free_port()) as c:
        stub = tts_pb2_grpc.TextToSpeechStub(channel(c.address))
        clone = workload()[2]
        assert np.array_equal(synthesize(stub, clone, timeout=120).code_frames(), baseline[2])
        old = c.service("worker")
        old.proc.kill()
        old.proc.wait()
        new = Service("worker", old.argv)
        c.services[c.services.index(old)] = new  # the cluster stops the new one at the end
        new.start(False, dict(os.environ, PYTHONUNBUFFERED="1"))
        new.wait_ready(120)
        wait_serving(c.address)  # until the scheduler has heard from it, requests are refused
        again = synthesize(stub, clone, timeout=120)  # its prefix is in the (stale) radix cache
        assert np.array_equal(again.code_frames(), baseline[2])
        assert metric(c, "chorus_worker_restarts_total") == 1
        assert wait_until_idle(c) == (0, 0, 0, 0)


def wait_serving(address: str, timeout: float = 30.0) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    import time

    health = health_pb2_grpc.HealthStub(channel(address))
    deadline = time.monotonic() + timeout
    while health.Check(health_pb2.HealthCheckRequest(service="chorus.v1.TextToSpeech")).status != \
            health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "the service is not SERVING again"
        time.sleep(0.1)


@pytest.mark.parametrize("scheduler_args", [["--worker-probe-s", "1"], ["--worker-probe-s", "0", "--step-timeout-s", "2"]],
                         ids=["probe", "step_timeout"])
def test_a_worker_restart_mid_request_loses_no_audio(scheduler_args):
    """The worker dies mid-request and comes back (as its stall watchdog or a crash plus its
    supervisor would do). The step in flight gets no journal; the scheduler finds a new worker
    process answering hello (asked after --worker-probe-s without the journal, or after the step's
    --step-timeout-s when probing is off: with the default 300 s timeout the first path must be the
    one that works, or the client's 120 s deadline runs out), re-prefills the request's prompt and
    frames on it, and the request goes on: its frames equal those of the same request run without a
    restart."""
    from chorus.processes import Service, free_port

    req = workload()[0]
    req.min_frames = req.max_frames = 300
    with make_cluster(WORKER, scheduler_args, worker_port=free_port()) as c:
        stub = tts_pb2_grpc.TextToSpeechStub(channel(c.address))
        want = synthesize(stub, req, timeout=120).code_frames()
        codes = []
        for resp in stub.Synthesize(req, timeout=120):
            if resp.HasField("codes"):
                codes.append(np.frombuffer(resp.codes.codes.data, "<i4").reshape(-1, 12))
                if len(codes) == 20:  # mid-request: kill the worker and start another on its port
                    old = c.service("worker")
                    old.proc.kill()
                    old.proc.wait()
                    new = Service("worker", old.argv)
                    c.services[c.services.index(old)] = new
                    new.start(False, dict(os.environ, PYTHONUNBUFFERED="1"))
        got = np.concatenate(codes)
        assert got.shape == want.shape and np.array_equal(got, want)
        assert metric(c, "chorus_worker_restarts_total") == 1
        assert wait_until_idle(c) == (0, 0, 0, 0)


@pytest.mark.parametrize("page_size,kv_slots", [(1, 260), (4, 260)], ids=["rows", "pages4"])
def test_forced_retraction_equals_unretracted(baseline, page_size, kv_slots):
    # Room for the three prompts but not for their 30 frames each: decode must retract. Pages of 4
    # run out before frame 14 (the earliest stop) whatever order the requests arrive in; with pages
    # of 16 whether they do depends on when the requests stop.
    worker = WORKER + ["--kv-slots", str(kv_slots), "--page-size", str(page_size)]
    with make_cluster(worker, ["--max-running", "8"]) as c:
        assert_same(run(c, concurrent=True), baseline)
        assert metric(c, "chorus_retractions_total") > 0
        assert wait_until_idle(c) == (0, 0, 0, 0)
