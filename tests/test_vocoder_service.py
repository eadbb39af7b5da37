"""The vocoder gRPC service, run as a real subprocess on an ephemeral port."""

from __future__ import annotations

import asyncio
import io
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import soundfile as sf
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from chorus.v1 import common_pb2, vocoder_pb2, vocoder_pb2_grpc
from vocoder_svc.codec import build_codec, tiny_v2
from vocoder_svc.server import DecodeWorker, Metrics, check_batch_invariance

REPO = Path(__file__).resolve().parent.parent
HOP = 3840
SEED = 7


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    metrics_port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vocoder_svc.server", "--port", "0", "--metrics-port", str(metrics_port),
         "--preset", "tiny", "--seed", str(SEED), "--first-chunk-frames", "5", "--chunk-frames", "25",
         "--grace", "1"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout], daemon=True).start()
    address, seen, deadline = None, [], time.time() + 60
    while address is None and time.time() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if m := re.match(r"vocoder ready on (\S+)", line):
            address = m.group(1)
    if address is None:
        proc.kill()
        pytest.fail("vocoder did not start:\n" + "".join(seen))
    channel = grpc.insecure_channel(address)
    yield {"stub": vocoder_pb2_grpc.VocoderStub(channel), "channel": channel, "metrics_port": metrics_port,
           "proc": proc, "lines": lines}
    channel.close()
    proc.terminate()  # SIGTERM: graceful drain
    try:
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def matrix(codes: np.ndarray) -> common_pb2.IntMatrix:
    return common_pb2.IntMatrix(rows=codes.shape[0], cols=codes.shape[1], data=codes.astype("<i4").tobytes())


def start(codebooks=12, first=5, chunk=25) -> vocoder_pb2.DecodeRequest:
    return vocoder_pb2.DecodeRequest(start=vocoder_pb2.DecodeStart(stream_id="t", codebooks=codebooks,
                                                                   first_chunk_frames=first, chunk_frames=chunk))


def decode_requests(codes: np.ndarray, pieces: list[int]):
    yield start()
    i = 0
    for n in pieces:
        yield vocoder_pb2.DecodeRequest(frames=matrix(codes[i:i + n]))
        i += n
    yield vocoder_pb2.DecodeRequest(end=True)


def random_codes(t: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1024, size=(t, 12), dtype=np.int32)


def test_decode_chunks_match_offline(server):
    stub = server["stub"]
    codes = random_codes(33)
    responses = list(stub.Decode(decode_requests(codes, [33]), timeout=60))
    assert [r.frames for r in responses] == [5, 25, 3]
    assert [r.first_frame for r in responses] == [0, 5, 30]
    assert [r.first_sample for r in responses] == [0, 5 * HOP, 30 * HOP]
    assert [r.num_samples for r in responses] == [5 * HOP, 25 * HOP, 3 * HOP]
    pcm = np.concatenate([np.frombuffer(r.pcm, "<f4").reshape(r.num_samples, 2) for r in responses])
    assert pcm.shape == (33 * HOP, 2)

    model = build_codec(tiny_v2(), seed=SEED)
    offline = model.decode(torch.from_numpy(codes.T.astype(np.int64)).unsqueeze(1))[0].numpy().T  # [N, 2]
    assert np.abs(pcm - offline).max() <= 1e-6 * max(1.0, np.abs(offline).max())

    # Chunking never depends on how frames arrive: other message splits give the same bytes.
    again = list(stub.Decode(decode_requests(codes, [1] * 7 + [4, 22]), timeout=60))
    assert [r.frames for r in again] == [5, 25, 3]
    assert b"".join(r.pcm for r in again) == b"".join(r.pcm for r in responses)


