"""One unmasking step of one canvas (spec section 4): how many cells a step reveals, which cells,
and with which codes. Numerics follow the reference operation for operation, so a canvas equals
the package's token for token given the same logits and the same noise.

Randomness: the Gumbel noise of a request's step k comes from its own generator, seeded with
`noise_seed(seed, k)`, and is drawn with that request's own shapes (class noise first, then
position noise), so its tokens never depend on which requests share the step or in which order
steps arrive.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

from chorus.omnivoice.knobs import UnmaskKnobs

CLASS_TOP_FRACTION = 0.1  # class sampling keeps the ceil(0.1 * audio_vocab_size) likeliest codes (103)
_SEED_MULTIPLIER = 1_000_003
_SEED_MASK = (1 << 63) - 1


@lru_cache(maxsize=256)
def time_steps(num_step: int, t_shift: float) -> tuple[float, ...]:
    """The shifted schedule s_0..s_N: computed in float32 on the CPU, as the reference does, because
    the reveal counts take ceil() of their differences and float64 lands on other integers."""
    t = torch.linspace(0.0, 1.0, num_step + 1)
    return tuple((t_shift * t / (1 + (t_shift - 1) * t)).tolist())


@lru_cache(maxsize=1024)
def reveal_counts(target_frames: int, num_step: int, t_shift: float, num_codebooks: int = 8) -> tuple[int, ...]:
    """Cells revealed at each step; they sum to target_frames * num_codebooks (the last step takes
    whatever is left). A count may be 0 for a tiny canvas: that step reveals nothing."""
    s = time_steps(num_step, t_shift)
    total = left = target_frames * num_codebooks
    counts = []
    for k in range(num_step):
        n = left if k == num_step - 1 else min(math.ceil(total * (s[k + 1] - s[k])), left)
        counts.append(n)
        left -= n
    return tuple(counts)


def noise_seed(seed: int, step: int) -> int:
    """The generator seed of one request's step: seed * 1_000_003 + step, kept to 63 bits (steps are
    < 64, so one request's steps never share a seed)."""
    return (seed * _SEED_MULTIPLIER + step) & _SEED_MASK


def gumbel(shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    """Standard Gumbel noise in float32 on the CPU, from uniforms u in [0, 1) with the reference's
    1e-10 guards: -log(-log(u + 1e-10) + 1e-10)."""
    u = torch.rand(shape, generator=generator, dtype=torch.float32)
    return -torch.log(-torch.log(u + 1e-10) + 1e-10)


def guided_log_probs(cond: Tensor, uncond: Tensor | None, guidance_scale: float, mask_id: int) -> Tensor:
    """Log-probabilities [C, T, V] of each cell's code. With guidance, the cond and uncond
    log-softmaxes are extrapolated, a + g(a - b), and renormalised. MASK is never a prediction."""
    if uncond is not None and guidance_scale != 0:
        a = torch.log_softmax(cond, dim=-1)
        b = torch.log_softmax(uncond, dim=-1)
        lp = torch.log_softmax(a + guidance_scale * (a - b), dim=-1)
    else:
        lp = torch.log_softmax(cond, dim=-1)
    lp[..., mask_id] = -math.inf
    return lp


def predict(lp: Tensor, class_temperature: float, generator: torch.Generator | None) -> Tensor:
    """The code each cell would take [C, T]: the likeliest, or with a class temperature a Gumbel-max
    draw among the top 10% of codes."""
    if class_temperature <= 0:
        return lp.argmax(dim=-1)
    keep = math.ceil(CLASS_TOP_FRACTION * lp.shape[-1])
    top, where = lp.topk(keep, dim=-1)
    kept = torch.full_like(lp, -math.inf).scatter_(-1, where, top)
    noise = gumbel(tuple(lp.shape), generator).to(lp.device)
    return (kept / class_temperature + noise).argmax(dim=-1)


def unmask_step(canvas: Tensor, cond: Tensor, uncond: Tensor | None, knobs: UnmaskKnobs, count: int,
                mask_id: int, generator: torch.Generator | None = None) -> Tensor:
    """One step of one canvas. canvas: int64 [C, T] codes or mask_id; cond/uncond: fp32 logits
    [C, T, V] at the target rows (uncond None without guidance). Returns a new canvas with the
    `count` most confident masked cells revealed (revealed cells never change again).

    A cell's confidence is the max log-probability over codes (not the drawn code's), lowered by
    layer_penalty_factor per codebook index so earlier codebooks reveal first; with a position
    temperature it is divided by it and Gumbel noise is added. `generator` feeds both noises."""
    if count <= 0:
        return canvas
    lp = guided_log_probs(cond, uncond, knobs.guidance_scale, mask_id)
    codes = predict(lp, knobs.class_temperature, generator)
    score = lp.max(dim=-1).values
    codebook = torch.arange(canvas.shape[0], device=canvas.device).view(-1, 1)
    score = score - codebook * knobs.layer_penalty_factor
    if knobs.position_temperature > 0:
        score = score / knobs.position_temperature + gumbel(tuple(score.shape), generator).to(score.device)
    score = score.masked_fill(canvas != mask_id, -math.inf)
    chosen = score.flatten().topk(count).indices  # flat index = codebook * T + frame
    revealed = canvas.flatten().clone()
    revealed[chosen] = codes.flatten()[chosen]
    return revealed.view_as(canvas)


def step_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(noise_seed(seed, step))
