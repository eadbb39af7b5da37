"""Admission with a latency promise: how long a new request would wait, and what to do with it.

A request that arrives while every running place is taken waits until enough running requests
leave: with `ahead` requests queued before it and `free` places open, it needs
ahead + 1 - free departures. With every place taken, places free up at max_running / lifetime a
second (Little's law; lifetime: a request's measured time from its prefill to its end). Under
light load lifetimes are shorter than at a full batch, so the estimate errs towards admitting.
Then it waits for the
next step that admits (every `interval` steps) and is prefilled and decoded to its first frame
(the measured service time). Its expected time to first frame is the sum.

Three outcomes (`decide`):
- admit: the expected time to first frame is within the TTFA objective;
- queue: beyond the objective, but its expected wait is within the bound;
- refuse: it must wait for a place and its expected wait passes the bound (RESOURCE_EXHAUSTED,
  retry after the excess). A request with a place free is never refused, however slow the steps.

KV shortage is not in the estimate: with the worker's KV sized for its max batch (chorus.sizing),
the running places are what requests wait for. Until a lifetime has been measured the wait for
a place is unknown (infinite) and nothing is refused on the estimate: a cold start's burst must
not be turned away by a guess.

Pure arithmetic: the driver measures the rates (`Rates`, EWMAs) and hands them in as numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum


class Decision(str, Enum):
    ADMIT = "admit"
    QUEUE = "queue"
    REFUSE = "refuse"


@dataclass
class Rates:
    """What the driver measured (exponentially weighted): 0 = not measured yet."""
    lifetime_s: float = 0.0  # a finished request's first prefill chunk sent to its end
    step_s: float = 0.0      # seconds between journals while steps run
    service_s: float = 0.0   # first prefill chunk sent to the first frame back


@dataclass(frozen=True)
class Estimate:
    wait_s: float        # expected seconds before the request is admitted and its prefill sent
    ttfa_s: float        # wait_s plus the service time: expected seconds to its first frame
    decision: Decision
    retry_after_s: float = 0.0  # with REFUSE: when the expected wait should be back within the bound


def expected_wait(ahead: int, running: int, max_running: int, interval: int, rates: Rates) -> float:
    """Seconds a request queued behind `ahead` others waits for its prefill to be sent."""
    need = ahead + 1 - max(0, max_running - running)
    if need > 0:
        if rates.lifetime_s <= 0 or max_running <= 0:
            return math.inf
        slot = need * rates.lifetime_s / max_running
    else:
        slot = 0.0
    return slot + max(1, interval) * rates.step_s


def decide(ahead: int, running: int, max_running: int, interval: int, rates: Rates,
           objective_s: float, bound_s: float) -> Estimate:
    """The estimate and the outcome for a request arriving now. objective_s 0: no objective (every
    accepted request counts as admitted); bound_s 0: nothing is refused on the estimate."""
    wait = expected_wait(ahead, running, max_running, interval, rates)
    ttfa = wait + rates.service_s
    waits_for_place = ahead + 1 > max_running - running
    if bound_s > 0 and waits_for_place and wait > bound_s and math.isfinite(wait):
        return Estimate(wait, ttfa, Decision.REFUSE, retry_after_s=wait - bound_s + rates.step_s)
    if objective_s > 0 and ttfa > objective_s:
        return Estimate(wait, ttfa, Decision.QUEUE)
    return Estimate(wait, ttfa, Decision.ADMIT)


class Ewma:
    """An exponentially weighted mean: each sample moves it `weight` of the way (about the last
    1 / weight samples count)."""

    def __init__(self, weight: float):
        self.weight = weight
        self.value = 0.0
        self.measured = False

    def add(self, sample: float) -> float:
        if not self.measured:
            self.value, self.measured = sample, True
        else:
            self.value += self.weight * (sample - self.value)
        return self.value
