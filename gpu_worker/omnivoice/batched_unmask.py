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


def unmask_batch(logits: Tensor, items: list[Item], mask_id: int) -> list[Tensor]:
    """New canvases, one per item: `count` most confident masked cells revealed. logits: [C, n, V]
    of a packed step (engine layout: cond targets, then uncond targets), fp32 or the head's fp16 /
    bf16 (each widened to fp32 first, exactly)."""
    dev = logits.device
    c = logits.shape[0]
    lens = [it.canvas.shape[1] for it in items]
    n = sum(lens)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    guided = [i for i, it in enumerate(items) if it.uncond_column is not None]

    # Host-side tables, each copied to the device in one piece.
    rows_guided = np.concatenate([np.arange(starts[i], starts[i] + lens[i]) for i in guided]) if guided else \
        np.zeros(0, np.int64)
    uncond_rows = np.concatenate([np.arange(items[i].uncond_column, items[i].uncond_column + lens[i])
                                  for i in guided]) if guided else np.zeros(0, np.int64)
    cond_rows = np.concatenate([np.arange(it.cond_column, it.cond_column + t) for it, t in zip(items, lens)])
    tmax = max(lens)
    frame = np.concatenate([np.arange(t) for t in lens])
    owner = np.repeat(np.arange(len(items)), lens)
    # flat index of cell (codebook k, row j) in the padded [items, C, tmax] matrix
    flat = (owner[None, :] * c + np.arange(c)[:, None]) * tmax + frame[None, :]
    counts = np.array([it.count for it in items], dtype=np.int64)
    # per column: its uncond row (-1 without guidance) and guidance scale, for the kernel
    uncond_of = np.full(n, -1, np.int64)
    uncond_of[rows_guided] = uncond_rows
    ints = np.concatenate([rows_guided, uncond_rows, cond_rows, uncond_of, flat.ravel(), counts])
    scale = np.repeat([items[i].knobs.guidance_scale for i in guided], [lens[i] for i in guided])
    scale_of = np.zeros(n, np.float64)
    scale_of[rows_guided] = scale
    penalty = np.repeat([it.knobs.layer_penalty_factor for it in items], lens)
    temperature = np.repeat([it.knobs.position_temperature if it.knobs.position_temperature > 0 else 1.0
                             for it in items], lens)
    noise = np.zeros((c, n), np.float32)
    for it, s, t in zip(items, starts, lens):
        if it.knobs.position_temperature > 0:
            noise[:, s:s + t] = gumbel((c, t), it.generator).numpy()
    floats = np.concatenate([scale, penalty, temperature, scale_of]).astype(np.float32)
    ints, floats, noise = to_device_together([ints, floats, noise], dev)
    g = len(rows_guided)
    rows_guided, uncond_rows, cond_rows, uncond_of, flat, counts = ints.split([g, g, n, n, c * n, len(items)])
    scale, penalty, temperature, scale_of = floats.split([g, n, n, n])
    canvas = torch.cat([it.canvas for it in items], dim=1)

    if unmask_kernel.usable(logits):
        codes, score = unmask_kernel.scores(logits, cond_rows, uncond_of, scale_of, penalty, temperature, noise,
                                            canvas, mask_id)
    else:
        codes, score = _scores(logits.float(), items, starts, lens, guided, rows_guided, uncond_rows, cond_rows, scale,
                               penalty, temperature, noise, canvas, mask_id)

    padded = torch.full((len(items) * c * tmax,), -math.inf, dtype=score.dtype, device=dev)
    padded[flat] = score.flatten()
    top = padded.view(len(items), c * tmax).topk(max(it.count for it in items), dim=1).indices
    keep = torch.arange(top.shape[1], device=dev)[None, :] < counts[:, None]
    chosen = torch.zeros(len(items), c * tmax, dtype=torch.bool, device=dev).scatter_(1, top, keep)
    chosen = chosen.view(-1)[flat].view(c, n)
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
