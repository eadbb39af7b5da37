"""Checks an OmniVoice SynthesizeRequest at the gRPC edge and resolves its knobs.

A field that only MOSS reads is an error here, not silently ignored: the client learns at once that
its temperature or max_frames does nothing for this model. The knobs' ranges are
chorus/omnivoice/knobs.py's, so the worker and the edge agree on what is valid."""

from __future__ import annotations

import math
from dataclasses import dataclass

from chorus.omnivoice import knobs as ov
from chorus.seeds import derive_sampling_seed
from chorus.v1 import tts_pb2
from scheduler_svc.validation import InvalidRequest, Limits, check_output, check_sizes

# SamplingParams fields OmniVoice has no use for (its sampling is the unmasking knobs).
MOSS_SAMPLING = tuple(f.name for f in tts_pb2.SamplingParams.DESCRIPTOR.fields if f.name != "seed")
NOT_FOR_OMNIVOICE = "is not used by OmniVoice"
MOSS_FRAME_SECONDS = 0.08  # Limits.max_frames counts MOSS frames


@dataclass(frozen=True)
class OmniVoiceRequest:
    """What the OmniVoice path needs of a validated request."""
    knobs: ov.UnmaskKnobs
    speed: float | None
    duration_seconds: float | None
    denoise: bool
    postprocess: bool
    seed: int                 # the derived sampling seed of piece 0
    output_format: int
    sample_rate: int          # 0: the codec's


def _knob(params: tts_pb2.OmniVoiceParams, name: str):
    """The client's value of a knob after its range check, or None when unset."""
    if not params.HasField(name):
        return None
    value = getattr(params, name)
    if not math.isfinite(value) or not ov.in_range(name, value):
        raise InvalidRequest(f"omnivoice.{name} must be in {ov.range_text(name)}, got {value}")
    return value


def check_moss_fields(req: tts_pb2.SynthesizeRequest, model: str) -> None:
    """Every MOSS-only field the client set on a request for an OmniVoice model."""
    def refuse(field: str, hint: str = "") -> None:
        raise InvalidRequest(f"{field} {NOT_FOR_OMNIVOICE} (model {model}){hint}")

    for name in MOSS_SAMPLING:
        if req.sampling.HasField(name):
            refuse(f"sampling.{name}", "; its knobs are in omnivoice.*")
    for name, hint in (("max_frames", "; its length comes from the text, speed or duration_seconds"),
                       ("min_frames", ""), ("duration_frames", "; use duration_seconds"),
                       ("auto_duration", "; it always estimates the duration")):
        if getattr(req, name):
            refuse(name, hint)
    if req.HasField("continuation"):
        refuse("continuation", "; give one voice in references instead")
    for name in ("first_chunk_frames", "chunk_frames"):
        if getattr(req.streaming, name):
            refuse(f"streaming.{name}", "; each piece's audio is sent whole")
    if len(req.references) > 1:
        raise InvalidRequest(f"references has {len(req.references)} entries; OmniVoice clones one voice "
                             "(give at most one)")


def validate_omnivoice(req: tts_pb2.SynthesizeRequest, limits: Limits, model: str) -> OmniVoiceRequest:
    check_sizes(req, limits, ov.FRAME_RATE)
    if not req.text.strip():
        raise InvalidRequest("text is empty: give the words to speak")
    check_moss_fields(req, model)
    params = req.omnivoice
    num_step = _knob(params, "num_step")
    values = {name: _knob(params, name) for name in ("guidance_scale", "t_shift", "layer_penalty_factor",
                                                      "position_temperature", "class_temperature")}
    defaults = ov.UnmaskKnobs()
    knobs = ov.UnmaskKnobs(num_step=defaults.num_step if num_step is None else num_step,
                           **{k: getattr(defaults, k) if v is None else v for k, v in values.items()})
    speed = _knob(params, "speed")
    max_seconds = limits.max_frames * MOSS_FRAME_SECONDS  # the cap MOSS requests have, in seconds
    if not (math.isfinite(req.duration_seconds) and 0 <= req.duration_seconds <= max_seconds):
        raise InvalidRequest(f"duration_seconds must be in [0, {max_seconds:g}] (0 = from the text), "
                             f"got {req.duration_seconds}")
    check_output(req)
    return OmniVoiceRequest(
        knobs=knobs, speed=speed, duration_seconds=req.duration_seconds or None,
        denoise=params.denoise if params.HasField("denoise") else True,
        postprocess=params.postprocess if params.HasField("postprocess") else True,
        seed=derive_sampling_seed(req.sampling.seed if req.sampling.HasField("seed") else None),
        output_format=req.format or tts_pb2.PCM16, sample_rate=req.sample_rate)
