"""The scheduler service as one core and several frontend processes on one port:
client connections spread over the frontends, and every frontend sees the same
scheduler (seeded frames), voices and metrics. Voices live in the frontends' store: they
outlive a restart, and a deleted voice's prefix leaves the core's radix cache. A frontend
that dies takes the service down loudly instead of leaving a port that half works."""

import io
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import soundfile as sf

from chorus.client import synthesize
from chorus.v1 import common_pb2, tts_pb2, tts_pb2_grpc
from chorus.processes import Service, child_pids
from chorus.voice_store import open_store
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


def _wav(seconds: float = 1.0, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.random.default_rng(seed).standard_normal(int(seconds * 24000)).astype(np.float32) * 0.1,
             24000, format="WAV")
    return buf.getvalue()


def _wait_for_metric(cluster, name: str, value: float, timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    while (got := metric(cluster, name)) != value and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def test_first_use_warms_a_voices_prefix_and_deleting_the_voice_frees_it(cluster2):
    stub = tts_pb2_grpc.TextToSpeechStub(own_connection(cluster2.address))
    voice = stub.CreateVoice(tts_pb2.CreateVoiceRequest(audio=common_pb2.AudioData(data=_wav(seed=1)),
                                                        voice_id="warm"))
    with pytest.raises(grpc.RpcError) as e:  # the id is taken
        stub.CreateVoice(tts_pb2.CreateVoiceRequest(audio=common_pb2.AudioData(data=_wav()), voice_id="warm"))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert wait_until_idle(cluster2) == (0, 0, 0, 0)
    cached = metric(cluster2, "chorus_kv_slots_cached")
    outs = []
    for text in ("The first use of the voice.", "Other words in the same voice."):
        req = seeded_request(text=text, seed=7, frames=3)
        req.references.add(voice_id="warm")
        outs.append(synthesize(stub, req, timeout=120))
    assert outs[0].summary.cached_prompt_rows < voice.frames <= outs[1].summary.cached_prompt_rows
    assert wait_until_idle(cluster2) == (0, 0, 0, 0)
    assert metric(cluster2, "chorus_kv_slots_cached") > cached
    stub.DeleteVoice(tts_pb2.DeleteVoiceRequest(voice_id="warm"))
    assert _wait_for_metric(cluster2, "chorus_kv_slots_cached", cached) == cached  # its rows, and no others


def restart_scheduler(cluster) -> None:
    """Stop the scheduler (its core and frontends) and start it again from the same config, so on the
    same voice store file; the worker and the vocoders keep running."""
    old = cluster.service("scheduler")
    old.stop()
    new = Service("scheduler", old.argv)
    cluster.services[cluster.services.index(old)] = new
    new.start(False, dict(os.environ, PYTHONUNBUFFERED="1"))
    new.wait_ready(300)


def test_a_voice_outlives_a_restart(cluster2):
    stub = tts_pb2_grpc.TextToSpeechStub(own_connection(cluster2.address))
    voice = stub.CreateVoice(tts_pb2.CreateVoiceRequest(audio=common_pb2.AudioData(data=_wav(seed=2)),
                                                        voice_id="kept", transcript="A reference, said once."))
    req = seeded_request(seed=8, frames=4, return_codes=True)
    req.references.add(voice_id="kept")
    before = synthesize(stub, req, timeout=120)
    restart_scheduler(cluster2)
    stub = tts_pb2_grpc.TextToSpeechStub(own_connection(cluster2.address))
    assert [(v.voice_id, v.frames, v.transcript) for v in stub.ListVoices(tts_pb2.ListVoicesRequest()).voices] == \
        [("kept", voice.frames, "A reference, said once.")]
    after = synthesize(stub, req, timeout=120)
    assert after.summary.prompt_rows == before.summary.prompt_rows
    assert np.array_equal(after.code_frames(), before.code_frames())  # the same voice, the same seed
    with open_store(f"sqlite:///{cluster2._tmp.name}/voices.sqlite3") as db:  # the cluster's own file
        assert db.get("", "kept").frames == voice.frames  # in the database itself
    stub.DeleteVoice(tts_pb2.DeleteVoiceRequest(voice_id="kept"))
    assert stub.ListVoices(tts_pb2.ListVoicesRequest()).voices == []


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
