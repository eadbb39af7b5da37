"""The scoring half of batched_unmask.unmask_batch as one Triton launch: for every cell (codebook
k, canvas column j) of a packed step, its predicted code and its reveal score.

Per cell, from its cond logits row (and, with guidance, its uncond row): the log-softmax of each,
the guidance extrapolation a + g(a - b) and its log-softmax, MASK excluded, the code with the
highest log-probability (the first on ties, as torch.argmax) and that log-probability, minus
k x the layer penalty, over the position temperature, plus the cell's Gumbel noise; -inf where
the cell is already revealed.

Why: torch does this in ~20 launches that each read or write the step's [C, n, 1025] fp32
logits, and the host spends most of a one-canvas step issuing them; one program per cell reads
its row(s) once. The reductions run in the program's fixed order, not torch's, so a
log-probability may move by an ulp against the torch path (batched_unmask.py's, the reference):
the same cells win except at near-ties. Every cell's result depends on its own rows only, so a
canvas scores the same alone or packed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from chorus.triton_support import HAVE_TRITON, INTERPRET, div, exp, launch_opts, log, tl, triton
from gpu_worker.omnivoice import model

if HAVE_TRITON:

    @triton.jit
    def _log_softmax(x, valid, CUDA: tl.constexpr):
        """torch's order: (x - max) - log(sum(exp(x - max))); lanes outside the row stay -inf."""
        xm = x - tl.max(x, axis=0)
        total = tl.sum(tl.where(valid, exp(xm, CUDA), 0.0), axis=0)
        return tl.where(valid, xm - log(total, CUDA), -float("inf"))

    @triton.jit
    def _scores_kernel(logits_ptr, stride_c, stride_r, cond_ptr, uncond_ptr, scale_ptr, penalty_ptr, temp_ptr,
                       noise_ptr, canvas_ptr, codes_ptr, score_ptr, n, V, mask_id,
                       BLOCK_V: tl.constexpr, CUDA: tl.constexpr):
        cell = tl.program_id(0)  # k * n + j
        k = cell // n
        j = cell % n
        offs = tl.arange(0, BLOCK_V)
        valid = offs < V
        rows = logits_ptr + k.to(tl.int64) * stride_c + offs
        cond = tl.load(cond_ptr + j).to(tl.int64)
        # fp16 / bf16 logits widen exactly, as torch's .float()
        lp = _log_softmax(tl.load(rows + cond * stride_r, mask=valid, other=-float("inf")).to(tl.float32),
                          valid, CUDA)
        uncond = tl.load(uncond_ptr + j).to(tl.int64)
        if uncond >= 0:
            b = _log_softmax(tl.load(rows + uncond * stride_r, mask=valid, other=-float("inf")).to(tl.float32),
                             valid, CUDA)
            scale = tl.load(scale_ptr + j)
            gap = tl.where(valid, lp - b, 0.0)  # -inf - -inf outside the row
            lp = _log_softmax(tl.where(valid, lp + scale * gap, -float("inf")), valid, CUDA)
        lp = tl.where(offs == mask_id, -float("inf"), lp)
        best = tl.max(lp, axis=0)
        code = tl.argmax(lp, axis=0, tie_break_left=True)
        score = best - k.to(tl.float32) * tl.load(penalty_ptr + j)
        score = div(score, tl.load(temp_ptr + j)) + tl.load(noise_ptr + cell)
        score = tl.where(tl.load(canvas_ptr + cell) != mask_id, -float("inf"), score)
        tl.store(codes_ptr + cell, code.to(tl.int64))
        tl.store(score_ptr + cell, score)


def usable(logits: Tensor) -> bool:
    """Whether the worker scores with the kernel: CUDA with compiled triton, fp32 / fp16 / bf16 logits
    whose rows are contiguous along the vocabulary, and model.KERNELS "auto" ("torch" keeps the
    reference)."""
    return (model.KERNELS == "auto" and HAVE_TRITON and not INTERPRET and logits.is_cuda
            and logits.dtype in (torch.float32, torch.float16, torch.bfloat16) and logits.stride(2) == 1)


def scores(logits: Tensor, cond_rows: Tensor, uncond_rows: Tensor, scale: Tensor, penalty: Tensor,
           temperature: Tensor, noise: Tensor, canvas: Tensor, mask_id: int,
           num_warps: int = 4) -> tuple[Tensor, Tensor]:
    """codes int64 [C, n] and scores fp32 [C, n] of every cell. logits [C, rows, V] in fp32, fp16
    or bf16 (widened to fp32 on load);
    cond_rows, uncond_rows int64 [n] (uncond -1: no guidance for that column); scale, penalty,
    temperature fp32 [n]; noise fp32 [C, n]; canvas int64 [C, n] (MASK where not yet revealed).
    Runs under the interpreter too (CPU tensors, TRITON_INTERPRET=1) for the tests. num_warps: a
    program's warps (omnivoice_gpu_check times the choices)."""
    c, _, v = logits.shape
    n = cond_rows.shape[0]
    codes = torch.empty((c, n), dtype=torch.int64, device=logits.device)
    score = torch.empty((c, n), dtype=torch.float32, device=logits.device)
    if n:
        _scores_kernel[(c * n,)](logits, logits.stride(0), logits.stride(1), cond_rows, uncond_rows, scale, penalty,
                                 temperature, noise.contiguous(), canvas.contiguous(), codes, score, n, v, mask_id,
                                 BLOCK_V=triton.next_power_of_2(v), CUDA=logits.is_cuda, **launch_opts(num_warps))
    return codes, score
