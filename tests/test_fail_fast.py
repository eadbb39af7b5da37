"""A dead worker is not a black hole (real processes, tiny model): running streams end UNAVAILABLE
within seconds, health says NOT_SERVING, new requests are refused at once; a worker started on the
same address brings the service back. A vocoder pool with no replica answers UNAVAILABLE at once."""

import os
import threading
import time

import grpc
from grpc_health.v1 import health_pb2

from chorus.client import channel
from chorus.v1 import tts_pb2_grpc
from helpers import health, make_cluster, seeded_request, wait_health, wait_until_idle

FAST = ["--worker-heartbeat-s", "0.5", "--worker-probe-s", "2", "--restart-wait-s", "2"]


def _stream(stub, req, out: dict, started: threading.Event) -> None:
    try:
        for resp in stub.Synthesize(req, timeout=120):
            if resp.HasField("audio"):
                started.set()
        out["code"] = grpc.StatusCode.OK
    except grpc.RpcError as e:
        out["code"], out["details"], out["t"] = e.code(), e.details(), time.monotonic()
    started.set()


def test_a_killed_worker_fails_fast_and_a_new_one_brings_the_service_back():
    from chorus.processes import Service, free_port

    with make_cluster(["--dtype", "float64"], FAST, worker_port=free_port()) as c:
        stub = tts_pb2_grpc.TextToSpeechStub(channel(c.address))
        assert health(c.address) == health_pb2.HealthCheckResponse.SERVING
        results = [{}, {}]
        started = [threading.Event(), threading.Event()]
        threads = [threading.Thread(target=_stream, args=(stub, seeded_request(seed=i, frames=2000), results[i],
                                                          started[i])) for i in range(2)]
        for t in threads:
            t.start()
        assert all(s.wait(120) for s in started)
        old = c.service("worker")
        old.proc.kill()
        old.proc.wait()
        killed = time.monotonic()
        for t in threads:
            t.join(60)
        for r in results:
            assert r["code"] == grpc.StatusCode.UNAVAILABLE, r
            assert "worker" in r["details"] and r["t"] - killed < 10, r
        assert wait_health(c.address, health_pb2.HealthCheckResponse.NOT_SERVING, 10) < 10

        t0 = time.monotonic()
        try:
            stub.Synthesize(seeded_request(frames=5), timeout=30).next()
            raise AssertionError("a request was accepted with no worker")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE and "not answering" in e.details(), e
        assert time.monotonic() - t0 < 5  # at once: not the call's 30 s deadline, with room for a loaded machine

        new = Service("worker", old.argv)
        c.services[c.services.index(old)] = new  # the cluster stops the new one at the end
        new.start(False, dict(os.environ, PYTHONUNBUFFERED="1"))
        new.wait_ready(120)
        wait_health(c.address, health_pb2.HealthCheckResponse.SERVING, 30)
        frames = [r for r in stub.Synthesize(seeded_request(frames=6), timeout=60) if r.HasField("summary")]
        assert frames[0].summary.frames == 6
        assert wait_until_idle(c) == (0, 0, 0, 0)


def test_a_vocoder_pool_with_no_live_replica_answers_unavailable_at_once():
    with make_cluster(["--dtype", "float64"]) as c:
        stub = tts_pb2_grpc.TextToSpeechStub(channel(c.address))
        assert sum(1 for _ in stub.Synthesize(seeded_request(frames=3), timeout=60)) > 0
        vocoder = c.service("vocoder")
        vocoder.proc.kill()
        vocoder.proc.wait()
        t0 = time.monotonic()
        try:
            list(stub.Synthesize(seeded_request(frames=3), timeout=60))
            raise AssertionError("a request succeeded with no vocoder")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE and "vocoder" in e.details(), e
        assert time.monotonic() - t0 < 10


def test_a_frontend_whose_core_is_gone_exits_non_zero():
    """So that its supervisor restarts the service: the test adopts the orphaned frontend (a child
    subreaper) to read its exit status."""
    import ctypes
    import signal

    PR_SET_CHILD_SUBREAPER = 36
    assert ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    try:
        with make_cluster(["--dtype", "float64"]) as c:
            core = c.service("scheduler").proc
            with open(f"/proc/{core.pid}/task/{core.pid}/children") as f:
                frontend = int(f.read().split()[0])
            core.send_signal(signal.SIGKILL)
            core.wait()
            deadline = time.monotonic() + 20
            while True:
                pid, status = os.waitpid(frontend, os.WNOHANG)
                if pid:
                    break
                assert time.monotonic() < deadline, "the frontend outlived its core"
                time.sleep(0.2)
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) != 0, status
    finally:
        ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
