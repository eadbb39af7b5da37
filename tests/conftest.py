import atexit
import importlib.util
import os
import shutil
import tempfile

import pytest
import torch

# Where triton is installed (not in CI), it must run in interpreter mode from the first
# import on: tests/test_kernels.py runs the kernels on the CPU that way, and a module
# imported compiled first cannot be switched later. Nothing else runs a kernel on the CPU.
if importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# What the services the tests start keep by default (the voice store's file) goes to a throwaway
# directory, never the user's home.
os.environ["XDG_STATE_HOME"] = _STATE = tempfile.mkdtemp(prefix="chorus-test-state-")
atexit.register(shutil.rmtree, _STATE, True)

from vocoder_svc.codec import tiny_v1, tiny_v2
from vocoder_svc.codec_checkpoint import build_codec

from helpers import make_cluster


@pytest.fixture(scope="session")
def cluster():
    """The three real services on loopback (tiny model, CPU), shared by the end-to-end tests."""
    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "8", "--kv-slots", "16384"],
                      scheduler_args=["--max-queue", "16"]) as c:
        yield c


@pytest.fixture(scope="session")
def omnivoice_cluster():
    """The real services serving the tiny OmniVoice and its codec beside MOSS's (CPU), shared by the
    OmniVoice serving and bench tests."""
    from gpu_worker.config import WorkerConfig
    from vocoder_svc.config import VocoderConfig

    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "4", "--kv-slots", "4096"],
                      omnivoice_worker=WorkerConfig(preset="omnivoice-tiny", dtype="float32"),
                      omnivoice_vocoder=VocoderConfig(preset="higgs-tiny")) as c:
        yield c


@pytest.fixture(scope="session")
def v2_64():
    """Tiny v2-shaped codec in float64 (the codec and session tests share it)."""
    return build_codec(tiny_v2(), seed=1, dtype=torch.float64)


@pytest.fixture(scope="session")
def v1_64():
    """Tiny v1-shaped codec in float64."""
    return build_codec(tiny_v1(), seed=2, dtype=torch.float64)
