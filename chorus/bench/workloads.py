"""chorus bench's workloads (MOSS: W1 short, W2 clone, W3 long; OmniVoice: O1 short, O2 clone,
O3 mixed knobs) and their request texts."""

from __future__ import annotations

import random
from dataclasses import dataclass

VOICE_FRAMES = 63  # 5 s at 12.5 frames/s


@dataclass(frozen=True)
class Workload:
    name: str
    frames: int
    words: int
    clone: bool
    description: str
    omnivoice: bool = False   # requests go to the served OmniVoice model, its length in seconds
    seconds: float = 0.0      # OmniVoice: duration_seconds of each request
    # OmniVoice: (num_step, guidance_scale) pairs, one drawn per request
    knobs: tuple[tuple[int, float], ...] = ((32, 2.0),)


WORKLOADS = {
    "W1": Workload("W1", 75, 25, False, "short: ~25 words, 75 frames (6 s), no reference"),
    "W2": Workload("W2", 75, 25, True, "clone: ~25 words, 75 frames, one of --voices 63-frame references"),
    "W3": Workload("W3", 375, 75, False, "long: ~75 words, 375 frames (30 s), no reference"),
    "O1": Workload("O1", 150, 25, False, "OmniVoice short: ~25 words, 6 s, 32 steps, guidance 2", True, 6.0),
    "O2": Workload("O2", 150, 25, True, "OmniVoice clone: as O1, cloning one of --voices stored voices", True, 6.0),
    "O3": Workload("O3", 150, 25, False, "OmniVoice mixed: as O1, num_step 16/32/64 and guidance 0/2 drawn "
                   "per request", True, 6.0, tuple((n, g) for n in (16, 32, 64) for g in (0.0, 2.0))),
}
OMNIVOICE_FRAME_RATE = 25  # OmniVoice frames per second (chorus.omnivoice.knobs.FRAME_RATE)

# Clauses that are joined into texts. Each request draws its own, so prompts
# differ after the shared header and the radix cache only reuses what a real
# deployment would share (the header, and W2's voice reference).
_CLAUSES = (
    "the morning train left the station early", "a quiet wind moved across the valley",
    "she opened the letter with careful hands", "our team finished the report on time",
    "the old bridge was painted bright blue", "children laughed in the park after school",
    "he ordered coffee and a slice of cake", "the museum opens again next Tuesday",
    "rain fell softly on the tin roof", "the market was busy with summer fruit",
    "please remember to close the kitchen window", "the river rose after three days of storms",
    "a small boat drifted toward the harbor", "the library keeps its rare maps downstairs",
    "we walked home under a sky full of stars", "the new software update fixed the bug",
    "my neighbor grows tomatoes on her balcony", "the concert ended with a long standing ovation",
    "snow covered the mountain road by noon", "the bakery sells fresh bread every morning",
    "the pilot announced a short delay", "our guide told stories about the castle",
    "the cat slept in a patch of sunlight", "traffic moved slowly through the city center",
    "the students prepared for their final exams", "a bright comet appeared in the northern sky",
    "the chef tasted the soup and added salt", "the meeting has been moved to Friday afternoon",
    "old photographs filled the wooden drawer", "the garden smelled of roses and cut grass",
    "the engineers tested the engine twice", "a friendly dog followed us to the beach",
)


def make_text(rng: random.Random, words: int) -> str:
    """About `words` words of plain English: sentences of one or two clauses."""
    sentences, count = [], 0
    while count < words:
        parts = [rng.choice(_CLAUSES)]
        if words - count > 10 and rng.random() < 0.6:
            parts.append(rng.choice(("and", "while", "because", "but")) + " " + rng.choice(_CLAUSES))
        s = " ".join(parts)
        count += len(s.split())
        sentences.append(s[0].upper() + s[1:] + ".")
    return " ".join(sentences)
