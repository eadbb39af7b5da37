"""The layout of one packed step (spec section 5): every request's documents in one unpadded row.

Documents go in request order, [cond_0, uncond_0, cond_1, ...], where cond_i is the prefix (text
ids, then reference codes) followed by the target canvas, and uncond_i is the target alone, present
only when request i uses guidance. Positions restart at 0 in every document. The audio head reads
only the target rows, gathered as all cond targets (request order) then all uncond targets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class Document:
    """What one request adds to a step: prefix rows, target frames, and whether it is guided."""

    prefix: int
    target: int
    guided: bool


@dataclass(frozen=True)
class Layout:
    doc_lens: list[int]       # rows of each document, in packed order
    positions: Tensor         # int64 [rows]: position of each row inside its document
    gather: Tensor            # int64 [n]: the packed rows the audio head reads
    cond_column: list[int]    # request i's cond target block in the gathered rows: [c, c + T_i)
    uncond_column: list[int | None]  # its uncond block, None without guidance

    @property
    def rows(self) -> int:
        return sum(self.doc_lens)


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The concatenation of range(s, s + n) for each (s, n), int64."""
    total = int(lens.sum())
    if not total:
        return np.zeros(0, np.int64)
    return np.arange(total, dtype=np.int64) + np.repeat(starts - (np.cumsum(lens) - lens), lens)


def layout(requests: list[Document]) -> Layout:
    doc_lens: list[int] = []
    cond_at, uncond_at = [], []  # packed row where each request's cond / uncond target starts
    start = 0
    for r in requests:
        cond = r.prefix + r.target
        doc_lens.append(cond)
        cond_at.append(start + r.prefix)
        start += cond
        if r.guided:
            doc_lens.append(r.target)
            uncond_at.append(start)
            start += r.target
    lens = np.asarray(doc_lens, dtype=np.int64)
    positions = _ranges(np.zeros(len(lens), np.int64), lens)
    targets = np.asarray([r.target for r in requests], dtype=np.int64)
    guided = np.asarray([r.guided for r in requests], dtype=bool)
    gather = np.concatenate([_ranges(np.asarray(cond_at, np.int64), targets),
                             _ranges(np.asarray(uncond_at, np.int64), targets[guided])]) if requests else \
        np.zeros(0, np.int64)
    cond_column, uncond_column = [], []
    cond_col, uncond_col = 0, int(targets.sum())
    for r in requests:
        cond_column.append(cond_col)
        cond_col += r.target
        uncond_column.append(uncond_col if r.guided else None)
        uncond_col += r.target if r.guided else 0
    return Layout(doc_lens, torch.from_numpy(positions), torch.from_numpy(gather), cond_column, uncond_column)
