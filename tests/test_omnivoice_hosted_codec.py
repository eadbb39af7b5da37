"""OmniVoice's codec hosted by the OmniVoice worker's process (cluster.colocate_omnivoice_codec): the
replica attached to it serves the same audio as a replica with a codec of its own, reports the hosted
forwards in its metrics, and fails its calls UNAVAILABLE when the host is gone."""

import os
import signal
import time

import grpc
import numpy as np
import pytest

from chorus.bench.server_counters import read_metrics
from chorus.client import channel, synthesize
from chorus.v1 import tts_pb2, tts_pb2_grpc, vocoder_pb2, vocoder_pb2_grpc
from gpu_worker.config import WorkerConfig
from chorus.processes import free_port
from helpers import make_cluster
from vocoder_svc.config import VocoderConfig

MODEL = "omnivoice-tiny"


def cluster(**kw):
    return make_cluster(worker_args=["--dtype", "float32", "--max-batch", "4", "--kv-slots", "4096"],
                        omnivoice_worker=WorkerConfig(preset="omnivoice-tiny", dtype="float32"),
                        omnivoice_vocoder=VocoderConfig(preset="higgs-tiny", attach_silence_s=2.0), **kw)


@pytest.fixture(scope="module")
def hosted():
    with cluster(colocate_omnivoice_codec=True, omnivoice_vocoder_metrics_ports=[free_port()]) as c:
        yield c


def request(text: str, seed: int) -> tts_pb2.SynthesizeRequest:
    req = tts_pb2.SynthesizeRequest(text=text, model=MODEL, language="en", return_codes=True)
    req.sampling.seed = seed
    req.omnivoice.num_step = 6
    return req


def test_the_hosted_codec_serves_the_same_audio(hosted, omnivoice_cluster):
    replica = hosted.service("omnivoice-vocoder")
    worker_pid = hosted.service("omnivoice-worker").proc.pid
    assert any(f"codec hosted by process {worker_pid}" in line for line in replica.lines), replica.lines[-20:]
    texts = ["The codec lives in the worker's process now.", "A second clip, of another length."]
    ours = [synthesize(tts_pb2_grpc.TextToSpeechStub(channel(hosted.address)), request(t, 3), timeout=300)
            for t in texts]
    theirs = [synthesize(tts_pb2_grpc.TextToSpeechStub(channel(omnivoice_cluster.address)), request(t, 3),
                         timeout=300) for t in texts]
    for a, b in zip(ours, theirs):
        assert np.array_equal(a.code_frames(), b.code_frames())
        assert len(a.audio_bytes) > 0 and a.audio_bytes == b.audio_bytes
    metrics = read_metrics(hosted.omnivoice_vocoder_metrics_ports[0])
    assert metrics["chorus_vocoder_clips_total"] >= 2 and metrics["chorus_vocoder_clip_forwards_total"] >= 1
    assert metrics["chorus_vocoder_clip_decode_ms_count"] >= 1 and metrics["chorus_vocoder_clip_finish_ms_count"] >= 2


def test_bad_codes_are_refused_by_the_replica_not_the_host(hosted):
    stub = vocoder_pb2_grpc.VocoderStub(channel(hosted.service("omnivoice-vocoder").address))
    codes = np.full((3, 8), 5000, dtype="<i4")
    with pytest.raises(grpc.RpcError) as e:
        stub.DecodeClip(vocoder_pb2.DecodeClipRequest(codes=dict(rows=3, cols=8, data=codes.tobytes())), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "codebook" in e.value.details()
    good = np.zeros((3, 8), dtype="<i4")  # and the host still answers
    reply = stub.DecodeClip(vocoder_pb2.DecodeClipRequest(codes=dict(rows=3, cols=8, data=good.tobytes()),
                                                          postprocess=False), timeout=60)
    assert reply.num_samples == 3 * 960


def test_cancelled_clips_leave_the_host_serving(hosted):
    stub = vocoder_pb2_grpc.VocoderStub(channel(hosted.service("omnivoice-vocoder").address))
    long = np.zeros((500, 8), dtype="<i4")
    calls = [stub.DecodeClip.future(vocoder_pb2.DecodeClipRequest(codes=dict(rows=500, cols=8, data=long.tobytes())),
                                    timeout=60) for _ in range(4)]
    for call in calls:
        call.cancel()
    good = np.ones((2, 8), dtype="<i4")
    reply = stub.DecodeClip(vocoder_pb2.DecodeClipRequest(codes=dict(rows=2, cols=8, data=good.tobytes()),
                                                          postprocess=False), timeout=60)
    assert reply.num_samples == 2 * 960


def test_a_replica_whose_host_is_gone_stops():
    """Without its codec the replica can serve nothing: it stops (its pod restarts with the worker's)."""
    with cluster(colocate_omnivoice_codec=True) as c:
        replica = c.service("omnivoice-vocoder")
        os.kill(c.service("omnivoice-worker").proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while replica.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert replica.proc.poll() is not None, "the replica outlived its hosted codec"
        assert any("went silent" in line for line in replica.lines), replica.lines[-20:]
