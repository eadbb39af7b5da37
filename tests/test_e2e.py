"""The spine, end to end: client → scheduler (gRPC) → worker (ZeroMQ) → scheduler
→ vocoder (gRPC) → client, all real processes on loopback."""

import io
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import soundfile as sf
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chorus.client import channel, synthesize
from chorus.v1 import common_pb2, tts_pb2, tts_pb2_grpc, vocoder_pb2, vocoder_pb2_grpc
from helpers import seeded_request, wait_until_idle

SAMPLES_PER_FRAME = 3840


@pytest.fixture(scope="module")
def stub(cluster):
    return tts_pb2_grpc.TextToSpeechStub(channel(cluster.address))


request = seeded_request


def test_health_and_models(cluster, stub):
    health = health_pb2_grpc.HealthStub(channel(cluster.address))
    resp = health.Check(health_pb2.HealthCheckRequest(service="chorus.v1.TextToSpeech"))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    models = stub.ListModels(tts_pb2.ListModelsRequest()).models
    assert models[0].sample_rate == 48000 and models[0].channels == 2 and models[0].codebooks == 12


def test_three_concurrent_requests_complete(stub):
    frames = [9, 14, 20]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda f: synthesize(stub, request(seed=f, frames=f), timeout=120), frames))
    for f, r in zip(frames, results):
        assert r.header.sample_rate == 48000 and r.header.channels == 2
        pcm = r.pcm()
        assert pcm.shape == (f * SAMPLES_PER_FRAME, 2)
        assert r.summary.frames == f and r.summary.finish_reason == tts_pb2.MAX_FRAMES
        starts = [c.first_sample for c in r.chunks]
        assert starts[0] == 0 and starts == sorted(starts)
        assert r.summary.first_audio_ms > 0 and r.summary.total_ms >= r.summary.first_audio_ms
        # the end: the last frame after the first, before the summary; every chunk waited for its audio
        assert r.summary.first_frame_ms <= r.summary.last_frame_ms <= r.summary.total_ms
        assert 0 < r.summary.max_audio_lag_ms <= r.summary.total_ms
        assert np.abs(pcm).max() > 0


def test_same_seed_is_byte_identical(stub):
    a = synthesize(stub, request(seed=42, frames=16, return_codes=True), timeout=120)
    b = synthesize(stub, request(seed=42, frames=16, return_codes=True), timeout=120)
    c = synthesize(stub, request(seed=43, frames=16, return_codes=True), timeout=120)
    assert a.audio_bytes == b.audio_bytes
    assert np.array_equal(a.code_frames(), b.code_frames()) and a.code_frames().shape == (16, 12)
    assert not np.array_equal(a.code_frames(), c.code_frames())


def test_wav_and_float32_and_resampled_output(stub):
    wav = synthesize(stub, request(frames=6, format=tts_pb2.WAV), timeout=120)
    data, rate = sf.read(io.BytesIO(wav.audio_bytes), dtype="int16")
    assert rate == 48000 and data.shape == (6 * SAMPLES_PER_FRAME, 2)
    f32 = synthesize(stub, request(frames=6, format=tts_pb2.FLOAT32), timeout=120)
    assert f32.pcm().dtype == np.float32 and f32.pcm().shape == (6 * SAMPLES_PER_FRAME, 2)
    low = synthesize(stub, request(frames=6, sample_rate=16000), timeout=120)
    assert low.header.sample_rate == 16000
    assert abs(low.pcm().shape[0] - 6 * SAMPLES_PER_FRAME // 3) <= 2


def test_unknown_voice_id_is_not_found(stub):
    req = request(frames=4)
    req.references.add(voice_id="nobody")
    with pytest.raises(grpc.RpcError) as e:
        synthesize(stub, req, timeout=60)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_voice_reference_audio_is_encoded_and_used(stub):
    t = np.arange(48000) / 48000
    buf = io.BytesIO()
    sf.write(buf, 0.3 * np.sin(2 * np.pi * 220 * t), 48000, format="WAV")
    voice = stub.CreateVoice(tts_pb2.CreateVoiceRequest(audio=common_pb2.AudioData(data=buf.getvalue())))
    assert voice.frames == 12
    req = request(frames=5)
    req.references.add(voice_id=voice.voice_id)
    r = synthesize(stub, req, timeout=120)
    assert r.summary.prompt_rows > synthesize(stub, request(frames=5), timeout=120).summary.prompt_rows


def test_cancelled_stream_leaves_nothing_held(cluster, stub):
    for cancel_after in (0, 1, 3):
        call = stub.Synthesize(request(frames=400, seed=cancel_after), timeout=120)
        seen = 0
        for resp in call:
            if resp.HasField("audio"):
                seen += 1
            if seen >= cancel_after and not resp.HasField("header"):
                break
        call.cancel()
    held = wait_until_idle(cluster)
    assert held == (0, 0, 0, 0), f"kv used, running, worker states, vocoder streams = {held}"
    # and it still serves
    assert synthesize(stub, request(frames=3), timeout=60).summary.frames == 3


def test_random_cancellations_leave_nothing_held(cluster, stub):
    """200 calls cancelled at random points (queued, prefilling, mid-lookahead, draining audio)."""
    rng = np.random.default_rng(7)
    plans = [(int(rng.integers(1, 60)), int(rng.integers(0, 4)), float(rng.uniform(0, 0.05)), i)
             for i in range(200)]

    def one(plan):
        frames, after, delay, seed = plan
        call = stub.Synthesize(request(text=f"Cancellation number {seed}.", seed=seed, frames=frames), timeout=60)
        try:
            for n, _ in enumerate(call):
                if n >= after:
                    break
            time.sleep(delay)
        except grpc.RpcError:
            pass
        call.cancel()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, plans))
    assert wait_until_idle(cluster) == (0, 0, 0, 0)
    assert synthesize(stub, request(frames=3), timeout=60).summary.frames == 3


