"""Fuzzing the public API's request decoding and validation against the real services (tiny
model, CPU): random bytes as a Synthesize body, and random well-typed SynthesizeRequest and
CreateVoiceRequest messages drawn over every proto field. Every answer is OK or a status the
client can act on (never UNKNOWN or INTERNAL), and the service keeps serving and holds nothing."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as F
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings, strategies as st

from chorus.client import channel, synthesize
from chorus.v1 import tts_pb2, tts_pb2_grpc
from helpers import make_cluster, seeded_request, wait_until_idle

MAX_FRAMES = 8  # the service's cap: a valid request drawn at random stays short
FORBIDDEN = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SYNTHESIZE = "/chorus.v1.TextToSpeech/Synthesize"


@pytest.fixture(scope="module")
def service():
    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "4", "--kv-slots", "4096"],
                      scheduler_args=["--max-frames", str(MAX_FRAMES), "--max-voices", "4"]) as c:
        c.channel = channel(c.address)
        yield c


# ---- strategies over a message's fields --------------------------------------------------------

INT32 = st.one_of(st.integers(-3, 300), st.sampled_from([-2 ** 31, 2 ** 31 - 1, 4096, 100_000]))
FLOAT = st.one_of(st.floats(-2.0, 200.0, width=32), st.sampled_from([float("nan"), float("inf"), -float("inf"),
                                                                    0.0, 1e30]))
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", "Hello there.", "x" * 5001, "\x00\n\x1b[2J"]))
SCALARS = {
    F.TYPE_INT32: INT32, F.TYPE_INT64: INT32, F.TYPE_UINT64: st.integers(0, 2 ** 64 - 1),
    F.TYPE_FLOAT: FLOAT, F.TYPE_DOUBLE: FLOAT, F.TYPE_BOOL: st.booleans(), F.TYPE_STRING: TEXT,
    F.TYPE_BYTES: st.binary(max_size=96), F.TYPE_ENUM: st.integers(-1, 4),
}
MODELS = st.sampled_from(["", "moss-tts-local-tiny", "omnivoice-tiny", "nope"])


def message(descriptor, depth: int = 0, base=None) -> st.SearchStrategy:
    """Instances of the message type with a random subset of its fields set to random values (on a
    copy of `base`, so that some get past the first checks)."""
    def field_value(f):
        if f.type == F.TYPE_MESSAGE:
            value = message(f.message_type, depth + 1) if depth < 3 else st.nothing()
        elif f.name == "model":
            value = MODELS
        else:
            value = SCALARS[f.type]
        return st.lists(value, max_size=3) if f.is_repeated else value

    cls = _class(descriptor)
    fields = list(descriptor.fields)

    @st.composite
    def build(draw):
        msg = cls()
        if base is not None:
            msg.CopyFrom(base)
        for f in draw(st.lists(st.sampled_from(fields), max_size=6, unique=True)) if fields else []:
            value = draw(field_value(f))
            if f.is_repeated:
                getattr(msg, f.name).extend(value) if f.type != F.TYPE_MESSAGE else \
                    [getattr(msg, f.name).add().CopyFrom(v) for v in value]
            elif f.type == F.TYPE_MESSAGE:
                getattr(msg, f.name).CopyFrom(value)
            else:
                setattr(msg, f.name, value)
        return msg

    return build()


def _class(descriptor):
    from google.protobuf import message_factory
    return message_factory.GetMessageClass(descriptor)


def _answer(call) -> None:
    try:
        call()
        event("OK")
    except grpc.RpcError as e:
        assert e.code() not in FORBIDDEN, f"{e.code()}: {(e.details() or '')[:300]}"
        event(e.code().name)


# ---- the fuzz ------------------------------------------------------------------------------------

VALID = seeded_request(frames=2).SerializeToString()


@st.composite
def mutated(draw) -> bytes:
    body = bytearray(VALID)
    for _ in range(draw(st.integers(1, 4))):
        body[draw(st.integers(0, len(body) - 1))] = draw(st.integers(0, 255))
    return bytes(body[:draw(st.integers(0, len(body)))])


@FUZZ
@given(body=st.one_of(st.binary(max_size=256), mutated()))
def test_random_bytes_as_a_synthesize_body(service, body):
    call = service.channel.unary_stream(SYNTHESIZE, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    _answer(lambda: list(call(body, timeout=60)))


@FUZZ
@given(request=message(tts_pb2.SynthesizeRequest.DESCRIPTOR, base=seeded_request(frames=2)))
def test_random_synthesize_requests(service, request):
    stub = tts_pb2_grpc.TextToSpeechStub(service.channel)
    _answer(lambda: list(stub.Synthesize(request, timeout=60)))


@FUZZ
@given(request=message(tts_pb2.CreateVoiceRequest.DESCRIPTOR))
def test_random_create_voice_requests(service, request):
    stub = tts_pb2_grpc.TextToSpeechStub(service.channel)
    _answer(lambda: stub.CreateVoice(request, timeout=60))


def test_afterwards_the_service_serves_and_holds_nothing(service):
    health = health_pb2_grpc.HealthStub(service.channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="chorus.v1.TextToSpeech"), timeout=10).status == \
        health_pb2.HealthCheckResponse.SERVING
    assert wait_until_idle(service) == (0, 0, 0, 0)
    stub = tts_pb2_grpc.TextToSpeechStub(service.channel)
    assert synthesize(stub, seeded_request(frames=3), timeout=60).summary.frames == 3
    assert service.service("scheduler").proc.poll() is None
