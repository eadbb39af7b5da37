"""OmniVoice through the public API: every bad knob and every field of the other model is an
INVALID_ARGUMENT naming the field; model routing; the Synthesize path's piece order, seeds and
cancellation against stand-ins for the core and the codec; then the same through the real CPU
services, MOSS and OmniVoice side by side."""

import asyncio
import io
import math
import random
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import soundfile as sf

from chorus.client import channel, synthesize
from chorus.omnivoice import knobs as ov
from chorus.v1 import common_pb2, frontend_pb2, tts_pb2, tts_pb2_grpc, vocoder_pb2, worker_pb2
from chorus.wire import matrix_array, rows_matrix
from gpu_worker.config import WorkerConfig
from helpers import make_cluster, worker_stats
from scheduler_svc import omnivoice_frontend
from scheduler_svc.core_client import CanvasTicket
from scheduler_svc.omnivoice_frontend import OmniVoiceFrontend, piece_seed
from scheduler_svc.omnivoice_validation import validate_omnivoice
from scheduler_svc.served_models import MOSS, OMNIVOICE, ServedModel, ServedModels
from scheduler_svc.validation import InvalidRequest, Limits, validate
from vocoder_svc.config import VocoderConfig

LIMITS = Limits(max_text_chars=5000, max_frames=4096, max_language_chars=64, max_instructions_chars=1000,
                max_request_id_chars=128, max_id_chars=128, max_references=8, max_reference_seconds=60.0,
                max_voices=16)
MODEL = "omnivoice-tiny"


def ovreq(**kw) -> tts_pb2.SynthesizeRequest:
    knobs = kw.pop("omnivoice", {})
    sampling = kw.pop("sampling", {})
    req = tts_pb2.SynthesizeRequest(text=kw.pop("text", "Hello there."), model=kw.pop("model", MODEL), **kw)
    for k, v in knobs.items():
        setattr(req.omnivoice, k, v)
    for k, v in sampling.items():
        setattr(req.sampling, k, v)
    return req


def codes_ref(rows: int = 3, cols: int = 8) -> tts_pb2.VoiceReference:
    return tts_pb2.VoiceReference(codes=rows_matrix(np.zeros((rows, cols), np.int32)), transcript="Hi.")


