"""Model fidelity to spec moss_tts_local.md §3 (GitHub issue "MOSS-TTS Local v1.5
exactly as upstream").

* §7 vectors 1 (shapes, incl. the real-size config on the meta device),
  2 (pad rows, sum order), 3 (interleaved vs half-split RoPE numbers),
  10 (loop bookkeeping).
* An independent transcription of §3.1–§3.5 written with explicit formulas
  over the raw weights (full-sequence recompute, explicit RoPE pairs, explicit
  GQA head mapping, explicit LayerNorm) must agree with the model's modules
  numerically (float64) and produce the same frames as the reference
  generator, for configs whose sizes differ from the real model's (head_dim
  not hidden/heads, GQA groups, several local blocks, absolute positions).
* The batched serving engine must produce exactly the reference generator's
  frames for several requests batched together (float32, CPU), including
  repetition penalty, chunked prefill mixed with decode, and a re-prefill.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gpu_worker.sampler as sampler_mod  # the kernels' torch path calls sampler.sample
from chorus.moss_config import BackboneConfig, LocalConfig, MossTTSLocalConfig, tiny_config
from chorus.prompt import build_prompt_rows
from chorus.tokenizer import load_tokenizer
from chorus.v1 import tts_pb2, worker_pb2
from gpu_worker.attention import AttentionBatch
from chorus.wire import rows_matrix
from gpu_worker.engine import Engine
from gpu_worker.loader import build_model
from gpu_worker.model import (FrameSampling, LocalTransformer, MossTTSLocal, init_random_weights,
                              precompute_code_qkv, rope_inv_freq)
from gpu_worker.torch_ops import rotate_half_split, rotate_interleaved
from gpu_worker.reference import ContiguousKVAttention, generate_reference
from gpu_worker.sampler import apply_repetition_penalty, derive_sampling_seed, sample
from scheduler_svc.validation import resolve_sampling

PAD = 1024


def make_model(cfg: MossTTSLocalConfig, dtype=torch.float64, seed: int = 0) -> MossTTSLocal:
    m = MossTTSLocal(cfg)
    init_random_weights(m, seed)
    return m.to(dtype).eval()


def sampling_config(seed: int, min_frames: int = 0, **params) -> worker_pb2.SamplingConfig:
    return resolve_sampling(tts_pb2.SamplingParams(seed=seed, **params), min_frames=min_frames)


@pytest.fixture(scope="module")
def tiny64():
    return build_model(preset="tiny", dtype="float64", seed=0)


@pytest.fixture(scope="module")
def tiny32():
    return build_model(preset="tiny", dtype="float32", seed=3)


# =============================================================================
# §7.1 shapes
# =============================================================================
class ShapeBackend:
    """Records q and K/V-cache shapes; returns a tensor shaped like the attention output."""

    def __init__(self, slots: int, kv_heads: int, head_dim: int):
        self.cache = torch.zeros(slots, kv_heads, head_dim, dtype=torch.bfloat16, device="meta")
        self.shapes = []

    def kv_cache(self, layer):
        return self.cache, self.cache

    def attend(self, layer, q, batch):
        self.shapes.append((tuple(q.shape), tuple(self.cache.shape[1:])))
        return torch.zeros_like(q)


def _hook_shapes(model: MossTTSLocal):
    seen = {}
    attn = model.transformer.layers[0].self_attn
    model.transformer.layers[0].self_attn.o_proj.register_forward_pre_hook(
        lambda mod, args: seen.__setitem__("o_proj_in", tuple(args[0].shape)))
    model.local_transformer.h[0].attn.c_attn.register_forward_hook(
        lambda mod, args, out: seen.__setitem__("c_attn_out", tuple(out.shape)))
    return seen, attn


def test_real_size_shapes_on_meta():
    cfg = MossTTSLocalConfig()
    with torch.device("meta"):
        model = MossTTSLocal(cfg).to(torch.bfloat16)
    sd = model.state_dict()
    assert sd["transformer.embed_tokens.weight"].shape == (151936, 2560)
    assert sd["transformer.layers.35.self_attn.q_proj.weight"].shape == (4096, 2560)
    assert sd["transformer.layers.0.self_attn.k_proj.weight"].shape == (1024, 2560)
    assert sd["transformer.layers.0.self_attn.q_norm.weight"].shape == (128,)
    assert sd["transformer.layers.0.mlp.gate_proj.weight"].shape == (9728, 2560)
    assert sd["local_transformer.h.0.attn.c_attn.weight"].shape == (7680, 2560)
    assert sd["local_transformer.h.0.attn.c_attn.bias"].shape == (7680,)
    assert sd["local_transformer.h.0.mlp.fc_in.weight"].shape == (9728, 2560)
    assert sd["local_transformer.ln_f.bias"].shape == (2560,)
    assert sd["audio_embeddings.11.weight"].shape == (1024, 2560)
    assert sd["local_text_lm_head.weight"].shape == (2, 2560)
    assert "local_transformer.wpe.weight" not in sd and "local_transformer.h.1.ln_1.weight" not in sd
    assert not any("inv_freq" in n or "lm_heads" in n or n.startswith("text_lm_head") for n in sd)
    # RoPE tables stay fp32 through .to(bfloat16)
    assert model.transformer.inv_freq.dtype == torch.float32
    assert model.local_transformer.cos_table.dtype == torch.float32

    seen, _ = _hook_shapes(model)
    t = 7
    rows = torch.full((t, 13), PAD, dtype=torch.int64, device="meta")
    e = model.embed_rows(rows)
    assert tuple(e.shape) == (t, 2560)
    be = ShapeBackend(t, 8, 128)
    arange = torch.arange(t, device="meta")
    hidden = model.backbone(e, AttentionBatch(arange, arange, *[None] * 3), be)
    assert be.shapes[0] == ((t, 32, 128), (8, 128)) and len(be.shapes) == 36
    assert seen["o_proj_in"] == (t, 4096)
    assert tuple(hidden.shape) == (t, 2560)
    lt = model.local_transformer
    cache = lt.new_cache(1, torch.bfloat16, torch.device("meta"))
    l0 = lt.step(hidden[-1:], 0, cache)
    assert seen["c_attn_out"] == (1, 7680) and lt.cfg.n_head == 32 and lt.cfg.head_dim == 80
    assert tuple(cache.k.shape) == (1, 1, 32, 13, 80) and cache.length == 1
    assert tuple(model.local_text_lm_head(l0).shape) == (1, 2)
    assert tuple(F.linear(l0, model.audio_embeddings[0].weight).shape) == (1, 1024)


def test_tiny_frame_shapes_and_counts(tiny64, monkeypatch):
    calls = {"step": 0, "sample": []}
    lt = tiny64.local_transformer
    orig_step, orig_sample = lt.blocks, sampler_mod.sample

    def step(*a, **k):
        calls["step"] += 1
        return orig_step(*a, **k)

    def rec_sample(logits, *a, **k):
        calls["sample"].append(logits.shape[-1])
        return orig_sample(logits, *a, **k)

    monkeypatch.setattr(lt, "blocks", step)
    monkeypatch.setattr(sampler_mod, "sample", rec_sample)
    hidden = torch.randn(3, 64, dtype=torch.float64)
    sp = FrameSampling(*(torch.tensor([v] * 3) for v in (1.0, 50, 1.0, 1.7, 25, 0.8, 1.0, 5, 0, 0)))
    codes, stop = tiny64.decode_frame(hidden, sp)
    assert codes.shape == (3, 12) and stop.shape == (3,) and stop.dtype == torch.bool
    assert calls["step"] == 12 and calls["sample"] == [2] + [1024] * 12
    assert tiny64.frame_rows(codes).shape == (3, 13)
    assert (tiny64.frame_rows(codes)[:, 0] == 151656).all()


def test_code_qkv_table_is_the_first_c_attn_of_each_fed_back_code(tiny64):
    """precompute_code_qkv: channel k's table row c is c_attn(ln_1(Eaudio_k[c])), it stays out of the
    state dict, and a frame decoded through it equals one decoded with the GEMM."""
    lt = tiny64.local_transformer
    assert lt.code_qkv.shape == (tiny64.cfg.n_vq - 1, 1024, 3 * tiny64.cfg.hidden_size)
    assert "local_transformer.code_qkv" not in tiny64.state_dict()
    block = lt.h[0]
    for k in (0, 10):
        want = block.attn.c_attn(block.ln_1(tiny64.audio_embeddings[k].weight))
        assert torch.allclose(lt.code_qkv[k], want, rtol=0, atol=1e-12)
    hidden = torch.randn(5, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    sp = FrameSampling(*(torch.tensor([v] * 5) for v in (1.0, 50, 1.0, 1.7, 25, 0.8, 1.0, 5, 0, 0)))
    sp.seed = torch.arange(5)
    table = lt.code_qkv
    try:
        with_table = tiny64.decode_frame(hidden, sp)
        lt.code_qkv = None
        with_gemm = tiny64.decode_frame(hidden, sp)
    finally:
        lt.code_qkv = table
    assert torch.equal(with_table[0], with_gemm[0]) and torch.equal(with_table[1], with_gemm[1])


# =============================================================================
# §7.2 pad rows and sum order
# =============================================================================
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pad_rows_embed_to_text_exactly(tiny64, dtype):
    m = make_model(tiny_config(), dtype=dtype, seed=1)
    ids = torch.tensor([0, 1, 151643, 151644, 151654, 151656, 151669, 151670, 151935, 12345])
    rows = torch.full((len(ids), 13), PAD)
    rows[:, 0] = ids
    e = m.embed_rows(rows)
    assert torch.equal(e, m.transformer.embed_tokens.weight[ids])
    assert e.dtype == dtype


def test_embedding_sum_order_and_no_pad_lookup():
    m = make_model(tiny_config(), dtype=torch.bfloat16, seed=2)
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 1024, (64, 13), generator=g)
    rows[:, 0] = torch.randint(0, 151936, (64,), generator=g)
    rows[:, 1:][torch.rand(64, 12, generator=g) < 0.3] = PAD  # some pad codes per row
    rows[5, 1:] = PAD
    looked_up = []
    for table in m.audio_embeddings:
        table.register_forward_pre_hook(lambda mod, args: looked_up.append(int(args[0].max())))
    e = m.embed_rows(rows)
    assert max(looked_up) < 1024  # the pad code never indexes a 1024-row table

    W = [t.weight for t in m.audio_embeddings]
    expect = m.transformer.embed_tokens.weight[rows[:, 0]].clone()
    for k in range(12):  # text, c0, ..., c11: one bf16 add per channel
        ids = rows[:, k + 1]
        valid = ids != PAD
        expect[valid] = expect[valid] + W[k][ids[valid]]
    assert torch.equal(e, expect)
    # The order is observable in bf16: audio codes summed first then text gives other bits.
    other = torch.zeros_like(expect)
    for k in reversed(range(12)):
        ids = rows[:, k + 1]
        valid = ids != PAD
        other[valid] = other[valid] + W[k][ids[valid]]
    other = other + m.transformer.embed_tokens.weight[rows[:, 0]]
    assert not torch.equal(e, other)


# =============================================================================
# §7.3 RoPE numbers
# =============================================================================
X = torch.tensor([1.0, 2.0, 3.0, 4.0])
INTERLEAVED_1E6 = [-1.1426397, 1.9220756, 2.9959985, 4.0029980]
INTERLEAVED_1E4 = [-1.1426397, 1.9220756, 2.9598507, 4.0297995]
HALF_SPLIT_1E6 = [-1.9841106, 1.9959990, 2.4623779, 4.0019980]


def _local_tables(base: float) -> LocalTransformer:
    return LocalTransformer(LocalConfig(n_embd=4, n_head=1, n_inner=8, n_layer=1, rope_base=base), positions=13)


@pytest.mark.parametrize("base,expected", [(1e6, INTERLEAVED_1E6), (1e4, INTERLEAVED_1E4)])
def test_local_rope_is_interleaved(base, expected):
    lt = _local_tables(base)
    assert torch.allclose(rope_inv_freq(base, 4), torch.tensor([1.0, 1.0 / math.sqrt(base)]), rtol=1e-7)
    out = rotate_interleaved(X, lt.cos_table[1], lt.sin_table[1])
    assert torch.allclose(out, torch.tensor(expected), atol=1e-6, rtol=0)
    # p = 0 is the identity, exactly
    assert torch.equal(rotate_interleaved(X, lt.cos_table[0], lt.sin_table[0]), X)


def test_half_split_gives_the_other_numbers():
    inv = rope_inv_freq(1e6, 4)
    cos, sin = inv.cos()[None], inv.sin()[None]  # p = 1
    out = rotate_half_split(X[None, None], cos, sin)[0, 0]
    assert torch.allclose(out, torch.tensor(HALF_SPLIT_1E6), atol=1e-6, rtol=0)
    assert not torch.allclose(out, torch.tensor(INTERLEAVED_1E6), atol=1e-3)
    # the backbone's tables at position 1 are exactly these
    bb = MossTTSLocal(replace(tiny_config(), backbone=replace(tiny_config().backbone, head_dim=4,
                                                               rope_theta=1e6))).transformer
    c, s = bb.rope(torch.tensor([1]), torch.float32)
    assert torch.equal(c, cos) and torch.equal(s, sin)


def test_real_inv_freq_values_fp32():
    local = rope_inv_freq(1e6, 80)
    assert local.dtype == torch.float32 and local.shape == (40,)
    assert local[0].item() == 1.0
    assert local[1].item() == pytest.approx(0.70794576, rel=1e-7)
    assert local[2].item() == pytest.approx(0.50118720, rel=1e-7)
    assert local[39].item() == pytest.approx(1.412537e-6, rel=1e-6)
    backbone = rope_inv_freq(1e6, 128)
    assert backbone.shape == (64,)
    # fp32 exponent and fp32 power (not a float64 table rounded to fp32)
    e = torch.arange(0, 128, 2).to(torch.float32) / 128
    assert torch.equal(backbone, 1.0 / (1e6 ** e))
    m = build_model(preset="tiny", dtype="bfloat16")
    assert m.transformer.inv_freq.dtype == torch.float32
    assert torch.equal(m.transformer.inv_freq, rope_inv_freq(1e6, 16))


# =============================================================================
# Independent transcription of §3 (explicit formulas over the raw weights)
# =============================================================================
class Spec:
    """§3.1–§3.5 written out from the spec text, for float64 on CPU."""

    def __init__(self, model: MossTTSLocal):
        self.cfg = model.cfg
        self.w = {k: v.detach() for k, v in model.state_dict().items()}

    # -- helpers ----------------------------------------------------------------
    @staticmethod
    def inv_freq(base: float, d: int) -> torch.Tensor:
        i = torch.arange(d // 2)
        return 1.0 / torch.pow(torch.tensor(base, dtype=torch.float32), (2 * i).to(torch.float32) / d)

    def rms(self, x, w):
        xf = x.to(torch.float64)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.backbone.rms_norm_eps)
        return w * y.to(x.dtype)

    def layer_norm(self, x, w, b):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)  # biased
        return (x - mu) / torch.sqrt(var + self.cfg.local.layer_norm_epsilon) * w + b

    def embed(self, rows):
        e = self.w["transformer.embed_tokens.weight"][rows[:, 0]].clone()
        for k in range(self.cfg.n_vq):
            for t in range(rows.shape[0]):
                c = int(rows[t, k + 1])
                if c != self.cfg.audio_pad_code:
                    e[t] = e[t] + self.w[f"audio_embeddings.{k}.weight"][c]
        return e

    # -- backbone, full causal recompute ----------------------------------------------
    def backbone(self, rows):
        cfg, w = self.cfg.backbone, self.w
        x = self.embed(rows)
        T, nh, nkv, d = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = d // 2
        ang = torch.arange(T, dtype=torch.float32)[:, None] * self.inv_freq(cfg.rope_theta, d)[None]
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)  # [T, d/2]

        def rope(v):  # half-split: pairs (i, i + d/2)
            out = torch.empty_like(v)
            for i in range(h):
                c, s = cos[:, i, None], sin[:, i, None]
                out[..., i] = v[..., i] * c - v[..., i + h] * s
                out[..., i + h] = v[..., i + h] * c + v[..., i] * s
            return out

        for li in range(cfg.num_hidden_layers):
            p = f"transformer.layers.{li}."
            n = self.rms(x, w[p + "input_layernorm.weight"])
            q = (n @ w[p + "self_attn.q_proj.weight"].T).view(T, nh, d)
            k = (n @ w[p + "self_attn.k_proj.weight"].T).view(T, nkv, d)
            v = (n @ w[p + "self_attn.v_proj.weight"].T).view(T, nkv, d)
            q = rope(self.rms(q, w[p + "self_attn.q_norm.weight"]))  # QK-norm before RoPE
            k = rope(self.rms(k, w[p + "self_attn.k_norm.weight"]))
            heads = []
            for hq in range(nh):
                kv = hq // (nh // nkv)
                scores = q[:, hq] @ k[:, kv].T / math.sqrt(d)
                scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
                heads.append(torch.softmax(scores, -1) @ v[:, kv])
            attn = torch.cat(heads, dim=-1)  # [T, nh*d]
            x = x + attn @ w[p + "self_attn.o_proj.weight"].T
            n2 = self.rms(x, w[p + "post_attention_layernorm.weight"])
            g = n2 @ w[p + "mlp.gate_proj.weight"].T
            x = x + ((g * torch.sigmoid(g)) * (n2 @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        return self.rms(x, w["transformer.norm.weight"])

    # -- local transformer ------------------------------------------------------------
    def local_step(self, x, p, cache):
        cfg, w = self.cfg.local, self.w
        H, nh = cfg.n_embd, cfg.n_head
        d = H // nh
        inv = self.inv_freq(cfg.rope_base, d)
        ang = torch.tensor(float(p), dtype=torch.float32) * inv
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)

        def rope(v):  # interleaved: pairs (2i, 2i+1)
            out = torch.empty_like(v)
            for i in range(d // 2):
                out[:, 2 * i] = v[:, 2 * i] * cos[i] - v[:, 2 * i + 1] * sin[i]
                out[:, 2 * i + 1] = v[:, 2 * i + 1] * cos[i] + v[:, 2 * i] * sin[i]
            return out

        absolute = cfg.position_embedding_type == "absolute"
        if absolute:
            x = x + w["local_transformer.wpe.weight"][p]
        for b in range(cfg.n_layer):
            pre = f"local_transformer.h.{b}."
            a = self.layer_norm(x, w[pre + "ln_1.weight"], w[pre + "ln_1.bias"])
            qkv = a @ w[pre + "attn.c_attn.weight"].T + w[pre + "attn.c_attn.bias"]
            q, k, v = qkv[0:H].view(nh, d), qkv[H:2 * H].view(nh, d), qkv[2 * H:3 * H].view(nh, d)
            if not absolute:
                q, k = rope(q), rope(k)
            cache[b].append((k, v))
            assert len(cache[b]) == p + 1
            K = torch.stack([kk for kk, _ in cache[b]], 1)  # [nh, p+1, d]
            V = torch.stack([vv for _, vv in cache[b]], 1)
            o = torch.stack([torch.softmax(K[h] @ q[h] / math.sqrt(d), -1) @ V[h] for h in range(nh)])
            x = x + o.reshape(H) @ w[pre + "attn.c_proj.weight"].T + w[pre + "attn.c_proj.bias"]
            m = self.layer_norm(x, w[pre + "ln_2.weight"], w[pre + "ln_2.bias"])
            f = m @ w[pre + "mlp.fc_in.weight"].T + w[pre + "mlp.fc_in.bias"]
            x = x + (f * torch.sigmoid(f)) @ w[pre + "mlp.fc_out.weight"].T + w[pre + "mlp.fc_out.bias"]
        return self.layer_norm(x, w["local_transformer.ln_f.weight"], w["local_transformer.ln_f.bias"])

    # -- §3.5 loop ----------------------------------------------------------------------
    def generate(self, prompt, sc: worker_pb2.SamplingConfig, max_frames: int, log=None):
        cfg = self.cfg
        rows = [list(map(int, r)) for r in prompt]
        presence = torch.zeros(1, cfg.n_vq, cfg.audio_vocab_size, dtype=torch.bool)
        f32 = lambda v: torch.tensor([v], dtype=torch.float32)  # noqa: E731
        i64 = lambda v: torch.tensor([int(v)])  # noqa: E731
        seed = i64(sc.seed)
        width = cfg.n_vq + 1  # sampler position = n·13 + channel for the real model (n_vq 12)
        frames = []
        for n in range(max_frames):
            H = self.backbone(torch.tensor(rows))[-1]  # position T + n - 1 of the last row
            cache = [[] for _ in range(cfg.local.n_layer)]
            l = self.local_step(H, 0, cache)
            z = (l @ self.w["local_text_lm_head.weight"].T)[None]
            if log is not None:
                log.append(z)
            s = sample(z, f32(sc.text_temperature), i64(sc.text_top_k), f32(sc.text_top_p), seed, i64(width * n))
            if int(s) == 1 and n >= sc.min_frames:
                return frames, True
            codes = []
            for k in range(cfg.n_vq):
                E = self.w[f"audio_embeddings.{k}.weight"]
                z = (l @ E.T)[None]
                z = apply_repetition_penalty(z, presence[:, k], f32(sc.audio_repetition_penalty or 1.0))
                if log is not None:
                    log.append(z)
                c = int(sample(z, f32(sc.audio_temperature), i64(sc.audio_top_k), f32(sc.audio_top_p),
                               seed, i64(width * n + k + 1)))
                codes.append(c)
                if k < cfg.n_vq - 1:
                    l = self.local_step(E[c], k + 1, cache)
            for k, c in enumerate(codes):
                presence[0, k, c] = True
            row = [cfg.audio_assistant_slot_token_id, *codes]
            frames.append(row)
            rows.append(row)
        return frames, False


def _odd_config() -> MossTTSLocalConfig:
    """Sizes unlike the real model: head_dim ≠ hidden/heads, 4:1 GQA, 2 local blocks, n_vq 5."""
    return MossTTSLocalConfig(
        backbone=BackboneConfig(vocab_size=1000, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=1, head_dim=10, rms_norm_eps=1e-5,
                                rope_theta=1e4),
        local=LocalConfig(n_embd=48, n_head=3, n_inner=72, n_layer=2, layer_norm_epsilon=1e-5, rope_base=1e4),
        n_vq=5, audio_vocab_size=64, audio_pad_code=64, pad_token_id=900, im_start_token_id=901,
        im_end_token_id=902, audio_start_token_id=903, audio_end_token_id=904, audio_user_slot_token_id=905,
        audio_assistant_slot_token_id=906, name="odd")


def _absolute_config() -> MossTTSLocalConfig:
    c = _odd_config()
    return replace(c, local=replace(c.local, position_embedding_type="absolute", n_layer=1))


def _synthetic_prompt(cfg: MossTTSLocalConfig, t: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    rows = np.full((t, cfg.row_width), cfg.audio_pad_code, dtype=np.int64)
    rows[:, 0] = g.integers(0, 800, t)
    ref = slice(3, 3 + t // 3)  # a reference span with codes
    rows[ref, 0] = cfg.audio_user_slot_token_id
    rows[ref, 1:] = g.integers(0, cfg.audio_vocab_size, (t // 3, cfg.n_vq))
    rows[-1, 0] = cfg.audio_start_token_id
    return rows


@pytest.mark.parametrize("cfg_fn", [tiny_config, _odd_config, _absolute_config], ids=["tiny", "odd", "absolute"])
def test_modules_match_spec_transcription(cfg_fn):
    cfg = cfg_fn()
    model = make_model(cfg, seed=4)
    precompute_code_qkv(model)  # as build_model does: fed-back codes' first c_attn from the table (rope configs)
    spec = Spec(model)
    prompt = _synthetic_prompt(cfg, 14, seed=5)
    rows = torch.as_tensor(prompt)

    # §3.1 + §3.2: final-norm hidden of every prompt row
    assert torch.allclose(model.embed_rows(rows), spec.embed(rows), rtol=0, atol=0)
    kv = ContiguousKVAttention(cfg.backbone.num_hidden_layers, cfg.backbone.num_key_value_heads,
                               cfg.backbone.head_dim, torch.float64, torch.device("cpu"))
    from gpu_worker.reference import _plain_batch
    with torch.inference_mode():
        hidden = model.backbone(model.embed_rows(rows), _plain_batch(torch.arange(len(rows))), kv)
    expect = spec.backbone(rows)
    assert torch.allclose(hidden, expect, rtol=1e-10, atol=1e-10), (hidden - expect).abs().max()

    # §3.3–§3.5: whole generation, sampled, with repetition penalty: identical frames, and
    # the logits the model samples from match the transcription's.
    sc = sampling_config(seed=7, repetition_penalty=1.25, min_frames=4)
    model_logits, spec_logits = [], []
    orig = sampler_mod.sample

    def rec(logits, *a, **k):
        model_logits.append(logits)
        return orig(logits, *a, **k)

    sampler_mod.sample = rec
    try:
        frames, stopped = generate_reference(model, prompt, sc, max_frames=6)
    finally:
        sampler_mod.sample = orig
    sframes, sstopped = spec.generate(prompt, sc, 6, log=spec_logits)
    assert (frames, stopped) == (sframes, sstopped)
    assert len(frames) >= 2
    # decode_frame samples all 13 even on a stop frame; the spec loop breaks after the stop draw
    for a, b in zip(model_logits, spec_logits):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-9)


# =============================================================================
# §7.10 loop bookkeeping (reference generator and serving engine)
# =============================================================================
def _instrument(model, monkeypatch):
    log = {"cache_len": [], "new_cache": 0, "positions": [], "backbone_positions": []}
    lt = model.local_transformer
    step, new_cache, samp, backbone = lt.blocks, lt.new_cache, sampler_mod.sample, model.backbone

    def rec_step(x, h, p, cache):
        out = step(x, h, p, cache)
        log["cache_len"].append(cache.length)
        assert cache.length == p + 1
        return out

    def rec_new_cache(*a, **k):
        log["new_cache"] += 1
        log["cache_len"].append(0)
        return new_cache(*a, **k)

    def rec_sample(logits, t, k, p, seed, position):
        log["positions"].append(position.tolist())
        return samp(logits, t, k, p, seed, position)

    def rec_backbone(x, batch, backend):
        log["backbone_positions"].append(batch.positions.tolist())
        return backbone(x, batch, backend)

    monkeypatch.setattr(lt, "blocks", rec_step)
    monkeypatch.setattr(lt, "new_cache", rec_new_cache)
    monkeypatch.setattr(sampler_mod, "sample", rec_sample)
    monkeypatch.setattr(model, "backbone", rec_backbone)
    return log


def _check_bookkeeping(log, t: int, frames: int):
    per_frame = [0] + list(range(1, 13))  # reset, then 12 local steps
    assert log["new_cache"] >= frames
    assert log["cache_len"][: 13 * frames] == per_frame * frames
    pos = [p[0] for p in log["positions"]]
    assert pos[: 13 * frames] == [13 * n + c for n in range(frames) for c in range(13)]
    assert log["backbone_positions"][0] == list(range(t))
    assert [p[0] for p in log["backbone_positions"][1:frames]] == [t + n for n in range(frames - 1)]


def test_loop_bookkeeping_reference(tiny64, monkeypatch):
    prompt = _synthetic_prompt(tiny64.cfg, 10, seed=1)
    log = _instrument(tiny64, monkeypatch)
    frames, stopped = generate_reference(tiny64, prompt, sampling_config(3, min_frames=5), max_frames=5)
    assert len(frames) == 5 and not stopped
    _check_bookkeeping(log, 10, 5)


def test_loop_bookkeeping_engine(tiny64, monkeypatch):
    prompt = _synthetic_prompt(tiny64.cfg, 10, seed=1)
    log = _instrument(tiny64, monkeypatch)
    drv = EngineDriver(tiny64)
    out = drv.run({1: Req(prompt, sampling_config(3, min_frames=5), 5)})
    assert len(out[1][0]) == 5
    _check_bookkeeping(log, 10, 5)


# =============================================================================
# Serving engine == reference generator
# =============================================================================
class Req:
    def __init__(self, rows, sampling, max_frames, chunks=1, start_step=0, prompt_length=None,
                 generation_step=0):
        self.rows, self.sampling, self.max_frames = np.asarray(rows), sampling, max_frames
        self.chunks, self.start_step = chunks, start_step
        self.prompt_length = len(self.rows) if prompt_length is None else prompt_length
        self.generation_step = generation_step


class EngineDriver:
    """A small scheduler: requests join at start_step, prefill in `chunks` pieces (one
    per step, batched with other requests' decode), then decode until the stop head
    or max_frames; stopped/finished requests are released in the next plan."""

    def __init__(self, model, num_slots=4096, max_batch=8):
        self.engine = Engine(model, num_kv_slots=num_slots, max_batch=max_batch, max_context=1024)
        self.next_slot = 0

    def slots(self, n):
        s = list(range(self.next_slot, self.next_slot + n))
        self.next_slot += n
        return s

    def run(self, reqs: dict[int, Req], max_steps=200, after_frames=None):
        out = {rid: [[], False] for rid in reqs}
        pending = {rid: np.array_split(np.arange(len(r.rows)), r.chunks) for rid, r in reqs.items()}
        done_chunks = {rid: 0 for rid in reqs}
        decoding, release = set(), []
        for step in range(max_steps):
            plan = worker_pb2.StepPlan(step_id=step, release=release)
            release = []
            for rid, r in reqs.items():
                if step < r.start_step or done_chunks[rid] >= r.chunks:
                    continue
                i = done_chunks[rid]
                idx = pending[rid][i]
                it = plan.prefill.add(request_id=rid, first_chunk=i == 0, last_chunk=i == r.chunks - 1,
                                      prompt_length=r.prompt_length, generation_step=r.generation_step)
                it.rows.CopyFrom(rows_matrix(np.asarray(r.rows[idx])))
                it.kv_slots.extend(self.slots(len(idx)))
                if i == 0:
                    it.sampling.CopyFrom(r.sampling)
                done_chunks[rid] += 1
            for rid in sorted(decoding):
                plan.decode.add(request_id=rid, kv_slot=self.slots(1)[0])
            if not plan.prefill and not plan.decode and not plan.release:
                if all(done_chunks[rid] >= reqs[rid].chunks for rid in reqs):
                    break
                continue
            j = self.engine.execute(plan)
            rows = np.frombuffer(j.rows.data, "<i4").reshape(j.rows.rows, j.rows.cols)
            for i, rid in enumerate(j.request_ids):
                if j.stopped[i]:
                    out[rid][1] = True
                    decoding.discard(rid)
                    release.append(rid)
                    continue
                out[rid][0].append(rows[i].tolist())
                if len(out[rid][0]) >= reqs[rid].max_frames:
                    decoding.discard(rid)
                    release.append(rid)
                else:
                    decoding.add(rid)
        return {rid: (frames, stopped) for rid, (frames, stopped) in out.items()}


def _reference(model, req: Req):
    return generate_reference(model, req.rows, req.sampling, req.max_frames)


@pytest.fixture(scope="module")
def prompts(tiny32):
    tok = load_tokenizer(None)
    cfg = tiny32.cfg
    g = np.random.default_rng(0)
    ref = g.integers(0, 1024, (9, 12))
    return {
        "hello": build_prompt_rows(cfg, tok, "Hello there.", language="English"),
        "long": build_prompt_rows(cfg, tok, "A much longer sentence to say, with commas, and more words.",
                                  language="English", tokens=40),
        "clone": build_prompt_rows(cfg, tok, "Clone this voice.", references=[ref], language="English"),
        "cont": build_prompt_rows(cfg, tok, "and then some.", continuation=ref[:4],
                                  continuation_transcript="It begins "),
    }


def test_engine_matches_reference_batched(tiny32, prompts):
    # min_frames keeps the (random, trigger-happy) stop head from ending requests at once
    reqs = {
        1: Req(prompts["hello"], sampling_config(11, min_frames=8), 14),
        2: Req(prompts["long"], sampling_config(12, min_frames=10, repetition_penalty=1.3), 14),
        3: Req(prompts["clone"], sampling_config(13, min_frames=9, temperature=0.9, top_k=40, top_p=0.9), 14,
               chunks=3, start_step=2),
        4: Req(prompts["cont"], sampling_config(11, min_frames=14), 14, chunks=2, start_step=1),
        5: Req(prompts["hello"], sampling_config(99, min_frames=6, audio_temperature=0.0), 10),
    }
    got = EngineDriver(tiny32).run(reqs)
    outcomes = set()
    for rid, req in reqs.items():
        want = _reference(tiny32, req)
        assert got[rid] == want, f"request {rid}: engine {got[rid]} != reference {want}"
        outcomes.add(want[1])
        assert len(want[0]) >= req.sampling.min_frames
    assert outcomes == {True, False}  # both stop-head and budget endings are covered
    # the penalty is live: without it request 2 differs
    no_pen = Req(prompts["long"], sampling_config(12, min_frames=10), 14)
    assert _reference(tiny32, no_pen)[0] != got[2][0]


def test_engine_matches_reference_after_reprefill(tiny32, prompts):
    """A request retracted after k frames and re-prefilled with prompt + its own rows
    (generation_step k, prompt_length T) continues exactly like an uninterrupted run;
    the repetition-penalty history is rebuilt from the re-prefilled rows."""
    sc = sampling_config(21, min_frames=12, repetition_penalty=1.5)
    prompt = prompts["clone"]
    want, _ = _reference(tiny32, Req(prompt, sc, 12))
    k = 5
    first = EngineDriver(tiny32).run({1: Req(prompt, sc, k)})
    assert first[1][0] == want[:k]
    resumed = Req(np.concatenate([prompt, np.asarray(want[:k])]), sc, 12 - k, chunks=2,
                  prompt_length=len(prompt), generation_step=k)
    again = EngineDriver(tiny32).run({7: resumed})
    assert first[1][0] + again[7][0] == want


def test_seed_derivation_used_by_reference(tiny32, prompts):
    sc = sampling_config(1234)
    assert sc.seed == derive_sampling_seed(1234) == 626674338
    a = generate_reference(tiny32, prompts["hello"], sc, 3)
    b = generate_reference(tiny32, prompts["hello"], {f.name: getattr(sc, f.name) for f in sc.DESCRIPTOR.fields}, 3)
    assert a == b
