import pytest

from helpers import make_cluster


@pytest.fixture(scope="session")
def cluster():
    """The three real services on loopback (tiny model, CPU), shared by the end-to-end tests."""
    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "8", "--kv-slots", "16384"],
                      scheduler_args=["--max-queue", "16"]) as c:
        yield c
