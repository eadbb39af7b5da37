"""`POST /v1/audio/speech` bodies -> the public API's SynthesizeRequest.

OpenAI's fields keep OpenAI's meaning. `model`: a served model's name; OpenAI's own model names
(tts-1, gpt-4o-mini-tts, ...) mean the server's default model. `voice`: a stored voice's id (made
with POST /v1/audio/voices); one of OpenAI's voice names that is not a stored voice means the
model's own voice (no reference), as does no voice. Chorus's fields sit beside them, named as in
tts.proto: the sampling knobs (seed, temperature, top_p, top_k, repetition_penalty and their
text_* / audio_* sides), language, max_frames, min_frames, duration_seconds, auto_duration,
sample_rate, first_chunk_frames, chunk_frames, request_id, a reference clip (reference_audio:
base64 of an audio file, reference_text: its transcript) and `omnivoice`, an object of
OmniVoiceParams.
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass

from google.protobuf import json_format

from chorus.v1 import common_pb2, tts_pb2
from gateway_svc.encoders import check_format, check_rate
from gateway_svc.errors import GatewayError, invalid

OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "gpt-4o-tts")
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer",
                 "verse", "marin", "cedar")
_SAMPLING = {"seed": int, "temperature": float, "top_p": float, "top_k": int, "repetition_penalty": float,
             "text_temperature": float, "text_top_p": float, "text_top_k": int, "audio_temperature": float,
             "audio_top_p": float, "audio_top_k": int, "audio_repetition_penalty": float}
_REQUEST = {"language": str, "max_frames": int, "min_frames": int, "duration_seconds": float,
            "auto_duration": bool, "sample_rate": int, "request_id": str}
_OWN = {"model": str, "input": str, "voice": (str, dict), "instructions": str, "response_format": str,
        "speed": float, "stream_format": str, "first_chunk_frames": int, "chunk_frames": int,
        "reference_audio": str, "reference_text": str, "omnivoice": dict}
FIELDS = {**_OWN, **_SAMPLING, **_REQUEST}
_TYPE_WORDS = {str: "a string", int: "an integer", float: "a number", bool: "true or false", dict: "an object"}


@dataclass
class SpeechPlan:
    request: tts_pb2.SynthesizeRequest
    response_format: str
    sse: bool
    # the voice is one of OpenAI's names: if no stored voice has it, synthesize without a reference
    voice_may_be_builtin: bool
    # the body field the request's reference came from (a scheduler's `references` error is about it)
    reference_param: str = "voice"


def _typed(name: str, value, tp):
    """value as the field's type, or 400 naming the field."""
    kinds = tp if isinstance(tp, tuple) else (tp,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
        raise invalid(name, f"expected {' or '.join(_TYPE_WORDS[k] for k in kinds)}, got {value!r:.40}")
    if isinstance(value, float) and not math.isfinite(value):
        raise invalid(name, f"must be a finite number, got {value}")
    return value


def _set(msg, field: str, value, name: str | None = None) -> None:
    """msg.field = value, or 400 naming the body field when the value does not fit the field's
    integer type (int32; the seed uint64)."""
    try:
        setattr(msg, field, value)
    except (ValueError, TypeError):
        raise invalid(name or field, f"{value!r} is out of range for this field") from None


def voice_name(voice) -> str:
    if isinstance(voice, dict):  # OpenAI's custom-voice form: {"id": "..."}
        if not isinstance(voice.get("id"), str) or set(voice) != {"id"}:
            raise invalid("voice", 'an object voice is {"id": "<voice id>"}')
        return voice["id"]
    return voice


def parse_speech(body, models: dict[str, tts_pb2.ModelInfo]) -> SpeechPlan:
    """The request a body asks for. models: the served models by name (for `model` and `speed`)."""
    if not isinstance(body, dict):
        raise GatewayError(400, "the body must be a JSON object", code="invalid_json")
    for key in body:
        if key not in FIELDS:
            raise invalid(key, f"unknown field; the fields are {', '.join(FIELDS)}")
    b = {k: _typed(k, v, FIELDS[k]) for k, v in body.items() if v is not None}
    if "input" not in b:
        raise invalid("input", "is required: the text to speak")
    model_info = resolve_model(b.get("model", ""), models)
    named = b.get("model", "") not in ("", *OPENAI_MODELS)
    # the served model's exact name (an architecture resolved here); none: the server's default
    model = (model_info.name if model_info else b["model"]) if named else ""
    req = tts_pb2.SynthesizeRequest(text=b["input"], model=model, instructions=b.get("instructions", ""))
    for k in _REQUEST:
        if k in b:
            _set(req, k, b[k])
    for k in _SAMPLING:
        if k in b:
            _set(req.sampling, k, b[k])
    for k in ("first_chunk_frames", "chunk_frames"):
        if k in b:
            _set(req.streaming, k, b[k], k)
    fmt = check_format(b.get("response_format", "mp3"))
    req.format = tts_pb2.WAV if fmt == "wav" else tts_pb2.PCM16
    check_rate(fmt, b.get("sample_rate") or (model_info.sample_rate if model_info else 48000))
    stream_format = b.get("stream_format", "audio")
    if stream_format not in ("audio", "sse"):
        raise invalid("stream_format", f"{stream_format!r}: choose audio or sse")
    if "omnivoice" in b:
        try:
            json_format.ParseDict(b["omnivoice"], req.omnivoice)
        except json_format.ParseError as e:
            raise invalid("omnivoice", str(e)) from None
    _apply_speed(req, b.get("speed", 1.0), model_info)
    voice = voice_name(b.get("voice", ""))
    builtin = voice in OPENAI_VOICES
    if "reference_audio" in b:
        if voice and not builtin:
            raise invalid("reference_audio", f"give either a stored voice ({voice!r}) or reference_audio, not both")
        try:
            data = base64.b64decode(b["reference_audio"], validate=True)
        except (binascii.Error, ValueError):
            raise invalid("reference_audio", "is not base64 (send an audio file's bytes, base64-encoded)") from None
        req.references.add(audio=common_pb2.AudioData(data=data), transcript=b.get("reference_text", ""))
        builtin = False
    elif voice:
        req.references.add(voice_id=voice)
    elif "reference_text" in b:
        raise invalid("reference_text", "is the transcript of reference_audio; give reference_audio too")
    return SpeechPlan(req, fmt, stream_format == "sse", builtin,
                      "reference_audio" if "reference_audio" in b else "voice")


def resolve_model(name: str, models: dict[str, tts_pb2.ModelInfo]) -> tts_pb2.ModelInfo | None:
    """The served model a request names (None: models unknown); 404 for one not served."""
    if not name or name in OPENAI_MODELS:
        return next((m for m in models.values() if m.is_default), None)
    if name in models:
        return models[name]
    arch = {"moss": "moss_tts_local"}.get(name, name)
    by_arch = [m for m in models.values() if m.architecture == arch]
    if by_arch:
        return by_arch[0]
    raise GatewayError(404, f"model {name!r} is not served here; GET /v1/models lists the models "
                       f"({', '.join(models)}), and {', '.join(OPENAI_MODELS)} mean the default one",
                       param="model", code="model_not_found")


def _apply_speed(req: tts_pb2.SynthesizeRequest, speed: float, model: tts_pb2.ModelInfo | None) -> None:
    if not 0.25 <= speed <= 4.0:
        raise invalid("speed", f"must be within 0.25..4.0, got {speed}")
    if speed == 1.0:
        return
    if model is not None and model.architecture != "omnivoice":
        raise invalid("speed", f"model {model.name!r} ({model.architecture}) has no speaking-rate control; "
                      "leave speed at 1.0")
    req.omnivoice.speed = speed
