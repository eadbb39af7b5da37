"""Limits on every input of the public API, against the real services: each bad request in the
catalogue ends with a precise status whose short message names the field (and never echoes
the client's input back at length), and the service keeps serving afterwards."""

import io

import grpc
import numpy as np
import pytest
import soundfile as sf

from chorus.client import channel, synthesize
from chorus.v1 import common_pb2, tts_pb2, tts_pb2_grpc
from helpers import make_cluster, seeded_request, wait_until_idle

MAX_REQUEST_BYTES = 2 << 20
MAX_REFERENCE_S = 2  # 25 frames at 12.5 Hz
MAX_VOICES = 3
BIG = 1_000_000  # characters: under the request size limit, far over every string limit
LONG_ID = "v" * 17_000  # an id longer than a client's default metadata limit allows echoing
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
SERVICE = "/chorus.v1.TextToSpeech/"


@pytest.fixture(scope="module")
def service():
    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "4", "--kv-slots", "4096"],
                      scheduler_args=["--max-request-bytes", str(MAX_REQUEST_BYTES),
                                      "--max-reference-s", str(MAX_REFERENCE_S),
                                      "--max-voices", str(MAX_VOICES)]) as c:
        yield c


@pytest.fixture(scope="module")
def stub(service):
    return tts_pb2_grpc.TextToSpeechStub(channel(service.address))


