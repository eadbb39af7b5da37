"""OmniVoice in the tiers layout, wired as the prod-omnivoice overlay wires it: two engines (a scheduler
core with frontends = 0, its MOSS worker and its own OmniVoice worker, every ZeroMQ link under CURVE),
the OmniVoice codec vocoder shared by both, and a frontend tier process in front that does OmniVoice's
prompts and codec calls. A seeded OmniVoice request through the tier gives the bytes one `chorus up`
engine gives, on either engine; an engine whose OmniVoice worker is gone takes no OmniVoice request
and keeps serving MOSS; with every OmniVoice worker gone only OmniVoice is NOT_SERVING."""

import io
import threading
import time
import urllib.request
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import soundfile as sf
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from chorus.client import channel, synthesize
from chorus.launcher import Cluster
from chorus.v1 import common_pb2, frontend_pb2, tts_pb2, tts_pb2_grpc, worker_pb2
from chorus.wire import rows_matrix
from gpu_worker.config import WorkerConfig
from helpers import seeded_request
from scheduler_svc import engine_picker
from scheduler_svc.engine_pool import EnginePool, affinity_key
from test_tiers import metrics_ports
from vocoder_svc.config import VocoderConfig

OMNIVOICE = "omnivoice-tiny"
N_VQ = 12  # the tiny MOSS preset's codebooks
SERVICE = "chorus.v1.TextToSpeech"


@pytest.fixture(scope="module")
def tiers():
    (front_metrics,) = metrics_ports(1)
    c = Cluster(worker_args=["--dtype", "float32", "--max-batch", "4", "--kv-slots", "4096"], engines=2,
                frontend_tier=1, curve=True, frontend_metrics_ports=[front_metrics],
                omnivoice_worker=WorkerConfig(preset="omnivoice-tiny", dtype="float32"),
                omnivoice_vocoder=VocoderConfig(preset="higgs-tiny"))
    with c:
        c.engine_names = [c.service(f"engine{i}").address for i in range(2)]
        c.served = {}  # the first OmniVoice answer, and the engine that gave it
        yield c


def stub(address: str) -> tts_pb2_grpc.TextToSpeechStub:
    return tts_pb2_grpc.TextToSpeechStub(channel(address))


def omnivoice_request() -> tts_pb2.SynthesizeRequest:
    """A seeded clone (a codes reference and its transcript) with sampling noise on."""
    req = tts_pb2.SynthesizeRequest(text="Both engines speak alike.", model=OMNIVOICE, language="en",
                                    return_codes=True)
    req.sampling.seed = 11
    req.omnivoice.num_step = 4
    req.omnivoice.class_temperature = 0.5
    codes = np.random.default_rng(3).integers(0, 1024, (20, 8), dtype=np.int32)
    req.references.add(codes=rows_matrix(codes), transcript="A reference.")
    return req


def moss_request(engine: str, engines: list[str]) -> tts_pb2.SynthesizeRequest:
    """A MOSS request whose reference's affinity places it on engine."""
    for seed in range(100):
        req = seeded_request(seed=seed, frames=3)
        req.references.add(codes=rows_matrix(np.random.default_rng(seed).integers(0, 64, (16, N_VQ), dtype=np.int32)))
        if engine_picker.rank(affinity_key(req), engines)[0] == engine:
            return req
    raise AssertionError(f"no reference placed on {engine}")


def picks(c: Cluster) -> dict[str, float]:
    """The frontend tier's requests placed per engine."""
    with urllib.request.urlopen(f"http://127.0.0.1:{c.frontend_metrics_ports[0]}/metrics", timeout=5) as r:
        families = text_string_to_metric_families(r.read().decode())
        return {s.labels["engine"]: s.value for f in families for s in f.samples
                if s.name == "chorus_frontend_engine_picks_total"}


def served_by(c: Cluster, request: tts_pb2.SynthesizeRequest):
    """(the answer, the engine that served it); a request of several pieces would count each."""
    before = picks(c)
    out = synthesize(stub(c.address), request, timeout=120)
    moved = [e for e, n in picks(c).items() if n > before.get(e, 0.0)]
    assert len(moved) == 1, moved
    return out, moved[0]


def health(c: Cluster, model: str) -> int:
    return health_pb2_grpc.HealthStub(channel(c.address)).Check(
        health_pb2.HealthCheckRequest(service=f"{SERVICE}/{model}"), timeout=5).status


def kill_omnivoice_worker(c: Cluster, engine: str) -> None:
    """SIGKILL the engine's OmniVoice worker, and wait until its core has seen it go."""
    i = c.engine_names.index(engine)
    victim, core = c.service(f"omnivoice-worker{i}"), c.service(f"engine{i}")
    victim.proc.kill()
    deadline = time.monotonic() + 30
    while not any(f"at {victim.address} is gone" in line for line in core.lines):
        assert time.monotonic() < deadline, "\n".join(core.lines[-20:])
        time.sleep(0.1)


