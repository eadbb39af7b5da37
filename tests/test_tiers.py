"""The tiers as separate processes, wired as a Kubernetes cluster wires them: two engines (a worker
and a scheduler core with frontends = 0 each, reached over TCP), two vocoders, and two frontend tier
processes on one port (each with its own /metrics) behind an HTTP gateway, every ZeroMQ link under
CURVE. A voice stays on the engine the rendezvous ranking gives it (its radix hits show on that
core's /metrics alone), other voices spread over both; a vocoder killed mid-stream changes no byte;
an engine killed mid-load ends its own streams UNAVAILABLE and nothing else."""

import asyncio
import io
import json
import random
import socket
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import soundfile as sf
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from chorus.client import channel, synthesize
from chorus.launcher import Cluster
from chorus.processes import read_metrics
from chorus.v1 import common_pb2, tts_pb2, tts_pb2_grpc, vocoder_pb2, vocoder_pb2_grpc
from chorus.wire import rows_matrix
from helpers import seeded_request
from scheduler_svc import engine_picker
from scheduler_svc.core_client import CoreClient, CoreUnavailable
from scheduler_svc.engine_pool import affinity_key

N_VQ = 12  # the tiny preset's codebooks


def metrics_ports(n: int) -> list[int]:
    """n free ports below the kernel's ephemeral range, which the services' port-0 binds draw from while
    the cluster starts (a free ephemeral port picked now may be taken by then)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports: list[int] = []
    for port in random.Random().sample(range(low // 2, low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise AssertionError("no free ports below the ephemeral range")


@pytest.fixture(scope="module")
def tiers():
    ports = metrics_ports(4)
    metrics, front_metrics = ports[:2], ports[2:]
    # curve: CURVE on the worker links and the frontend links, as between pods
    c = Cluster(worker_args=["--dtype", "float32", "--max-batch", "8", "--kv-slots", "8192"], engines=2,
                frontend_tier=2, vocoder_ports=[0, 0], engine_metrics_ports=metrics, curve=True,
                frontend_metrics_ports=front_metrics, gateway_port=0)
    with c:
        c.engine_metrics = dict(zip((c.service(f"engine{i}").address for i in range(2)), metrics))
        yield c


def own_connection(address: str) -> tts_pb2_grpc.TextToSpeechStub:
    """A client of its own TCP connection: successive ones land on either frontend process."""
    return tts_pb2_grpc.TextToSpeechStub(grpc.insecure_channel(address, options=[
        ("grpc.max_receive_message_length", 64 << 20), ("grpc.use_local_subchannel_pool", 1)]))


def prefill_rows(c: Cluster) -> dict[str, float]:
    """Of the engines alive."""
    return {e: read_metrics(port)["chorus_prefill_rows_total"] for e, port in c.engine_metrics.items()
            if c.service(f"engine{list(c.engine_metrics).index(e)}").proc.poll() is None}


def radix_hits(c: Cluster) -> dict[str, float]:
    return {e: read_metrics(port)["chorus_radix_hit_rows_total"] for e, port in c.engine_metrics.items()}


def served_by(c: Cluster, request: tts_pb2.SynthesizeRequest) -> str:
    """The engine whose core prefilled the request (the one whose counter moved)."""
    before = prefill_rows(c)
    synthesize(own_connection(c.address), request, timeout=120)
    moved = [e for e, rows in prefill_rows(c).items() if rows > before[e]]
    assert len(moved) == 1, moved
    return moved[0]


def codes_request(seed: int, frames: int = 2) -> tts_pb2.SynthesizeRequest:
    req = seeded_request(seed=seed, frames=frames)
    codes = np.random.default_rng(seed).integers(0, 64, (24, N_VQ), dtype=np.int32)
    req.references.add(codes=rows_matrix(codes))
    return req


def test_the_frontend_link_admits_only_the_frontends_key(tiers):
    async def hello(endpoint):
        client = CoreClient(endpoint)  # no CURVE keys: the handshake never completes
        try:
            await client.connect(timeout=2)
        finally:
            client.close()

    with pytest.raises(CoreUnavailable):
        asyncio.run(hello(tiers.service("engine0").address))


def test_a_voice_stays_on_its_engine(tiers):
    wav = io.BytesIO()
    sf.write(wav, np.random.default_rng(0).standard_normal((24000, 2)).astype(np.float32) * 0.1, 48000, format="WAV")
    own_connection(tiers.address).CreateVoice(tts_pb2.CreateVoiceRequest(
        audio=common_pb2.AudioData(data=wav.getvalue()), voice_id="alpha"))  # stored on every engine
    req = seeded_request(seed=2, frames=2)
    req.references.add(voice_id="alpha")
    home = engine_picker.rank(affinity_key(req), tiers.engine_metrics)[0]
    hits = radix_hits(tiers)
    for _ in range(3):  # over both frontend processes: they all rank the same
        assert served_by(tiers, req) == home
    after = radix_hits(tiers)
    assert after[home] > hits[home]  # the voice's prefix was reused
    assert all(after[e] == hits[e] for e in after if e != home)


def test_voices_spread_over_both_engines(tiers):
    homes = {}
    for seed in range(20):
        req = codes_request(seed)
        homes.setdefault(engine_picker.rank(affinity_key(req), tiers.engine_metrics)[0], req)
        if len(homes) == 2:
            break
    assert len(homes) == 2
    for home, req in homes.items():
        assert served_by(tiers, req) == home


def frontend_samples(c: Cluster) -> dict[tuple[str, tuple], float]:
    """Both frontend tier processes' samples, summed: {(name, labels): value}."""
    out: dict[tuple[str, tuple], float] = {}
    for port in c.frontend_metrics_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            for family in text_string_to_metric_families(r.read().decode()):
                for s in family.samples:
                    key = (s.name, tuple(sorted(s.labels.items())))
                    out[key] = out.get(key, 0.0) + s.value
    return out


