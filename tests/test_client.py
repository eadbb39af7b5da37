"""The SDK in chorus.client: several addresses, retry with backoff before the first answer, the
async twin, stopping a stream early, and audio files written as the stream comes."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import numpy as np
import pytest
import soundfile as sf

from chorus.client import AsyncClient, AudioFile, Client, Retry, channel, synthesize
from chorus.processes import free_port
from chorus.v1 import tts_pb2, tts_pb2_grpc
from helpers import seeded_request, wait_until_idle

FAST = Retry(attempts=4, first_wait=0.01, max_wait=0.02)


@pytest.fixture(scope="module")
def reference(cluster):
    return synthesize(tts_pb2_grpc.TextToSpeechStub(channel(cluster.address)), seeded_request(seed=5, frames=6),
                      timeout=120)


def test_a_dead_address_is_skipped(cluster, reference):
    dead = f"127.0.0.1:{free_port()}"
    with Client([dead, dead, cluster.address], retry=FAST, timeout=120) as client:
        for _ in range(3):  # whichever address it starts at
            got = client.synthesize(seeded_request(seed=5, frames=6))
            assert got.audio_bytes == reference.audio_bytes and got.summary.frames == 6
        assert client.list_models()[0].sample_rate == 48000


def test_the_async_client_gives_the_same_audio(cluster, reference):
    async def run():
        async with AsyncClient(cluster.address, timeout=120) as client:
            got = await client.synthesize(seeded_request(seed=5, frames=6))
            return got, await client.list_models()
    got, models = asyncio.run(run())
    assert got.audio_bytes == reference.audio_bytes and models[0].channels == 2


def test_stopping_a_stream_early_frees_the_request(cluster):
    with Client(cluster.address, timeout=120) as client:
        for resp in client.stream(seeded_request(frames=400)):
            if resp.WhichOneof("kind") == "audio":
                break
    assert wait_until_idle(cluster, timeout=30) == (0, 0, 0, 0)


@pytest.mark.parametrize("suffix,fmt", [("wav", tts_pb2.PCM16), ("flac", tts_pb2.WAV), ("wav", tts_pb2.FLOAT32),
                                        ("flac", tts_pb2.FLOAT32)])
def test_audio_files_hold_the_streamed_pcm(cluster, reference, tmp_path, suffix, fmt):
    path = tmp_path / f"out.{suffix}"
    with Client(cluster.address, timeout=120) as client, AudioFile(path) as out:
        for resp in client.stream(seeded_request(seed=5, frames=6, format=fmt)):
            out.add(resp)
    data, rate = sf.read(path, dtype="float32" if fmt == tts_pb2.FLOAT32 else "int16")
    assert rate == 48000
    if fmt != tts_pb2.FLOAT32:
        assert np.array_equal(data, reference.pcm())
        return
    want = synthesize(tts_pb2_grpc.TextToSpeechStub(channel(cluster.address)),
                      seeded_request(seed=5, frames=6, format=fmt), timeout=120).pcm()
    if suffix == "wav":  # float WAV holds the samples as they are
        assert np.array_equal(data, want)
    else:  # 24-bit FLAC: within its step, clipped to full scale
        assert np.abs(data - np.clip(want, -1, 1)).max() <= 2 ** -23


def test_an_unknown_file_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match="format"):
        AudioFile(tmp_path / "out.mp3")


class _Flaky(tts_pb2_grpc.TextToSpeechServicer):
    """Refuses the first `failures` calls with `code`, then answers."""

    def __init__(self, failures: int, code: grpc.StatusCode):
        self.failures, self.code, self.calls = failures, code, 0

    def Synthesize(self, request, context):
        self.calls += 1
        if self.calls <= self.failures:
            context.abort(self.code, "try again")
        yield tts_pb2.SynthesizeResponse(header=tts_pb2.StreamHeader(sample_rate=8000, channels=1))
        yield tts_pb2.SynthesizeResponse(audio=tts_pb2.AudioChunk(data=bytes(4), num_samples=2))
        yield tts_pb2.SynthesizeResponse(summary=tts_pb2.SynthesisSummary(frames=1))


def _serve(servicer) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    tts_pb2_grpc.add_TextToSpeechServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize("code,failures,succeeds", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 3, True),    # the 4th call answers
    (grpc.StatusCode.UNAVAILABLE, 4, False),          # out of attempts
    (grpc.StatusCode.INVALID_ARGUMENT, 1, False),     # never retried
])
def test_retry_before_the_first_answer(code, failures, succeeds):
    flaky = _Flaky(failures, code)
    server, address = _serve(flaky)
    try:
        with Client(address, retry=FAST, timeout=10) as client:
            if succeeds:
                assert client.synthesize(tts_pb2.SynthesizeRequest(text="x")).summary.frames == 1
            else:
                with pytest.raises(grpc.RpcError) as e:
                    client.synthesize(tts_pb2.SynthesizeRequest(text="x"))
                assert e.value.code() == code
        assert flaky.calls == (min(failures + 1, FAST.attempts) if code in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                                             grpc.StatusCode.UNAVAILABLE) else 1)
    finally:
        server.stop(0)


def test_backoff_grows_and_is_capped():
    r = Retry(attempts=10, first_wait=0.1, max_wait=0.5)
    waits = [max(r.wait(a) for _ in range(200)) for a in range(6)]
    assert waits[0] <= 0.1 and waits[2] <= 0.4 and max(waits) <= 0.5 and waits[5] > 0.3
