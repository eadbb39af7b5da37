"""Graceful drain on SIGTERM (rolling updates), each tier as a real process: the streams in flight
end with all their audio, byte for byte what an undisturbed run gives; a call that arrives meanwhile
is refused UNAVAILABLE with a retry hint (HTTP: 503 with Retry-After) and health reads NOT_SERVING;
the process exits 0. One engine serves the module; its last test drains its core and worker. A
SynthesizeStream session in front of two engines (a frontend tier, its own cluster) outlives the
drain of the engine speaking it."""

from __future__ import annotations

import itertools
import json
import os
import queue
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chorus.client import Client, Retry, Synthesis, add_response, channel, synthesize
from chorus.launcher import Cluster
from chorus.processes import Service
from chorus.retry_hint import KEY as RETRY_KEY
from chorus.v1 import tts_pb2, tts_pb2_grpc, vocoder_pb2, vocoder_pb2_grpc
from chorus.wire import rows_matrix
from helpers import make_cluster, metric, seeded_request
from scheduler_svc import engine_picker
from scheduler_svc.engine_pool import affinity_key

websockets_sync = pytest.importorskip("websockets.sync.client")
from websockets.exceptions import ConnectionClosed  # noqa: E402

FRAMES = 6    # a short request
IN_FLIGHT = 30  # a stream's frames: after its first audio (5 frames) it is still running when the signal lands
DRAIN_S = 60  # every drain's bound, however slow the machine: a drain ends when its streams do
SERVICE = "chorus.v1.TextToSpeech"


@pytest.fixture(scope="module")
def engine():
    """Two requests decode at a time (more wait in the queue); two vocoder replicas."""
    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "4", "--kv-slots", "16384"],
                      # queued requests wait however slow the machine is: this module tests drain, not
                      # admission's refusals (tests/test_admission.py does)
                      scheduler_args=["--max-running", "2", "--drain-seconds", str(DRAIN_S),
                                      "--max-expected-wait-s", "0"],
                      vocoder_args=["--grace", str(DRAIN_S)], vocoder_ports=[0, 0]) as c:
        c.stub = tts_pb2_grpc.TextToSpeechStub(channel(c.address))
        yield c


def reference(stub, requests) -> list[bytes]:
    """Each request's PCM from undisturbed runs (at once: batch-invariant, and quicker)."""
    with ThreadPoolExecutor(len(requests)) as pool:
        return [o.pcm().tobytes() for o in pool.map(lambda r: synthesize(stub, r, timeout=120), requests)]


class Streams:
    """Synthesize calls running in threads; `started` waits until each has sent audio."""

    def __init__(self, stub, requests):
        self.out, self.errors = {}, {}
        self._audio = [threading.Event() for _ in requests]
        self._threads = [threading.Thread(target=self._run, args=(i, stub, r), daemon=True)
                         for i, r in enumerate(requests)]
        for t in self._threads:
            t.start()

    def _run(self, i, stub, request):
        try:
            self.out[i] = synthesize(stub, request, timeout=120, on_chunk=lambda _: self._audio[i].set())
        except grpc.RpcError as e:
            self.errors[i] = e
            self._audio[i].set()

    def started(self, which, timeout=60.0) -> None:
        for i in which:
            assert self._audio[i].wait(timeout), f"stream {i} sent no audio"

    def join(self, timeout=120.0) -> None:
        for t in self._threads:
            t.join(timeout)
            assert not t.is_alive(), "a stream hangs"


def health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def hint_of(e: grpc.RpcError) -> str | None:
    return dict(e.trailing_metadata() or ()).get(RETRY_KEY)


# ---- vocoder ------------------------------------------------------------------------------------

def test_a_draining_vocoder_finishes_its_streams_and_refuses_new_ones(engine):
    requests = [seeded_request(seed=1, frames=IN_FLIGHT), seeded_request(seed=2, frames=IN_FLIGHT)]
    ref = reference(engine.stub, requests)
    vocoders = [engine.service("vocoder0"), engine.service("vocoder1")]
    streams = Streams(engine.stub, requests)
    streams.started([0, 1])
    stubs = [vocoder_pb2_grpc.VocoderStub(channel(v.address)) for v in vocoders]
    active = [s.Info(vocoder_pb2.VocoderInfoRequest()).active_streams for s in stubs]
    busy = 0 if active[0] else 1
    assert active[busy] > 0, active
    vocoders[busy].proc.send_signal(signal.SIGTERM)
    assert _until(lambda: health(vocoders[busy].address) == health_pb2.HealthCheckResponse.NOT_SERVING)
    with pytest.raises(grpc.RpcError) as e:  # a new stream: refused with the hint (the pool goes elsewhere)
        next(iter(stubs[busy].Decode(iter([vocoder_pb2.DecodeRequest(start=vocoder_pb2.DecodeStart(codebooks=16))]),
                                     timeout=10)))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and hint_of(e.value), e.value
    late = synthesize(engine.stub, seeded_request(seed=3, frames=FRAMES), timeout=120)  # on the other replica
    streams.join()
    assert not streams.errors, streams.errors
    assert [streams.out[i].pcm().tobytes() for i in (0, 1)] == ref
    assert late.summary.frames == FRAMES
    assert vocoders[busy].proc.wait(30) == 0


