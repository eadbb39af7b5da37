"""MOSS-TTS Local v1.5: the model math (spec moss_tts_local.md §2–§3).

Reads top to bottom: multi-channel row embedding → Qwen3 backbone (paged KV
through an attention backend) → local transformer that decodes one frame
(stop choice + n_vq codes) per backbone step. Module names equal the
upstream state-dict names, so a checkpoint loads by name.

Dtype policy: every tensor computes in the model dtype (bf16 for serving,
float32/float64 for CPU parity tests); logits are promoted to ≥ fp32 before
sampling; RMSNorm normalises in ≥ fp32 and casts before the weight multiply;
local attention scores/softmax run in ≥ fp32. RoPE inv_freq is computed on the
CPU in fp32 (fp32 exponent, fp32 power), angles pos·inv_freq in fp32, then
cos/sin are cast to the activation dtype; the tables are fp32 buffers that
follow the module's device but never its dtype (`model.to(torch.bfloat16)`
must not round inv_freq). The layers' elementwise math (RMSNorm, both RoPEs,
local attention) is gpu_worker/torch_ops.py, fused on CUDA by kernels.py.

Fidelity notes (spec §3): backbone RoPE is half-split (NeoX) after QK-norm;
the local transformer's is interleaved (GPT-J) on all head dims, with each
product rounded before the sum; ln_f runs once after the last local block; the
stop head reads local position 0 and audio head k local position k (tied to
Eaudio_k); code k is fed back at local position k+1 and the last code never;
sampler positions are n·(n_vq+1) + channel (13n + channel for v1.5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from chorus.moss_config import BackboneConfig, LocalConfig, MossTTSLocalConfig
from gpu_worker import kernels
from gpu_worker.attention import AttentionBatch, AttentionBackend
from gpu_worker.linears import fuse_linears, fused_linear
from gpu_worker.sampler_kernel import fused_sample


def rope_inv_freq(base: float, dim: int) -> Tensor:
    """inv_freq[i] = 1 / base^(2i/dim) for i < dim/2, with an fp32 exponent and an
    fp32 power, computed on the CPU as upstream does (spec §3.2.3). A float64
    table rounded to fp32 differs by one ulp in about a third of the entries."""
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    return 1.0 / (float(base) ** exponent)


def _embedding(rows: int, dim: int) -> nn.Embedding:
    """An embedding table created zeroed (weights come from a checkpoint or
    init_random_weights). Skips nn.Embedding's normal_ init, whose first call on
    the meta device costs seconds of one-time setup."""
    return nn.Embedding(rows, dim, _weight=torch.zeros(rows, dim))


class _Fp32Tables(nn.Module):
    """Holds RoPE tables as non-persistent fp32 buffers that follow the module's
    device but never its dtype: `model.to(torch.bfloat16)` would otherwise round
    inv_freq to bf16 and move every angle. The tables are rebuilt from the CPU
    fp32 originals after every `_apply` (`.to`, `.cuda`, `.half`, `to_empty`)."""

    def _register_tables(self, **tables: Tensor) -> None:
        self._table_src = {name: t.to(torch.float32) for name, t in tables.items()}
        device = torch.empty(0).device  # the construction device (e.g. under `with torch.device("meta")`)
        for name, t in self._table_src.items():
            self.register_buffer(name, t.to(device, copy=True), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for name, src in self._table_src.items():
            setattr(self, name, src.to(getattr(self, name).device))
        return self


# ---------------------------------------------------------------------------
# Backbone (Qwen3)
# ---------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)  # one launch on CUDA, torch_ops.rms_norm elsewhere


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: BackboneConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, batch: AttentionBatch,
                backend: AttentionBackend) -> Tensor:
        n = x.shape[0]
        q, k, v = fused_linear(x, (self.q_proj, self.k_proj, self.v_proj))
        q, k = q.view(n, self.n_heads, self.head_dim), k.view(n, self.n_kv, self.head_dim)
        v = v.view(n, self.n_kv, self.head_dim)
        # QK-norm, RoPE and the store of k, v in their KV slots: one launch on CUDA.
        k_cache, v_cache = backend.kv_cache(self.layer_idx)
        q = kernels.qk_norm_rope_store(q, k, v, self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.eps,
                                       k_cache, v_cache, batch.write_slots)
        o = backend.attend(self.layer_idx, q, batch)
        return self.o_proj(o.reshape(n, self.n_heads * self.head_dim))


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: BackboneConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = fused_linear(x, (self.gate_proj, self.up_proj))
        return self.down_proj(kernels.silu_mul(gate, up))  # F.silu(gate) * up, fused on CUDA


class Qwen3Layer(nn.Module):
    """Pre-norm: h = x + attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h)).
    Qwen3Backbone.forward runs it with each residual add fused into the norm after it."""

    def __init__(self, cfg: BackboneConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, layer_idx)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def add_norm(residual: Tensor, update: Tensor, norm: RMSNorm) -> tuple[Tensor, Tensor]:
    """(residual + update, norm(residual + update)): one launch on CUDA."""
    return kernels.add_rms_norm(residual, update, norm.weight, norm.eps)


class Qwen3Backbone(_Fp32Tables):
    def __init__(self, cfg: BackboneConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = _embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3Layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._register_tables(inv_freq=rope_inv_freq(cfg.rope_theta, cfg.head_dim))

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [N, head_dim/2]: angle = pos * inv_freq in fp32, then cast to the activation dtype."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, x: Tensor, batch: AttentionBatch, backend: AttentionBackend) -> Tensor:
        """x: [N, hidden] packed tokens of every sequence in the step → final-norm hidden [N, hidden]."""
        cos, sin = self.rope(batch.positions, x.dtype)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        h = self.layers[0].input_layernorm(x)
        for layer, next_norm in zip(self.layers, norms):
            x, h = add_norm(x, layer.self_attn(h, cos, sin, batch, backend), layer.post_attention_layernorm)
            x, h = add_norm(x, layer.mlp(h), next_norm)
        return h


# ---------------------------------------------------------------------------
# Local transformer (one GPT-2-style block with interleaved RoPE)
# ---------------------------------------------------------------------------
class LocalAttention(nn.Module):
    def __init__(self, cfg: LocalConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, qkv: Tensor, p: int, k_cache: Tensor, v_cache: Tensor, cos: Tensor | None,
                sin: Tensor | None) -> Tensor:
        """qkv: [B, 3H] (c_attn of the ln_1 output) at local position p → [B, H]; appends to the
        caches. It takes c_attn's output, not its input: a fed-back code's comes from a table."""
        return self.c_proj(kernels.local_attention(qkv, k_cache, v_cache, p, cos, sin, self.n_head))


class LocalMLP(nn.Module):
    def __init__(self, cfg: LocalConfig):
        super().__init__()
        self.fc_in = nn.Linear(cfg.n_embd, cfg.n_inner)
        self.fc_out = nn.Linear(cfg.n_inner, cfg.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_out(F.silu(self.fc_in(x)))


class LocalBlock(nn.Module):
    """GPT-2 pre-norm: x = x + attn(ln_1(x)); x = x + mlp(ln_2(x)). LocalTransformer.step
    runs it with each residual add fused into the LayerNorm after it."""

    def __init__(self, cfg: LocalConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = LocalAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = LocalMLP(cfg)


def add_layer_norm(residual: Tensor, update: Tensor | None, norm: nn.LayerNorm) -> tuple[Tensor, Tensor]:
    """(residual + update, norm(residual + update)); update None: (residual, norm(residual))."""
    return kernels.add_layer_norm(residual, update, norm.weight, norm.bias, norm.eps)


@dataclass
class LocalCache:
    """The local transformer's K/V for one frame decode, preallocated for every local
    position so a step appends in place (no growing cat) and the kernel can write it."""

    k: Tensor  # [n_layer, B, n_head, positions, head_dim]
    v: Tensor
    length: int = 0  # local positions written


class LocalTransformer(_Fp32Tables):
    def __init__(self, cfg: LocalConfig, positions: int):
        super().__init__()
        self.cfg = cfg
        self.use_rope = cfg.position_embedding_type == "rope"
        self.h = nn.ModuleList(LocalBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        if not self.use_rope:
            self.wpe = _embedding(positions, cfg.n_embd)
        # ang[p, i] = p * inv_freq[i] in fp32; dims 2i and 2i+1 share angle i (interleaved).
        inv = rope_inv_freq(cfg.rope_base, cfg.head_dim)
        angles = torch.arange(positions, dtype=torch.float32, device="cpu")[:, None] * inv[None, :]
        self._register_tables(cos_table=angles.cos().repeat_interleave(2, dim=-1),
                              sin_table=angles.sin().repeat_interleave(2, dim=-1))
        self.register_buffer("code_qkv", None, persistent=False)  # [fed-back channels, codes, 3H]: precompute_code_qkv

    def new_cache(self, batch: int, dtype: torch.dtype, device: torch.device) -> LocalCache:
        shape = (len(self.h), batch, self.cfg.n_head, self.cos_table.shape[0], self.cfg.head_dim)
        return LocalCache(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))

    def step(self, x: Tensor, p: int, cache: LocalCache) -> Tensor:
        """One local position for the whole batch: x [B, H] → ln_f output [B, H]."""
        if not self.use_rope:
            x = x + self.wpe.weight[p]
        x, h = add_layer_norm(x, None, self.h[0].ln_1)
        return self.blocks(x, self.h[0].attn.c_attn(h), p, cache)

    def step_codes(self, channel: int, table: Tensor, codes: Tensor, p: int, cache: LocalCache) -> Tensor:
        """step(table[codes], p, cache) for fed-back codes of audio channel `channel`: with code_qkv
        the first LayerNorm and c_attn are a gather (no code_qkv: absolute positions, or a model
        precompute_code_qkv has not seen)."""
        if self.code_qkv is None:
            return self.step(F.embedding(codes, table), p, cache)
        return self.blocks(F.embedding(codes, table), F.embedding(codes, self.code_qkv[channel]), p, cache)

    def blocks(self, x: Tensor, qkv: Tensor, p: int, cache: LocalCache) -> Tensor:
        """Local position p for the whole batch, from the residual x and the first block's c_attn
        output qkv → ln_f output; step and step_codes both end here."""
        cos = sin = None
        if self.use_rope:
            cos, sin = self.cos_table[p], self.sin_table[p]
        for i, block in enumerate(self.h):
            x, h = add_layer_norm(x, block.attn(qkv, p, cache.k[i], cache.v[i], cos, sin), block.ln_2)
            last = i + 1 == len(self.h)
            x, h = add_layer_norm(x, block.mlp(h), self.ln_f if last else self.h[i + 1].ln_1)
            if not last:
                qkv = self.h[i + 1].attn.c_attn(h)
        cache.length = p + 1
        return h


# ---------------------------------------------------------------------------
# The whole model
# ---------------------------------------------------------------------------
@dataclass
class FrameSampling:
    """Per-row sampling parameters for one frame decode; every field is [B]."""

    text_temperature: Tensor
    text_top_k: Tensor
    text_top_p: Tensor
    audio_temperature: Tensor
    audio_top_k: Tensor
    audio_top_p: Tensor
    audio_penalty: Tensor
    seed: Tensor
    generation_step: Tensor  # n: frames already committed
    min_frames: Tensor
    presence: Tensor | None = None  # [B, n_vq, V] bool: codes generated so far (repetition penalty)


def fuse_projections(model: "MossTTSLocal") -> None:
    """q/k/v and gate/up as single GEMMs, the audio tables in one storage (one-launch
    embed_rows); call after the weights are in place."""
    fuse_linears(tuple(model.audio_embeddings))
    for layer in model.transformer.layers:
        fuse_linears((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj))
        fuse_linears((layer.mlp.gate_proj, layer.mlp.up_proj))


def precompute_code_qkv(model: "MossTTSLocal") -> None:
    """The first local block's c_attn output for every code a frame feeds back (channels 0..n_vq-2,
    each at its fixed local position k+1), so a frame decode's 11 fed-back steps gather it instead
    of running LayerNorm and a [B, H] x [H, 3H] GEMM (full size: 11 x 1024 x 7680, 173 MB in bf16).
    Exact: ln_1 and c_attn see only the code's embedding row (RoPE comes after, in the attention).
    Derived from the weights, so call after they are in place (build_model does); left out without
    RoPE, where wpe[p] joins the input. A non-persistent buffer: it follows .to() and stays out of
    checkpoints."""
    lt = model.local_transformer
    if not lt.use_rope:
        return
    ln, c_attn = lt.h[0].ln_1, lt.h[0].attn.c_attn
    with torch.no_grad():
        tables = [c_attn(F.layer_norm(t.weight, ln.normalized_shape, ln.weight, ln.bias, ln.eps))
                  for t in model.audio_embeddings[:-1]]
    lt.code_qkv = torch.stack(tables)


class MossTTSLocal(nn.Module):
    def __init__(self, cfg: MossTTSLocalConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = Qwen3Backbone(cfg.backbone)
        self.local_transformer = LocalTransformer(cfg.local, positions=cfg.n_vq + 1)
        self.audio_embeddings = nn.ModuleList(
            _embedding(size, cfg.hidden_size) for size in cfg.codebook_sizes)
        self.local_text_lm_head = nn.Linear(cfg.hidden_size, 2, bias=False)

    # -- §3.1 --------------------------------------------------------------
    def embed_rows(self, rows: Tensor) -> Tensor:
        """rows: int [T, 1 + n_vq] → [T, hidden]. Pad code embeds to exactly zero, never
        indexing a table (it is out of range); the text channel is never masked, so a
        pad row embeds to exactly Etext[text_id]."""
        pad = self.cfg.audio_pad_code
        fused = kernels.embed_rows(rows, self.transformer.embed_tokens.weight,
                                   [t.weight for t in self.audio_embeddings], pad)
        if fused is not None:  # one launch on CUDA instead of ~5 per channel
            return fused
        e = self.transformer.embed_tokens(rows[:, 0])
        for k, table in enumerate(self.audio_embeddings):  # order text, c0..c11 matters in bf16
            ids = rows[:, k + 1]
            valid = ids != pad
            e = e + torch.where(valid[:, None], table(torch.where(valid, ids, 0)), 0)
        return e

    # -- §3.2 --------------------------------------------------------------
    def backbone(self, x: Tensor, batch: AttentionBatch, backend: AttentionBackend) -> Tensor:
        return self.transformer(x, batch, backend)

    # -- §3.3–§3.5 -----------------------------------------------------------
    def decode_frame(self, hidden: Tensor, sp: FrameSampling) -> tuple[Tensor, Tensor]:
        """Decode one frame for each row of hidden [B, H] (final-norm backbone output).

        Returns (codes int64 [B, n_vq], stop bool [B]). Codes are sampled for
        every row, stopped or not: the seeded noise depends only on (seed,
        position), so a row's draws never depend on its neighbours.
        """
        b = hidden.shape[0]
        lt = self.local_transformer
        cache = lt.new_cache(b, hidden.dtype, hidden.device)
        base = sp.generation_step * (self.cfg.n_vq + 1)  # sampler position = 13n + channel
        l = lt.step(hidden, 0, cache)
        stop_logits = self.local_text_lm_head(l)  # the sampler promotes to >= fp32 itself
        # fused_sample = sampler.sample (after the repetition penalty), one launch on CUDA
        stop = fused_sample(stop_logits, sp.text_temperature, sp.text_top_k, sp.text_top_p, sp.seed, base) == 1
        stop = stop & (sp.generation_step >= sp.min_frames)
        codes = []
        for k, table in enumerate(self.audio_embeddings):
            logits = kernels.head_linear(l, table.weight)  # head k is tied to Eaudio_k, reads local position k
            presence = sp.presence[:, k, :logits.shape[-1]] if sp.presence is not None else None
            c = fused_sample(logits, sp.audio_temperature, sp.audio_top_k, sp.audio_top_p, sp.seed, base,
                             presence, sp.audio_penalty if presence is not None else None, position_offset=k + 1)
            codes.append(c)
            if k + 1 < self.cfg.n_vq:  # code k is fed back at local position k+1; the last never is
                l = lt.step_codes(k, table.weight, c, k + 1, cache)
        return torch.stack(codes, dim=1), stop

    def frame_rows(self, codes: Tensor) -> Tensor:
        """Generated rows [B, 1 + n_vq]: the assistant slot id and the codes."""
        slot = torch.full_like(codes[:, :1], self.cfg.audio_assistant_slot_token_id)
        return torch.cat([slot, codes], dim=1)


def init_random_weights(model: MossTTSLocal, seed: int) -> None:
    """Deterministic random weights (tiny presets and `--load-format dummy`),
    generated on the parameters' own device (fast on CUDA; a given seed gives
    the same weights on every CPU, and on every GPU of a kind, but the CPU and
    CUDA generators differ)."""
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.device not in gens:
                gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            gen = gens[p.device]
            dt = torch.float32 if p.device.type == "cpu" else p.dtype
            randn = torch.randn(p.shape, generator=gen, device=p.device, dtype=dt)
            if name.endswith("norm.weight") or (".ln_" in name and name.endswith(".weight")):
                vals = randn.mul_(0.1).add_(1.0)
            elif name.endswith("bias"):
                vals = randn.mul_(0.02)
            elif "embed" in name:
                vals = randn.mul_(0.5)
            else:
                vals = randn.div_(p.shape[-1] ** 0.5)
            p.copy_(vals)