def test_each_frontend_serves_its_own_metrics(tiers):
    req = codes_request(seed=7)
    home = engine_picker.rank(affinity_key(req), tiers.engine_metrics)[0]
    before = frontend_samples(tiers)
    synthesize(own_connection(tiers.address), req, timeout=120)
    after = frontend_samples(tiers)
    moved = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    assert moved[("chorus_frontend_requests_total", (("outcome", "ok"),))] == 1
    assert moved[("chorus_frontend_engine_picks_total", (("engine", home),))] == 1
    assert moved[("chorus_frontend_time_to_first_audio_seconds_count", ())] == 1
    assert after[("chorus_frontend_engines", ())] == 2 * 2  # each process sees both engines
    assert after[("chorus_frontend_active_streams", ())] == 0


def test_the_gateway_speaks_through_the_frontend_tier(tiers):
    from chorus.layout import build, read_tables
    assert build(read_tables(), {"cluster": {"engines": 2, "http_port": 0}}).cluster_launcher().gateway_port == 0
    base = f"http://{tiers.http_address}"
    with urllib.request.urlopen(f"{base}/health", timeout=10) as r:
        assert r.status == 200
    body = json.dumps({"input": "Hello there.", "response_format": "wav", "seed": 3, "min_frames": 4,
                       "max_frames": 4}).encode()
    speech = urllib.request.Request(f"{base}/v1/audio/speech", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(speech, timeout=120) as r:
        assert r.headers["Content-Type"] == "audio/wav"
        audio, rate = sf.read(io.BytesIO(r.read()))
    assert rate == 48000 and len(audio) == 4 * 3840  # four 80 ms frames


def test_a_launched_gateway_refuses_a_tls_scheduler():
    from chorus.processes import LaunchError
    from scheduler_svc.config import SchedulerConfig
    with pytest.raises(LaunchError, match="--scheduler-tls-dir"):
        Cluster(scheduler=SchedulerConfig(tls_dir="/nonexistent"), gateway_port=0).start()


def _frames_request(seed: int, frames: int) -> tts_pb2.SynthesizeRequest:
    req = seeded_request(text=f"Tiers, request {seed}.", seed=seed, frames=frames)
    req.streaming.first_chunk_frames = 3
    req.streaming.chunk_frames = 5
    return req


def _run_all(c: Cluster, requests, on_started=None, min_chunks: int = 1):
    """The requests at once, each on a connection of its own; on_started() once each has min_chunks
    audio chunks. Each result is a Synthesis or the grpc.RpcError that ended it."""
    started: set[int] = set()

    def one(i):
        def on_chunk(s):
            if len(s.chunks) >= min_chunks and i not in started:
                started.add(i)
                if len(started) == len(requests) and on_started:
                    on_started()
        try:
            return synthesize(own_connection(c.address), requests[i], timeout=120, on_chunk=on_chunk)
        except grpc.RpcError as e:
            return e

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, range(len(requests))))


