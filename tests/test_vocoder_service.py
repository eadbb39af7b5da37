"""The vocoder gRPC service, run as a real subprocess on an ephemeral port."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
import queue
import re
import signal
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
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from chorus.audio import encode_pcm16
from chorus.config import parse
from chorus.v1 import common_pb2, vocoder_decoder_pb2 as dpb, vocoder_pb2, vocoder_pb2_grpc
from vocoder_svc import slot_decoder as slot_decoder_module
from vocoder_svc.codec import tiny_v2
from vocoder_svc.codec_checkpoint import build_codec
from vocoder_svc.config import VocoderConfig
from vocoder_svc.decode_process import Decoder, host_in_thread
from vocoder_svc.decoder_build import resolve_engine
from vocoder_svc.decoder_client import DecodeProcess, host_endpoints
from vocoder_svc.metrics import Metrics
from vocoder_svc.selfcheck import check_batch_invariance
from vocoder_svc.servicer import VocoderServicer
from vocoder_svc.slot_decoder import SlotDecoder
from vocoder_svc.slot_worker import SlotWorker
from vocoder_svc.stream_worker import DecodeWorker

from helpers import free_port, still_running

REPO = Path(__file__).resolve().parent.parent
HOP = 3840
SEED = 7


def start_vocoder(*flags: str, timeout: float = 90) -> tuple[subprocess.Popen, str, list[str], queue.Queue]:
    """`python -m vocoder_svc.server` on a free port with the tiny codec and `flags`, started for real;
    returns (process, address, its output up to ready, a queue of its later lines)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "vocoder_svc.server", "--port", "0", "--preset", "tiny", "--seed", str(SEED), *flags],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout], daemon=True).start()
    seen, address, deadline = [], None, time.time() + timeout
    while address is None and time.time() < deadline and proc.poll() is None:
        try:
            seen.append(lines.get(timeout=1))
        except queue.Empty:
            continue
        if m := re.match(r"vocoder ready on (\S+)", seen[-1]):
            address = m.group(1)
    if address is None:
        proc.kill()
        pytest.fail("vocoder did not start:\n" + "".join(seen))
    return proc, address, seen, lines


@pytest.fixture(scope="module")
def server():
    metrics_port = free_port()
    proc, address, _, lines = start_vocoder("--metrics-port", str(metrics_port), "--first-chunk-frames", "5",
                                            "--chunk-frames", "25", "--grace", "1", timeout=60)
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


def start(codebooks=12, first=5, chunk=25, encoding=vocoder_pb2.PCM_FLOAT32) -> vocoder_pb2.DecodeRequest:
    return vocoder_pb2.DecodeRequest(start=vocoder_pb2.DecodeStart(stream_id="t", codebooks=codebooks,
                                                                   first_chunk_frames=first, chunk_frames=chunk,
                                                                   pcm_encoding=encoding))


