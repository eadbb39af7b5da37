"""OmniVoice through the public API: every bad knob and every field of the other model is an
INVALID_ARGUMENT naming the field; model routing; the Synthesize path's piece order, seeds and
cancellation against stand-ins for the core and the codec; and, where the OmniVoice services are
built, the same through the real CPU services."""

import asyncio
import math

import grpc
import numpy as np
import pytest

from chorus.omnivoice import knobs as ov
from chorus.v1 import common_pb2, frontend_pb2, tts_pb2, vocoder_pb2
from chorus.wire import matrix_array, rows_matrix
from scheduler_svc.omnivoice_validation import validate_omnivoice
from scheduler_svc.served_models import MOSS, OMNIVOICE, ServedModel, ServedModels
from scheduler_svc.validation import InvalidRequest, Limits, validate

LIMITS = Limits(max_text_chars=5000, max_frames=4096, max_language_chars=64, max_instructions_chars=1000,
                max_request_id_chars=128, max_id_chars=128, max_references=8, max_reference_seconds=60.0,
                max_voices=16)
MODEL = "omnivoice-tiny"


def ovreq(**kw) -> tts_pb2.SynthesizeRequest:
    knobs = kw.pop("omnivoice", {})
    sampling = kw.pop("sampling", {})
    req = tts_pb2.SynthesizeRequest(text=kw.pop("text", "Hello there."), model=MODEL, **kw)
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
    with pytest.raises(InvalidRequest, match="^model 'nope' is not served here; available: moss-tts-local-tiny, "):
        models.resolve("nope")
    with pytest.raises(InvalidRequest, match="names 2 served models"):
        ServedModels([moss, omni, ServedModel("other-ov", OMNIVOICE)]).resolve("omnivoice")
    with pytest.raises(ValueError, match="default_model"):
        ServedModels([moss], default="omnivoice")