def test_omnivoice_through_the_tier_is_one_engines_omnivoice(tiers, omnivoice_cluster):
    models = {m.name: m.architecture for m in stub(tiers.address).ListModels(tts_pb2.ListModelsRequest()).models}
    assert models[OMNIVOICE] == "omnivoice" and len(models) == 2
    home = tiers.engine_names[0]
    moss, before = {}, picks(tiers)
    beside = threading.Thread(target=lambda: moss.update(out=synthesize(
        stub(tiers.address), moss_request(home, tiers.engine_names), timeout=120)))
    beside.start()
    out = synthesize(stub(tiers.address), omnivoice_request(), timeout=120)
    beside.join()
    assert moss["out"].summary.frames == 3
    moved = {e: n - before.get(e, 0.0) - (e == home) for e, n in picks(tiers).items()}
    (engine,) = [e for e, n in moved.items() if n == 1]
    alone = synthesize(stub(omnivoice_cluster.address), omnivoice_request(), timeout=120)
    assert out.header.model == OMNIVOICE and len(out.audio_bytes) > 0
    assert out.audio_bytes == alone.audio_bytes
    assert np.array_equal(out.code_frames(), alone.code_frames())
    tiers.served.update(out=out, engine=engine)


def test_an_omnivoice_voice_made_through_the_tier_clones(tiers):
    wav = io.BytesIO()
    sf.write(wav, np.random.default_rng(1).standard_normal(24000).astype(np.float32) * 0.1, 24000, format="WAV")
    api = stub(tiers.address)
    voice = api.CreateVoice(tts_pb2.CreateVoiceRequest(audio=common_pb2.AudioData(data=wav.getvalue()),
                                                       model="omnivoice", transcript="A reference.", voice_id="ov"))
    assert voice.model == OMNIVOICE and voice.frames > 0
    req = omnivoice_request()
    req.references[0].CopyFrom(tts_pb2.VoiceReference(voice_id="ov"))
    out = synthesize(api, req, timeout=120)
    assert out.header.model == OMNIVOICE and len(out.audio_bytes) > 0
    moss = seeded_request(frames=3)
    moss.references.add(voice_id="ov")
    with pytest.raises(grpc.RpcError) as e:  # a voice belongs to its model's codec
        synthesize(api, moss, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_an_engine_without_its_omnivoice_worker_serves_moss_alone(tiers):
    if not tiers.served:
        pytest.skip("needs the first OmniVoice answer")
    first = tiers.served["engine"]
    kill_omnivoice_worker(tiers, first)
    other = next(e for e in tiers.engine_names if e != first)
    for _ in range(2):  # however idle the first engine looks
        out, engine = served_by(tiers, omnivoice_request())
        assert engine == other
        assert out.audio_bytes == tiers.served["out"].audio_bytes
    for engine in tiers.engine_names:  # MOSS on both
        assert served_by(tiers, moss_request(engine, tiers.engine_names))[1] == engine
    assert health(tiers, OMNIVOICE) == health_pb2.HealthCheckResponse.SERVING


def test_with_no_omnivoice_worker_left_only_omnivoice_is_down(tiers):
    if not tiers.served:
        pytest.skip("needs the first OmniVoice answer")
    kill_omnivoice_worker(tiers, next(e for e in tiers.engine_names if e != tiers.served["engine"]))
    deadline = time.monotonic() + 10
    while health(tiers, OMNIVOICE) != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    with pytest.raises(grpc.RpcError) as e:
        synthesize(stub(tiers.address), omnivoice_request(), timeout=60)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    for name in ("", SERVICE):
        assert health_pb2_grpc.HealthStub(channel(tiers.address)).Check(
            health_pb2.HealthCheckRequest(service=name), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    assert served_by(tiers, moss_request(tiers.engine_names[1], tiers.engine_names))[1] == tiers.engine_names[1]


def test_chorus_up_engines_serve_omnivoice_as_one_engine_does():
    from chorus.layout import build, read_tables
    launcher = build(read_tables(), {"cluster": {"engines": 2, "omnivoice_vocoders": 2}}).cluster_launcher()
    assert launcher.omnivoice_worker.preset == "omnivoice-tiny" and launcher.omnivoice_vocoder_ports == [0, 0]
    off = build(read_tables(), {"cluster": {"engines": 2, "omnivoice": False}}).cluster_launcher()
    assert off.omnivoice_worker is None


def test_omnivoice_requests_go_only_to_engines_that_schedule_it():
    """A pool of an engine with an OmniVoice worker, one without, and one whose OmniVoice worker is down
    (their links' state as CoreClient holds it: the link is the real thing the other tests run)."""
    def engine(endpoint, omnivoice: bool, down=()):
        hello = frontend_pb2.CoreHello(worker=worker_pb2.Hello(model_name="moss"))
        if omnivoice:
            hello.canvas_workers.add(model_name=OMNIVOICE)
        return SimpleNamespace(endpoint=endpoint, up=True, draining=False, hello=hello, down=set(down),
                               in_flight=0, queued=0)

    pool = EnginePool(["tcp://a", "tcp://b", "tcp://c"], parent=True)
    pool.engines = {"tcp://a": engine("tcp://a", False), "tcp://b": engine("tcp://b", True),
                    "tcp://c": engine("tcp://c", True, down=[OMNIVOICE])}
    pool.hello = pool.engines["tcp://b"].hello
    assert [c.endpoint for c in pool._live(OMNIVOICE)] == ["tcp://b"]
    assert [c.endpoint for c in pool._live()] == ["tcp://a", "tcp://b", "tcp://c"]
    assert pool._pick(None, OMNIVOICE, set()).endpoint == "tcp://b"
    assert pool.down == set()
    pool.engines["tcp://b"].down = {OMNIVOICE}
    assert pool.down == {OMNIVOICE}
