"""The HTTP gateway against the real services (tiny model, CPU): OpenAI's speech API in, the
public gRPC API behind it. Every format decodes back to the PCM gRPC gives for the same request,
errors carry OpenAI's shape and the gRPC status's HTTP status, the `openai` package works
unchanged, and a client that goes away frees everything its request held."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import soundfile as sf

from chorus.client import channel, synthesize
from chorus.processes import Service, free_port
from chorus.v1 import tts_pb2, tts_pb2_grpc
from helpers import make_cluster, metric, wait_until_idle

FRAMES = 8
SAMPLES_PER_FRAME = 3840
TEXT = "Hello from the gateway."
MAX_BODY = 256 << 10


def start_gateway(scheduler: str, *args: str) -> Service:
    g = Service("gateway", [sys.executable, "-m", "gateway_svc.server", "--port", "0", "--scheduler", scheduler,
                            *args])
    g.start(False, dict(os.environ, PYTHONUNBUFFERED="1"))
    g.wait_ready(120)
    return g


@pytest.fixture(scope="module")
def stack():
    """The services with one request running at a time and one waiting (so that a third is refused),
    and a gateway in front."""
    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "4", "--kv-slots", "8192"],
                      scheduler_args=["--max-running", "1", "--max-queue", "1"]) as cluster:
        gateway = start_gateway(cluster.address, "--max-body-bytes", str(MAX_BODY), "--retry-after-s", "2")
        try:
            cluster.http, cluster.gateway = f"http://{gateway.address}", gateway
            yield cluster
        finally:
            gateway.stop()


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.http, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def grpc_pcm(stack):
    """What the gRPC API gives for the request `body()` describes: int16 [n, channels]."""
    stub = tts_pb2_grpc.TextToSpeechStub(channel(stack.address))
    req = tts_pb2.SynthesizeRequest(text=TEXT, min_frames=FRAMES, max_frames=FRAMES)
    req.sampling.seed = 7
    out = synthesize(stub, req, timeout=120)
    return out.pcm(), out.header.sample_rate


def body(**kw) -> dict:
    return {"model": "tts-1", "input": TEXT, "voice": "alloy", "seed": 7, "min_frames": FRAMES,
            "max_frames": FRAMES, **kw}


def decode(data: bytes, dtype: str = "int16") -> tuple[np.ndarray, int]:
    """[n, channels] samples from a file's bytes (float64: unclipped, as lossy codecs overshoot).
    A streamed FLAC leaves its length unknown, which soundfile cannot seek in: read front to back."""
    f = sf.SoundFile(io.BytesIO(data))
    if f.frames > 1 << 40:
        f._info.seekable = 0
    blocks = []
    while len(block := f.read(4096, dtype=dtype, always_2d=True)):
        blocks.append(block)
        if len(block) < 4096:
            break
    return np.concatenate(blocks), f.samplerate


def aligned(ref: np.ndarray, got: np.ndarray, max_lag: int = 4000) -> tuple[float, float]:
    """(correlation, RMS ratio in dB) of got against ref at the lag that fits best (codec delay)."""
    a, b = ref[:, 0] / 32768, got[:, 0].astype(np.float64)
    head = a[:len(a) // 2]
    lag = int(np.argmax(np.correlate(b[:len(head) + max_lag], head, "valid")))
    n = min(len(a), len(b) - lag)
    x, y = a[:n], b[lag:lag + n]
    return float(np.corrcoef(x, y)[0, 1]), float(20 * np.log10(np.sqrt(np.mean(y ** 2)) / np.sqrt(np.mean(x ** 2))))


def error_of(resp: httpx.Response) -> dict:
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# ---- success paths ------------------------------------------------------------------------------

def test_models_and_health(http):
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    (m,) = models["data"]
    assert m["object"] == "model" and m["default"] and m["sample_rate"] == 48000 and m["channels"] == 2
    assert http.get("/health").json()["status"] == "ok"


def decode_aac(data: bytes) -> tuple[np.ndarray, int]:
    """[n, channels] float64 samples of an ADTS AAC stream (libsndfile has no AAC: PyAV decodes it)."""
    av = pytest.importorskip("av")
    with av.open(io.BytesIO(data), format="adts") as c:
        frames = [f for f in c.decode(audio=0)]
    return np.concatenate([f.to_ndarray() for f in frames], 1).T.astype(np.float64), frames[0].sample_rate


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac", "mp3", "opus", "aac"])
def test_every_format_decodes_to_the_grpc_pcm(http, grpc_pcm, fmt):
    ref, rate = grpc_pcm
    resp = http.post("/v1/audio/speech", json=body(response_format=fmt))
    assert resp.status_code == 200, resp.text
    assert (resp.headers["x-sample-rate"], resp.headers["x-channels"]) == (str(rate), "2")
    if fmt == "pcm":
        got = np.frombuffer(resp.content, "<i2").reshape(-1, 2)
    elif fmt == "aac":
        got, got_rate = decode_aac(resp.content)
        assert got_rate == rate
    else:
        got, got_rate = decode(resp.content, "int16" if fmt in ("wav", "flac") else "float64")
        assert got_rate == rate
    if fmt in ("wav", "pcm", "flac"):
        assert np.array_equal(got, ref)
        return
    # lossy: the same waveform (codec delay aside), about as loud, about as long. The tiny model's
    # random weights give full-scale noise, the hardest input there is (mp3 drops all above ~17 kHz).
    corr, gain_db = aligned(ref, got)
    assert corr > 0.5 and abs(gain_db) < 3, (corr, gain_db)
    assert len(ref) <= len(got) <= len(ref) + 4000


def test_sse_sends_deltas_then_done(http, grpc_pcm):
    with http.stream("POST", "/v1/audio/speech", json=body(response_format="pcm", stream_format="sse")) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in resp.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "speech.audio.done" and set(kinds[:-1]) == {"speech.audio.delta"} and len(kinds) >= 3
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert np.array_equal(np.frombuffer(audio, "<i2").reshape(-1, 2), grpc_pcm[0])
    done = events[-1]
    assert done["usage"]["output_tokens"] == FRAMES and done["usage"]["input_tokens"] > 0
    assert done["summary"]["finish_reason"] == "max_frames"


def test_the_openai_client_works_unchanged(stack, grpc_pcm):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0)
    extra = {"seed": 7, "min_frames": FRAMES, "max_frames": FRAMES}
    speech = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="wav",
                                        extra_body=extra)
    assert np.array_equal(decode(speech.content)[0], grpc_pcm[0])
    with client.audio.speech.with_streaming_response.create(
            model="gpt-4o-mini-tts", voice="nova", input=TEXT, response_format="pcm", extra_body=extra) as resp:
        pieces = list(resp.iter_bytes())
    assert np.array_equal(np.frombuffer(b"".join(pieces), "<i2").reshape(-1, 2), grpc_pcm[0])
    with pytest.raises(openai.NotFoundError):
        client.audio.speech.create(model="no-such-model", voice="alloy", input=TEXT)
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, extra_body={"seed": -1})
    assert "seed" in str(e.value)


def _wav(seconds: float = 1.0, rate: int = 24000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, 0.3 * np.sin(2 * np.pi * 220 * t), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _prompt_rows(http, **kw) -> int:
    with http.stream("POST", "/v1/audio/speech", json=body(response_format="pcm", stream_format="sse",
                                                            max_frames=2, min_frames=2, **kw)) as resp:
        assert resp.status_code == 200, resp.read()
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    return events[-1]["usage"]["input_tokens"]


def test_voices_are_created_listed_used_and_deleted(http):
    plain = _prompt_rows(http, voice="nova")  # an OpenAI name no voice has: the model's own voice
    before = int(time.time())
    made = http.post("/v1/audio/voices", files={"audio_sample": ("ref.wav", _wav(), "audio/wav")},
                     data={"name": "nova", "transcript": "A short reference."})
    assert made.status_code == 200, made.text
    assert made.json()["id"] == "nova" and made.json()["frames"] > 0
    assert before <= made.json()["created_at"] <= time.time()  # unix seconds, as OpenAI's objects
    as_json = http.post("/v1/audio/voices", json={"name": "narrator", "audio": base64.b64encode(_wav()).decode()})
    assert as_json.status_code == 200, as_json.text
    listed = {v["id"]: v for v in http.get("/v1/audio/voices").json()["data"]}
    assert {"nova", "narrator"} <= set(listed)
    assert listed["nova"]["created_at"] == made.json()["created_at"]
    assert listed["narrator"]["created_at"] == as_json.json()["created_at"]
    assert _prompt_rows(http, voice="nova") > plain  # the stored voice now wins over the name
    assert _prompt_rows(http, voice={"id": "narrator"}) > plain
    for voice_id in ("nova", "narrator"):
        assert http.delete(f"/v1/audio/voices/{voice_id}").json()["deleted"] is True
    gone = http.delete("/v1/audio/voices/narrator")
    assert gone.status_code == 404 and error_of(gone)["code"] == "voice_not_found"
    missing = http.post("/v1/audio/speech", json=body(voice="narrator"))
    assert missing.status_code == 404 and error_of(missing)["param"] == "voice"
    assert _prompt_rows(http, voice="nova") == plain


def _connections(pid: int, port: int) -> int:
    """Established TCP connections process `pid` holds to `port` on this host."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                count += cols[9] in inodes and int(cols[2].rsplit(":", 1)[1], 16) == port and cols[3] == "01"
    return count