def test_a_killed_vocoder_changes_no_byte(tiers):
    requests = [_frames_request(seed, 10) for seed in (21, 22)]
    clean = _run_all(tiers, requests)
    killed = []

    def kill_busiest():
        vocoders = [tiers.service(f"vocoder{i}") for i in range(2)]
        busy = [vocoder_pb2_grpc.VocoderStub(channel(v.address)).Info(vocoder_pb2.VocoderInfoRequest(),
                                                                         timeout=5).active_streams for v in vocoders]
        victim = vocoders[int(np.argmax(busy))]
        killed.append(max(busy))
        victim.proc.kill()

    faulted = _run_all(tiers, requests, on_started=kill_busiest)
    assert killed and killed[0] >= 1
    for a, b in zip(clean, faulted):
        assert isinstance(b, type(a)), b
        assert a.audio_bytes == b.audio_bytes and a.summary.frames == 10


def _homed_requests(c: Cluster, per_engine: int, frames: int) -> dict[str, list[tts_pb2.SynthesizeRequest]]:
    """per_engine streaming requests for each engine, placed there by their references' affinity
    (a request without one goes to whichever engine looks least loaded at that moment)."""
    homes: dict[str, list] = {e: [] for e in c.engine_metrics}
    for seed in range(100, 200):
        req = codes_request(seed, frames)
        req.streaming.first_chunk_frames = 3
        req.streaming.chunk_frames = 5
        home = homes[engine_picker.rank(affinity_key(req), c.engine_metrics)[0]]
        if len(home) < per_engine:
            home.append(req)
        if all(len(h) == per_engine for h in homes.values()):
            return homes
    raise AssertionError(f"no {per_engine} requests for each engine")


def test_a_killed_engine_fails_only_its_own_streams(tiers):
    victim = tiers.service("engine0")
    homes = _homed_requests(tiers, per_engine=2, frames=12)
    for req in homes[victim.address]:  # still running when the last stream starts, however slow the machine
        req.min_frames = req.max_frames = 120
    requests = homes[victim.address] + homes[tiers.service("engine1").address]
    results = _run_all(tiers, requests, on_started=victim.proc.kill)  # a hang would end DEADLINE_EXCEEDED
    victim.proc.wait(timeout=30)  # reaped: served_by reads the metrics of live engines only
    assert all(isinstance(r, grpc.RpcError) for r in results[:2]), results
    assert {e.code() for e in results[:2]} == {grpc.StatusCode.UNAVAILABLE}
    assert all(not isinstance(r, grpc.RpcError) and r.summary.frames == 12 for r in results[2:]), results
    survivor = tiers.service("engine1").address
    for seed in (41, 42):  # new requests, any voice: the survivor
        assert served_by(tiers, codes_request(seed)) == survivor
    health = health_pb2_grpc.HealthStub(channel(tiers.address))
    assert health.Check(health_pb2.HealthCheckRequest(service="chorus.v1.TextToSpeech"),
                        timeout=5).status == health_pb2.HealthCheckResponse.SERVING
