"""The slot decoder's weights and state laid out for its step (SlotDecoder, vocoder_svc/slot_decoder.py):
the quantizer's folded decode table, each Transformer stage's GEMM weights cast once to the compute
dtype, and the per-row KV rings."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from vocoder_svc.codec import LayerScale, MossAudioTokenizer, PatchedPretransform, ProjectedTransformer


def rope_freq(head_dim: int, max_period: float, device: torch.device) -> Tensor:
    """freq[i] of §3.3, computed exactly as codec.rope_cos_sin does (same ops, same device)."""
    c = -2.0 * math.log(max_period) / head_dim
    i = torch.arange(head_dim // 2, dtype=torch.float32, device=device)
    return torch.exp(i * torch.tensor(c, dtype=torch.float32, device=device))


@dataclass
class Layer:
    ln1_w: Tensor
    ln1_b: Tensor
    wqkv: Tensor
    wo: Tensor
    s1: Tensor | None
    ln2_w: Tensor
    ln2_b: Tensor
    w1: Tensor
    w2: Tensor
    s2: Tensor | None


@dataclass
class Stage:
    """One decoder Transformer stage: weights, window and its per-row KV buffers."""

    index: int  # decoder module index
    mult: int  # tokens of this stage per code frame
    window: int
    heads: int
    head_dim: int
    d_model: int
    w_in: Tensor | None
    w_out: Tensor | None
    layers: list[Layer]
    freq: Tensor  # [D/2] fp32
    k: list[Tensor]  # per layer [rows, H, W, D]
    v: list[Tensor]


@dataclass
class StepWeights:
    table: Tensor  # [n_q*K, rvq]: row i*K + c = Out_i(codebook_i[c])
    q_offsets: Tensor  # [n_q, 1, 1]: codebook i's first row in the table
    q_out_w: Tensor | None
    q_out_b: Tensor | None
    plan: list[tuple[str, object]]  # ("patch", h) or ("stage", Stage), in decoder order
    max_mult: int  # tokens per code frame at the last stage


def build_weights(codec: MossAudioTokenizer, n_q: int, n_rows: int, compute_dtype: torch.dtype,
                  residual_dtype: torch.dtype) -> StepWeights:
    """The step's tensors for the first n_q codebooks and n_rows KV rows (slots and scratch rows)."""
    dev, cd, rd = codec.device, compute_dtype, residual_dtype


    def gemm(w: Tensor | None) -> Tensor | None:
        return None if w is None else w.detach().to(device=dev, dtype=cd)

    def vec(w: Tensor) -> Tensor:
        return w.detach().to(device=dev, dtype=rd)

    q = codec.quantizer
    k = codec.config.quantizer.codebook_size
    # The folded decode table of §3.2 for the first n_q codebooks: row i*K + c = Out_i(codebook_i[c]),
    # computed with the codec's own 1x1 convolution weights (fp32; fp64 for fp64 codecs).
    rows = []
    for lfq in list(q.quantizers)[:n_q]:
        cb = lfq.codebook.weight.detach()
        rows.append(cb if lfq.out_proj is None else
                    F.conv1d(cb.t().unsqueeze(0), lfq.out_proj.weight, lfq.out_proj.bias)[0].t())
    table = torch.cat(rows, dim=0).contiguous()  # [n_q*K, rvq]
    q_offsets = (torch.arange(n_q, device=dev) * k).view(n_q, 1, 1)
    if q.output_proj is None:
        q_out_w = q_out_b = None
    else:
        q_out_w = q.output_proj.weight[:, :, 0]
        q_out_b = q.output_proj.bias
    plan: list[tuple[str, object]] = []  # ("patch", h) or ("stage", Stage)
    mult = 1
    for i, m in enumerate(codec.decoder):
        if isinstance(m, PatchedPretransform):
            plan.append(("patch", m.patch_size))
            mult *= m.patch_size
            continue
        assert isinstance(m, ProjectedTransformer)
        s = m.cfg
        layers = []
        for layer in m.transformer.layers:
            attn = layer.self_attn
            wqkv = attn.in_proj.weight if hasattr(attn, "in_proj") else attn.in_projs[0].weight
            wo = attn.out_proj.weight if hasattr(attn, "out_proj") else attn.out_projs[0].weight
            if hasattr(layer, "ffn"):
                w1, w2 = layer.ffn[0].weight, layer.ffn[2].weight
            else:
                w1, w2 = layer.linear1.weight, layer.linear2.weight
            s1 = vec(layer.layer_scale_1.scale) if isinstance(layer.layer_scale_1, LayerScale) else None
            s2 = vec(layer.layer_scale_2.scale) if isinstance(layer.layer_scale_2, LayerScale) else None
            layers.append(Layer(vec(layer.norm1.weight), vec(layer.norm1.bias), gemm(wqkv), gemm(wo), s1,
                                 vec(layer.norm2.weight), vec(layer.norm2.bias), gemm(w1), gemm(w2), s2))
        shape = (n_rows, s.num_heads, m.window, s.head_dim)
        stage = Stage(index=i, mult=mult, window=m.window, heads=s.num_heads, head_dim=s.head_dim,
                       d_model=s.d_model,
                       w_in=gemm(None if m.input_proj is None else m.input_proj.weight),
                       w_out=gemm(None if m.output_proj is None else m.output_proj.weight),
                       layers=layers, freq=rope_freq(s.head_dim, s.max_period, dev),
                       k=[torch.zeros(shape, dtype=cd, device=dev) for _ in layers],
                       v=[torch.zeros(shape, dtype=cd, device=dev) for _ in layers])
        plan.append(("stage", stage))
    return StepWeights(table, q_offsets, q_out_w, q_out_b, plan, mult)