def test_calls_spread_over_several_connections(stack, http):
    """Frontends share the port and the kernel gives each connection to one: the gateway keeps four."""
    for _ in range(8):
        assert http.get("/v1/models").status_code == 200
    assert _connections(stack.gateway.proc.pid, int(stack.address.rsplit(":", 1)[1])) == 4


# ---- errors -------------------------------------------------------------------------------------

def _first_bytes(stack, long_body: dict, started: threading.Event, stop: threading.Event) -> None:
    with httpx.Client(base_url=stack.http, timeout=120) as c, c.stream("POST", "/v1/audio/speech", json=long_body) as r:
        for _ in r.iter_raw():
            started.set()
            if stop.wait(0.05):
                return


def test_a_full_queue_is_429_with_retry_after(stack, http):
    long_body = body(response_format="pcm", min_frames=4000, max_frames=4000)
    stop = threading.Event()
    running, waiting = threading.Event(), threading.Event()
    threads = [threading.Thread(target=_first_bytes, args=(stack, long_body, ev, stop), daemon=True)
               for ev in (running, waiting)]
    try:
        threads[0].start()
        assert running.wait(60)
        threads[1].start()  # waits: one request runs at a time
        deadline = time.monotonic() + 30
        while metric(stack, "chorus_queue_depth") < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        resp = http.post("/v1/audio/speech", json=body())
        assert resp.status_code == 429, resp.text
        # the server's hint (chorus/retry_hint.py) in whole seconds; the gateway's own only without one
        assert int(resp.headers["retry-after"]) >= 1 and error_of(resp)["type"] == "rate_limit_error"
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert wait_until_idle(stack) == (0, 0, 0, 0)


