import socket

import pytest

from chorus.launcher import Cluster


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def cluster():
    """The three real services on loopback (tiny model, CPU), shared by the end-to-end tests."""
    metrics_port = free_port()
    c = Cluster(worker_args=["--dtype", "float32", "--max-batch", "8", "--kv-slots", "16384"],
                scheduler_args=["--metrics-port", str(metrics_port), "--max-queue", "16"])
    c.metrics_port = metrics_port
    with c:
        yield c