# name -> (request, the field the message must name)
BAD = {
    "num_step 0": (ovreq(omnivoice={"num_step": 0}), "omnivoice.num_step"),
    "num_step 65": (ovreq(omnivoice={"num_step": 65}), "omnivoice.num_step"),
    "num_step negative": (ovreq(omnivoice={"num_step": -3}), "omnivoice.num_step"),
    "guidance_scale negative": (ovreq(omnivoice={"guidance_scale": -0.5}), "omnivoice.guidance_scale"),
    "guidance_scale 11": (ovreq(omnivoice={"guidance_scale": 11.0}), "omnivoice.guidance_scale"),
    "guidance_scale nan": (ovreq(omnivoice={"guidance_scale": math.nan}), "omnivoice.guidance_scale"),
    "t_shift 0": (ovreq(omnivoice={"t_shift": 0.0}), "omnivoice.t_shift"),
    "t_shift 1.5": (ovreq(omnivoice={"t_shift": 1.5}), "omnivoice.t_shift"),
    "t_shift inf": (ovreq(omnivoice={"t_shift": math.inf}), "omnivoice.t_shift"),
    "layer_penalty_factor negative": (ovreq(omnivoice={"layer_penalty_factor": -1.0}),
                                      "omnivoice.layer_penalty_factor"),
    "layer_penalty_factor 1e9": (ovreq(omnivoice={"layer_penalty_factor": 1e9}), "omnivoice.layer_penalty_factor"),
    "position_temperature negative": (ovreq(omnivoice={"position_temperature": -0.1}),
                                      "omnivoice.position_temperature"),
    "position_temperature nan": (ovreq(omnivoice={"position_temperature": math.nan}),
                                 "omnivoice.position_temperature"),
    "class_temperature negative": (ovreq(omnivoice={"class_temperature": -2.0}), "omnivoice.class_temperature"),
    "class_temperature -inf": (ovreq(omnivoice={"class_temperature": -math.inf}), "omnivoice.class_temperature"),
    "speed 0": (ovreq(omnivoice={"speed": 0.0}), "omnivoice.speed"),
    "speed 5": (ovreq(omnivoice={"speed": 5.0}), "omnivoice.speed"),
    "speed nan": (ovreq(omnivoice={"speed": math.nan}), "omnivoice.speed"),
    "duration_seconds negative": (ovreq(duration_seconds=-1.0), "duration_seconds"),
    "duration_seconds nan": (ovreq(duration_seconds=math.nan), "duration_seconds"),
    # MOSS-only fields on an OmniVoice request
    "sampling.temperature": (ovreq(sampling={"temperature": 0.7}), "sampling.temperature"),
    "sampling.top_p": (ovreq(sampling={"top_p": 0.9}), "sampling.top_p"),
    "sampling.top_k": (ovreq(sampling={"top_k": 5}), "sampling.top_k"),
    "sampling.repetition_penalty": (ovreq(sampling={"repetition_penalty": 1.1}), "sampling.repetition_penalty"),
    "sampling.audio_temperature": (ovreq(sampling={"audio_temperature": 1.0}), "sampling.audio_temperature"),
    "sampling.text_top_k": (ovreq(sampling={"text_top_k": 3}), "sampling.text_top_k"),
    "max_frames": (ovreq(max_frames=100), "max_frames"),
    "min_frames": (ovreq(min_frames=10), "min_frames"),
    "duration_frames": (ovreq(duration_frames=40), "duration_frames"),
    "auto_duration": (ovreq(auto_duration=True), "auto_duration"),
    "continuation": (ovreq(continuation=codes_ref()), "continuation"),
    "streaming.first_chunk_frames": (ovreq(streaming=tts_pb2.StreamingPolicy(first_chunk_frames=3)),
                                     "streaming.first_chunk_frames"),
    "streaming.chunk_frames": (ovreq(streaming=tts_pb2.StreamingPolicy(chunk_frames=10)), "streaming.chunk_frames"),
    "two references": (ovreq(references=[codes_ref(), codes_ref()]), "references"),
    # what MOSS requests share
    "empty text": (ovreq(text="   "), "text"),
    "text over the limit": (ovreq(text="x" * 5001), "text"),
    "instructions over the limit": (ovreq(instructions="i" * 1001), "instructions"),
    "format unknown": (ovreq(format=9), "format"),
    "sample_rate too low": (ovreq(sample_rate=100), "sample_rate"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_omnivoice_request_names_its_field(name):
    req, field = BAD[name]
    with pytest.raises(InvalidRequest) as e:
        validate_omnivoice(req, LIMITS, MODEL)
    assert str(e.value).startswith(field), str(e.value)
    assert len(str(e.value)) < 300


def test_the_catalogue_is_broad():
    assert len(BAD) >= 25


def test_knob_messages_give_the_range_and_the_value():
    with pytest.raises(InvalidRequest, match=r"^omnivoice.t_shift must be in \(0, 1\], got 0.0$"):
        validate_omnivoice(ovreq(omnivoice={"t_shift": 0.0}), LIMITS, MODEL)
    with pytest.raises(InvalidRequest, match=r"^omnivoice.num_step must be in \[1, 64\], got 65$"):
        validate_omnivoice(ovreq(omnivoice={"num_step": 65}), LIMITS, MODEL)
    with pytest.raises(InvalidRequest, match="not used by OmniVoice"):
        validate_omnivoice(ovreq(sampling={"temperature": 0.7}), LIMITS, MODEL)


def test_a_good_request_resolves_its_knobs_and_seed():
    r = validate_omnivoice(ovreq(omnivoice={"num_step": 8, "guidance_scale": 0.0, "speed": 1.5, "denoise": False},
                                 sampling={"seed": 7}, duration_seconds=2.0, references=[codes_ref()]),
                           LIMITS, MODEL)
    assert r.knobs == ov.UnmaskKnobs(num_step=8, guidance_scale=0.0)
    assert (r.speed, r.duration_seconds, r.denoise, r.postprocess) == (1.5, 2.0, False, True)
    again = validate_omnivoice(ovreq(sampling={"seed": 7}), LIMITS, MODEL)
    assert r.seed == again.seed and r.output_format == tts_pb2.PCM16
    d = validate_omnivoice(ovreq(), LIMITS, MODEL)
    assert d.knobs == ov.UnmaskKnobs() and d.speed is None and d.duration_seconds is None
    for name in ov.RANGES:  # each range's ends are accepted
        low, high, low_in, high_in = ov.RANGES[name]
        for v in ([low] if low_in else []) + ([high] if high_in else []):
            validate_omnivoice(ovreq(omnivoice={name: int(v) if name == "num_step" else v}), LIMITS, MODEL)


def test_omnivoice_knobs_on_a_moss_request_are_an_error():
    req = tts_pb2.SynthesizeRequest(text="Hello.")
    req.omnivoice.num_step = 8
    with pytest.raises(InvalidRequest, match="^omnivoice is only for OmniVoice"):
        validate(req, LIMITS, None, 12.5)
    validate(tts_pb2.SynthesizeRequest(text="Hello."), LIMITS, None, 12.5)


def test_model_names_resolve_by_name_architecture_and_default():
    moss, omni = ServedModel("moss-tts-local-tiny", MOSS), ServedModel(MODEL, OMNIVOICE)
    models = ServedModels([moss, omni, omni])
    assert models.names == ["moss-tts-local-tiny", MODEL]
    assert models.resolve("") is moss and models.resolve("moss") is moss and models.resolve("moss_tts_local") is moss
    assert models.resolve("omnivoice") is omni and models.resolve(MODEL) is omni
    assert ServedModels([moss, omni], default="omnivoice").resolve("") is omni
    with pytest.raises(InvalidRequest, match="^model 'nope' is not served here: give one of 'moss-tts-local-tiny'"):
        models.resolve("nope")
    with pytest.raises(InvalidRequest, match="is ambiguous"):
        ServedModels([moss, omni, ServedModel("other-ov", OMNIVOICE)]).resolve("omnivoice")
    with pytest.raises(ValueError, match="default_model"):
        ServedModels([moss], default="omnivoice")


# ---- the Synthesize path against stand-ins for the core, the codec and the prompt planner ------------

@dataclass(frozen=True)
class FakePiece:  # chorus.omnivoice.prompt.Piece's fields
    text: str
    text_ids: list
    target_frames: int
    reference: str


class FakeCore:
    """Answers submit_canvas at once; a canvas is done when the test says (finish). Its voices stand in
    for the voice library (get_voice)."""

    def __init__(self):
        self.hello = frontend_pb2.CoreHello(canvas_workers=[worker_pb2.Hello(model_name=MODEL,
                                                                             max_packed_rows=24576)])
        self.submitted: list[tuple[CanvasTicket, worker_pb2.CanvasStart]] = []
        self.aborted: list[int] = []
        self.voices: dict[str, frontend_pb2.StoredVoice] = {}
        self.changed = asyncio.Event()

    async def submit_canvas(self, model, canvas):
        assert model == MODEL
        t = CanvasTicket(len(self.submitted) + 1)
        self.submitted.append((t, canvas))
        self.changed.set()
        return t

    def finish(self, i: int, fill: int) -> None:
        t, canvas = self.submitted[i]
        codes = np.full((canvas.target_frames, 8), fill, np.int32)
        t.t_done = t.t_accepted
        t.done.set_result(frontend_pb2.CanvasDone(ticket=t.ticket, codes=rows_matrix(codes), queue_ms=1.0))

    def abort(self, t):
        if not t.done.done() or t.done.cancelled():  # as CoreClient: still open in the core
            self.aborted.append(t.ticket)

    def report(self, *a, **kw):
        pass

    async def get_voice(self, voice_id, owner=""):
        return self.voices.get(voice_id)


class FakeClips:
    """DecodeClip: T frames -> T * 960 samples, each the canvas's first code / 1000."""

    def __init__(self):
        self.calls: list[vocoder_pb2.DecodeClipRequest] = []

    async def decode_clip(self, request):
        self.calls.append(request)
        codes = matrix_array(request.codes)
        pcm = np.full(codes.shape[0] * ov.SAMPLES_PER_FRAME, codes[0, 0] / 1000, np.float32)
        if request.pcm_encoding == vocoder_pb2.PCM_INT16:
            return vocoder_pb2.DecodeClipResponse(pcm=(pcm * 32767).round().astype("<i2").tobytes(),
                                                  num_samples=pcm.size, pcm_encoding=vocoder_pb2.PCM_INT16)
        return vocoder_pb2.DecodeClipResponse(pcm=pcm.tobytes(), num_samples=pcm.size)

    async def encode_reference(self, audio):
        return vocoder_pb2.EncodeResponse(codes=rows_matrix(np.ones((5, 8), np.int32)), rms=0.05)


def frontend_with(monkeypatch, pieces):
    monkeypatch.setattr(omnivoice_frontend, "plan", lambda *a, **kw: pieces)
    core, clips = FakeCore(), FakeClips()
    return OmniVoiceFrontend(core, clips, tokenizer=None, limits=LIMITS, voices=core), core, clips


async def wait_for(core: FakeCore, n: int) -> None:
    while len(core.submitted) < n:
        core.changed.clear()
        await asyncio.wait_for(core.changed.wait(), 5)


async def collect(gen, out: list) -> None:
    async for r in gen:
        out.append(r)


def pieces_of(refs: list[str], frames=(4, 6, 5)) -> list[FakePiece]:
    return [FakePiece(f"piece {i}", [100 + i] * (3 + i), frames[i], r) for i, r in enumerate(refs)]


def test_pieces_stream_in_order_and_later_pieces_wait_for_piece_zero(monkeypatch):
    pieces = pieces_of(["none", "first_piece", "first_piece"])
    fe, core, clips = frontend_with(monkeypatch, pieces)

    async def run():
        out = []
        req = ovreq(return_codes=True, format=tts_pb2.FLOAT32, sampling={"seed": 5})
        task = asyncio.get_running_loop().create_task(collect(fe.synthesize(req, MODEL), out))
        await wait_for(core, 1)
        await asyncio.sleep(0.05)
        assert len(core.submitted) == 1  # pieces 1 and 2 need piece 0's canvas as their reference
        core.finish(0, 100)
        await wait_for(core, 3)
        for _, canvas in core.submitted[1:]:
            assert np.array_equal(matrix_array(canvas.reference_codes), np.full((4, 8), 100))
        core.finish(2, 300)  # out of order: piece 2's audio must still follow piece 1's
        await asyncio.sleep(0.05)
        assert sum(r.HasField("audio") for r in out) == 1  # piece 0's only
        core.finish(1, 200)
        await asyncio.wait_for(task, 5)
        return out

    out = asyncio.run(run())
    header = out[0].header
    assert (header.model, header.sample_rate, header.channels, header.samples_per_frame) == (MODEL, 24000, 1, 960)
    audio = np.concatenate([np.frombuffer(r.audio.data, "<f4") for r in out if r.HasField("audio")])
    expect = np.concatenate([np.full(f * 960, v / 1000, np.float32) for f, v in ((4, 100), (6, 200), (5, 300))])
    assert np.array_equal(audio, expect)
    starts = [r.audio.first_sample for r in out if r.HasField("audio")]
    assert starts == sorted(starts) and starts[0] == 0
    assert [r.codes.first_frame for r in out if r.HasField("codes")] == [0, 4, 10]
    s = out[-1].summary
    assert s.frames == 15 and s.finish_reason == tts_pb2.STOP and s.audio_seconds == pytest.approx(15 * 0.04)
    canvases = [c for _, c in core.submitted]
    assert [list(c.text_ids) for c in canvases] == [p.text_ids for p in pieces]
    assert len({c.seed for c in canvases}) == 3 and canvases[0].seed == piece_seed(canvases[0].seed, 0)
    assert all(c.knobs.num_step == 32 for c in canvases)
    flags = sorted((matrix_array(c.codes)[0, 0], c.continues, c.continued) for c in clips.calls)
    assert flags == [(100, False, True), (200, True, True), (300, True, False)]
    assert all(c.reference_rms == 0 and c.fade_seconds == pytest.approx(0.1) for c in clips.calls)
    assert core.aborted == []


def test_a_clone_sends_every_piece_at_once_with_the_reference(monkeypatch):
    pieces = pieces_of(["request", "request"])
    fe, core, clips = frontend_with(monkeypatch, pieces)
    ref = tts_pb2.VoiceReference(audio=common_pb2.AudioData(data=b"RIFF"), transcript="Said before.")

    async def run():
        out = []
        task = asyncio.get_running_loop().create_task(collect(fe.synthesize(ovreq(references=[ref]), MODEL), out))
        await wait_for(core, 2)
        core.finish(1, 20)
        core.finish(0, 10)
        await asyncio.wait_for(task, 5)
        return out

    out = asyncio.run(run())
    assert all(np.array_equal(matrix_array(c.reference_codes), np.ones((5, 8))) for _, c in core.submitted)
    assert all(c.reference_rms == pytest.approx(0.05) for c in clips.calls)
    pcm = np.concatenate([np.frombuffer(r.audio.data, "<i2") for r in out if r.HasField("audio")])
    assert pcm.shape == (10 * 960,) and pcm[0] == round(0.01 * 32767) and pcm[-1] == round(0.02 * 32767)


def test_a_voice_of_the_other_model_or_without_transcript_is_refused(monkeypatch):
    fe, core, _ = frontend_with(monkeypatch, pieces_of(["request"]))
    core.voices["m"] = frontend_pb2.StoredVoice(voice_id="m", codes=rows_matrix(np.zeros((3, 12), np.int32)),
                                                transcript="Hi.", frames=3, model="moss-tts-local-tiny")
    core.voices["quiet"] = frontend_pb2.StoredVoice(voice_id="quiet", codes=rows_matrix(np.zeros((3, 8), np.int32)),
                                                    frames=3, model=MODEL)

    def refused(ref):
        with pytest.raises(InvalidRequest) as e:
            asyncio.run(collect(fe.synthesize(ovreq(references=[ref]), MODEL), []))
        return str(e.value)

    assert refused(tts_pb2.VoiceReference(voice_id="m")).startswith("references[0].voice_id 'm' was made for model "
                                                                     "moss-tts-local-tiny")
    assert refused(tts_pb2.VoiceReference(voice_id="quiet")).startswith("references[0].transcript is empty")
    assert refused(codes_ref(cols=12)).startswith("references[0].codes must be [T>0, 8]")
    bad = tts_pb2.VoiceReference(codes=rows_matrix(np.full((2, 8), 1024, np.int32)), transcript="Hi.")
    assert refused(bad).startswith("references[0].codes values must be in [0, 1024)")


def test_cancelling_the_stream_aborts_every_piece_still_running(monkeypatch):
    fe, core, _ = frontend_with(monkeypatch, pieces_of(["request", "request", "request"]))

    async def run():
        gen = fe.synthesize(ovreq(references=[codes_ref()]), MODEL)
        assert (await gen.__anext__()).HasField("header")
        core.finish(0, 1)
        assert (await gen.__anext__()).HasField("audio")
        await gen.aclose()  # the client went away

    asyncio.run(run())
    assert sorted(core.aborted) == [2, 3]


def test_a_piece_over_the_budget_is_refused_before_it_is_submitted(monkeypatch):
    fe, core, _ = frontend_with(monkeypatch, [FakePiece("long", [1] * 100, 20000, "none")])
    with pytest.raises(InvalidRequest, match="packed rows"):
        asyncio.run(collect(fe.synthesize(ovreq(), MODEL), []))
    assert core.submitted == []


def test_chorus_say_puts_the_omnivoice_flags_in_the_request(tmp_path):
    import argparse

    from chorus.cli import _add_say_flags, _say_request

    p = argparse.ArgumentParser()
    p.add_argument("text")
    p.add_argument("--model", default="")
    _add_say_flags(p, "out.wav")
    voice = tmp_path / "v.wav"
    voice.write_bytes(b"RIFF")
    args = p.parse_args(["Hi there.", "--model", "omnivoice", "--num-step", "8", "--guidance-scale", "0",
                         "--speed", "1.25", "--instructions", "female, low pitch", "--language", "en",
                         "--seed", "3", "--no-denoise", "--voice", str(voice), "--transcript", "Said."])
    req = _say_request(args)
    assert req.model == "omnivoice" and req.instructions == "female, low pitch" and req.language == "en"
    assert req.omnivoice.num_step == 8 and req.omnivoice.HasField("guidance_scale")
    assert req.omnivoice.speed == 1.25 and req.omnivoice.denoise is False
    assert not req.omnivoice.HasField("postprocess") and not req.omnivoice.HasField("t_shift")
    assert req.references[0].transcript == "Said." and req.sampling.seed == 3
    validate_omnivoice(req, LIMITS, MODEL)  # what chorus say sends passes the edge
    moss = _say_request(p.parse_args(["Hi.", "--temperature", "0.5"]))
    assert not moss.HasField("omnivoice")
    validate(moss, LIMITS, None, 12.5)


def test_the_real_planner_builds_the_canvases_and_its_errors_name_the_field():
    from chorus.omnivoice.prompt import plan_pieces
    from chorus.omnivoice.tokenizer import load_omnivoice_tokenizer

    tok = load_omnivoice_tokenizer(None)
    core, clips = FakeCore(), FakeClips()
    fe = OmniVoiceFrontend(core, clips, tok, LIMITS, voices=core)
    req = ovreq(text="Good morning.", language="English", instructions="female, low pitch",
                references=[codes_ref(rows=40)])

    async def run():
        out = []
        task = asyncio.get_running_loop().create_task(collect(fe.synthesize(req, MODEL), out))
        await wait_for(core, 1)
        core.finish(0, 7)
        await asyncio.wait_for(task, 5)
        return out

    out = asyncio.run(run())
    [expect] = plan_pieces(tok, "Good morning.", language="English", instructions="female, low pitch",
                           has_reference=True, reference_text="Hi.", reference_frames=40)
    canvas = core.submitted[0][1]
    assert list(canvas.text_ids) == expect.text_ids and canvas.target_frames == expect.target_frames
    assert out[-1].summary.frames == expect.target_frames
    with pytest.raises(InvalidRequest, match="^instructions: "):
        asyncio.run(collect(fe.synthesize(ovreq(instructions="purple, shouting"), MODEL), []))


def test_decode_clip_moves_to_another_replica_when_one_is_down():
    from chorus.v1 import vocoder_pb2_grpc
    from scheduler_svc.clip_vocoders import ClipVocoders

    class Clip(vocoder_pb2_grpc.VocoderServicer):
        def __init__(self, up: bool):
            self.up, self.calls = up, 0

        async def DecodeClip(self, request, context):
            self.calls += 1
            if not self.up:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
            return vocoder_pb2.DecodeClipResponse(num_samples=request.codes.rows * 960)

    async def run():
        servicers, servers, ports = [Clip(False), Clip(True)], [], []
        for s in servicers:
            server = grpc.aio.server()
            vocoder_pb2_grpc.add_VocoderServicer_to_server(s, server)
            ports.append(server.add_insecure_port("127.0.0.1:0"))
            await server.start()
            servers.append(server)
        pool = ClipVocoders([f"127.0.0.1:{p}" for p in ports])
        try:
            resp = await pool.decode_clip(vocoder_pb2.DecodeClipRequest(codes=rows_matrix(np.zeros((3, 8), np.int32))))
            assert resp.num_samples == 3 * 960
            assert [s.calls for s in servicers] == [1, 1] and not pool.replicas[0].healthy
        finally:
            await pool.close()
            for server in servers:
                await server.stop(None)

    asyncio.run(run())


# ---- through the real CPU services: MOSS tiny beside an OmniVoice tiny worker and a Higgs tiny vocoder ----

QUICK = {"num_step": 4}  # a few unmasking steps keep the tiny model quick on the CPU
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def speech_wav(seconds: float, rate: int = 24000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, 0.2 * np.sin(2 * np.pi * 180 * t) * (1 + np.sin(2 * np.pi * 3 * t)) / 2, rate, format="WAV")
    return buf.getvalue()


def ov_service_request(text="Hello from the OmniVoice tests.", knobs=None, **kw) -> tts_pb2.SynthesizeRequest:
    return ovreq(text=text, omnivoice={**QUICK, **(knobs or {})}, **kw)


@pytest.fixture(scope="module")
def both():
    """MOSS (tiny) and OmniVoice (tiny) behind one scheduler."""
    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "8", "--kv-slots", "16384"],
                      omnivoice_worker=WorkerConfig(preset="omnivoice-tiny", dtype="float32"),
                      omnivoice_vocoder=VocoderConfig(preset="higgs-tiny")) as c:
        yield c


