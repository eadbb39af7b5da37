"""The scheduler service as one core and several frontend processes on one port:
client connections spread over the frontends, and every frontend sees the same
scheduler (seeded frames), voices and metrics. A frontend that dies takes the
service down loudly instead of leaving a port that half works."""

import io
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import soundfile as sf

from chorus.client import synthesize
from chorus.v1 import common_pb2, tts_pb2, tts_pb2_grpc
from chorus.launcher import child_pids
from helpers import make_cluster, metric, seeded_request, still_running, wait_until_idle

FRONTENDS = 2


def own_connection(address: str) -> grpc.Channel:
    """A channel with its own TCP connection (no shared subchannel), i.e. a client of its own."""
    return grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20),
                                                   ("grpc.use_local_subchannel_pool", 1)])


@pytest.fixture(scope="module")
def cluster2():
    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "8", "--kv-slots", "16384"],
                      scheduler_args=["--frontends", str(FRONTENDS)]) as c:
        yield c


def test_connections_spread_and_agree(cluster2):
    channels = [own_connection(cluster2.address) for _ in range(12)]
    stubs = [tts_pb2_grpc.TextToSpeechStub(ch) for ch in channels]
    ttfa0 = metric(cluster2, "chorus_time_to_first_audio_seconds_count")
    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda s: synthesize(s, seeded_request(seed=3, frames=6), timeout=120), stubs))
    assert len({o.pcm().tobytes() for o in outs}) == 1 and outs[0].pcm().size > 0  # same seed, any frontend: same bytes
    served = {i for i in range(FRONTENDS)
              if any(f"frontend{i} INFO request" in line for line in cluster2.service("scheduler").lines)}
    assert served == set(range(FRONTENDS)), "12 connections all landed on one frontend"
    # one /metrics for the whole service
    assert metric(cluster2, "chorus_time_to_first_audio_seconds_count") - ttfa0 == 12
    assert metric(cluster2, "chorus_active_streams") == 0
    assert wait_until_idle(cluster2) == (0, 0, 0, 0)
    for ch in channels:
        ch.close()


def test_voices_are_shared_by_all_frontends(cluster2):
    stubs = [tts_pb2_grpc.TextToSpeechStub(own_connection(cluster2.address)) for _ in range(8)]
    buf = io.BytesIO()
    sf.write(buf, np.random.default_rng(0).standard_normal((48000, 2)).astype(np.float32) * 0.1, 48000,
             format="WAV")
    voice = stubs[0].CreateVoice(tts_pb2.CreateVoiceRequest(audio=common_pb2.AudioData(data=buf.getvalue()),
                                                            voice_id="shared"))
    for s in stubs:  # 8 connections: some land on the other frontend
        assert [v.voice_id for v in s.ListVoices(tts_pb2.ListVoicesRequest()).voices] == ["shared"]
        req = seeded_request(seed=4, frames=4)
        req.references.add(voice_id=voice.voice_id)
        assert synthesize(s, req, timeout=120).summary.prompt_rows > voice.frames
    stubs[-1].DeleteVoice(tts_pb2.DeleteVoiceRequest(voice_id="shared"))
    with pytest.raises(grpc.RpcError) as e:
        stubs[0].DeleteVoice(tts_pb2.DeleteVoiceRequest(voice_id="shared"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_dead_frontend_stops_the_service():
    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "4", "--kv-slots", "4096"],
                      scheduler_args=["--frontends", "2"]) as c:
        core = c.service("scheduler").proc
        fronts = child_pids(core.pid)
        assert len(fronts) == 2
        os.kill(fronts[0], signal.SIGKILL)
        assert core.wait(30) != 0  # exits non-zero: the orchestrator restarts the pod
        assert not still_running(fronts[1:], timeout=15), "the other frontend outlived the core"


def test_sigterm_lets_open_streams_finish():
    """Rolling restarts: SIGTERM stops new calls, but a stream already open gets all its audio."""
    # The drain outlasts the stream however slow the machine (the default is for servers).
    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "4", "--kv-slots", "4096"],
                      scheduler_args=["--frontends", "2", "--drain-seconds", "120"]) as c:
        stub = tts_pb2_grpc.TextToSpeechStub(own_connection(c.address))
        responses = stub.Synthesize(seeded_request(seed=6, frames=40), timeout=120)
        kinds = []
        for resp in responses:
            kinds.append(resp.WhichOneof("kind"))
            if kinds[-1] == "audio":
                break
        core = c.service("scheduler").proc
        core.send_signal(signal.SIGTERM)
        rest = list(responses)
        assert rest[-1].WhichOneof("kind") == "summary" and rest[-1].summary.frames == 40
        assert core.wait(60) == 0


def test_full_queue_is_resource_exhausted_and_leaks_nothing():
    """Past --max-queue the core refuses the submit; the frontend turns that into RESOURCE_EXHAUSTED
    with a message to retry, the accepted requests finish, and nothing stays held."""
    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "1", "--kv-slots", "4096"],
                      scheduler_args=["--max-queue", "1", "--frontends", "2"]) as c:
        stubs = [tts_pb2_grpc.TextToSpeechStub(own_connection(c.address)) for _ in range(6)]

        def call(s):
            try:
                return synthesize(s, seeded_request(seed=8, frames=30), timeout=120).summary.frames
            except grpc.RpcError as e:
                return e

        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(call, stubs))
        refused = [r for r in results if isinstance(r, grpc.RpcError)]
        assert refused and all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry" in e.details()
                               for e in refused)
        assert all(r == 30 for r in results if not isinstance(r, grpc.RpcError))
        assert wait_until_idle(c) == (0, 0, 0, 0)
        assert synthesize(stubs[0], seeded_request(seed=9, frames=4), timeout=60).summary.frames == 4


def test_frontends_exit_when_the_core_is_killed():
    """SIGKILL on the core (no cleanup ran) must not leave frontends holding the port."""
    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "2", "--kv-slots", "4096"],
                      scheduler_args=["--frontends", "2"]) as c:
        core = c.service("scheduler").proc
        fronts = child_pids(core.pid)
        assert len(fronts) == 2
        core.kill()
        core.wait(10)
        assert not still_running(fronts, timeout=15), "frontends outlived a killed core"
