"""Paged attention for the backbone.

The scheduler owns the KV slot allocator; the worker owns the KV tensors
and is told, per step, where each new token's K/V goes (`write_slots`) and
which slots each sequence attends to. A backend turns that into attention.
`TorchPagedAttention` is the reference (CPU and GPU); a flashinfer backend
with the same interface serves on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from torch import Tensor


@dataclass
class SequenceSpan:
    """One sequence in a step: its new tokens are the last `num_new` of `kv_slots`."""

    kv_slots: Sequence[int]  # every slot the sequence attends to, in position order
    num_new: int


@dataclass
class AttentionBatch:
    """Everything a backend needs for one forward over packed tokens."""

    positions: Tensor      # [N] int64, backbone position of each packed token
    write_slots: Tensor    # [N] int64, KV slot each token's K/V is written to
    query_index: Tensor    # [S, Qmax] int64 into the packed tokens (padding: 0)
    query_valid: Tensor    # [S, Qmax] bool
    kv_index: Tensor       # [S, Lmax] int64 slot ids (padding: 0)
    attend: Tensor         # [S, Qmax, Lmax] bool, causal within each sequence

    @staticmethod
    def build(spans: Sequence[SequenceSpan], device: torch.device) -> "AttentionBatch":
        """Packed order = spans in order, each contributing its num_new tokens."""
        s = len(spans)
        q_max = max(sp.num_new for sp in spans)
        l_max = max(len(sp.kv_slots) for sp in spans)
        query_index = torch.zeros(s, q_max, dtype=torch.int64)
        query_valid = torch.zeros(s, q_max, dtype=torch.bool)
        kv_index = torch.zeros(s, l_max, dtype=torch.int64)
        attend = torch.zeros(s, q_max, l_max, dtype=torch.bool)
        positions, write_slots = [], []
        offset = 0
        for i, sp in enumerate(spans):
            length, new = len(sp.kv_slots), sp.num_new
            first_pos = length - new
            query_index[i, :new] = torch.arange(offset, offset + new)
            query_valid[i, :new] = True
            kv_index[i, :length] = torch.as_tensor(sp.kv_slots, dtype=torch.int64)
            q_pos = torch.arange(first_pos, length)[:, None]
            attend[i, :new, :length] = torch.arange(length)[None, :] <= q_pos
            positions.append(torch.arange(first_pos, length))
            write_slots.append(torch.as_tensor(sp.kv_slots[first_pos:], dtype=torch.int64))
            offset += new
        return AttentionBatch(
            positions=torch.cat(positions).to(device),
            write_slots=torch.cat(write_slots).to(device),
            query_index=query_index.to(device),
            query_valid=query_valid.to(device),
            kv_index=kv_index.to(device),
            attend=attend.to(device),
        )


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, batch: AttentionBatch) -> Tensor:
        """Write k, v [N, n_kv, d] to the cache, return attention output [N, n_heads, d]."""
        ...


class TorchPagedAttention:
    """Reference backend: a slot-indexed KV cache and padded batched SDPA math."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.scale = head_dim ** -0.5

    @property
    def num_slots(self) -> int:
        return self.k_cache.shape[1]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, batch: AttentionBatch) -> Tensor:
        self.k_cache[layer, batch.write_slots] = k
        self.v_cache[layer, batch.write_slots] = v
        keys = self.k_cache[layer][batch.kv_index]      # [S, L, n_kv, d]
        values = self.v_cache[layer][batch.kv_index]
        group = q.shape[1] // k.shape[1]
        keys = keys.repeat_interleave(group, dim=2)     # GQA: query head h uses kv head h // group
        values = values.repeat_interleave(group, dim=2)
        queries = q[batch.query_index]                  # [S, Q, H, d]
        scores = torch.einsum("sqhd,slhd->shql", queries, keys) * self.scale
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        scores = scores.masked_fill(~batch.attend[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(q.dtype)
        out = torch.einsum("shql,slhd->sqhd", probs, values)
        result = torch.empty_like(q)
        result[batch.query_index[batch.query_valid]] = out[batch.query_valid]
        return result