@pytest.fixture(scope="module")
def stub(both):
    return tts_pb2_grpc.TextToSpeechStub(channel(both.address))


def test_list_models_lists_both(stub):
    models = {m.architecture: m for m in stub.ListModels(tts_pb2.ListModelsRequest()).models}
    assert set(models) == {"moss_tts_local", "omnivoice"} and models["moss_tts_local"].is_default
    ov_info = models["omnivoice"]
    assert (ov_info.name, ov_info.sample_rate, ov_info.channels, ov_info.frame_rate, ov_info.codebooks) == \
        (MODEL, 24000, 1, 25, 8)
    with pytest.raises(grpc.RpcError) as e:
        synthesize(stub, ovreq(model="nope"), timeout=60)
    assert e.value.code() == INVALID and MODEL in e.value.details() and "moss_tts_local" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.CreateVoice(tts_pb2.CreateVoiceRequest(model="nope", audio=common_pb2.AudioData(data=speech_wav(1.0))))
    assert e.value.code() == INVALID and e.value.details().startswith("model 'nope'")


def test_an_omnivoice_request_streams_24_khz_mono_audio(stub):
    out = synthesize(stub, ov_service_request(return_codes=True, sampling={"seed": 1}), timeout=300)
    assert (out.header.model, out.header.sample_rate, out.header.channels) == (MODEL, 24000, 1)
    pcm = out.pcm()
    assert pcm.shape[1] == 1 and pcm.shape[0] > 0 and np.abs(pcm).max() > 0
    assert out.summary.finish_reason == tts_pb2.STOP and out.summary.frames == out.code_frames().shape[0]
    assert out.summary.audio_seconds == pytest.approx(pcm.shape[0] / 24000)
    again = synthesize(stub, ov_service_request(return_codes=True, sampling={"seed": 1}), timeout=300)
    assert np.array_equal(again.code_frames(), out.code_frames())  # same seed, same canvas
    resampled = synthesize(stub, ov_service_request(model="omnivoice", sample_rate=16000, format=tts_pb2.WAV),
                           timeout=300)
    assert resampled.header.sample_rate == 16000 and resampled.pcm().shape[0] > 0


