"""OmniVoice: the model math (spec section 2) over a packed step.

Reads top to bottom: each row's embedding (a text id, or the sum of its 8 codebooks' code rows)
-> a bidirectional Qwen3 body in which a row attends only to rows of its own document and
positions restart per document -> the audio head at the gathered target rows, in fp32.
Module names equal the checkpoint's tensor names, so it loads by name.

Numerics follow the reference's Qwen3 (transformers) operation for operation, so a document's
logits do not depend on the documents packed beside it and equal the reference's: RMSNorm
statistics in fp32 (also for fp64 activations), RoPE angles and cos/sin in fp32 then cast, q/k
norm before half-split RoPE, softmax attention per document. CPU GEMMs compute the last
(rows mod 4) rows of a batch with another kernel whose bits differ, so a step's rows, and the rows
the head reads, are padded to a multiple of ROW_MULTIPLE: a row's result then never depends on
where it sits in the pack.

On CUDA with triton, RMSNorm (with the residual add before it), q/k norm + RoPE and
SiLU x mul run as gpu_worker/kernels.py's fused kernels (KERNELS = "auto"; "torch" keeps the
reference ops everywhere): the same math with the norm's sum in the kernel's fixed order. At a
packed step of thousands of rows the separate torch ops cost more than the GEMMs.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from chorus.omnivoice.config import OmniVoiceConfig
from chorus.triton_support import KERNEL_DTYPES
from gpu_worker import kernels
from gpu_worker.linears import fuse_linears, fused_linear

ROW_MULTIPLE = 4
KERNELS = "auto"  # "auto": gpu_worker/kernels.py's fused kernels on CUDA when triton imports; "torch": never

# One step's attention, planned for its documents: q [rows, H, d], k/v [rows, KV, d] -> [rows, H, d].
# One whose attribute `reads_strided` is true takes k and v as views of the q/k/v GEMM's output.
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


def fused(x: Tensor) -> bool:
    """Whether x's norms, RoPE and SiLU x mul run as Triton kernels: compiled ones only (the
    interpreter the CPU tests turn on cannot run inside a CUDA graph)."""
    return (KERNELS == "auto" and kernels.HAVE_TRITON and not kernels.INTERPRET and x.is_cuda
            and x.dtype in KERNEL_DTYPES)


def _pad_rows(x: Tensor, multiple: int, dim: int, fill) -> Tensor:
    """x with rows appended along dim (filled with `fill`) up to a multiple of `multiple`."""
    pad = -x.shape[dim] % multiple
    if not pad:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, torch.full(shape, fill, dtype=x.dtype, device=x.device)], dim=dim)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if fused(x):
            return kernels.rms_norm(x, self.weight, self.eps, impl="auto")
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


@lru_cache(maxsize=8)
def _inv_freq(head_dim: int, theta: float, device: torch.device) -> Tensor:
    """RoPE frequencies, computed on the CPU as the reference does, then kept on `device` (a CUDA
    graph may not copy from the host)."""
    return (1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))).to(device)


def rope_tables(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [rows, head_dim] of half-split RoPE: angles in fp32, then cast to the activation dtype."""
    angles = positions.to(torch.float32)[:, None] * _inv_freq(head_dim, theta, positions.device)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [rows, heads, d] rotated by pairs (i, i + d/2)."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + turned * sin[:, None]


def document_attention(q: Tensor, k: Tensor, v: Tensor, doc_lens: list[int]) -> Tensor:
    """Bidirectional attention inside each document. q [rows, H, d], k/v [rows, KV, d] with H a
    multiple of KV (each kv head serves H/KV query heads) -> [rows, H, d]."""
    groups = q.shape[1] // k.shape[1]
    out = []
    for qd, kd, vd in zip(q.split(doc_lens), k.split(doc_lens), v.split(doc_lens)):
        kd, vd = kd.repeat_interleave(groups, dim=1), vd.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(qd.transpose(0, 1)[None], kd.transpose(0, 1)[None],
                                           vd.transpose(0, 1)[None], scale=q.shape[-1] ** -0.5)
        out.append(o[0].transpose(0, 1))
    return torch.cat(out)