def test_a_client_that_disconnects_frees_its_request(stack):
    assert wait_until_idle(stack) == (0, 0, 0, 0)
    aborted, frames = metric(stack, "chorus_requests_aborted_total"), metric(stack, "chorus_frames_generated_total")
    long_body = body(response_format="mp3", min_frames=4000, max_frames=4000)
    with httpx.Client(base_url=stack.http, timeout=120) as c, c.stream("POST", "/v1/audio/speech", json=long_body) as r:
        assert r.status_code == 200
        next(r.iter_raw())  # audio is flowing: the request holds KV, a decode state and a vocoder stream
    assert wait_until_idle(stack, timeout=30) == (0, 0, 0, 0)
    assert metric(stack, "chorus_requests_aborted_total") == aborted + 1
    assert metric(stack, "chorus_frames_generated_total") - frames < 4000


def test_an_unreachable_scheduler_is_503_with_retry_after():
    gateway = start_gateway(f"127.0.0.1:{free_port()}", "--retry-after-s", "3")
    try:
        with httpx.Client(base_url=f"http://{gateway.address}", timeout=60) as c:
            for resp in (c.post("/v1/audio/speech", json=body()), c.get("/health")):
                assert resp.status_code == 503 and resp.headers["retry-after"] == "3"
                assert error_of(resp)["type"] == "server_error"
    finally:
        gateway.stop()



