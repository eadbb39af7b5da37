"""Shared pieces of the end-to-end tests: starting clusters and reading the
services' own debug surfaces (scheduler /metrics, worker stats, vocoder Info)."""

from __future__ import annotations

import importlib.util
import time

import grpc
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chorus.client import channel
from chorus.launcher import Cluster
from chorus.processes import free_port, read_metrics
from chorus.v1 import tts_pb2, vocoder_pb2, vocoder_pb2_grpc, worker_pb2


def make_cluster(worker_args=(), scheduler_args=(), **kw) -> Cluster:
    """A Cluster whose scheduler serves /metrics on a free port (cluster.metrics_port)."""
    port = free_port()
    c = Cluster(worker_args=list(worker_args), scheduler_args=["--metrics-port", str(port), *scheduler_args], **kw)
    c.metrics_port = port
    return c


def metric(cluster: Cluster, name: str) -> float:
    return read_metrics(cluster.metrics_port)[name]


def worker_stats(cluster: Cluster) -> worker_pb2.WorkerStats:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.service("worker").address)
    try:
        sock.send(worker_pb2.WorkerCommand(stats=worker_pb2.StatsRequest()).SerializeToString())
        assert sock.poll(10000), "worker did not answer a stats request"
        return worker_pb2.WorkerEvent.FromString(sock.recv()).stats
    finally:
        sock.close()


def vocoder_active(cluster: Cluster) -> int:
    stub = vocoder_pb2_grpc.VocoderStub(channel(cluster.service("vocoder").address))
    return stub.Info(vocoder_pb2.VocoderInfoRequest()).active_streams


def held_resources(cluster: Cluster) -> tuple:
    """(KV slots held by requests, running requests, worker decode states, vocoder streams)."""
    return (metric(cluster, "chorus_kv_slots_used"), metric(cluster, "chorus_running_requests"),
            worker_stats(cluster).active_requests, vocoder_active(cluster))


def wait_until_idle(cluster: Cluster, timeout: float = 20.0) -> tuple:
    deadline = time.monotonic() + timeout
    while True:
        held = held_resources(cluster)
        if held == (0, 0, 0, 0) or time.monotonic() > deadline:
            return held
        time.sleep(0.1)


def seeded_request(text: str = "Hello from the test suite.", seed: int = 1, frames: int = 12,
                   **kw) -> tts_pb2.SynthesizeRequest:
    req = tts_pb2.SynthesizeRequest(text=text, language="English", min_frames=frames, max_frames=frames, **kw)
    req.sampling.seed = seed
    return req


def triton_skip_reason() -> str | None:
    """Why Triton kernels cannot run on the CPU here (None: they can, in the interpreter).
    conftest.py sets TRITON_INTERPRET=1 before anything imports triton, where it is installed."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    from chorus import triton_support
    if not triton_support.INTERPRET:
        return "triton was imported in compiled mode: run the tests with TRITON_INTERPRET=1"
    return None


def still_running(pids: list[int], timeout: float) -> list[int]:
    """The pids still running (not gone, not zombies) after waiting up to timeout for them to exit."""
    def running(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def health(address: str, service: str = "chorus.v1.TextToSpeech") -> int:
    """The server's grpc health status for service; -1 when nothing answers (yet)."""
    ch = channel(address)
    try:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
    except grpc.RpcError:
        return -1
    finally:
        ch.close()


def wait_health(address: str, want: int, timeout: float) -> float:
    """Seconds until health reads want; fails after timeout."""
    t0 = time.monotonic()
    while health(address) != want:
        assert time.monotonic() - t0 < timeout, f"health is not {want} after {timeout} s"
        time.sleep(0.1)
    return time.monotonic() - t0