def test_a_long_text_streams_several_pieces_in_order(stub):
    text = " ".join(["The committee met again on Tuesday, and after a long discussion of the budget, "
                     "the members agreed to postpone the vote until the next session."] * 5)
    out = synthesize(stub, ov_service_request(text=text, return_codes=True), timeout=600)
    assert out.summary.frames > 750
    starts = [c.first_sample for c in out.chunks]
    assert starts == sorted(starts) and out.pcm().shape[0] == sum(c.num_samples for c in out.chunks)
    assert len(out.codes) >= 2, "a text of more than 30 s of speech is generated in pieces"


def test_clones_by_audio_and_by_stored_voice(stub):
    by_audio = ov_service_request(references=[tts_pb2.VoiceReference(
        audio=common_pb2.AudioData(data=speech_wav(1.5)), transcript="A short reference sentence.")])
    assert synthesize(stub, by_audio, timeout=300).pcm().shape[0] > 0
    voice = stub.CreateVoice(tts_pb2.CreateVoiceRequest(voice_id="ov-voice", model="omnivoice", transcript="Hello.",
                                                        audio=common_pb2.AudioData(data=speech_wav(1.0))))
    assert voice.model == MODEL and voice.frames == 25
    listed = {v.voice_id: v for v in stub.ListVoices(tts_pb2.ListVoicesRequest()).voices}
    assert listed["ov-voice"].model == MODEL
    out = synthesize(stub, ov_service_request(references=[tts_pb2.VoiceReference(voice_id="ov-voice")]), timeout=300)
    assert out.pcm().shape[0] > 0
    moss = tts_pb2.SynthesizeRequest(text="Hi.", max_frames=4, references=[tts_pb2.VoiceReference(voice_id="ov-voice")])
    with pytest.raises(grpc.RpcError) as e:
        synthesize(stub, moss, timeout=60)
    assert e.value.code() == INVALID and "references[0].voice_id" in e.value.details()
    stub.DeleteVoice(tts_pb2.DeleteVoiceRequest(voice_id="ov-voice"))