def test_duration_hints_reach_the_prompt(stub):
    plain = synthesize(stub, request(frames=3), timeout=60).summary.prompt_rows
    # "None" is one token; Qwen splits numbers into digits. The text's estimate is 23 frames,
    # so 2.0 s (25 frames) stays inside its 0.5x-1.5x band.
    for kw, digits in ((dict(duration_frames=125), 3), (dict(duration_seconds=2.0), 2), (dict(auto_duration=True), 2)):
        r = synthesize(stub, request(frames=3, **kw), timeout=60)
        assert r.summary.prompt_rows == plain - 1 + digits, kw
    with pytest.raises(grpc.RpcError) as e:
        synthesize(stub, request(frames=3, duration_frames=10, duration_seconds=1.0), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most one" in e.value.details()


def test_under_load_new_streams_start_with_the_loaded_first_chunk():
    """--first-chunk-frames-loaded: a request taken while --loaded-batch requests run gets that first
    chunk (unless its client asked for a size); one taken with nothing running keeps the default."""
    from helpers import make_cluster
    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "8"], vocoder_args=["--chunk-frames", "6"],
                      scheduler_args=["--loaded-batch", "1", "--first-chunk-frames-loaded", "3"]) as c:
        stub = tts_pb2_grpc.TextToSpeechStub(channel(c.address))
        first_chunk = lambda r: r.chunks[1].first_sample // SAMPLES_PER_FRAME  # noqa: E731
        alone = synthesize(stub, request(seed=1, frames=12), timeout=120)
        assert first_chunk(alone) == 5  # nothing was running: the default first chunk
        long = stub.Synthesize(request(seed=2, frames=120), timeout=120)
        assert next(long).HasField("header") and next(long).HasField("audio")  # it runs now
        loaded = synthesize(stub, request(seed=3, frames=12), timeout=120)
        asked = request(seed=4, frames=12)
        asked.streaming.first_chunk_frames = 4
        asked = synthesize(stub, asked, timeout=120)
        assert first_chunk(loaded) == 3 and first_chunk(asked) == 4
        assert loaded.pcm().shape == (12 * SAMPLES_PER_FRAME, 2)
        assert [ch.first_sample // SAMPLES_PER_FRAME for ch in loaded.chunks] == [0, 3, 9]  # then 6-frame chunks
        assert sum(1 for _ in long) > 0


def test_streams_get_the_vocoders_chunk_sizes():
    """The scheduler takes its chunk defaults from the vocoder's Info: a vocoder started with first 3,
    chunk 7 gives a request that leaves streaming unset chunks of 3 then 7 frames; a client's size wins."""
    from helpers import make_cluster
    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "8"],
                      vocoder_args=["--first-chunk-frames", "3", "--chunk-frames", "7"]) as c:
        info = vocoder_pb2_grpc.VocoderStub(channel(c.service("vocoder").address)).Info(
            vocoder_pb2.VocoderInfoRequest(), timeout=10)
        assert (info.first_chunk_frames, info.chunk_frames, info.slots, list(info.graph_frames)) == (3, 7, 0, [])
        stub = tts_pb2_grpc.TextToSpeechStub(channel(c.address))
        plain = synthesize(stub, request(seed=5, frames=17), timeout=120)
        assert plain.pcm().shape == (17 * SAMPLES_PER_FRAME, 2)
        assert [ch.first_sample // SAMPLES_PER_FRAME for ch in plain.chunks] == [0, 3, 10]
        asked = request(seed=5, frames=17)
        asked.streaming.chunk_frames = 4
        asked = synthesize(stub, asked, timeout=120)
        assert [ch.first_sample // SAMPLES_PER_FRAME for ch in asked.chunks] == [0, 3, 7, 11, 15]