def decode_requests(codes: np.ndarray, pieces: list[int], encoding=vocoder_pb2.PCM_FLOAT32):
    yield start(encoding=encoding)
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

    # int16 PCM (for PCM16 clients at the native rate) is exactly the scheduler's encoding of the float32
    as_int16 = list(stub.Decode(decode_requests(codes, [33], vocoder_pb2.PCM_INT16), timeout=60))
    assert all(r.pcm_encoding == vocoder_pb2.PCM_INT16 for r in as_int16)
    assert all(r.pcm_encoding == vocoder_pb2.PCM_FLOAT32 for r in responses)
    assert [(r.frames, r.num_samples) for r in as_int16] == [(r.frames, r.num_samples) for r in responses]
    assert b"".join(r.pcm for r in as_int16) == encode_pcm16(pcm)


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
        ([start(encoding=7)], "start.pcm_encoding=7"),
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
    # the stream engine's streaming defaults: no slots, no steps, no graphs
    assert (info.first_chunk_frames, info.chunk_frames, info.step_frames, list(info.graph_frames),
            info.slots) == (5, 25, 0, [], 0)
    reflect = reflection_pb2_grpc.ServerReflectionStub(server["channel"])
    reply = next(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=10))
    assert "chorus.v1.Vocoder" in {s.name for s in reply.list_services_response.service}
    health = health_pb2_grpc.HealthStub(server["channel"])
    for service in ("", "chorus.v1.Vocoder"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_decode_clip_is_for_omnivoice_replicas(server):
    codes = random_codes(2)[:, :8]
    with pytest.raises(grpc.RpcError) as e:
        server["stub"].DecodeClip(vocoder_pb2.DecodeClipRequest(codes=matrix(codes)), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "streams with Decode" in e.value.details()


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


# ---- the slots engine on CPU, its decoder hosted in this process ----------------------------------

SLOTS = 3


def stop_hosted_decoder(decoder: Decoder, path: str) -> None:
    """Stand in for a vocoder on the hosted decoder's endpoint (none is attached any more) and stop it."""
    ctx = zmq.Context()
    try:
        jobs = ctx.socket(zmq.PUSH)
        jobs.bind(host_endpoints(path)[0])
        jobs.send(dpb.DecoderInput(shutdown=True).SerializeToString())
        assert wait_for(lambda: decoder.worker._closed)
    finally:
        ctx.destroy(linger=0)


class InProcessVocoder:
    """A VocoderServicer served by grpc.aio on a private event loop thread, its slots engine a decoder
    hosted in this process (host_in_thread, as gpu_worker hosts one) under `path`, configured by the
    vocoder flags `flags`: no process is started, and the tests can look into the slot decoder."""

    def __init__(self, codec, path: str, *flags: str, first_chunk_frames: int = 5, chunk_frames: int = 25):
        # --torch-threads 0: the host leaves this process's torch thread count alone.
        config = parse(VocoderConfig, ["--preset", "tiny", "--seed", str(SEED), "--torch-threads", "0", *flags])
        self.path = path
        self.decoder = host_in_thread(path, config, "cpu")
        self.slot_decoder = self.decoder.worker.slot_decoder
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-vocoder-loop", daemon=True)
        self.thread.start()

        async def start():  # on the loop: the client's asyncio sockets and tasks live there
            metrics = Metrics()
            client = DecodeProcess(config, metrics, attach=path)
            await client.start()
            servicer = VocoderServicer(codec, "tiny", first_chunk_frames=first_chunk_frames,
                                       chunk_frames=chunk_frames, metrics=metrics, decoder=client)
            server = grpc.aio.server()
            vocoder_pb2_grpc.add_VocoderServicer_to_server(servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return servicer, server, port

        self.servicer, self.server, port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(60)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = vocoder_pb2_grpc.VocoderStub(self.channel)

    def info(self) -> vocoder_pb2.VocoderInfo:
        return self.stub.Info(vocoder_pb2.VocoderInfoRequest(), timeout=10)

    def close(self) -> None:
        self.channel.close()
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(30)

        async def close_servicer():  # on the loop, like its client's tasks and sockets
            self.servicer.close()

        asyncio.run_coroutine_threadsafe(close_servicer(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        stop_hosted_decoder(self.decoder, self.path)


@pytest.fixture(scope="module")
def tiny_codec():
    return build_codec(tiny_v2(), seed=SEED)


@pytest.fixture(scope="module")
def slots_vocoder(tiny_codec, tmp_path_factory):
    # Emulated graphs for the service's chunk sizes (5, 25): the graph bookkeeping runs, replays are eager.
    v = InProcessVocoder(tiny_codec, str(tmp_path_factory.mktemp("decoder")), "--slots", str(SLOTS),
                         "--graphs", "emulate", "--graph-frames", "5,25")
    yield v
    v.close()


def offline_pcm(codec, codes: np.ndarray) -> np.ndarray:
    """codes [T, n_q] -> [T*hop, C] float32, decoded in one offline call."""
    return codec.decode(torch.from_numpy(codes.T.astype(np.int64)).unsqueeze(1))[0].numpy().T


def pcm_of(responses) -> np.ndarray:
    return np.concatenate([np.frombuffer(r.pcm, "<f4").reshape(r.num_samples, 2) for r in responses])


def assert_close(pcm: np.ndarray, ref: np.ndarray) -> None:
    assert pcm.shape == ref.shape
    assert np.abs(pcm - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())


def decode_33(stub, seed: int) -> list:
    """random_codes(33, seed) through a Decode call in pieces of 10 and 23 frames: its responses."""
    return list(stub.Decode(decode_requests(random_codes(33, seed), [10, 23]), timeout=60))


def decode_33_at_once(stub_of_seed: dict, codec) -> None:
    """decode_33 for every seed at once, on its stub, one thread each; every stream's chunks are the
    first (5) and steady (25) chunk and the rest, and its PCM is the offline decode."""
    results: dict[int, list] = {}
    threads = [threading.Thread(target=lambda s=s, stub=stub: results.__setitem__(s, decode_33(stub, s)))
               for s, stub in stub_of_seed.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seed in stub_of_seed:
        assert [r.frames for r in results[seed]] == [5, 25, 3]
        assert_close(pcm_of(results[seed]), offline_pcm(codec, random_codes(33, seed)))


def settled(v: InProcessVocoder) -> bool:
    """No call open and every slot back (slots are freed on the worker thread, after the call ends)."""
    return v.info().active_streams == 0 and v.slot_decoder.free_slots == SLOTS


def test_slots_engine_decode_matches_offline(slots_vocoder, tiny_codec):
    v = slots_vocoder
    codes = random_codes(33, seed=21)
    responses = list(v.stub.Decode(decode_requests(codes, [33]), timeout=60))
    assert [(r.first_frame, r.frames, r.first_sample) for r in responses] == [(0, 5, 0), (5, 25, 5 * HOP),
                                                                              (30, 3, 30 * HOP)]
    assert_close(pcm_of(responses), offline_pcm(tiny_codec, codes))
    again = list(v.stub.Decode(decode_requests(codes, [1] * 7 + [4, 22]), timeout=60))
    assert b"".join(r.pcm for r in again) == b"".join(r.pcm for r in responses)  # arrival never matters
    # Codebooks other than the slot decoder's go through the stream engine.
    few = random_codes(9, seed=22)[:, :8]
    reqs = [start(codebooks=8), vocoder_pb2.DecodeRequest(frames=matrix(few)), vocoder_pb2.DecodeRequest(end=True)]
    assert_close(pcm_of(v.stub.Decode(iter(reqs), timeout=60)), offline_pcm(tiny_codec, few))
    assert wait_for(lambda: settled(v))
    steps = v.servicer.metrics.registry.get_sample_value
    # 5 and 25 frames are graphed, and so are the 3-frame tails: padded to 25 frames, PCM cut back
    assert steps("chorus_vocoder_slot_steps_total", {"path": "graph"}) >= 6
    assert steps("chorus_vocoder_slot_steps_total", {"path": "eager"}) is None


def test_slots_engine_concurrent_streams_with_different_chunks(slots_vocoder, tiny_codec):
    v = slots_vocoder
    configs = {0: (5, 25, [40]), 1: (3, 7, [2] * 20), 2: (5, 25, [1] * 40)}  # first, chunk, message sizes
    results: dict[int, np.ndarray] = {}
    barrier = threading.Barrier(len(configs))

    def one(seed):
        first, chunk, pieces = configs[seed]
        codes = random_codes(40, seed=30 + seed)

        def reqs():
            yield start(first=first, chunk=chunk)
            i = 0
            for n in pieces:
                yield vocoder_pb2.DecodeRequest(frames=matrix(codes[i:i + n]))
                i += n
            yield vocoder_pb2.DecodeRequest(end=True)

        barrier.wait()
        resp = list(v.stub.Decode(reqs(), timeout=60))
        want = [first] + [chunk] * ((40 - first) // chunk) + ([(40 - first) % chunk] if (40 - first) % chunk else [])
        assert [r.frames for r in resp] == want
        results[seed] = pcm_of(resp)

    threads = [threading.Thread(target=one, args=(s,)) for s in configs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == sorted(configs)
    for seed in configs:
        assert_close(results[seed], offline_pcm(tiny_codec, random_codes(40, seed=30 + seed)))
    assert wait_for(lambda: settled(v))


def _open_stream(stub, codes: np.ndarray):
    """A Decode call fed from a queue; returns (outbox, responses queue, call)."""
    outbox: queue.Queue = queue.Queue()
    got: queue.Queue = queue.Queue()
    call = stub.Decode(iter(outbox.get, None), timeout=60)

    def read():
        try:
            for r in call:
                got.put(r)
            got.put("done")
        except grpc.RpcError as e:
            got.put(e)

    threading.Thread(target=read, daemon=True).start()
    outbox.put(start())
    outbox.put(vocoder_pb2.DecodeRequest(frames=matrix(codes)))
    return outbox, got, call


def test_slots_engine_frees_slots_on_cancel_and_error(slots_vocoder):
    v = slots_vocoder
    slot_decoder = v.slot_decoder
    outbox, got, call = _open_stream(v.stub, random_codes(7, seed=40))
    assert got.get(timeout=30).frames == 5  # first step done: the stream holds a slot
    assert v.info().active_streams == 1 and slot_decoder.free_slots == SLOTS - 1
    call.cancel()
    outbox.put(None)
    assert wait_for(lambda: settled(v))
    # An invalid frame after the first chunk ends the call with INVALID_ARGUMENT; the slot comes back too.
    bad = random_codes(3, seed=41)
    bad[0, 0] = 4096
    outbox, got, call = _open_stream(v.stub, random_codes(6, seed=42))
    assert got.get(timeout=30).frames == 5 and slot_decoder.free_slots == SLOTS - 1
    outbox.put(vocoder_pb2.DecodeRequest(frames=matrix(bad)))
    outbox.put(None)
    err = got.get(timeout=30)
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert wait_for(lambda: settled(v))
    sample = v.servicer.metrics.registry.get_sample_value
    assert wait_for(lambda: sample("chorus_vocoder_free_slots") == SLOTS)  # the decoder's report follows
    assert sample("chorus_vocoder_active_streams") == 0


def test_slots_engine_queues_streams_beyond_slots(slots_vocoder, tiny_codec):
    """With every slot held, a new stream's first step waits (no error) until a call ends; a waiting
    stream that is cancelled leaves nothing behind."""
    v = slots_vocoder
    slot_decoder = v.slot_decoder
    holders = [_open_stream(v.stub, random_codes(5, seed=50 + i)) for i in range(SLOTS)]
    for _, got, _ in holders:
        assert got.get(timeout=30).frames == 5
    assert slot_decoder.free_slots == 0
    waiting_codes = random_codes(12, seed=60)
    outbox, got, call = _open_stream(v.stub, waiting_codes[:5])
    quitter = _open_stream(v.stub, random_codes(5, seed=61))
    gauge = lambda: v.servicer.metrics.registry.get_sample_value("chorus_vocoder_waiting_streams")  # noqa: E731
    assert wait_for(lambda: gauge() == 2)
    with pytest.raises(queue.Empty):
        got.get(timeout=1.0)  # queued, not failed
    assert v.info().active_streams == SLOTS + 2
    quitter[2].cancel()  # gives up while waiting: it never held a slot
    quitter[0].put(None)
    assert wait_for(lambda: v.info().active_streams == SLOTS + 1)
    h_out, h_got, _ = holders[0]
    h_out.put(vocoder_pb2.DecodeRequest(end=True))  # one holder finishes: its slot goes to the waiting stream
    h_out.put(None)
    assert h_got.get(timeout=30) == "done"
    first = got.get(timeout=30)
    assert first.frames == 5
    outbox.put(vocoder_pb2.DecodeRequest(frames=matrix(waiting_codes[5:])))
    outbox.put(vocoder_pb2.DecodeRequest(end=True))
    outbox.put(None)
    rest = []
    while (item := got.get(timeout=30)) != "done":
        rest.append(item)
    assert_close(pcm_of([first, *rest]), offline_pcm(tiny_codec, waiting_codes))
    for h_out, h_got, _ in holders[1:]:
        h_out.put(vocoder_pb2.DecodeRequest(end=True))
        h_out.put(None)
        assert h_got.get(timeout=30) == "done"
    assert wait_for(lambda: settled(v)) and gauge() == 0


def test_slot_worker_runs_first_chunks_first(tiny_codec):
    """A new stream's first step (its listener hears nothing yet) goes before an older steady step."""
    slot_decoder = SlotDecoder(tiny_codec, slots=4, n_q=12, buckets=[4])
    worker = SlotWorker(slot_decoder, Metrics().record_step)
    codes = random_codes(10, 1)
    order: list[str] = []

    async def run() -> None:
        steady, new = worker.open(), worker.open()
        await worker.submit(steady, codes[:5])  # steady now holds a slot
        with worker._cond:  # queue both before the worker looks: the steady step is older
            older = worker.submit(steady, codes[5:8])
            starter = worker.submit(new, codes[:5])
        older.add_done_callback(lambda _: order.append("steady"))
        starter.add_done_callback(lambda _: order.append("first chunk"))
        await asyncio.gather(older, starter)
        worker.release(steady)
        worker.release(new)

    try:
        asyncio.run(run())
    finally:
        worker.close()
    assert order == ["first chunk", "steady"]


def test_slot_worker_batches_same_frame_counts(tiny_codec):
    """Steps due together with the same T are one decoder step (different T: separate steps); each
    stream's PCM is bitwise what it is alone in the same bucket."""
    slot_decoder = SlotDecoder(tiny_codec, slots=4, n_q=12, buckets=[4])  # one bucket: any grouping, same bytes
    metrics = Metrics()
    worker = SlotWorker(slot_decoder, metrics.record_step)
    codes = [random_codes(10, seed) for seed in range(4)]

    async def run(streams: list[int], sizes: dict[int, list[int]]) -> dict[int, bytes]:
        handles = {s: worker.open() for s in streams}
        out = {s: b"" for s in streams}
        pos = dict.fromkeys(streams, 0)
        for k in range(len(sizes[streams[0]])):
            with worker._cond:  # hold the worker off until every stream's step is queued
                futures = {s: worker.submit(handles[s], codes[s][pos[s]:pos[s] + sizes[s][k]]) for s in streams}
            for s, f in futures.items():
                out[s] += await f  # float32 wire PCM
                pos[s] += sizes[s][k]
        for h in handles.values():
            worker.release(h)
        return out

    try:
        mixed = asyncio.run(run([0, 1, 2, 3], {0: [5, 5], 1: [5, 5], 2: [3, 7], 3: [5, 5]}))
        assert wait_for(lambda: slot_decoder.free_slots == 4)
        alone = {s: asyncio.run(run([s], {s: [5, 5] if s != 2 else [3, 7]}))[s] for s in range(4)}
    finally:
        worker.close()
    assert mixed == alone
    sample = metrics.registry.get_sample_value
    # mixed: per round one step of three streams (T=5) and one of one (T=3 / T=7); then 4 solo runs x 2 steps
    assert sample("chorus_vocoder_decode_batch_streams_count") == 2 * 2 + 4 * 2
    assert sample("chorus_vocoder_decode_batch_streams_sum") == 2 * 4 + 4 * 2
    assert slot_decoder.free_slots == 4 and sample("chorus_vocoder_free_slots") == 4


def test_slots_engine_cli(tiny_codec):
    """--engine slots on CPU with emulated graphs: capture progress, the self-check line, a decode."""
    proc, address, seen, _ = start_vocoder("--metrics-port", "0", "--engine", "slots", "--slots", "2",
                                           "--graphs", "emulate", "--graph-frames", "5,25", "--grace", "1", timeout=60)
    try:
        text = "".join(seen)
        assert "slots engine: 2 slots, buckets [1, 2], 12 codebooks" in text
        assert re.search(r"captured graph 4/4 \(bucket 1, 5 frames\)", text), text
        assert "bitwise independent of its neighbours" in text and "graph == eager bitwise" in text
        with grpc.insecure_channel(address) as ch:
            codes = random_codes(33, seed=70)
            resp = list(vocoder_pb2_grpc.VocoderStub(ch).Decode(decode_requests(codes, [33]), timeout=60))
            info = vocoder_pb2_grpc.VocoderStub(ch).Info(vocoder_pb2.VocoderInfoRequest(), timeout=10)
        assert [r.frames for r in resp] == [5, 25, 3]
        assert_close(pcm_of(resp), offline_pcm(tiny_codec, codes))
        assert (info.first_chunk_frames, info.chunk_frames, list(info.graph_frames), info.slots) == (5, 25, [5, 25], 2)
        proc.terminate()
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_engine_choice():
    assert resolve_engine("auto", "cpu") == "stream" and resolve_engine("auto", "cuda:1") == "slots"
    assert resolve_engine("slots", "cpu") == "slots" and resolve_engine("stream", "cuda") == "stream"


def test_slots_engine_stream_limit_is_out_of_range(tiny_codec, tmp_path, monkeypatch):
    """A stream past the slot decoder's exact-position limit ends with OUT_OF_RANGE (no failover) after the
    chunks that fit, and frees its slot."""
    build_weights = slot_decoder_module.build_weights  # max_stream_frames = 12 instead of 2184:
    monkeypatch.setattr(slot_decoder_module, "build_weights", lambda *a: dataclasses.replace(
        build_weights(*a), max_mult=slot_decoder_module.MAX_POSITION // 12))
    v = InProcessVocoder(tiny_codec, str(tmp_path / "d"), "--slots", "1", "--graphs", "off",
                         first_chunk_frames=5, chunk_frames=5)
    slot_decoder = v.slot_decoder
    try:
        assert slot_decoder.max_stream_frames == 12 and v.servicer.decoder.max_stream_frames == 12
        got = []
        with pytest.raises(grpc.RpcError) as e:
            for r in v.stub.Decode(decode_requests(random_codes(16, seed=80), [16]), timeout=60):
                got.append(r.frames)
        assert got in ([5], [5, 5])  # the chunks that fit (grpc may drop the last one queued before the abort)
        assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE and "longer than 12 frames" in e.value.details()
        assert wait_for(lambda: v.info().active_streams == 0 and slot_decoder.free_slots == 1)
    finally:
        v.close()


# ---- the slots engine in its child decode process -----------------------------------------------

def _start_decode_process_vocoder(metrics_port: int = 0):
    """The vocoder with its slot decoder in a child process (2 slots, emulated graphs); returns (proc, address,
    decode process pid, output lines)."""
    proc, address, seen, lines = start_vocoder(
        "--metrics-port", str(metrics_port), "--engine", "slots", "--slots", "2",
        "--graphs", "emulate", "--graph-frames", "5,25", "--grace", "5")
    child = next((int(m.group(1)) for line in seen if (m := re.match(r"vocoder: decode process (\d+) ready", line))),
                 None)
    assert child is not None and child != proc.pid, "".join(seen)
    return proc, address, child, lines


def test_decode_process_serves_queues_cancels_and_drains(tiny_codec):
    """Through the decode process: streams beyond the slots wait and every one decodes to the offline
    PCM; a cancelled stream's slot comes back; the child's step figures reach /metrics; SIGTERM drains
    an open call, then both processes exit 0."""
    metrics_port = free_port()
    proc, address, child, _ = _start_decode_process_vocoder(metrics_port)
    metric = lambda name: _metric({"metrics_port": metrics_port}, name)  # noqa: E731
    try:
        with grpc.insecure_channel(address) as ch:
            stub = vocoder_pb2_grpc.VocoderStub(ch)
            info = stub.Info(vocoder_pb2.VocoderInfoRequest(), timeout=10)  # the decode process's facts
            assert (info.slots, list(info.graph_frames), info.step_frames) == (2, [5, 25], 0)
            decode_33_at_once({seed: stub for seed in range(3)}, tiny_codec)  # 3 streams, 2 slots

            outbox, got, call = _open_stream(stub, random_codes(7, 9))
            assert got.get(timeout=30).frames == 5
            assert wait_for(lambda: metric("chorus_vocoder_free_slots") == 1)
            call.cancel()
            outbox.put(None)
            assert wait_for(lambda: metric("chorus_vocoder_free_slots") == 2)
            assert metric('chorus_vocoder_slot_steps_total{path="graph"}') >= 4
            assert metric("chorus_vocoder_decode_step_ms_count") >= 7
            assert metric("chorus_vocoder_active_streams") == 0

            outbox, got, call = _open_stream(stub, random_codes(12, 3))  # open while SIGTERM arrives
            assert got.get(timeout=30).frames == 5
            proc.terminate()
            time.sleep(0.5)
            outbox.put(vocoder_pb2.DecodeRequest(end=True))
            outbox.put(None)
            rest = [got.get(timeout=30)]
            assert rest[0] != "done" and rest[0].frames == 7 and got.get(timeout=30) == "done"
        assert proc.wait(timeout=30) == 0
        assert not still_running([child], timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _kill_decoder_mid_stream(proc: subprocess.Popen, address: str, kill, why: str) -> None:
    """Open a stream on the vocoder, kill its decoder after the first chunk: the call must end UNAVAILABLE
    saying `why`, and the vocoder must exit non-zero."""
    with grpc.insecure_channel(address) as ch:
        outbox, got, _ = _open_stream(vocoder_pb2_grpc.VocoderStub(ch), random_codes(7, 4))
        assert got.get(timeout=30).frames == 5
        kill()
        outbox.put(vocoder_pb2.DecodeRequest(end=True))
        outbox.put(None)
        err = got.get(timeout=30)
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert why in err.details()
    assert proc.wait(timeout=30) != 0


def test_decode_process_death_fails_calls_unavailable_and_stops_the_service():
    """SIGKILL of the decode process mid-stream: the open call ends UNAVAILABLE (the scheduler replays it
    on another replica) and the service exits non-zero, so its pod restarts."""
    proc, address, child, lines = _start_decode_process_vocoder()
    try:
        _kill_decoder_mid_stream(proc, address, lambda: os.kill(child, signal.SIGKILL), "decode process exited")
        out = []
        while not lines.empty():
            out.append(lines.get())
        assert any("decode process exited with -9" in line for line in out), "".join(out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- the decoder hosted in another process (gpu_worker --host-vocoder-decoder) -------------------------

def test_hosted_decoder_serves_one_vocoder_after_another(tiny_codec, tmp_path):
    """A decoder hosted in this process (as gpu_worker hosts it) serves a vocoder started with
    --attach-decoder; SIGKILL that vocoder mid-stream and a new one attaches to the same decoder: its
    hello frees the dead one's slot, and its streams decode to the offline PCM."""
    path = str(tmp_path / "decoder")
    decoder = host_in_thread(path, parse(VocoderConfig, ["--preset", "tiny", "--seed", str(SEED), "--slots", "2",
                                                         "--graphs", "emulate", "--graph-frames", "5,25"]), "cpu")
    assert decoder.ready.hosted and decoder.ready.pid == os.getpid()
    procs = []
    ctx = zmq.Context()
    try:
        jobs = ctx.socket(zmq.PUSH)  # a frame that is no DecoderInput is dropped; the decoder serves on
        jobs.bind(host_endpoints(path)[0])
        jobs.send(b"\xff not a DecoderInput")
        jobs.close(linger=2000)
        for round_ in range(2):
            metrics_port = free_port()
            proc, address, seen, _ = start_vocoder("--metrics-port", str(metrics_port), "--attach-decoder", path,
                                                   "--grace", "1")
            procs.append(proc)
            assert any(f"hosted by process {os.getpid()}" in line for line in seen), "".join(seen)
            metric = lambda name: _metric({"metrics_port": metrics_port}, name)  # noqa: E731
            with grpc.insecure_channel(address) as ch:
                stub = vocoder_pb2_grpc.VocoderStub(ch)
                # The first vocoder's stream holds a slot when it dies; the second's hello frees it.
                assert wait_for(lambda: metric("chorus_vocoder_free_slots") == 2)
                decode_33_at_once({round_: stub}, tiny_codec)
                if round_ == 0:
                    outbox, got, _ = _open_stream(stub, random_codes(7, 9))
                    assert got.get(timeout=30).frames == 5
                    assert wait_for(lambda: metric("chorus_vocoder_free_slots") == 1)
                    proc.kill()
                    proc.wait()
                    outbox.put(None)
        assert wait_for(lambda: decoder.worker.slot_decoder.free_slots == 2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        ctx.destroy(linger=0)
        stop_hosted_decoder(decoder, path)


def test_hosted_decoder_death_fails_calls_unavailable_and_stops_the_vocoder(tmp_path):
    """SIGKILL of the process hosting the decoder (the worker, in production) mid-stream: its heartbeat
    stops, the open call ends UNAVAILABLE after --attach-silence-s and the vocoder exits non-zero."""
    path = str(tmp_path / "decoder")
    host = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from vocoder_svc.decode_process import host_in_thread; "
         "from chorus.config import parse; from vocoder_svc.config import VocoderConfig; "
         f"host_in_thread({path!r}, parse(VocoderConfig, ['--preset', 'tiny', '--seed', '{SEED}', '--slots', '2']), "
         "'cpu'); "
         "print('hosting', flush=True); time.sleep(600)"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc = None
    try:
        assert any(line.strip() == "hosting" for line in iter(host.stdout.readline, "")), "the host did not start"
        proc, address, _, lines = start_vocoder("--attach-decoder", path, "--attach-silence-s", "2")
        _kill_decoder_mid_stream(proc, address, host.kill, "went silent")
    finally:
        for p in (host, proc):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_colocation_defaults_to_one_gpu_layouts():
    """--colocate-vocoder auto: on when the worker and the one vocoder share a CUDA device, and then the
    vocoder decodes in first-chunk-sized steps unless its flags say otherwise. On the worker's device
    (colocated or not) it launches ahead only steps of half its slots; on a device of its own it keeps
    its server's default (every step)."""
    from chorus.launcher import colocation

    from chorus.config import given_fields, parse
    from vocoder_svc.config import VocoderConfig

    def flags(*argv):  # (colocate?, the fields that differ from the vocoder's defaults)
        def run(choice, device, vocoder_device, replicas):
            on, v = colocation(choice, device, vocoder_device, replicas, parse(VocoderConfig, list(argv)),
                               given_fields(VocoderConfig, list(argv)))
            return on, {k: x for k, x in vars(v).items() if x != getattr(VocoderConfig(), k)}
        return run

    half = {"launch_ahead_streams": 32}  # half of the server's 64 slots
    assert flags()("auto", "cuda", None, 1) == (True, {**half, "step_frames": 5})
    assert flags("--first-chunk-frames=4")("auto", "cuda", "cuda:0", 1) == (
        True, {"first_chunk_frames": 4, **half, "step_frames": 4})
    assert flags("--step-frames=0", "--slots=8")("auto", "cuda:0", None, 1) == (
        True, {"slots": 8, "launch_ahead_streams": 4})
    assert flags("--launch-ahead-streams=1")("auto", "cuda:0", None, 1) == (True, {"step_frames": 5})
    for device, vocoder_device, replicas in (("cpu", None, 1), ("cuda", None, 2)):  # shared, not colocated
        assert flags("--slots", "8")("auto", device, vocoder_device, replicas) == (
            False, {"slots": 8, "launch_ahead_streams": 4})
    assert flags("--slots", "8")("auto", "cuda:0", "cuda:1", 1) == (False, {"slots": 8})  # its own GPU
    assert flags()("off", "cuda", None, 1) == (False, half)
    assert flags()("on", "cpu", None, 1) == (True, {**half, "step_frames": 5})


def test_colocated_cluster_serves_audio_of_its_codes(tiny_codec):
    """chorus up --colocate-vocoder's layout, started for real: the worker hosts the vocoder's decoder and
    a request's audio is the offline decode of the codes it returns."""
    from chorus.client import channel, synthesize
    from chorus.v1 import tts_pb2, tts_pb2_grpc
    from helpers import make_cluster, seeded_request

    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "4", "--kv-slots", "4096"],
                      vocoder_args=["--seed", str(SEED), "--slots", "2"], colocate_vocoder=True) as cluster:
        worker = cluster.service("worker")
        assert any("hosting the vocoder's decoder" in line for line in worker.lines), worker.lines
        stub = tts_pb2_grpc.TextToSpeechStub(channel(cluster.address))
        req = seeded_request(seed=5, frames=14, return_codes=True, format=tts_pb2.FLOAT32)
        r = synthesize(stub, req, timeout=120)
        assert r.summary.frames == 14
        assert_close(r.pcm(), offline_pcm(tiny_codec, r.code_frames().astype(np.int32)))


def test_shared_decoder_cluster_serves_audio_of_its_codes(tiny_codec):
    """chorus up --vocoders 2 --shared-vocoder-decoder, started for real: a decoder process of its own
    behind both vocoder replicas, and requests spread over the replicas get the offline decode of their codes."""
    from chorus.client import channel, synthesize
    from chorus.v1 import tts_pb2, tts_pb2_grpc
    from helpers import make_cluster, seeded_request

    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "4", "--kv-slots", "4096"],
                      vocoder_args=["--seed", str(SEED), "--slots", "4"], vocoder_ports=[0, 0],
                      shared_decoder=True) as cluster:
        assert any("for 2 fronts ready on" in line for line in cluster.service("decoder").lines)
        for name in ("vocoder0", "vocoder1"):
            assert any("slots engine in the decoder hosted by process" in line
                       for line in cluster.service(name).lines), cluster.service(name).lines
        stub = tts_pb2_grpc.TextToSpeechStub(channel(cluster.address))
        replies = []
        threads = [threading.Thread(target=lambda s=s: replies.append(synthesize(stub, seeded_request(
            seed=s, frames=9, return_codes=True, format=tts_pb2.FLOAT32), timeout=120))) for s in (5, 6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(replies) == 2
        for r in replies:
            assert r.summary.frames == 9
            assert_close(r.pcm(), offline_pcm(tiny_codec, r.code_frames().astype(np.int32)))


class FakeSlotDecoder:
    """What SlotWorker calls on a SlotDecoder, without a codec: 4 slots; tests override
    launch_pcm (and uses_priority_stream) to record the steps the worker forms."""

    slots, n_q, max_stream_frames, last_step_graphed = 4, 12, 1000, True
    device = torch.device("cpu")

    def __init__(self):
        self._free = [3, 2, 1, 0]

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def frames_decoded(self, slot: int) -> int:
        return 0

    def uses_priority_stream(self, t: int) -> bool:
        return False


def test_slot_worker_launches_ahead_only_under_load():
    """A step is launched while the previous one still runs on the device only if it carries at least
    launch_ahead_streams streams; a smaller one (e.g. a new stream's first chunk) waits for the device
    first, so it never queues behind more than the running step."""
    events: list[str] = []

    class Pending:
        def __init__(self, n: int, slots: list[int]):
            self.n, self.slots, self.done = n, slots, False

        def wait_device(self) -> None:
            events.append(f"wait for the {self.n}-stream step")
            self.done = True

        def running(self) -> bool:  # a fake device: a step runs until someone waits for it
            return not self.done

        def result(self) -> dict[int, bytes]:
            return {s: b"pcm" for s in self.slots}

    class SlotDecoderStub(FakeSlotDecoder):
        def uses_priority_stream(self, t: int) -> bool:
            return t == 7

        def launch_pcm(self, codes, int16=()):
            events.append(f"launch {len(codes)}")
            return Pending(len(codes), list(codes))

    reports = []
    worker = SlotWorker(SlotDecoderStub(), reports.append, launch_ahead_streams=2)

    async def run() -> None:
        a, b, c = worker.open(), worker.open(), worker.open()
        with worker._cond:  # both queued before the worker looks: one 2-stream step
            first = [worker.submit(a, random_codes(5, 1)), worker.submit(b, random_codes(5, 2))]
        await asyncio.gather(*first)
        await worker.submit(c, random_codes(5, 3))  # 1 stream: waits for the device first
        with worker._cond:
            second = [worker.submit(a, random_codes(25, 1)), worker.submit(b, random_codes(25, 2))]
        await asyncio.gather(*second)  # 2 streams: launched ahead
        await worker.submit(c, random_codes(7, 3))  # 1 stream, but on the priority stream: never waits
        for h in (a, b, c):
            worker.release(h)

    try:
        asyncio.run(run())
    finally:
        worker.close()
    assert events == ["launch 2", "wait for the 2-stream step", "launch 1", "launch 2", "launch 1"]
    # what the metrics hear (chorus_vocoder_steps_launched_ahead): the last two overlapped their predecessor
    assert [r.launched_ahead for r in reports if r.step_ms is not None] == [False, False, True, True]


def test_slot_worker_decodes_chunks_in_step_frame_pieces():
    """--step-frames 5: a 25-frame chunk is decoded as five 5-frame steps, the first of them together
    with a new stream's 5-frame first chunk, and its caller gets the five pieces' PCM as one chunk;
    an error in a piece fails the chunk once and skips the pieces not yet run."""
    events: list[str] = []
    counter = iter(range(1000))

    class Pending:
        def __init__(self, codes):
            self.pcm = {s: b"<%d:%d>" % (s, next(counter)) for s in codes}

        def wait_device(self) -> None:
            pass

        def running(self) -> bool:
            return False

        def result(self) -> dict[int, bytes]:
            return self.pcm

    class SlotDecoderStub(FakeSlotDecoder):
        fail_at = -1

        def launch_pcm(self, codes, int16=()):
            events.append(f"launch {sorted(codes)} x {[c.shape[1] for c in codes.values()]}")
            if len(events) == self.fail_at:
                raise RuntimeError("device fault")
            return Pending(codes)

    slot_decoder = SlotDecoderStub()
    worker = SlotWorker(slot_decoder, lambda report: None, launch_ahead_streams=1, step_frames=5)
    shared: list[str] = []

    async def run() -> tuple[bytes, bytes]:
        a, b = worker.open(), worker.open()
        await worker.submit(a, random_codes(5, 1))  # a holds slot 0
        events.clear()
        with worker._cond:  # queued together: a's steady chunk, then b's first chunk
            steady = worker.submit(a, random_codes(25, 2))
            first = worker.submit(b, random_codes(5, 3))
        out = await asyncio.gather(steady, first)
        shared.extend(events)
        slot_decoder.fail_at = 2  # the second piece of the next chunk fails
        events.clear()
        with pytest.raises(RuntimeError, match="device fault"):
            await worker.submit(a, random_codes(15, 4))
        for h in (a, b):
            worker.release(h)
        return out

    try:
        steady, first = asyncio.run(run())
    finally:
        worker.close()
    assert shared == ["launch [0, 1] x [5, 5]"] + ["launch [0] x [5]"] * 4
    assert first == b"<1:2>"  # b's first chunk shared a step with a's first piece
    assert steady == b"<0:1><0:3><0:4><0:5><0:6>"  # the five pieces, in order, as one chunk
    assert events == ["launch [0] x [5]", "launch [0] x [5]"]  # the failed chunk's third piece never ran


class StepRecorder(FakeSlotDecoder):
    """A FakeSlotDecoder that records each step ("launch [slots] x [frames]") and answers at once with 4
    bytes a frame, (step, frame), step counted from the first launch since `events` was cleared."""

    graph_mode = None

    def __init__(self):
        super().__init__()
        self.events: list[str] = []

    def bucket_for(self, n: int) -> int:
        return n

    def launch_pcm(self, codes, int16=()):
        self.events.append(f"launch {sorted(codes)} x {[c.shape[1] for c in codes.values()]}")
        pcm = {s: step_pcm(len(self.events) - 1, range(c.shape[1])) for s, c in codes.items()}
        return type("Pending", (), {"wait_device": lambda self: None, "running": lambda self: False,
                                    "result": lambda self: pcm})()


def step_pcm(step: int, frames: range) -> bytes:
    return b"".join(b"%02d%02d" % (step, f) for f in frames)


def drive(worker: SlotWorker, calls):
    """Run the coroutine function `calls` against the worker, then close it."""
    try:
        return asyncio.run(calls())
    finally:
        worker.close()


def test_slot_worker_decodes_a_backlog_one_chunk_a_step():
    """A stream that fell behind (three 5-frame chunks queued) has one chunk decoded a step: the first
    beside a new stream's first chunk (which leads) and the other streams' chunks of that size."""
    slot_decoder = StepRecorder()
    worker = SlotWorker(slot_decoder, lambda report: None, launch_ahead_streams=1)

    async def run() -> list[bytes]:
        a, b, c = (worker.open() for _ in range(3))
        with worker._cond:
            pair = [worker.submit(a, random_codes(5, 1)), worker.submit(b, random_codes(5, 2))]
        await asyncio.gather(*pair)
        with worker._cond:  # a is three chunks behind, b one; c is new
            out = [worker.submit(a, random_codes(5, 5 + i)) for i in range(3)]
            out += [worker.submit(b, random_codes(5, 8)), worker.submit(c, random_codes(5, 9))]
        out = list(await asyncio.gather(*out))
        for h in (a, b, c):
            worker.release(h)
        return out

    out = drive(worker, run)
    assert slot_decoder.events == ["launch [0, 1] x [5, 5]", "launch [0, 1, 2] x [5, 5, 5]",
                              "launch [0] x [5]", "launch [0] x [5]"]
    assert out == [step_pcm(1, range(5)), step_pcm(2, range(5)), step_pcm(3, range(5)),
                   step_pcm(1, range(5)), step_pcm(1, range(5))]


def test_slots_engine_step_frames_match_offline(tiny_codec, tmp_path):
    """--step-frames 5 on a real slot decoder: chunks of 5, 25 and a 12-frame tail come back as those
    chunks, decoded in 5-frame graph steps (1 + 5 + 3: the tail is padded to 15, not 25), with the
    offline decode's audio."""
    v = InProcessVocoder(tiny_codec, str(tmp_path / "d"), "--slots", str(SLOTS), "--graphs", "emulate",
                         "--graph-frames", "5", "--step-frames", "5")
    try:
        info = v.info()  # the hosted slot decoder's facts
        assert (info.first_chunk_frames, info.chunk_frames, info.step_frames, list(info.graph_frames),
                info.slots) == (5, 25, 5, [5], SLOTS)
        sample = v.servicer.metrics.registry.get_sample_value
        codes = random_codes(42, seed=31)
        responses = list(v.stub.Decode(decode_requests(codes, [42]), timeout=60))
        assert [(r.first_frame, r.frames) for r in responses] == [(0, 5), (5, 25), (30, 12)]
        assert_close(pcm_of(responses), offline_pcm(tiny_codec, codes))
        assert sample("chorus_vocoder_slot_steps_total", {"path": "graph"}) == 9
        assert wait_for(lambda: settled(v))
    finally:
        v.close()


def test_slots_engine_pads_short_last_steps(slots_vocoder, tiny_codec):
    """A stream's last step shorter than its chunk runs padded to the chunk (graphed, with code-0
    frames) and comes back cut to its real frames: a 3-frame stream is one 5-frame graph step and
    3 frames of audio equal to the offline decode (the codec is causal)."""
    v = slots_vocoder
    sample = v.servicer.metrics.registry.get_sample_value
    before = sample("chorus_vocoder_slot_steps_total", {"path": "graph"}) or 0
    codes = random_codes(3, seed=23)
    responses = list(v.stub.Decode(decode_requests(codes, [3]), timeout=60))
    assert [(r.first_frame, r.frames, r.num_samples) for r in responses] == [(0, 3, 3 * HOP)]
    assert len(responses[0].pcm) == 3 * HOP * 2 * 4
    assert_close(pcm_of(responses), offline_pcm(tiny_codec, codes))
    assert sample("chorus_vocoder_slot_steps_total", {"path": "graph"}) == before + 1
    assert wait_for(lambda: settled(v))


# ---- one decoder behind several vocoder processes (decode_process --fronts-dir, --shared-vocoder-decoder) ----

def test_shared_decoder_serves_every_front(tiny_codec, tmp_path):
    """A decoder process of its own behind two vocoders (`--attach-decoder DIR/0` and `DIR/1`): streams on
    both decode to the offline PCM in one slot decoder; the step metrics are the first front's only (summed over
    the fronts, a step counts once); an idle front keeps hearing the decoder while the other one is busy;
    and a front's SIGKILL frees only its own slot once a new front attaches in its place."""
    from vocoder_svc.decode_process import front_dirs

    path = str(tmp_path / "decoder")
    host = subprocess.Popen(
        [sys.executable, "-m", "vocoder_svc.decode_process", "--fronts-dir", path, "--fronts", "2", "--preset", "tiny",
         "--seed", str(SEED), "--slots", "4", "--device", "cpu"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    procs = []
    try:
        assert any("ready on" in line for line in iter(host.stdout.readline, "")), "the decoder did not start"
        threading.Thread(target=lambda: [None for _ in host.stdout], daemon=True).start()  # keep its pipe drained
        ports = [free_port(), free_port()]
        fronts = []
        for d, port in zip(front_dirs(path, 2), ports):
            proc, address, seen, _ = start_vocoder("--metrics-port", str(port), "--attach-decoder", d,
                                                   "--attach-silence-s", "4", "--grace", "1")
            procs.append(proc)
            fronts.append(grpc.insecure_channel(address))
        stubs = [vocoder_pb2_grpc.VocoderStub(ch) for ch in fronts]
        metric = lambda i, name: _metric({"metrics_port": ports[i]}, name)  # noqa: E731

        decode_33_at_once({seed: stubs[seed % 2] for seed in range(4)}, tiny_codec)
        assert metric(0, "chorus_vocoder_decode_step_ms_count") > 0
        assert metric(1, "chorus_vocoder_decode_step_ms_count") == 0

        # Front 1 idle for longer than its --attach-silence-s while front 0 decodes: it still serves.
        busy_until = time.time() + 5
        while time.time() < busy_until:
            decode_33(stubs[0], 9)
        assert procs[1].poll() is None
        assert_close(pcm_of(decode_33(stubs[1], 10)), offline_pcm(tiny_codec, random_codes(33, 10)))

        # Front 1 dies holding a slot; front 0 keeps serving; a new front 1's hello frees only that slot.
        outbox, got, _ = _open_stream(stubs[1], random_codes(7, 11))
        assert got.get(timeout=30).frames == 5
        outbox0, got0, _ = _open_stream(stubs[0], random_codes(7, 12))
        assert got0.get(timeout=30).frames == 5
        assert wait_for(lambda: metric(0, "chorus_vocoder_free_slots") == 2)
        procs[1].kill()
        procs[1].wait()
        outbox.put(None)
        proc, address, _, _ = start_vocoder("--metrics-port", str(ports[1]), "--attach-decoder", front_dirs(path, 2)[1],
                                            "--attach-silence-s", "4", "--grace", "1")
        procs.append(proc)
        assert wait_for(lambda: metric(0, "chorus_vocoder_free_slots") == 3)
        outbox0.put(None)
        assert wait_for(lambda: metric(0, "chorus_vocoder_free_slots") == 4)
        for ch in fronts:
            ch.close()
    finally:
        for p in (*procs, host):
            if p.poll() is None:
                p.kill()
                p.wait()
