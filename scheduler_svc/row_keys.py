"""Radix-cache keys for prompt and generated rows (spec moss_tts_local.md §4.4).

* prompt rows:    LE_uint64(blake2b(row as little-endian int64, digest 8)) & (2^63 - 1)
* generated rows: polynomial hash mod 2^31-1 with base 1000000007, reduced
                  mod 151643 (below the special-token band); a stop row
                  (text id 151670) keys as 151670.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

__all__ = [
    "prompt_row_key",
    "generated_row_key",
    "prompt_row_keys",
    "generated_row_keys",
    "POLY_MOD",
    "POLY_BASE",
    "GENERATED_KEY_MOD",
    "STOP_ROW_KEY",
]

POLY_MOD = 2**31 - 1
POLY_BASE = 1000000007
GENERATED_KEY_MOD = 151643
STOP_ROW_KEY = 151670  # audio_end / eos id
_MASK63 = 2**63 - 1


def _digest_key(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & _MASK63


def prompt_row_key(row: Sequence[int] | np.ndarray) -> int:
    """Key of one prompt row (13 values: text id, n_vq codes)."""
    return _digest_key(np.asarray(row, dtype="<i8").tobytes())


def generated_row_key(row: Sequence[int] | np.ndarray, stop_id: int = STOP_ROW_KEY) -> int:
    """Key of one generated row [text, c0..c11]; a row whose text is stop_id keys as stop_id."""
    vals = [int(v) for v in row]
    if vals[0] == stop_id:
        return stop_id
    acc = 0
    for v in vals:
        acc = (acc * POLY_BASE + v % POLY_MOD) % POLY_MOD
    return acc % GENERATED_KEY_MOD


def prompt_row_keys(rows: np.ndarray) -> np.ndarray:
    """prompt_row_key over each row of [T, W]; int64 [T] (keys are < 2^63)."""
    data = np.ascontiguousarray(np.asarray(rows), dtype="<i8")
    if data.ndim != 2:
        raise ValueError(f"rows must be 2-D [T, W], got shape {data.shape}")
    width = data.shape[1] * 8
    buf = data.tobytes()
    return np.array([_digest_key(buf[i:i + width]) for i in range(0, len(buf), width)], dtype=np.int64)


def generated_row_keys(rows: np.ndarray, stop_id: int = STOP_ROW_KEY) -> np.ndarray:
    """generated_row_key over each row of [T, W], vectorised; int64 [T]."""
    data = np.asarray(rows, dtype=np.int64)
    if data.ndim != 2:
        raise ValueError(f"rows must be 2-D [T, W], got shape {data.shape}")
    acc = np.zeros(data.shape[0], dtype=np.int64)
    for col in range(data.shape[1]):  # acc < 2^31, so acc * B + v < 2^62: no overflow
        acc = (acc * POLY_BASE + np.mod(data[:, col], POLY_MOD)) % POLY_MOD
    keys = acc % GENERATED_KEY_MOD
    return np.where(data[:, 0] == stop_id, stop_id, keys) if data.shape[0] else keys
