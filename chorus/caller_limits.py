"""Per-caller limits: one API key owner cannot take the whole service.

Each owner (an API key's owner; "" for every caller when keys are off) has a cap on the calls it
has open at once (Synthesize calls and SynthesizeStream sessions, any model) and a token bucket
on the calls it starts: `per_minute` tokens a minute, holding at most `burst`. A call admitted
holds one place until `release`; a refused call holds nothing and consumes no token.

A frontend process keeps its own counts, so a deployment's effective limit is the configured one
times the number of frontend processes serving the port. Pure policy: the caller passes the time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CAP_KEY = "max_calls_per_owner"
RATE_KEY = "calls_per_minute_per_owner"
CAP_RETRY_S = 1.0  # when a place frees is unknown: a call's length, not a rate


@dataclass(frozen=True)
class Limit:
    """An owner's limits; 0 turns each off."""
    max_calls: int = 0
    per_minute: float = 0.0
    burst: int = 1

    @property
    def off(self) -> bool:
        return not self.max_calls and not self.per_minute


@dataclass(frozen=True)
class Refusal:
    limit: str          # the config key whose limit refused the call
    retry_after: float  # seconds until a retry can succeed (the cap's: a guess, CAP_RETRY_S)
    message: str


@dataclass
class _Owner:
    calls: int = 0
    tokens: float = 0.0
    stamp: float = field(default=float("-inf"))  # when tokens was last brought up to date


class CallerLimits:
    """The open calls and token buckets of every owner under one Limit."""

    def __init__(self, limit: Limit):
        self.limit = limit
        self._owners: dict[str, _Owner] = {}

    def admit(self, owner: str, now: float) -> Refusal | None:
        """None, and the call holds a place until release(owner); else why not and when to retry."""
        lim = self.limit
        if lim.off:
            return None
        state = self._owners.setdefault(owner, _Owner())
        if lim.max_calls and state.calls >= lim.max_calls:
            return Refusal(CAP_KEY, CAP_RETRY_S,
                           f"this caller has {state.calls} calls open, the limit ({CAP_KEY} = {lim.max_calls}); "
                           f"retry when one ends")
        if lim.per_minute:
            rate = lim.per_minute / 60.0
            capacity = max(1, lim.burst)
            state.tokens = min(capacity, state.tokens + (now - state.stamp) * rate)
            state.stamp = now
            if state.tokens < 1.0:
                wait = (1.0 - state.tokens) / rate
                return Refusal(RATE_KEY, wait,
                               f"this caller started calls faster than the limit ({RATE_KEY} = {lim.per_minute:g}, "
                               f"bursts of {capacity}); retry in {wait:.1f} s")
            state.tokens -= 1.0
        state.calls += 1
        return None

    def release(self, owner: str) -> None:
        """An admitted call of owner ended (however it ended)."""
        state = self._owners.get(owner)
        if state is None or state.calls == 0:
            return
        state.calls -= 1
        if state.calls == 0 and not self.limit.per_minute:  # nothing to remember: owners come and go with keys
            del self._owners[owner]

    def open_calls(self, owner: str) -> int:
        state = self._owners.get(owner)
        return state.calls if state else 0

    def total_open(self) -> int:
        return sum(s.calls for s in self._owners.values())
