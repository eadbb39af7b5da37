"""Checks the public requests at the gRPC edge and resolves a SynthesizeRequest's defaults.
Every message names the field, the value and the allowed range, and shows at most a short
prefix of what the client sent. Sizes are checked first, before anything decodes audio or
tokenizes text."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import soundfile as sf

import numpy as np

from chorus.v1 import common_pb2, tts_pb2, worker_pb2
from chorus.seeds import derive_sampling_seed
from chorus.wire import matrix_array

# Model defaults (spec moss_tts_local.md §4.2: the app's recommended values).
AUDIO_DEFAULTS = dict(temperature=1.7, top_p=0.8, top_k=25, repetition_penalty=1.0)
TEXT_DEFAULTS = dict(temperature=1.0, top_p=1.0, top_k=50)
MAX_TEMPERATURE = 100.0
MAX_CHUNK_FRAMES = 250


class InvalidRequest(ValueError):
    pass


SHOWN_CHARS = 32  # the most of a client's string an error message repeats


def shown(value: str) -> str:
    """A client's string as an error message may quote it: a repr'd prefix."""
    return repr(value[:SHOWN_CHARS]) + ("..." if len(value) > SHOWN_CHARS else "")


def printable(value: str, limit: int = 128) -> str:
    """A client's string as a log line may carry it: control characters escaped, length capped."""
    value = value[:limit]
    return value if value.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in value)


@dataclass(frozen=True)
class Limits:
    """The scheduler config's request limits (the SchedulerConfig fields of the same names)."""
    max_text_chars: int  # text and transcripts
    max_frames: int  # a request's cap, and its default when it asks for none
    max_language_chars: int
    max_instructions_chars: int
    max_request_id_chars: int
    max_id_chars: int  # model names and voice ids
    max_references: int
    max_reference_seconds: float
    max_voices: int  # voices in the store


def matrix_field(m: common_pb2.IntMatrix, field: str) -> np.ndarray:
    """A client's matrix as an array; a malformed one is an InvalidRequest naming the field."""
    try:
        return matrix_array(m)
    except ValueError as e:
        raise InvalidRequest(f"{field}: {e}") from None