def wav(seconds: float, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    t = np.arange(int(seconds * rate)) / rate
    sf.write(buf, 0.3 * np.sin(2 * np.pi * 220 * t), rate, format="WAV")
    return buf.getvalue()


def pcm16(samples: int, rate: int = 16000) -> common_pb2.AudioData:
    return common_pb2.AudioData(data=bytes(2 * samples), encoding=common_pb2.AUDIO_ENCODING_PCM16,
                                sample_rate=rate, channels=1)


def codes(rows: int) -> common_pb2.IntMatrix:
    return common_pb2.IntMatrix(rows=rows, cols=12, data=bytes(rows * 12 * 4))


def ref(**kw) -> tts_pb2.VoiceReference:
    return tts_pb2.VoiceReference(**kw)


def synth(**fields) -> bytes:
    base = dict(text="Fine text.", max_frames=4)
    base.update(fields)
    return tts_pb2.SynthesizeRequest(**base).SerializeToString()


def with_bad_utf8(message_bytes: bytes, marker: bytes) -> bytes:
    """The bytes with a same-length invalid UTF-8 sequence where `marker` was."""
    assert marker in message_bytes
    return message_bytes.replace(marker, b"\xff" * len(marker))


# (rpc, request bytes, status, what the message must contain); every request goes as raw bytes,
# so bodies a client library would refuse to build (invalid UTF-8, corrupt) go the same way.
CASES = {
    # Synthesize: every string's length
    "text over the long-form limit": ("Synthesize", synth(text="x" * 60_000), INVALID, "text"),
    "language over 64": ("Synthesize", synth(language="E" * 65), INVALID, "language"),
    "language 1 MB": ("Synthesize", synth(language="x" * BIG), INVALID, "language"),
    "instructions over 1000": ("Synthesize", synth(instructions="i" * 1001), INVALID, "instructions"),
    "instructions 1 MB": ("Synthesize", synth(instructions="i" * BIG), INVALID, "instructions"),
    "request_id over 128": ("Synthesize", synth(request_id="r" * 129), INVALID, "request_id"),
    "request_id 1 MB": ("Synthesize", synth(request_id="r" * BIG), INVALID, "request_id"),
    "model over 128": ("Synthesize", synth(model="m" * 129), INVALID, "model"),
    "model 17 KB": ("Synthesize", synth(model="m" * 17_000), INVALID, "model"),
    "model unknown": ("Synthesize", synth(model="no-such-model-" + "z" * 100), INVALID, "model"),
    # Synthesize: references
    "reference voice_id 17 KB": ("Synthesize", synth(references=[ref(voice_id=LONG_ID)]), INVALID,
                                 "references[0].voice_id"),
    "reference voice_id unknown": ("Synthesize", synth(references=[ref(voice_id="nobody-" + "n" * 100)]),
                                   NOT_FOUND, "references[0].voice_id"),
    "reference transcript over the limit": ("Synthesize", synth(references=[ref(voice_id="a", transcript="t" * 6000)]),
                                            INVALID, "references[0].transcript"),
    "too many references": ("Synthesize", synth(references=[ref(codes=codes(2))] * 9), INVALID, "references"),
    "reference codes too long": ("Synthesize", synth(references=[ref(codes=codes(26))]), INVALID,
                                 "references[0].codes"),
    "reference codes row count lies": ("Synthesize", synth(references=[ref(codes=common_pb2.IntMatrix(
        rows=3, cols=12, data=bytes(8)))]), INVALID, "references[0].codes"),
    "reference raw audio too long": ("Synthesize", synth(references=[ref(audio=pcm16(3 * 16000))]), INVALID,
                                     "references[0].audio"),
    "reference WAV too long": ("Synthesize", synth(references=[ref(codes=codes(2)), ref(
        audio=common_pb2.AudioData(data=wav(3.0)))]), INVALID, "references[1].audio"),
    "reference of one sample": ("Synthesize", synth(references=[ref(audio=pcm16(1))]), INVALID,
                                "references[0].audio"),
    "reference not audio": ("Synthesize", synth(references=[ref(audio=common_pb2.AudioData(data=b"garbage"))]),
                            INVALID, "references[0].audio"),
    # Synthesize: continuation
    "continuation transcript over the limit": ("Synthesize", synth(continuation=ref(
        codes=codes(2), transcript="t" * 6000)), INVALID, "continuation.transcript"),
    "continuation voice_id 17 KB": ("Synthesize", synth(continuation=ref(voice_id=LONG_ID, transcript="hi")),
                                    INVALID, "continuation.voice_id"),
    "continuation voice_id unknown": ("Synthesize", synth(continuation=ref(voice_id="x" * 128, transcript="hi")),
                                      NOT_FOUND, "continuation.voice_id"),
    "continuation WAV too long": ("Synthesize", synth(continuation=ref(audio=common_pb2.AudioData(data=wav(3.0)),
                                                                       transcript="hi")),
                                  INVALID, "continuation.audio"),
    # Synthesize: bytes that do not decode
    "text not UTF-8": ("Synthesize", with_bad_utf8(synth(text="Fine QQQQ."), b"QQQQ"), INVALID, "text"),
    "language not UTF-8": ("Synthesize", with_bad_utf8(synth(language="QQQQ"), b"QQQQ"), INVALID, "language"),
    "request_id not UTF-8": ("Synthesize", with_bad_utf8(synth(request_id="QQQQ"), b"QQQQ"), INVALID,
                             "request_id"),
    "nested transcript not UTF-8": ("Synthesize", with_bad_utf8(synth(references=[
        ref(codes=codes(2)), ref(voice_id="a", transcript="QQQQ")]), b"QQQQ"), INVALID,
        "references[1].transcript"),
    "corrupt body": ("Synthesize", b"\xff\xff\xff\xff", INVALID, "request"),
    "truncated body": ("Synthesize", synth(instructions="calm and slow")[:-3], INVALID, "request"),
    "body over the size limit": ("Synthesize", synth(text="x" * (MAX_REQUEST_BYTES + 10)),
                                 grpc.StatusCode.RESOURCE_EXHAUSTED, str(MAX_REQUEST_BYTES)),
    # CreateVoice
    "voice_id over 128": ("CreateVoice", tts_pb2.CreateVoiceRequest(
        voice_id="v" * 129, audio=common_pb2.AudioData(data=wav(1.0))).SerializeToString(), INVALID, "voice_id"),
    "voice_id 17 KB": ("CreateVoice", tts_pb2.CreateVoiceRequest(
        voice_id=LONG_ID, audio=common_pb2.AudioData(data=wav(1.0))).SerializeToString(), INVALID, "voice_id"),
    "voice transcript over the limit": ("CreateVoice", tts_pb2.CreateVoiceRequest(
        transcript="t" * 6000, audio=common_pb2.AudioData(data=wav(1.0))).SerializeToString(), INVALID,
        "transcript"),
    "voice without audio": ("CreateVoice", tts_pb2.CreateVoiceRequest(voice_id="a").SerializeToString(),
                            INVALID, "audio"),
    "voice of one sample": ("CreateVoice", tts_pb2.CreateVoiceRequest(
        voice_id="tiny", audio=pcm16(1)).SerializeToString(), INVALID, "audio"),
    "voice of one WAV sample": ("CreateVoice", tts_pb2.CreateVoiceRequest(
        voice_id="tiny", audio=common_pb2.AudioData(data=wav(1 / 16000))).SerializeToString(), INVALID, "audio"),
    "voice too long": ("CreateVoice", tts_pb2.CreateVoiceRequest(
        audio=common_pb2.AudioData(data=wav(3.0))).SerializeToString(), INVALID, "audio"),
    "voice_id not UTF-8": ("CreateVoice", with_bad_utf8(tts_pb2.CreateVoiceRequest(
        voice_id="QQQQ", audio=common_pb2.AudioData(data=wav(1.0))).SerializeToString(), b"QQQQ"), INVALID,
        "voice_id"),
    "voice corrupt body": ("CreateVoice", b"\x12\xff\xff\xff\xff\x0f", INVALID, "request"),
    # DeleteVoice, ListVoices, ListModels
    "delete voice_id 17 KB": ("DeleteVoice", tts_pb2.DeleteVoiceRequest(voice_id=LONG_ID).SerializeToString(),
                              INVALID, "voice_id"),
    "delete voice_id unknown": ("DeleteVoice", tts_pb2.DeleteVoiceRequest(voice_id="d" * 128).SerializeToString(),
                                NOT_FOUND, "voice_id"),
    "delete voice_id not UTF-8": ("DeleteVoice", with_bad_utf8(tts_pb2.DeleteVoiceRequest(
        voice_id="QQQQ").SerializeToString(), b"QQQQ"), INVALID, "voice_id"),
    "list voices corrupt body": ("ListVoices", b"\x0a\x05ab", INVALID, "request"),
    "list models corrupt body": ("ListModels", b"\xff", INVALID, "request"),
}


def call_raw(ch: grpc.Channel, rpc: str, body: bytes):
    passthrough = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    if rpc == "Synthesize":
        return list(ch.unary_stream(SERVICE + rpc, **passthrough)(body, timeout=60))
    return ch.unary_unary(SERVICE + rpc, **passthrough)(body, timeout=60)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gets_a_short_precise_error(service, name):
    rpc, body, code, needle = CASES[name]
    ch = channel(service.address)
    try:
        with pytest.raises(grpc.RpcError) as e:
            call_raw(ch, rpc, body)
    finally:
        ch.close()
    details = e.value.details() or ""
    assert e.value.code() == code, f"{name}: {e.value.code()} {details[:300]}"
    assert needle in details, details[:300]
    assert len(details) < 300, f"{name}: {len(details)} characters"


def test_the_catalogue_is_broad():
    assert len(CASES) >= 30


def test_no_zero_frame_voice_is_stored_and_the_service_still_serves(service, stub):
    voices = stub.ListVoices(tts_pb2.ListVoicesRequest()).voices
    assert all(v.frames > 0 for v in voices) and "tiny" not in [v.voice_id for v in voices]
    voice = stub.CreateVoice(tts_pb2.CreateVoiceRequest(voice_id="ok", audio=common_pb2.AudioData(data=wav(1.0))))
    assert voice.frames > 0
    req = seeded_request(frames=3, instructions="calm", request_id="r" * 128)
    req.references.add(voice_id="ok")
    out = synthesize(stub, req, timeout=120)
    assert out.summary.frames == 3 and out.header.request_id == "r" * 128
    stub.DeleteVoice(tts_pb2.DeleteVoiceRequest(voice_id="ok"))
    assert wait_until_idle(service) == (0, 0, 0, 0)


def test_a_request_id_cannot_forge_a_log_line(service, stub):
    out = synthesize(stub, seeded_request(frames=2, request_id="abc\nFORGED INFO all is well\x1b[2J"), timeout=120)
    assert out.summary.frames == 2
    lines = service.service("scheduler").lines
    assert not any(line.startswith("FORGED") for line in lines)
    assert any("abc\\nFORGED INFO all is well\\x1b[2J" in line for line in lines)


def test_the_voice_store_is_bounded(stub):
    audio = common_pb2.AudioData(data=wav(0.5))
    for i in range(MAX_VOICES):
        stub.CreateVoice(tts_pb2.CreateVoiceRequest(voice_id=f"v{i}", audio=audio))
    with pytest.raises(grpc.RpcError) as e:
        stub.CreateVoice(tts_pb2.CreateVoiceRequest(voice_id="one-too-many", audio=audio))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "voice store" in e.value.details()
    assert str(MAX_VOICES) in e.value.details() and len(e.value.details()) < 300
    stub.CreateVoice(tts_pb2.CreateVoiceRequest(voice_id="v0", audio=audio))  # replacing one still works
    assert sorted(v.voice_id for v in stub.ListVoices(tts_pb2.ListVoicesRequest()).voices) == ["v0", "v1", "v2"]
    for i in range(MAX_VOICES):
        stub.DeleteVoice(tts_pb2.DeleteVoiceRequest(voice_id=f"v{i}"))
    stub.CreateVoice(tts_pb2.CreateVoiceRequest(voice_id="room-again", audio=audio))
    stub.DeleteVoice(tts_pb2.DeleteVoiceRequest(voice_id="room-again"))


def test_the_request_decoder_never_raises_on_mutated_bytes():
    """Whatever the bytes, the servicer gets a message or an Undecodable naming what is wrong (an
    exception in the deserializer would reach the client as UNKNOWN)."""
    from scheduler_svc.request_decoding import Undecodable, deserializer
    decode = deserializer(tts_pb2.SynthesizeRequest)
    valid = bytearray(synth(language="English", references=[ref(voice_id="v", transcript="hello")],
                            continuation=ref(codes=codes(2), transcript="said")))
    rng = np.random.default_rng(0)
    for _ in range(3000):
        body = bytearray(valid)
        for i in rng.integers(0, len(body), size=int(rng.integers(1, 4))):
            body[i] = int(rng.integers(0, 256))
        out = decode(bytes(body[:int(rng.integers(0, len(body) + 1))]))
        assert isinstance(out, (tts_pb2.SynthesizeRequest, Undecodable))
        if isinstance(out, Undecodable):
            assert len(out.message) < 300


def test_log_text_escapes_control_characters_and_is_capped():
    from scheduler_svc.validation import printable, shown
    assert printable("abc\ndef\x1b\t") == "abc\\ndef\\x1b\\t"
    assert len(printable("x" * 10_000)) == 128 and printable("plain-id_1") == "plain-id_1"
    assert shown("y" * 17_000) == repr("y" * 32) + "..."