class Attention(nn.Module):
    def __init__(self, cfg: OmniVoiceConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend, slots: Tensor | None = None) -> Tensor:
        """slots: arange(rows) on x's device, where the kernel path stores k and v (made once a step)."""
        rows = x.shape[0]
        q, k, v = fused_linear(x, (self.q_proj, self.k_proj, self.v_proj))
        q, k = q.view(rows, self.n_heads, self.head_dim), k.view(rows, self.n_kv, self.head_dim)
        v = v.view(rows, self.n_kv, self.head_dim)
        if fused(x):  # q/k norms and RoPE in one launch
            half = self.head_dim // 2
            slots = torch.arange(rows, device=x.device) if slots is None else slots
            if getattr(attend, "reads_strided", False):  # k rotated in place, v read where the GEMM left it
                q = kernels.qk_norm_rope_store(q, k, v, self.q_norm.weight, self.k_norm.weight, cos[:, :half],
                                               sin[:, :half], self.q_norm.eps, k, None, slots, impl="auto",
                                               rows_per_program=16)
                o = attend(q, k, v)
            else:  # k and v land in fresh [rows, KV, d] buffers
                k_out, v_out = torch.empty_like(k), torch.empty_like(v)
                q = kernels.qk_norm_rope_store(q, k, v, self.q_norm.weight, self.k_norm.weight, cos[:, :half],
                                               sin[:, :half], self.q_norm.eps, k_out, v_out, slots, impl="auto",
                                               rows_per_program=16)
                o = attend(q, k_out, v_out)
        else:
            o = attend(rotate(self.q_norm(q), cos, sin), rotate(self.k_norm(k), cos, sin), v)
        return self.o_proj(o.reshape(rows, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: OmniVoiceConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = fused_linear(x, (self.gate_proj, self.up_proj))
        return self.down_proj(kernels.silu_mul(gate, up, impl="auto") if fused(x) else F.silu(gate) * up)


def add_norm(norm: RMSNorm, x: Tensor, delta: Tensor | None) -> tuple[Tensor, Tensor]:
    """(s, norm(s)) with s = x + delta (x when delta is None): a residual add and the norm after it,
    in one launch on CUDA."""
    if delta is not None and fused(x):
        return kernels.add_rms_norm(x, delta, norm.weight, norm.eps, impl="auto")
    s = x if delta is None else x + delta
    return s, norm(s)


class Layer(nn.Module):
    def __init__(self, cfg: OmniVoiceConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, delta: Tensor | None, cos: Tensor, sin: Tensor,
                attend: Attend, slots: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x: the residual stream; delta: the previous layer's MLP output, not yet added to it (None
        in the first layer). Returns the stream and this layer's MLP output, so each residual add
        rides in the launch of the norm after it."""
        x, h = add_norm(self.input_layernorm, x, delta)
        x, h = add_norm(self.post_attention_layernorm, x, self.self_attn(h, cos, sin, attend, slots))
        return x, self.mlp(h)


class Body(nn.Module):
    """The Qwen3 body, no LM head (checkpoint prefix `llm.`)."""

    def __init__(self, cfg: OmniVoiceConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        cos, sin = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        slots = torch.arange(x.shape[0], device=x.device) if fused(x) else None
        delta = None
        for layer in self.layers:
            x, delta = layer(x, delta, cos, sin, attend, slots)
        return add_norm(self.norm, x, delta)[1]


class OmniVoiceModel(nn.Module):
    def __init__(self, cfg: OmniVoiceConfig):
        super().__init__()
        self.cfg = cfg
        self.llm = Body(cfg)
        codes = cfg.num_codebooks * cfg.audio_vocab_size
        self.audio_embeddings = nn.Embedding(codes, cfg.hidden_size)  # row = codebook * audio_vocab_size + code
        self.audio_heads = nn.Linear(cfg.hidden_size, codes, bias=False)  # output block c = codebook c

    def embed(self, ids: Tensor, audio_mask: Tensor) -> Tensor:
        """ids int64 [C, rows] (a text row repeats its id in every codebook), audio_mask bool [rows]
        -> [rows, hidden]: a text row's token embedding, or the sum over codebooks of code rows.
        Both are looked up for every row and one is kept: no data-dependent shapes (CUDA graphs)."""
        text = self.llm.embed_tokens(torch.where(audio_mask, 0, ids[0]))
        offsets = torch.arange(self.cfg.num_codebooks, device=ids.device)[:, None] * self.cfg.audio_vocab_size
        audio = self.audio_embeddings(torch.where(audio_mask, ids, 0) + offsets).sum(dim=0)
        return torch.where(audio_mask[:, None], audio, text)

    def hidden(self, ids: Tensor, audio_mask: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        """Final-norm hidden states [rows, hidden] of a packed step (what a CUDA graph holds)."""
        return self.llm(self.embed(ids, audio_mask), positions, attend)

    def head(self, h: Tensor, gather: Tensor) -> Tensor:
        """fp32 logits [C, n, V] of the rows `gather` [n] of h."""
        return self.head_logits(h, gather).float()

    def head_logits(self, h: Tensor, gather: Tensor) -> Tensor:
        """head's logits in the activations' dtype (a view [C, n, V] of the head's [n, C x V] output):
        the unmasking kernel reads them so, and widens each to fp32 as .float() would."""
        n = gather.shape[0]
        logits = self.audio_heads(h[_pad_rows(gather, ROW_MULTIPLE, 0, 0)])[:n]
        return logits.view(n, self.cfg.num_codebooks, self.cfg.audio_vocab_size).transpose(0, 1)

    def forward(self, ids: Tensor, audio_mask: Tensor, positions: Tensor, doc_lens: list[int],
                gather: Tensor, attention=None) -> Tensor:
        """One packed step: ids [C, rows], audio_mask [rows], positions [rows] restarting per
        document, doc_lens summing to rows, gather [n] the rows to score -> fp32 logits [C, n, V].
        Filler rows (a MASK document of their own) round the pack up to ROW_MULTIPLE rows.
        `attention`: a backend of gpu_worker.omnivoice.attention (None: the torch reference)."""
        rows = ids.shape[1]
        fill = -rows % ROW_MULTIPLE
        if fill:
            ids = _pad_rows(ids, ROW_MULTIPLE, 1, self.cfg.audio_mask_id)
            audio_mask = _pad_rows(audio_mask, ROW_MULTIPLE, 0, True)
            positions = torch.cat([positions, torch.arange(fill, device=positions.device)])
            doc_lens = [*doc_lens, fill]
        attend = attention.plan(doc_lens) if attention is not None else \
            (lambda q, k, v: document_attention(q, k, v, doc_lens))
        return self.head(self.hidden(ids, audio_mask, positions, attend), gather)


def fuse_projections(model: OmniVoiceModel) -> None:
    """q/k/v and gate/up of every layer as one GEMM each (gpu_worker/linears.py); call after the
    weights are in place."""
    for layer in model.llm.layers:
        fuse_linears((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj))
        fuse_linears((layer.mlp.gate_proj, layer.mlp.up_proj))
