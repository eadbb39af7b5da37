"""Which engine (scheduler core + its worker) serves a request: pure policy, no I/O.

Requests that share a prompt prefix (a voice, a reference clip) should land on the
engine whose radix cache already holds that prefix's KV. Rendezvous hashing
(highest random weight) ranks the engines per key: every frontend computes the
same ranking without talking to the others, and when an engine joins or leaves
only the keys whose top engine it is (about 1/n of them) move.

Affinity must not pile a hot voice onto one engine while others idle: the top
ranked engine is taken only while its load is within a bound over the mean
(consistent hashing with bounded loads); otherwise the next ranked one. The
least loaded engine is always within the bound, so a live engine is always found.
"""

from __future__ import annotations

import hashlib
from typing import Mapping


def score(key: bytes, engine: str) -> int:
    """The engine's weight for key: a 64-bit hash of both (stable across processes and runs)."""
    return int.from_bytes(hashlib.blake2b(key + b"\0" + engine.encode(), digest_size=8).digest(), "big")


def rank(key: bytes, engines) -> list[str]:
    """The engines, most preferred for key first."""
    return sorted(engines, key=lambda e: (score(key, e), e), reverse=True)


def load_bound(loads: Mapping[str, float], slack: float, margin: float) -> float:
    """The most load an engine may carry and still take a request for its keys."""
    return (1.0 + slack) * sum(loads.values()) / len(loads) + margin


def pick(key: bytes | None, loads: Mapping[str, float], slack: float = 0.25, margin: float = 2.0) -> str | None:
    """The engine for a request with affinity key (None: no affinity, the least loaded one).

    loads: the live engines only, each with its load (requests in flight plus queued); None when
    no engine is live. slack, margin: an engine takes its keys while its load <= (1 + slack) *
    mean load + margin."""
    if not loads:
        return None
    if key is None:
        return min(loads, key=lambda e: (loads[e], e))
    bound = load_bound(loads, slack, margin)
    for engine in rank(key, loads):
        if loads[engine] <= bound:
            return engine
    return min(loads, key=lambda e: (loads[e], e))  # unreachable with slack, margin >= 0: the minimum is <= mean