@pytest.mark.parametrize("fmt", ["mp3", "opus", "flac", "aac"])
def test_each_chunk_leaves_the_encoder_with_its_audio(fmt):
    """No encoder sits on a chunk: the first (5 frames) comes out at about the steady rate."""
    from gateway_svc.encoders import Encoder

    rng = np.random.default_rng(0)
    chunk = 5 * SAMPLES_PER_FRAME
    pcm = (rng.standard_normal((10 * chunk, 2)) * 3000).astype("<i2")
    enc = Encoder(fmt, 48000, 2)
    sizes = [len(enc.encode(pcm[i:i + chunk].tobytes())) for i in range(0, len(pcm), chunk)]
    tail = enc.finish()
    assert min(sizes) > 0 and sizes[0] >= 0.5 * np.mean(sizes[1:]), sizes
    assert len(tail) < np.mean(sizes), (len(tail), sizes)


def test_unknown_routes_and_methods_answer_in_openais_shape(http):
    for resp, status in ((http.get("/v1/nothing"), 404), (http.get("/v1/audio/speech"), 405)):
        assert resp.status_code == status and error_of(resp)["message"].startswith("GET /v1/")


@pytest.mark.parametrize("kw,status,param", [
    (dict(data={"name": "x"}, files={"other": ("a.txt", b"hi", "text/plain")}), 400, "audio_sample"),
    (dict(json={"name": "x", "colour": "blue"}), 400, "colour"),
    (dict(json={"name": "x"}), 400, "audio"),
    (dict(json={"name": "x", "audio": base64.b64encode(b"not audio").decode()}), 400, "audio"),
    (dict(json={"name": "x", "audio": base64.b64encode(_wav()).decode(), "model": "nope"}), 404, "model"),
])
def test_bad_voices_name_the_field(http, kw, status, param):
    resp = http.post("/v1/audio/voices", **kw)
    assert resp.status_code == status and error_of(resp)["param"] == param, resp.text


