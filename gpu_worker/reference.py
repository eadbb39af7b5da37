"""Plain single-request reference generator: the oracle for serving-path tests.

It runs the upstream loop of spec moss_tts_local.md §3.5 for one request,
with the model's own modules (``embed_rows``, the backbone layers,
``decode_frame``) but none of the serving machinery: no paging, no slot
tables, no decode-state pool, no batching. The backbone's KV cache is one
contiguous tensor per layer that grows by one row per generated frame::

    H = backbone(embed_rows(prompt_rows))[last]            # positions 0..T-1
    for n in 0 .. max_frames-1:
        codes, stop = decode_frame(H, sampling at generation step n)
        if stop: break                                     # no frame is emitted
        emit row = [assistant_slot, c0..c11]
        H = backbone(embed_rows([row]))[0]                 # position T+n

The sampler positions are 13n + channel; the repetition-penalty history holds
only generated codes (never the prompt's).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from gpu_worker.attention import AttentionBatch
from gpu_worker.model import FrameSampling, MossTTSLocal

__all__ = ["ContiguousKVAttention", "generate_reference", "single_sampling"]


class ContiguousKVAttention:
    """An AttentionBackend for one sequence over a contiguous cache [capacity, n_kv, d]
    per layer (row i = position i). New tokens must continue the sequence (positions
    L, L+1, ...); the model stores them at write_slots = positions."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, capacity: int = 2048):
        self.k = torch.zeros(num_layers, capacity, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.length = 0
        self.scale = head_dim ** -0.5
        self.positions_seen: list[list[int]] = []  # per forward: the positions of its tokens (layer 0)

    def __len__(self) -> int:
        return self.length

    def begin(self, batch: AttentionBatch) -> None:
        """Nothing to plan: one sequence, contiguous."""

    def kv_cache(self, layer: int) -> tuple[Tensor, Tensor]:
        return self.k[layer], self.v[layer]

    def attend(self, layer: int, q: Tensor, batch: AttentionBatch) -> Tensor:
        pos = batch.positions
        if layer == 0:  # the first layer of a forward extends the sequence
            start = self.length
            if not torch.equal(pos.cpu(), torch.arange(start, start + q.shape[0])):
                raise ValueError(f"positions {pos.tolist()} do not continue a cache of {start}")
            self.positions_seen.append(pos.tolist())
            self.length = start + q.shape[0]
        keys, values = self.k[layer, :self.length], self.v[layer, :self.length]
        group = q.shape[1] // keys.shape[1]  # GQA: query head h reads kv head h // group
        keys = keys.repeat_interleave(group, dim=1)      # [L, H, d]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,lhd->hql", q, keys) * self.scale
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        causal = torch.arange(keys.shape[0], device=q.device)[None, :] <= pos[:, None]  # [Q, L]
        scores = scores.masked_fill(~causal[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.einsum("hql,lhd->qhd", probs, values)


def _plain_batch(positions: Tensor) -> AttentionBatch:
    """An AttentionBatch carrying only positions (the contiguous backend reads nothing else)."""
    n = positions.numel()
    csr = torch.tensor([0, n], dtype=torch.int32)
    return AttentionBatch(positions=positions, write_slots=positions, qo_indptr=csr, kv_indptr=csr,
                          kv_indices=torch.arange(n, dtype=torch.int32))


_FIELDS = ("text_temperature", "text_top_k", "text_top_p", "audio_temperature", "audio_top_k", "audio_top_p")


def single_sampling(sampling: Any, device: torch.device) -> FrameSampling:
    """One-row FrameSampling from a worker_pb2.SamplingConfig, a FrameSampling
    (one row), a mapping or any object with SamplingConfig's field names
    (audio_repetition_penalty or audio_penalty; 0/absent penalty means 1).
    Parameters are held as the decode-state pool holds them (float32 / int64)."""
    if isinstance(sampling, FrameSampling):
        if sampling.seed.numel() != 1:
            raise ValueError("generate_reference takes one request: a FrameSampling with one row")
        return FrameSampling(**{f: getattr(sampling, f).reshape(1).to(device) for f in (
            *_FIELDS, "audio_penalty", "seed", "generation_step", "min_frames")}, presence=None)
    get = (lambda k, d=None: sampling.get(k, d)) if isinstance(sampling, dict) else \
        (lambda k, d=None: getattr(sampling, k, d))
    f32 = dict(dtype=torch.float32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    penalty = get("audio_repetition_penalty", None)
    if penalty is None:
        penalty = get("audio_penalty", None)
    return FrameSampling(
        text_temperature=torch.tensor([float(get("text_temperature"))], **f32),
        text_top_k=torch.tensor([int(get("text_top_k"))], **i64),
        text_top_p=torch.tensor([float(get("text_top_p"))], **f32),
        audio_temperature=torch.tensor([float(get("audio_temperature"))], **f32),
        audio_top_k=torch.tensor([int(get("audio_top_k"))], **i64),
        audio_top_p=torch.tensor([float(get("audio_top_p"))], **f32),
        audio_penalty=torch.tensor([float(penalty or 1.0)], **f32),
        seed=torch.tensor([int(get("seed"))], **i64),
        generation_step=torch.zeros(1, **i64),
        min_frames=torch.tensor([int(get("min_frames", 0) or 0)], **i64),
    )


@torch.inference_mode()
def generate_reference(model: MossTTSLocal, prompt_rows: np.ndarray | Tensor, sampling: Any,
                       max_frames: int, *, backend: ContiguousKVAttention | None = None
                       ) -> tuple[list[list[int]], bool]:
    """Generate one request the plain way. Returns (frames, stopped): frames are the
    emitted rows [assistant_slot, c0..c(n_vq-1)] as int lists; stopped is True when the
    stop head ended the request, False when the max_frames budget did. Pass `backend`
    (a fresh ContiguousKVAttention) to inspect the cache and positions afterwards."""
    cfg = model.cfg
    p = next(model.parameters())
    device, dtype = p.device, p.dtype
    rows = torch.as_tensor(np.asarray(prompt_rows) if not isinstance(prompt_rows, Tensor) else prompt_rows)
    rows = rows.to(device=device, dtype=torch.int64)
    if rows.ndim != 2 or rows.shape[1] != cfg.row_width or rows.shape[0] == 0:
        raise ValueError(f"prompt_rows must be [T>0, {cfg.row_width}], got {tuple(rows.shape)}")
    sp = single_sampling(sampling, device)
    penalised = bool((sp.audio_penalty != 1.0).item())
    presence = torch.zeros(1, cfg.n_vq, cfg.audio_vocab_size, dtype=torch.bool, device=device)
    bb = cfg.backbone
    kv = backend or ContiguousKVAttention(bb.num_hidden_layers, bb.num_key_value_heads, bb.head_dim, dtype, device)
    if len(kv):
        raise ValueError("backend must be a fresh (empty) ContiguousKVAttention")

    t = rows.shape[0]
    hidden = model.backbone(model.embed_rows(rows), _plain_batch(torch.arange(t, device=device)), kv)[-1:]
    frames: list[list[int]] = []
    for n in range(max_frames):
        sp.generation_step = torch.tensor([n], dtype=torch.int64, device=device)
        sp.presence = presence if penalised else None
        codes, stop = model.decode_frame(hidden, sp)
        if bool(stop.item()):
            return frames, True
        row = model.frame_rows(codes)                                  # [1, 1 + n_vq]
        frames.append(row[0].tolist())
        presence[0, torch.arange(cfg.n_vq, device=device), codes[0]] = True
        if n + 1 < max_frames:  # the next frame's backbone step, at position T + n
            pos = torch.tensor([t + n], device=device)
            hidden = model.backbone(model.embed_rows(row), _plain_batch(pos), kv)
    return frames, False