CANVAS_GAUGES = ("chorus_canvas_queue_depth", "chorus_canvas_running", "chorus_canvas_rows_used")


def labelled(cluster, name: str, label: str = "") -> float:
    """A labelled metric of the core summed over the series whose labels contain `label`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{") and label in line)


def canvases_held(cluster) -> tuple:
    """(the core's canvas gauges, canvases on the OmniVoice worker)."""
    stats = worker_stats(SimpleNamespace(service=lambda name: cluster.service("omnivoice-worker")))
    return tuple(labelled(cluster, g) for g in CANVAS_GAUGES) + (stats.active_requests,)


def test_a_hundred_cancelled_requests_leave_no_canvas_held(both, stub):
    rng = random.Random(0)
    calls = []
    aborted = labelled(both, "chorus_canvases_total", 'outcome="cancelled"')
    for i in range(100):  # default steps, up to ~90 s of speech: many are cut off mid-canvas or mid-piece
        text = "Cancel me now. " * rng.randint(1, 120)
        call = stub.Synthesize(ovreq(text=text, sampling={"seed": i}), timeout=300)
        calls.append(call)
        threading.Timer(rng.uniform(0, 2.0), call.cancel).start()
    cancelled = 0
    for call in calls:
        try:
            for _ in call:
                pass
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED, e.details()
            cancelled += 1
    assert cancelled >= 50
    assert labelled(both, "chorus_canvases_total", 'outcome="cancelled"') > aborted  # the core dropped canvases
    deadline = time.monotonic() + 60
    while any(canvases_held(both)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert canvases_held(both) == (0, 0, 0, 0)
    assert synthesize(stub, ov_service_request(), timeout=300).pcm().shape[0] > 0


def test_a_mixed_moss_and_omnivoice_load_is_served_concurrently(stub):
    def one(i):
        if i % 2:
            return synthesize(stub, ov_service_request(sampling={"seed": i}), timeout=600)
        req = tts_pb2.SynthesizeRequest(text="Mixed load.", language="English", min_frames=8, max_frames=8)
        req.sampling.seed = i
        return synthesize(stub, req, timeout=600)

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, range(8)))
    for i, out in enumerate(outs):
        expect = (24000, 1) if i % 2 else (48000, 2)
        assert (out.header.sample_rate, out.header.channels) == expect and out.pcm().shape[0] > 0


def test_chorus_say_model_omnivoice_writes_a_wav(both, tmp_path):
    wav = tmp_path / "ov.wav"
    proc = subprocess.run([sys.executable, "-m", "chorus.cli", "say", "Hello there.", "--server", both.address,
                           "--model", "omnivoice", "--num-step", "4", "--speed", "1.2", "--seed", "3", "-o", str(wav)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    audio, rate = sf.read(wav)
    assert rate == 24000 and audio.ndim == 1 and audio.shape[0] > 0


def test_chorus_demo_model_omnivoice_writes_a_wav(tmp_path):
    wav = tmp_path / "demo.wav"
    proc = subprocess.run([sys.executable, "-m", "chorus.cli", "demo", "--model", "omnivoice", "--num-step", "4",
                           "-o", str(wav)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    audio, rate = sf.read(wav)
    assert rate == 24000 and audio.ndim == 1 and audio.shape[0] > 0