def test_chorus_fields_reach_the_request(http):
    resp = http.post("/v1/audio/speech", json=body(response_format="pcm", sample_rate=24000, language="English",
                                                    instructions="Calm and slow.", first_chunk_frames=2,
                                                    chunk_frames=3, request_id="gw-test-1"))
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-sample-rate"] == "24000" and resp.headers["x-request-id"] == "gw-test-1"
    assert abs(len(resp.content) // 4 - FRAMES * SAMPLES_PER_FRAME // 2) <= 2
    cloned = _prompt_rows(http, voice=None, reference_audio=base64.b64encode(_wav()).decode(),
                          reference_text="A short reference.")
    assert cloned > _prompt_rows(http, voice=None)


# ---- the pieces, without services ---------------------------------------------------------------

def _rpc_error(code, details: str):
    import grpc
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize("code,details,status,param,retry", [
    ("INVALID_ARGUMENT", "sampling.top_k must be >= -1, got -5", 400, "top_k", None),
    ("INVALID_ARGUMENT", "text is empty: give the text to speak", 400, "input", None),
    ("INVALID_ARGUMENT", "streaming.chunk_frames must be <= 100", 400, "chunk_frames", None),
    ("NOT_FOUND", "references[0].voice_id 'x' not found", 404, "voice", None),
    ("RESOURCE_EXHAUSTED", "the waiting queue is full (1 requests); retry later", 429, None, "2"),
    ("RESOURCE_EXHAUSTED", "Received message larger than max (40000000 vs. 33554432)", 413, None, None),
    ("UNAVAILABLE", "the server is draining", 503, None, "2"),
    ("DEADLINE_EXCEEDED", "Deadline Exceeded", 504, None, None),
    ("INTERNAL", "boom", 500, None, None),
])
def test_grpc_statuses_become_http_statuses(code, details, status, param, retry):
    import grpc

    from gateway_svc.errors import from_rpc

    err = from_rpc(_rpc_error(getattr(grpc.StatusCode, code), details), retry_after=2)
    resp = err.response()
    assert (err.status, err.param, resp.headers.get("retry-after")) == (status, param, retry)
    assert json.loads(resp.body)["error"]["message"] == details  # the scheduler's words, unchanged


class _FakeCall:
    """A Synthesize call whose header was read: `items` (responses, or an error to raise) follow."""

    def __init__(self, items, block: bool = False):
        self.items, self.block, self.cancelled = list(items), block, False

    async def read(self):
        import asyncio

        import grpc
        if not self.items:
            if self.block:
                await asyncio.sleep(3600)
            return grpc.aio.EOF
        item = self.items.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


def _run_stream(call, sse: bool, fmt: str = "pcm", disconnect_after: float | None = None) -> list[dict]:
    import asyncio

    from gateway_svc.encoders import Encoder
    from gateway_svc.stream import AudioStream

    sent = []

    async def receive():
        if disconnect_after is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    async def main():
        stream = AudioStream(call, Encoder(fmt, 8000, 1), sse, {}, retry_after=1)
        await asyncio.wait_for(stream({"type": "http"}, receive, send), 10)

    asyncio.run(main())
    return sent


def _audio(n: int):
    return tts_pb2.SynthesizeResponse(audio=tts_pb2.AudioChunk(data=bytes(2 * n), num_samples=n))


def test_an_error_mid_stream_ends_sse_with_an_error_event():
    import grpc
    err = _rpc_error(grpc.StatusCode.UNAVAILABLE, "vocoder stream broke four times")
    sent = _run_stream(_FakeCall([_audio(80), err]), sse=True)
    events = [json.loads(m["body"][6:]) for m in sent if m["type"] == "http.response.body" and m["body"]]
    assert [e["type"] for e in events] == ["speech.audio.delta", "error"]
    assert events[-1]["error"]["message"] == "vocoder stream broke four times" and sent[-1]["more_body"] is False


def test_an_error_mid_stream_cuts_the_audio_response():
    import grpc
    err = _rpc_error(grpc.StatusCode.INTERNAL, "worker step failed")
    call = _FakeCall([_audio(80), err])
    with pytest.raises(grpc.aio.AioRpcError):  # uvicorn then drops the connection: no clean end
        _run_stream(call, sse=False)
    assert call.cancelled


def test_a_disconnect_cancels_the_call():
    call = _FakeCall([_audio(80)], block=True)
    sent = _run_stream(call, sse=False, fmt="mp3", disconnect_after=0.2)
    assert call.cancelled and not any(m.get("more_body") is False for m in sent)


def test_a_model_by_name_or_architecture(http, grpc_pcm):
    name = http.get("/v1/models").json()["data"][0]["id"]
    for model in (name, "moss_tts_local", "moss"):
        resp = http.post("/v1/audio/speech", json=body(model=model, response_format="pcm"))
        assert resp.status_code == 200 and resp.headers["x-model"] == name, (model, resp.text)
        assert np.array_equal(np.frombuffer(resp.content, "<i2").reshape(-1, 2), grpc_pcm[0])