def test_decode_invalid_arguments(server):
    stub = server["stub"]
    bad = random_codes(3)
    bad[1, 4] = 1024
    cases = [
        ([start(), vocoder_pb2.DecodeRequest(frames=matrix(bad))], "code 1024 at row 1, codebook 4"),
        ([vocoder_pb2.DecodeRequest(frames=matrix(random_codes(2)))], "must be `start`"),
        ([start(), vocoder_pb2.DecodeRequest(frames=matrix(random_codes(2)[:, :8]))], "8 columns"),
        ([start(codebooks=33)], "1..32 codebooks"),
        ([start(), start()], "twice"),
    ]
    for reqs, message in cases:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Decode(iter(reqs), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert message in e.value.details()


def test_encode_and_cache(server):
    stub = server["stub"]
    rate, n = 22050, 30000
    t = np.arange(n) / rate
    wav = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, wav, rate, format="WAV", subtype="PCM_16")
    req = vocoder_pb2.EncodeRequest(audio=common_pb2.AudioData(data=buf.getvalue()), codebooks=12)
    first = stub.Encode(req, timeout=60)
    frames = (n * 48000 // rate) // HOP
    assert (first.codes.rows, first.codes.cols) == (frames, 12) and not first.cache_hit
    codes = np.frombuffer(first.codes.data, "<i4")
    assert codes.size == frames * 12 and 0 <= codes.min() and codes.max() < 1024
    second = stub.Encode(req, timeout=60)
    assert second.cache_hit and second.codes == first.codes
    with pytest.raises(grpc.RpcError) as e:
        stub.Encode(vocoder_pb2.EncodeRequest(audio=common_pb2.AudioData(data=b"garbage")), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "could not decode" in e.value.details()


def test_info_health_reflection(server):
    info = server["stub"].Info(vocoder_pb2.VocoderInfoRequest(), timeout=10)
    assert (info.sample_rate, info.channels, info.samples_per_frame, info.max_codebooks) == (48000, 2, HOP, 32)
    reflect = reflection_pb2_grpc.ServerReflectionStub(server["channel"])
    reply = next(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=10))
    assert "chorus.v1.Vocoder" in {s.name for s in reply.list_services_response.service}
    health = health_pb2_grpc.HealthStub(server["channel"])
    for service in ("", "chorus.v1.Vocoder"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def active_streams(server) -> int:
    return server["stub"].Info(vocoder_pb2.VocoderInfoRequest(), timeout=10).active_streams


def wait_for(predicate, timeout=20.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_cancelled_decode_releases_stream(server):
    stub = server["stub"]
    outbox: queue.Queue = queue.Queue()

    def requests():
        while (item := outbox.get()) is not None:
            yield item

    call = stub.Decode(requests(), timeout=60)
    outbox.put(start())
    outbox.put(vocoder_pb2.DecodeRequest(frames=matrix(random_codes(7))))
    first = next(call)  # the 5-frame first chunk arrives; 2 frames stay pending
    assert first.frames == 5
    assert active_streams(server) == 1
    call.cancel()
    outbox.put(None)
    assert wait_for(lambda: active_streams(server) == 0)
    body = urllib.request.urlopen(f"http://127.0.0.1:{server['metrics_port']}/metrics", timeout=10).read().decode()
    assert re.search(r"^chorus_vocoder_active_streams 0\.0$", body, re.M)
    assert "chorus_vocoder_decode_step_ms_bucket" in body and "chorus_vocoder_audio_seconds_total" in body


def test_concurrent_streams(server):
    stub = server["stub"]
    results = {}

    def one(seed):
        codes = random_codes(12, seed)
        results[seed] = b"".join(r.pcm for r in stub.Decode(decode_requests(codes, [3, 9]), timeout=60))

    threads = [threading.Thread(target=one, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    solo = b"".join(r.pcm for r in stub.Decode(decode_requests(random_codes(12, 1), [12]), timeout=60))
    assert len(results) == 3 and results[1] == solo
    assert active_streams(server) == 0


def _metric(server, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{server['metrics_port']}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", body, re.M)
    assert m, f"{name} not exported"
    return float(m.group(1))


@pytest.fixture
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the service runs (--torch-threads 1)
    yield
    torch.set_num_threads(threads)


def test_batched_decode_is_batch_invariant_in_process(one_torch_thread):
    """Steps of several streams that are due together run as one forward, and each stream's
    PCM is byte-identical to decoding it alone (the default, batch-invariant mode)."""
    model = build_codec(tiny_v2(), seed=SEED)
    assert check_batch_invariance(model, 5, 25) is None
    codes = [random_codes(16, seed) for seed in range(4)]
    pattern = [5, 10, 1]

    async def run(streams: list[int], worker: DecodeWorker) -> dict[int, bytes]:
        states = {s: model.new_stream() for s in streams}
        out = {s: b"" for s in streams}
        i = 0
        for n in pattern:
            with worker._cond:  # re-entrant: hold the worker off until every stream's step is queued
                futures = {s: worker.submit(states[s], codes[s][i:i + n]) for s in streams}
            for s, f in futures.items():
                out[s] += np.ascontiguousarray((await f).T).astype("<f4").tobytes()
            i += n
        return out

    metrics = Metrics()
    worker = DecodeWorker(model, metrics, max_batch=8)
    try:
        together = asyncio.run(run([0, 1, 2, 3], worker))
        alone = {s: asyncio.run(run([s], worker))[s] for s in range(4)}
        pair = asyncio.run(run([2, 0], worker))
    finally:
        worker.close()
    assert together == alone
    assert pair == {s: alone[s] for s in (2, 0)}
    sample = metrics.registry.get_sample_value
    assert sample("chorus_vocoder_decode_batch_streams_count") == 3 * (1 + 4 + 1)  # 3 steps x (4-batch, 4 solos, pair)
    assert sample("chorus_vocoder_decode_batch_streams_sum") == 3 * (4 + 4 + 2)


def test_concurrent_streams_are_byte_identical_and_batched(server):
    stub = server["stub"]
    steps_before = _metric(server, "chorus_vocoder_decode_batch_streams_count")
    streams_before = _metric(server, "chorus_vocoder_decode_batch_streams_sum")
    seconds_before = _metric(server, "chorus_vocoder_audio_seconds_total")
    frames, n = 60, 6
    results: dict[int, bytes] = {}
    barrier = threading.Barrier(n)

    def one(seed):
        codes = random_codes(frames, seed)
        barrier.wait()
        results[seed] = b"".join(r.pcm for r in stub.Decode(decode_requests(codes, [1] * frames), timeout=60))

    threads = [threading.Thread(target=one, args=(s,)) for s in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    steps = _metric(server, "chorus_vocoder_decode_batch_streams_count") - steps_before
    streams = _metric(server, "chorus_vocoder_decode_batch_streams_sum") - streams_before
    assert streams == n * 4  # chunks 5, 25, 25, 5 per stream
    assert steps < streams, "no two streams were ever decoded in one step"
    for seed in range(n):
        solo = b"".join(r.pcm for r in stub.Decode(decode_requests(random_codes(frames, seed), [frames]),
                                                  timeout=60))
        assert results[seed] == solo
    assert _metric(server, "chorus_vocoder_audio_seconds_total") - seconds_before == pytest.approx(
        2 * n * frames * HOP / 48000)
    assert active_streams(server) == 0


def test_graceful_drain():
    """SIGTERM: new calls are refused, an open stream still finishes within --grace, then exit 0."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "vocoder_svc.server", "--port", "0", "--metrics-port", "0", "--preset", "tiny",
         "--seed", str(SEED), "--grace", "20"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout], daemon=True).start()
    try:
        address, deadline = None, time.time() + 60
        while address is None and time.time() < deadline and proc.poll() is None:
            try:
                if m := re.match(r"vocoder ready on (\S+)", lines.get(timeout=1)):
                    address = m.group(1)
            except queue.Empty:
                pass
        assert address, "vocoder did not start"
        channel = grpc.insecure_channel(address)
        stub = vocoder_pb2_grpc.VocoderStub(channel)
        codes = random_codes(33, seed=5)
        want = b"".join(r.pcm for r in stub.Decode(decode_requests(codes, [33]), timeout=60))

        outbox: queue.Queue = queue.Queue()
        call = stub.Decode(iter(outbox.get, None), timeout=60)
        outbox.put(start())
        outbox.put(vocoder_pb2.DecodeRequest(frames=matrix(codes[:7])))
        got = [next(call)]  # the stream is open and producing
        t0 = time.time()
        proc.terminate()
        # New calls are refused once the drain has begun.
        assert wait_for(lambda: _refused(stub), timeout=10)
        outbox.put(vocoder_pb2.DecodeRequest(frames=matrix(codes[7:])))
        outbox.put(vocoder_pb2.DecodeRequest(end=True))
        outbox.put(None)
        got += list(call)
        assert b"".join(r.pcm for r in got) == want  # the open stream finished normally
        assert proc.wait(timeout=15) == 0
        assert time.time() - t0 < 15  # it left once its last call ended, not after the full grace
        channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _refused(stub) -> bool:
    try:
        stub.Info(vocoder_pb2.VocoderInfoRequest(), timeout=2)
    except grpc.RpcError as e:
        return e.code() == grpc.StatusCode.UNAVAILABLE
    return False
