"""Faults the reliability suite survives on one cluster of the real services (tiny model, CPU),
in order: a vocoder pool with no live replica turns health NOT_SERVING and back; an overload
of several times what the service holds is refused RESOURCE_EXHAUSTED with a retry hint while
memory stays flat and every accepted request gets all its audio; a frontend, then the core,
killed with streams running: their clients see UNAVAILABLE within seconds (never a hang) and the
launcher's supervisor brings the service back on its port, giving the same audio as before."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from chorus.client import channel, synthesize
from chorus.processes import Service, child_pids, free_port
from chorus.retry_hint import KEY as RETRY_KEY
from chorus.v1 import tts_pb2_grpc
from helpers import health, make_cluster, seeded_request, wait_health, wait_until_idle

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
MAX_QUEUE = 8
MAX_BATCH = 4
OVERLOAD = 160  # concurrent requests: many times the batch plus the queue
FRAMES = 2
SAMPLES_PER_FRAME = 3840
RSS_GROWTH_MB = 64  # the most the core and its frontends may grow under the overload


@pytest.fixture(scope="module")
def service():
    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", str(MAX_BATCH), "--kv-slots", "4096"],
                      scheduler_args=["--max-queue", str(MAX_QUEUE), "--drain-seconds", "1"], vocoder_ports=[free_port()]) as c:
        c.golden = synthesize(tts_pb2_grpc.TextToSpeechStub(channel(c.address)), seeded_request(seed=5, frames=6),
                              timeout=120).audio_bytes
        yield c


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _scheduler_pids(cluster) -> list[int]:
    core = cluster.service("scheduler").proc.pid
    return [core, *child_pids(core)]


# ---- a vocoder pool with no live replica ------------------------------------------------------

def test_health_follows_the_vocoder_pool(service):
    assert health(service.address) == SERVING
    old = service.service("vocoder")
    old.proc.kill()
    old.proc.wait()
    assert wait_health(service.address, NOT_SERVING, 10) < 5
    new = Service("vocoder", old.argv)  # its config names the same port
    service.services[service.services.index(old)] = new
    new.start(False, dict(os.environ, PYTHONUNBUFFERED="1"))
    new.wait_ready(120)
    wait_health(service.address, SERVING, 15)
    stub = tts_pb2_grpc.TextToSpeechStub(channel(service.address))
    assert synthesize(stub, seeded_request(seed=5, frames=6), timeout=120).audio_bytes == service.golden


# ---- overload ---------------------------------------------------------------------------------

async def _overload(address: str, n: int) -> list:
    """n concurrent short requests over a few connections: each one's (frames, samples) or its error."""
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(8)]

    async def one(i: int):
        stub = tts_pb2_grpc.TextToSpeechStub(channels[i % len(channels)])
        samples, frames = 0, None
        try:
            async for resp in stub.Synthesize(seeded_request(text=f"Request {i}.", seed=i, frames=FRAMES), timeout=120):
                if resp.HasField("audio"):
                    samples += resp.audio.num_samples
                elif resp.HasField("summary"):
                    frames = resp.summary.frames
            return frames, samples
        except grpc.aio.AioRpcError as e:
            return e

    try:
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        for ch in channels:
            await ch.close()


def test_an_overload_is_refused_with_a_hint_memory_stays_flat_and_nothing_is_lost(service):
    pids = _scheduler_pids(service)
    asyncio.run(_overload(service.address, MAX_BATCH + MAX_QUEUE))  # warm: first-use allocations
    before = sum(_rss_mb(p) for p in pids)
    t0 = time.monotonic()
    results = asyncio.run(_overload(service.address, OVERLOAD))
    print(f"overload: {time.monotonic() - t0:.1f} s")
    after = sum(_rss_mb(p) for p in pids)
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    served = [r for r in results if not isinstance(r, grpc.aio.AioRpcError)]
    assert refused and served, (len(refused), len(served))
    for e in refused:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue" in e.details(), (e.code(), e.details())
        hints = [int(v) for k, v in e.trailing_metadata() or () if k == RETRY_KEY]
        assert hints and hints[0] > 0, e.trailing_metadata()
    assert all(r == (FRAMES, FRAMES * SAMPLES_PER_FRAME) for r in served), "an accepted request lost audio"
    assert after - before < RSS_GROWTH_MB, f"RSS grew {after - before:.0f} MB"
    assert wait_until_idle(service) == (0, 0, 0, 0)


# ---- a frontend, then the core, killed with streams running -----------------------------------

def _stream(address: str, out: dict, started: threading.Event) -> None:
    stub = tts_pb2_grpc.TextToSpeechStub(channel(address))
    try:
        for resp in stub.Synthesize(seeded_request(seed=9, frames=2000), timeout=120):
            if resp.HasField("audio"):
                started.set()
        out["code"] = grpc.StatusCode.OK
    except grpc.RpcError as e:
        out["code"], out["details"] = e.code(), e.details()
    out["t"] = time.monotonic()
    started.set()


def _kill_with_streams_running(service, pid_of) -> list[dict]:
    """Kills the process pid_of() names while two streams run; returns how each stream ended."""
    results, started = [{}, {}], [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=_stream, args=(service.address, r, s)) for r, s in zip(results, started)]
    for t in threads:
        t.start()
    assert all(s.wait(60) for s in started)
    os.kill(pid_of(), signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(30)
    print(f"streams ended {max(r['t'] for r in results) - killed:.1f} s after the kill")
    assert not any(t.is_alive() for t in threads), "a client hangs"
    for r in results:
        assert r["code"] == grpc.StatusCode.UNAVAILABLE, r
        assert r["t"] - killed < 15, r
    return results


@pytest.fixture(scope="module")
def supervised(service):
    stop = threading.Event()
    watcher = threading.Thread(target=service.supervise, args=(stop,), daemon=True)
    watcher.start()
    yield service
    stop.set()
    watcher.join(30)


@pytest.mark.parametrize("victim", ["frontend", "core"])
def test_a_killed_scheduler_process_is_unavailable_then_restarted(supervised, victim):
    service, address = supervised, supervised.address
    restarts = service.restarts
    core = service.service("scheduler").proc
    t0 = time.monotonic()
    _kill_with_streams_running(service, lambda: child_pids(core.pid)[0] if victim == "frontend" else core.pid)
    assert core.wait(30) != 0  # a supervisor sees the failure
    t1 = time.monotonic()
    while service.restarts == restarts and time.monotonic() - t1 < 60:  # the orphaned frontends may
        time.sleep(0.1)                                                   # answer health for a moment
    assert service.restarts == restarts + 1
    wait_health(address, SERVING, 90)
    print(f"{victim}: streams ended in {t1 - t0:.1f} s, serving again after {time.monotonic() - t1:.1f} s")
    stub = tts_pb2_grpc.TextToSpeechStub(channel(address))
    assert synthesize(stub, seeded_request(seed=5, frames=6), timeout=120).audio_bytes == service.golden
    assert wait_until_idle(service) == (0, 0, 0, 0)