def _check_length(field: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise InvalidRequest(f"{field} has {len(value)} characters; the limit is {limit}")


def audio_seconds(audio: common_pb2.AudioData) -> float | None:
    """The audio's duration from its size or its container's header, without decoding it
    (None: unknown here; the vocoder then says what is wrong with it)."""
    raw = {common_pb2.AUDIO_ENCODING_PCM16: 2, common_pb2.AUDIO_ENCODING_FLOAT32: 4}.get(audio.encoding)
    if raw:
        if audio.sample_rate <= 0 or audio.channels <= 0:
            return None
        return len(audio.data) / (raw * audio.channels * audio.sample_rate)
    try:
        info = sf.info(io.BytesIO(audio.data))
    except Exception:  # not a container soundfile reads: the vocoder's decoder reports it
        return None
    return info.frames / info.samplerate if info.samplerate > 0 else None


def _check_audio(field: str, audio: common_pb2.AudioData, limits: Limits) -> None:
    seconds = audio_seconds(audio)
    if seconds is not None and seconds > limits.max_reference_seconds:
        raise InvalidRequest(f"{field} is {seconds:.1f} s long; the limit is {limits.max_reference_seconds:g} s")


def _check_reference(field: str, ref: tts_pb2.VoiceReference, limits: Limits, frame_rate: float) -> None:
    _check_length(f"{field}.transcript", ref.transcript, limits.max_text_chars)
    kind = ref.WhichOneof("source")
    if kind == "voice_id":
        _check_length(f"{field}.voice_id", ref.voice_id, limits.max_id_chars)
    elif kind == "audio":
        _check_audio(f"{field}.audio", ref.audio, limits)
    elif kind == "codes":
        max_rows = int(limits.max_reference_seconds * frame_rate)
        if ref.codes.rows > max_rows:
            raise InvalidRequest(f"{field}.codes has {ref.codes.rows} frames; the limit is {max_rows} "
                                 f"({limits.max_reference_seconds:g} s)")


def check_sizes(req: tts_pb2.SynthesizeRequest, limits: Limits, frame_rate: float) -> None:
    """Every string's length and the references' count and durations: cheap checks that keep
    oversized input away from the tokenizer and the codec."""
    if len(req.text) > limits.max_text_chars:
        raise InvalidRequest(f"text has {len(req.text)} characters; the limit is {limits.max_text_chars} "
                             "(split long text into several requests)")
    for field, limit in (("model", limits.max_id_chars), ("language", limits.max_language_chars),
                         ("instructions", limits.max_instructions_chars),
                         ("request_id", limits.max_request_id_chars)):
        _check_length(field, getattr(req, field), limit)
    if len(req.references) > limits.max_references:
        raise InvalidRequest(f"references has {len(req.references)} entries; the limit is {limits.max_references}")
    for i, ref in enumerate(req.references):
        _check_reference(f"references[{i}]", ref, limits, frame_rate)
    if req.HasField("continuation"):
        _check_reference("continuation", req.continuation, limits, frame_rate)


def check_model_name(name: str, limits: Limits) -> None:
    """Before routing by it: the answer to an unknown name repeats it."""
    _check_length("model", name, limits.max_id_chars)


def check_create_voice(req: tts_pb2.CreateVoiceRequest, limits: Limits) -> None:
    _check_length("voice_id", req.voice_id, limits.max_id_chars)
    check_model_name(req.model, limits)
    _check_length("transcript", req.transcript, limits.max_text_chars)
    for field in ("voice_id", "transcript"):  # a database's text cannot hold one
        if "\0" in getattr(req, field):
            raise InvalidRequest(f"{field} contains a NUL character (\\x00); remove it")
    if not req.HasField("audio") or not req.audio.data:
        raise InvalidRequest("audio is empty: give the voice's audio (a WAV/FLAC/OGG file or raw PCM)")
    _check_audio("audio", req.audio, limits)


@dataclass
class ResolvedRequest:
    sampling: worker_pb2.SamplingConfig
    max_frames: int
    min_frames: int
    output_format: int
    sample_rate: int


# knob -> (low, low included, high, what the range means); high is always included
RANGES = {
    "temperature": (0.0, True, MAX_TEMPERATURE, " (0 = greedy)"),
    "top_p": (0.0, False, 1.0, ""),
    "top_k": (-1, True, math.inf, " (-1 or 0 = off)"),
    "repetition_penalty": (0.0, False, 100.0, " (1 = off)"),
}


def _check(knob: str, name: str, v: float) -> float:
    lo, lo_incl, hi, note = RANGES[knob]
    if not math.isfinite(v):
        raise InvalidRequest(f"sampling.{name} must be a finite number, got {v}")
    if not ((v >= lo if lo_incl else v > lo) and v <= hi):
        span = f">= {lo}" if hi == math.inf else f"in {'[' if lo_incl else '('}{lo:g}, {hi:g}]"
        raise InvalidRequest(f"sampling.{name} must be {span}{note}, got {v}")
    return v


def _pick(s: tts_pb2.SamplingParams, side: str, knob: str, default):
    """text_/audio_ override, then the plain field, then the model default."""
    for name in (f"{side}_{knob}", knob):
        if s.HasField(name):
            return name, getattr(s, name)
    return knob, default


def resolve_sampling(s: tts_pb2.SamplingParams, min_frames: int) -> worker_pb2.SamplingConfig:
    out = {}
    for side, defaults in (("text", TEXT_DEFAULTS), ("audio", AUDIO_DEFAULTS)):
        for knob, default in defaults.items():
            name, value = _pick(s, side, knob, default)
            out[f"{side}_{knob}"] = _check(knob, name, value)
    seed = s.seed if s.HasField("seed") else None
    return worker_pb2.SamplingConfig(
        text_temperature=out["text_temperature"], text_top_p=out["text_top_p"], text_top_k=out["text_top_k"],
        audio_temperature=out["audio_temperature"], audio_top_p=out["audio_top_p"],
        audio_top_k=out["audio_top_k"], audio_repetition_penalty=out["audio_repetition_penalty"],
        seed=derive_sampling_seed(seed), min_frames=min_frames)


def check_output(req: tts_pb2.SynthesizeRequest) -> None:
    if req.format not in tts_pb2.OutputFormat.values():
        raise InvalidRequest(f"format {req.format} is unknown; use PCM16, FLOAT32 or WAV")
    if req.sample_rate and not 8000 <= req.sample_rate <= 192000:
        raise InvalidRequest(f"sample_rate must be 0 (native) or in [8000, 192000], got {req.sample_rate}")


def validate(req: tts_pb2.SynthesizeRequest, limits: Limits, known_models: list[str] | None,
             frame_rate: float) -> ResolvedRequest:
    """A MOSS request. known_models: the names it may ask for (None: the caller has routed it);
    frame_rate: the codec's frames per second (a reference's duration limit in frames)."""
    check_sizes(req, limits, frame_rate)
    if not req.text.strip():
        raise InvalidRequest("text is empty: give the words to speak")
    if known_models is not None and req.model and req.model not in known_models:
        raise InvalidRequest(f"model {shown(req.model)} is not served here; available: {', '.join(known_models)}")
    if req.HasField("omnivoice"):
        raise InvalidRequest("omnivoice is only for OmniVoice models; this request is for a MOSS model "
                             "(its knobs are in sampling.*)")
    max_frames = req.max_frames or limits.max_frames
    if not 0 < max_frames <= limits.max_frames:
        raise InvalidRequest(f"max_frames must be in [1, {limits.max_frames}] (0 = default), "
                             f"got {req.max_frames}")
    if not 0 <= req.min_frames <= max_frames:
        raise InvalidRequest(f"min_frames must be in [0, max_frames={max_frames}], got {req.min_frames}")
    if not 0 <= req.duration_frames <= limits.max_frames:
        raise InvalidRequest(f"duration_frames must be in [0, {limits.max_frames}], got {req.duration_frames}")
    if not (math.isfinite(req.duration_seconds) and 0 <= req.duration_seconds <= limits.max_frames / 12.5):
        raise InvalidRequest(f"duration_seconds must be in [0, {limits.max_frames / 12.5:g}], "
                             f"got {req.duration_seconds}")
    if sum(map(bool, (req.duration_frames, req.duration_seconds, req.auto_duration))) > 1:
        raise InvalidRequest("give at most one of duration_frames, duration_seconds and auto_duration")
    check_output(req)
    for name, v in (("streaming.first_chunk_frames", req.streaming.first_chunk_frames),
                    ("streaming.chunk_frames", req.streaming.chunk_frames)):
        if not 0 <= v <= MAX_CHUNK_FRAMES:
            raise InvalidRequest(f"{name} must be in [0, {MAX_CHUNK_FRAMES}] (0 = default), got {v}")
    if req.HasField("continuation"):
        if req.references:
            raise InvalidRequest("use either references (voice cloning) or continuation, not both")
        if not req.continuation.transcript.strip():
            raise InvalidRequest("continuation.transcript is empty: continuation needs what the audio says")
    return ResolvedRequest(
        sampling=resolve_sampling(req.sampling, req.min_frames), max_frames=max_frames,
        min_frames=req.min_frames, output_format=req.format or tts_pb2.PCM16, sample_rate=req.sample_rate)
