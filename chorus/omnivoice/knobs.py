"""OmniVoice's generation knobs: defaults, ranges, and the wire form the worker receives."""

from __future__ import annotations

from dataclasses import dataclass, fields

from chorus.v1 import worker_pb2

NUM_CODEBOOKS = 8
SAMPLE_RATE = 24000
FRAME_RATE = 25
SAMPLES_PER_FRAME = SAMPLE_RATE // FRAME_RATE  # 960
MAX_NUM_STEP = 64


@dataclass(frozen=True)
class UnmaskKnobs:
    """How one request's canvas is unmasked (spec section 4); the reference's defaults."""

    num_step: int = 32
    guidance_scale: float = 2.0
    t_shift: float = 0.1
    layer_penalty_factor: float = 5.0
    position_temperature: float = 5.0
    class_temperature: float = 0.0

    def to_proto(self) -> worker_pb2.UnmaskKnobs:
        return worker_pb2.UnmaskKnobs(**{f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_proto(cls, m: worker_pb2.UnmaskKnobs) -> "UnmaskKnobs":
        return cls(**{f.name: getattr(m, f.name) for f in fields(cls)})


def packed_rows(prefix_rows: int, target_frames: int, guidance_scale: float) -> int:
    """Rows one request adds to a packed step: the cond document (prefix + target), plus the
    uncond document (the target alone) when guidance is on."""
    return prefix_rows + target_frames + (target_frames if guidance_scale != 0 else 0)


# name -> (low, high, low inclusive, high inclusive): the accepted range of each public knob.
RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "num_step": (1, MAX_NUM_STEP, True, True),
    "guidance_scale": (0.0, 10.0, True, True),
    "t_shift": (0.0, 1.0, False, True),
    "layer_penalty_factor": (0.0, 100.0, True, True),
    "position_temperature": (0.0, 100.0, True, True),
    "class_temperature": (0.0, 100.0, True, True),
    "speed": (0.25, 4.0, True, True),
}


def range_text(name: str) -> str:
    low, high, low_in, high_in = RANGES[name]
    return f"{'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"


def in_range(name: str, value: float) -> bool:
    low, high, low_in, high_in = RANGES[name]
    return (low <= value if low_in else low < value) and (value <= high if high_in else value < high)
