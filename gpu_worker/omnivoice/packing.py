"""The layout of one packed step (spec section 5): every request's documents in one unpadded row.

Documents go in request order, [cond_0, uncond_0, cond_1, ...], where cond_i is the prefix (text
ids, then reference codes) followed by the target canvas, and uncond_i is the target alone, present
only when request i uses guidance. Positions restart at 0 in every document. The audio head reads
only the target rows, gathered as all cond targets (request order) then all uncond targets.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def layout(requests: list[Document]) -> Layout:
    doc_lens: list[int] = []
    cond_rows: list[Tensor] = []
    uncond_rows: list[Tensor] = []
    start = 0
    for r in requests:
        cond = r.prefix + r.target
        doc_lens.append(cond)
        cond_rows.append(torch.arange(start + r.prefix, start + cond))
        start += cond
        if r.guided:
            doc_lens.append(r.target)
            uncond_rows.append(torch.arange(start, start + r.target))
            start += r.target
    positions = torch.cat([torch.arange(n) for n in doc_lens]) if doc_lens else torch.zeros(0, dtype=torch.int64)
    gather = torch.cat(cond_rows + uncond_rows) if requests else torch.zeros(0, dtype=torch.int64)
    cond_column, uncond_column = [], []
    cond_at, uncond_at = 0, sum(r.target for r in requests)
    for r in requests:
        cond_column.append(cond_at)
        cond_at += r.target
        uncond_column.append(uncond_at if r.guided else None)
        uncond_at += r.target if r.guided else 0
    return Layout(doc_lens, positions, gather, cond_column, uncond_column)
