"""The public seed -> sampling seed hash (spec moss_tts_local.md §4.3), shared by the frontends that
validate requests and the worker that samples."""

from __future__ import annotations

import hashlib
import os


def derive_sampling_seed(public_seed: int | None) -> int:
    """§4.3: LE_uint64(blake2b("moss-tts:<decimal>", digest 8)) & 0x7FFFFFFF;
    None -> 4 random bytes (LE) & 0x7FFFFFFF."""
    if public_seed is None:
        return int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    if isinstance(public_seed, bool) or not isinstance(public_seed, int):
        raise ValueError(f"seed must be a non-negative integer, got {public_seed!r}")
    if public_seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {public_seed}")
    digest = hashlib.blake2b(f"moss-tts:{public_seed}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF
