"""One unmasking step of many canvases at once: unmask.unmask_step's math over a packed step's
gathered logits, in ~25 launches instead of ~25 per canvas (at 32 canvases a per-canvas loop
would be most of a graphed step's host time).

Same operations in the same order as the per-canvas reference, each over all rows at once: the
log-softmaxes and guidance extrapolation row by row (guided canvases' rows together), the code
and score of each cell, the per-canvas codebook penalty, position temperature and Gumbel noise
(each canvas's noise from its own generator, drawn with its own shape on the CPU, then copied with
the step's tables in one piece), the revealed cells masked out. The per-canvas top-`count` runs
over a [canvases, cells] matrix padded with -inf, each canvas's cells in the reference's order
(codebook-major); ties aside (which Gumbel noise makes vanishing), it picks the reference's cells.

On CUDA with compiled triton, the per-cell scoring (everything before the top-`count`) is one
launch (unmask_kernel.py), and the torch ops here (`_scores`) are its reference.

Canvases with a class temperature draw class noise before position noise: they keep the
reference path (engine.py), so this module never draws class noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from chorus.omnivoice.knobs import UnmaskKnobs
from gpu_worker.omnivoice import unmask_kernel
from gpu_worker.omnivoice.staging import to_device_together
from gpu_worker.omnivoice.unmask import gumbel


@dataclass
class Item:
    canvas: Tensor               # int64 [C, T]: codes or MASK
    cond_column: int             # its cond rows in the gathered logits: [col, col + T)
    uncond_column: int | None    # its uncond rows, None without guidance
    knobs: UnmaskKnobs           # class_temperature must be 0
    count: int                   # cells to reveal (> 0)
    generator: torch.Generator | None  # position noise, when position_temperature > 0


@dataclass
class Tables:
    """What a set of items fixes for every step they take together, on the device: their rows in
    the gathered logits, knobs per column, and each cell's place in the padded top-k matrix. Only
    the counts and the noise change from one step to the next."""

    c: int                    # codebooks
    lens: list[int]           # frames of each item
    starts: np.ndarray        # each item's first column
    guided: list[int]         # the items with guidance
    noisy: list[bool]         # the items with position noise
    rows_guided: Tensor
    uncond_rows: Tensor
    cond_rows: Tensor
    uncond_of: Tensor         # per column: its uncond row, -1 without guidance
    flat: Tensor              # flat index of cell (codebook k, column j) in the padded [items, C, tmax] matrix
    scale: Tensor
    penalty: Tensor
    temperature: Tensor
    scale_of: Tensor          # per column: its guidance scale, 0 without

    @property
    def tmax(self) -> int:
        return max(self.lens)

    @classmethod
    def of(cls, items: list[Item], c: int, dev: torch.device) -> Tables:
        lens = [it.canvas.shape[1] for it in items]
        n = sum(lens)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        guided = [i for i, it in enumerate(items) if it.uncond_column is not None]
        rows_guided = np.concatenate([np.arange(starts[i], starts[i] + lens[i]) for i in guided]) if guided else \
            np.zeros(0, np.int64)
        uncond_rows = np.concatenate([np.arange(items[i].uncond_column, items[i].uncond_column + lens[i])
                                      for i in guided]) if guided else np.zeros(0, np.int64)
        cond_rows = np.concatenate([np.arange(it.cond_column, it.cond_column + t) for it, t in zip(items, lens)])
        tmax = max(lens)
        frame = np.concatenate([np.arange(t) for t in lens])
        owner = np.repeat(np.arange(len(items)), lens)
        flat = (owner[None, :] * c + np.arange(c)[:, None]) * tmax + frame[None, :]
        uncond_of = np.full(n, -1, np.int64)
        uncond_of[rows_guided] = uncond_rows
        ints = np.concatenate([rows_guided, uncond_rows, cond_rows, uncond_of, flat.ravel()])
        scale = np.repeat([items[i].knobs.guidance_scale for i in guided], [lens[i] for i in guided])
        scale_of = np.zeros(n, np.float64)
        scale_of[rows_guided] = scale
        penalty = np.repeat([it.knobs.layer_penalty_factor for it in items], lens)
        temperature = np.repeat([it.knobs.position_temperature if it.knobs.position_temperature > 0 else 1.0
                                 for it in items], lens)
        floats = np.concatenate([scale, penalty, temperature, scale_of]).astype(np.float32)
        ints, floats = to_device_together([ints, floats], dev)
        g = len(rows_guided)
        rows_guided, uncond_rows, cond_rows, uncond_of, flat = ints.split([g, g, n, n, c * n])
        scale, penalty, temperature, scale_of = floats.split([g, n, n, n])
        return cls(c, lens, starts, guided, [it.knobs.position_temperature > 0 for it in items], rows_guided,
                   uncond_rows, cond_rows, uncond_of, flat, scale, penalty, temperature, scale_of)


def unmask_batch(logits: Tensor, items: list[Item], mask_id: int, tables: Tables | None = None) -> list[Tensor]:
    """New canvases, one per item: `count` most confident masked cells revealed. logits: [C, n, V]
    of a packed step (engine layout: cond targets, then uncond targets), fp32 or the head's fp16 /
    bf16 (each widened to fp32 first, exactly). tables: Tables.of(items) from an earlier step of the
    same items (their canvases, counts and generators aside), else built here."""
    dev = logits.device
    c = logits.shape[0]
    t = tables if tables is not None else Tables.of(items, c, dev)
    lens, n, tmax = t.lens, sum(t.lens), t.tmax
    # The per-step part, copied to the device in one piece.
    noise = np.zeros((c, n), np.float32)
    for it, noisy, s, length in zip(items, t.noisy, t.starts, lens):
        if noisy:
            noise[:, s:s + length] = gumbel((c, length), it.generator).numpy()
    counts, noise = to_device_together([np.array([it.count for it in items], dtype=np.int64), noise], dev)
    canvas = torch.cat([it.canvas for it in items], dim=1)

    if unmask_kernel.usable(logits):
        codes, score = unmask_kernel.scores(logits, t.cond_rows, t.uncond_of, t.scale_of, t.penalty, t.temperature,
                                            noise, canvas, mask_id)
    else:
        codes, score = _scores(logits.float(), items, t.starts, lens, t.guided, t.rows_guided, t.uncond_rows,
                               t.cond_rows, t.scale, t.penalty, t.temperature, noise, canvas, mask_id)

    padded = torch.full((len(items) * c * tmax,), -math.inf, dtype=score.dtype, device=dev)
    padded[t.flat] = score.flatten()
    top = padded.view(len(items), c * tmax).topk(max(it.count for it in items), dim=1).indices
    keep = torch.arange(top.shape[1], device=dev)[None, :] < counts[:, None]
    chosen = torch.zeros(len(items), c * tmax, dtype=torch.bool, device=dev).scatter_(1, top, keep)
    chosen = chosen.view(-1)[t.flat].view(c, n)
    revealed = torch.where(chosen, codes, canvas)
    return list(revealed.split(lens, dim=1))


def _scores(logits, items, starts, lens, guided, rows_guided, uncond_rows, cond_rows, scale, penalty, temperature,
            noise, canvas, mask_id) -> tuple[Tensor, Tensor]:
    """unmask_kernel.scores' result with torch ops: the reference (CPU, and CUDA without triton)."""
    c, n, g = logits.shape[0], len(cond_rows), len(rows_guided)
    # The engine's layout puts the cond rows first and the uncond rows after them, each in item
    # order: slices then, no gathered copies of [C, rows, V] (the step's largest tensors).
    contiguous = all(it.cond_column == s for it, s in zip(items, starts)) and \
        all(items[i].uncond_column == n + sum(lens[j] for j in guided[:m]) for m, i in enumerate(guided))
    lp = torch.log_softmax(logits[:, :n] if contiguous else logits[:, cond_rows], dim=-1)
    if g:
        a = lp if g == n else lp[:, rows_guided]
        b = torch.log_softmax(logits[:, n:n + g] if contiguous else logits[:, uncond_rows], dim=-1)
        extrapolated = torch.log_softmax(a + scale[None, :, None] * (a - b), dim=-1)
        if g == n:
            lp = extrapolated
        else:
            lp[:, rows_guided] = extrapolated
    lp[..., mask_id] = -math.inf
    codes = lp.argmax(dim=-1)
    score = lp.max(dim=-1).values
    codebook = torch.arange(c, device=logits.device).view(-1, 1)
    score = score - codebook * penalty[None, :]
    score = score / temperature[None, :] + noise
    return codes, score.masked_fill(canvas != mask_id, -math.inf)