# ---- gateway ------------------------------------------------------------------------------------

def test_a_draining_gateway_finishes_http_and_websocket_streams_then_exits_0(engine):
    gw = Service("gateway", [sys.executable, "-m", "gateway_svc.server", "--port", "0", "--scheduler",
                             engine.address, "--drain-seconds", str(DRAIN_S)])
    gw.start(False, dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        url = f"http://{gw.wait_ready(120)}"
        body = {"model": "tts-1", "input": "Hello from the test suite.", "voice": "alloy", "seed": 5,
                "min_frames": IN_FLIGHT, "max_frames": IN_FLIGHT, "response_format": "pcm"}
        with httpx.Client(base_url=url, timeout=120) as http:
            whole = http.post("/v1/audio/speech", json=body).content
            got, first_bytes = {}, threading.Event()

            def stream():
                with httpx.Client(base_url=url, timeout=120) as own, own.stream("POST", "/v1/audio/speech",
                                                                                json=body) as r:
                    got["status"], data = r.status_code, bytearray()
                    for piece in r.iter_bytes():
                        data += piece
                        first_bytes.set()
                    got["data"] = bytes(data)

            t = threading.Thread(target=stream, daemon=True)
            t.start()
            with websockets_sync.connect(url.replace("http", "ws") + "/v1/audio/speech/stream",
                                         open_timeout=30) as ws:
                # long enough that the first sentence is still being spoken when the SIGTERM lands
                ws.send(json.dumps({"model": "tts-1", "seed": 7, "min_frames": IN_FLIGHT, "max_frames": IN_FLIGHT}))
                ws.send(json.dumps({"type": "text", "text": "The first sentence. The second one. And a thir"}))
                events, audio = [], bytearray()
                while not audio:  # the first sentence is being spoken
                    msg = ws.recv(timeout=60)
                    (audio.extend if isinstance(msg, bytes) else lambda m: events.append(json.loads(m)))(msg)
                assert first_bytes.wait(60)
                gw.proc.send_signal(signal.SIGTERM)
                assert _until(lambda: http.get("/health").status_code == 503)
                refused = http.post("/v1/audio/speech", json=body)
                assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1, refused.text
                close = None
                try:
                    while True:
                        msg = ws.recv(timeout=60)
                        (audio.extend if isinstance(msg, bytes) else lambda m: events.append(json.loads(m)))(msg)
                except ConnectionClosed as e:
                    close = e.rcvd.code if e.rcvd else None
            t.join(60)
        kinds = [e["type"] for e in events]
        assert kinds == ["ready", "sentence", "audio_done", "done"], events
        assert len(audio) == IN_FLIGHT * 3840 * 2 * 2  # the whole first sentence (int16 stereo, 48 kHz)
        done = events[-1]
        assert done["going_away"] is True and done["unspoken"] == "The second one. And a thir", done
        assert close == 1001
        assert got["status"] == 200 and got["data"] == whole
        assert gw.proc.wait(30) == 0
    finally:
        gw.stop(5)


# ---- SynthesizeStream sessions: the test speaks as it goes ---------------------------------------

class Session:
    """A SynthesizeStream call whose messages the test sends as it goes; responses read on demand."""

    def __init__(self, stub, config: tts_pb2.SynthesizeRequest):
        self._feed: queue.Queue = queue.Queue()
        self._feed.put(tts_pb2.SynthesizeStreamRequest(config=config))
        self._responses = iter(stub.SynthesizeStream(iter(self._feed.get, None), timeout=120))
        self.out = Synthesis()
        self.summaries = 0
        self._t0 = time.monotonic()

    def say(self, text: str) -> None:
        """The text, spoken now (FLUSH)."""
        self._feed.put(tts_pb2.SynthesizeStreamRequest(text=text))
        self._feed.put(tts_pb2.SynthesizeStreamRequest(signal=tts_pb2.FLUSH))

    def end(self) -> Synthesis:
        self._feed.put(tts_pb2.SynthesizeStreamRequest(signal=tts_pb2.END))
        self._feed.put(None)
        for resp in self._responses:
            add_response(self.out, resp, self._t0)
        return self.out

    def until_audio(self, sentences: int, whole: bool = False) -> None:
        """Read until that many sentences have audio (whole: all of it, their summaries)."""
        while len({max(s.index for s in self.out.sentences if s.first_sample <= c.first_sample)
                   for c in self.out.chunks}) < sentences or whole and self.summaries < sentences:
            resp = next(self._responses)
            self.summaries += resp.HasField("summary")
            add_response(self.out, resp, self._t0)


def session_config(frames: int) -> tts_pb2.SynthesizeRequest:
    """A seeded config whose reference (codes) gives its first sentence a known engine; audio from
    each sentence's first frame on, so a sentence has most of its frames to go at its first audio."""
    req = tts_pb2.SynthesizeRequest(min_frames=frames, max_frames=frames, language="English")
    req.streaming.first_chunk_frames, req.streaming.chunk_frames = 1, 4
    req.sampling.seed = 31
    req.references.add(codes=rows_matrix(np.random.default_rng(3).integers(0, 64, (24, 12), dtype=np.int32)))
    return req


def spoken(config: tts_pb2.SynthesizeRequest, text: str) -> tts_pb2.SynthesizeRequest:
    """The first sentence's request as the session builds it (scheduler_svc/synthesize_stream.py)."""
    from scheduler_svc.synthesize_stream import Continuation
    return Continuation(config, True, 0, 1000).request(0, text)


SESSION_FRAMES = 12
SENTENCES = ["The first sentence is long.", "A second one follows.", "And a third ends it."]


# ---- engine: frontends + core + worker ----------------------------------------------------------

def test_a_draining_engine_ends_every_stream_then_exits_0(engine, cluster):
    """SIGTERM to the core and its worker at once (one pod): the running and the queued requests
    finish, new calls are refused with the hint, and the SDK with a second server's address moves
    its call there; a request still running when the drain ends (here: a second SIGTERM, as at the
    deadline) ends UNAVAILABLE. A SynthesizeStream session between sentences has no other engine:
    its next sentence ends it UNAVAILABLE with the hint, saying the scheduler drains."""
    short = [seeded_request(seed=11, frames=IN_FLIGHT), seeded_request(seed=12, frames=FRAMES)]
    ref = reference(engine.stub, short)
    session = Session(engine.stub, seeded_request(text="", seed=13, frames=FRAMES))
    session.say(SENTENCES[0])
    session.until_audio(1, whole=True)  # then idle, between sentences, when the drain begins
    long = seeded_request(seed=9, frames=4000)  # min_frames too: it cannot stop early
    # the long request takes one of the two running places, the first short one the other: the
    # second waits in the queue when the SIGTERM lands
    running = Streams(engine.stub, [long])
    running.started([0])
    streams = Streams(engine.stub, short[:1])
    streams.started([0])
    queued = Streams(engine.stub, short[1:])
    assert _until(lambda: metric(engine, "chorus_queue_depth") == 1)
    core, worker = engine.service("scheduler").proc, engine.service("worker").proc
    model = _model(engine.address)
    core.send_signal(signal.SIGTERM)
    worker.send_signal(signal.SIGTERM)
    assert _until(lambda: health(engine.address) == health_pb2.HealthCheckResponse.NOT_SERVING)
    for service in (SERVICE, f"{SERVICE}/{model}"):
        assert health(engine.address, service) == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as e:
        synthesize(engine.stub, seeded_request(seed=1, frames=FRAMES), timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and hint_of(e.value), e.value
    session.say(SENTENCES[1])  # its one core drains: no engine takes the next sentence
    with pytest.raises(grpc.RpcError) as e:
        session.end()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and hint_of(e.value), e.value
    assert "draining" in e.value.details() and "retry" in e.value.details(), e.value.details()
    with Client([engine.address, cluster.address], retry=Retry(attempts=3, first_wait=0.05), timeout=120) as sdk:
        sdk._turn = itertools.count(0)  # the draining server first
        assert sdk.synthesize(seeded_request(seed=11, frames=FRAMES)).summary.frames == FRAMES
    for done in (streams, queued):
        done.join()
        assert not done.errors, {i: e.details() for i, e in done.errors.items()}
    assert [streams.out[0].pcm().tobytes(), queued.out[0].pcm().tobytes()] == ref
    assert core.poll() is None and not running.out  # the long one still runs: the core waits for it
    core.send_signal(signal.SIGTERM)
    running.join()
    cut = running.errors[0]
    assert cut.code() == grpc.StatusCode.UNAVAILABLE and "engine shutting down" in cut.details(), cut
    assert core.wait(30) == 0
    assert worker.wait(30) == 0  # it served on until its scheduler had gone


def _model(address: str) -> str:
    with grpc.insecure_channel(address) as ch:
        return tts_pb2_grpc.TextToSpeechStub(ch).ListModels(tts_pb2.ListModelsRequest(), timeout=10).models[0].name


def _until(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return True
        except grpc.RpcError:
            pass
        time.sleep(0.05)
    return False


# ---- a session in a frontend tier: its engine drains ----------------------------------------------

def _placed(stub, request, timeout: float = 30.0):
    """A long call placed on an engine (its header read). An engine counts a request as waiting until
    its loop admits it, so on a loaded machine every place can look taken for a moment before the
    last one frees: a refusal then is tried again."""
    deadline = time.monotonic() + timeout
    while True:
        call = stub.Synthesize(request, timeout=120)
        try:
            next(call)
            return call
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_session_outlives_full_queues_and_the_drain_of_its_engine():
    """Two engines behind a frontend tier, as Kubernetes runs them, each running one request at a
    time and queueing one. A session's sentence that every engine refuses (queue full) waits for
    the hint and is spoken once a place frees. The engine speaking a session's first sentence drains
    (core and worker get SIGTERM, as a pod does): that sentence ends there with all its audio, the
    next ones go to the other engine, the session ends OK with the audio an undisturbed session
    gives, and the drained engine exits 0. When the last engine drains too, the session's next
    sentence ends UNAVAILABLE with the retry hint, saying why, once it has been refused for twice
    engine_refresh."""
    with Cluster(worker_args=["--dtype", "float32", "--max-batch", "4", "--kv-slots", "8192"], engines=2,
                 scheduler_args=["--drain-seconds", str(DRAIN_S), "--engine-refresh-s", "1", "--max-running", "1",
                                 "--max-queue", "1", "--max-expected-wait-s", "0"]) as c:
        stub = tts_pb2_grpc.TextToSpeechStub(channel(c.address))
        engines = {c.service(f"engine{i}").address: (c.service(f"engine{i}"), c.service(f"worker{i}"))
                   for i in range(2)}
        config = session_config(SESSION_FRAMES)
        calm = Session(stub, config)
        for text in SENTENCES:
            calm.say(text)
        calm = calm.end()

        session = Session(stub, config)
        session.say(SENTENCES[0])
        session.until_audio(1, whole=True)
        busy = [_placed(stub, seeded_request(seed=seed, frames=4000)) for seed in range(4)]
        session.say(SENTENCES[1])
        frontend = c.service("frontend0")
        assert _until(lambda: any("trying again" in line for line in frontend.lines)), frontend.lines[-20:]
        for call in busy:
            call.cancel()
        for text in SENTENCES[2:]:
            session.say(text)
        assert session.end().audio_bytes == calm.audio_bytes

        home = engine_picker.rank(affinity_key(spoken(config, SENTENCES[0])), engines)[0]
        core, worker = engines.pop(home)

        session = Session(stub, config)
        session.say(SENTENCES[0])
        session.until_audio(1)
        core.proc.send_signal(signal.SIGTERM)
        worker.proc.send_signal(signal.SIGTERM)
        for text in SENTENCES[1:]:
            session.say(text)
        drained = session.end()
        assert [s.text for s in drained.sentences] == SENTENCES
        assert drained.summary.frames == SESSION_FRAMES
        assert drained.audio_bytes == calm.audio_bytes  # a seeded sentence is the same on any engine
        assert core.proc.wait(30) == 0 and worker.proc.wait(30) == 0

        (core, worker), = engines.values()  # the last engine: nothing takes the next sentence
        session = Session(stub, config)
        session.say(SENTENCES[0])
        session.until_audio(1)
        core.proc.send_signal(signal.SIGTERM)
        worker.proc.send_signal(signal.SIGTERM)
        retries = sum("trying again" in line for line in frontend.lines)
        session.say(SENTENCES[1])
        with pytest.raises(grpc.RpcError) as e:
            session.end()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and hint_of(e.value), e.value
        assert "draining" in e.value.details(), e.value.details()
        assert sum("trying again" in line for line in frontend.lines) > retries
        assert len(session.out.sentences) == 2 and session.out.pcm().shape[0] == len(calm.pcm()) // 3
        assert core.proc.wait(30) == 0 and worker.proc.wait(30) == 0
