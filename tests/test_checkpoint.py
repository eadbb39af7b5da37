"""Checkpoint loading (spec moss_tts_local.md §2) and config.json parsing (§1).

A tiny checkpoint is written in the upstream layout (config.json from
MossTTSLocalConfig.to_dict, float16 safetensors, upstream tensor names, single
file or shards + model.safetensors.index.json, with or without the tied
duplicates) and must reproduce the in-memory model exactly once that model's
weights are rounded to float16 the same way.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from chorus.moss_config import ConfigError, MossTTSLocalConfig, tiny_config
from gpu_worker.loader import CheckpointError, build_model, check_checkpoint
from gpu_worker.model import MossTTSLocal, init_random_weights
from gpu_worker.reference import generate_reference

PROMPT = np.array([[151644, *[1024] * 12]] + [[t, *[1024] * 12] for t in (872, 198, 27, 882, 29)]
                  + [[151654, *range(5, 17)], [151654, *range(100, 112)]]
                  + [[151669, *[1024] * 12]])
SAMPLING = dict(text_temperature=1.0, text_top_k=50, text_top_p=1.0, audio_temperature=1.7, audio_top_k=25,
                audio_top_p=0.8, audio_repetition_penalty=1.2, seed=626674338, min_frames=4)


def _model(cfg: MossTTSLocalConfig, seed: int = 0) -> MossTTSLocal:
    m = MossTTSLocal(cfg)
    init_random_weights(m, seed)
    return m.eval()


def write_checkpoint(model: MossTTSLocal, path: Path, *, shards: int = 1, tied: bool = False,
                     extra: dict[str, torch.Tensor] | None = None, drop: tuple[str, ...] = (),
                     rename: dict[str, str] | None = None, config: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or model.cfg.to_dict(), indent=2))
    sd = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    if tied:
        sd["text_lm_head.weight"] = sd["transformer.embed_tokens.weight"].clone()
        for k in range(model.cfg.n_vq):
            sd[f"audio_lm_heads.{k}.weight"] = sd[f"audio_embeddings.{k}.weight"].clone()
        sd["transformer.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # non-persistent upstream
    sd.update(extra or {})
    for name in drop:
        del sd[name]
    for old, new in (rename or {}).items():
        sd[new] = sd.pop(old)
    names = sorted(sd)
    if shards == 1:
        save_file(sd, str(path / "model.safetensors"))
        return path
    weight_map = {}
    for i, part in enumerate(np.array_split(np.array(names, dtype=object), shards)):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: sd[n] for n in part}, str(path / file))
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return path


def fp16_rounded(model: MossTTSLocal, dtype=torch.float32) -> MossTTSLocal:
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.to(torch.float16))
    return m.to(dtype)


@pytest.fixture(scope="module")
def tiny():
    return _model(tiny_config(), seed=5)


@pytest.mark.parametrize("shards,tied", [(1, False), (1, True), (3, False), (4, True)])
def test_roundtrip_reproduces_in_memory_model(tiny, tmp_path, shards, tied):
    ckpt = write_checkpoint(tiny, tmp_path / "ckpt", shards=shards, tied=tied)
    loaded = build_model(model_dir=str(ckpt), dtype="float32")
    expect = fp16_rounded(tiny)
    a, b = loaded.state_dict(), expect.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert loaded.cfg.to_dict() == {**tiny.cfg.to_dict(), "chorus_name": tiny.cfg.name}
    got = generate_reference(loaded, PROMPT, SAMPLING, 8)
    assert got == generate_reference(expect, PROMPT, SAMPLING, 8)
    assert len(got[0]) >= 4


def test_load_in_bf16_keeps_fp32_rope_and_casts(tiny, tmp_path):
    ckpt = write_checkpoint(tiny, tmp_path / "ckpt")
    m = build_model(model_dir=str(ckpt), dtype="bfloat16")
    assert m.transformer.embed_tokens.weight.dtype == torch.bfloat16
    assert m.transformer.inv_freq.dtype == torch.float32
    assert torch.equal(m.local_text_lm_head.weight, tiny.local_text_lm_head.weight.to(torch.float16).to(torch.bfloat16))
    frames, _ = generate_reference(m, PROMPT, SAMPLING, 3)
    assert len(frames) == 3 and all(len(r) == 13 for r in frames)


def test_absolute_variant_loads_wpe(tmp_path):
    cfg = tiny_config()
    cfg = replace(cfg, local=replace(cfg.local, position_embedding_type="absolute", n_layer=2))
    model = _model(cfg, seed=1)
    assert "local_transformer.wpe.weight" in model.state_dict()
    ckpt = write_checkpoint(model, tmp_path / "abs", shards=2)
    loaded = build_model(model_dir=str(ckpt), dtype="float32")
    assert loaded.cfg.local.position_embedding_type == "absolute" and loaded.cfg.local.n_layer == 2
    assert generate_reference(loaded, PROMPT, SAMPLING, 5) == generate_reference(fp16_rounded(model), PROMPT,
                                                                                   SAMPLING, 5)


def test_tied_duplicates_are_not_loaded_and_mismatch_warns(tiny, tmp_path, caplog):
    bad = tiny.audio_embeddings[3].weight.detach().to(torch.float16) + 1
    ckpt = write_checkpoint(tiny, tmp_path / "ckpt", shards=2, tied=True,
                            extra={"audio_lm_heads.3.weight": bad})
    with caplog.at_level(logging.WARNING, logger="gpu_worker.loader"):
        loaded = build_model(model_dir=str(ckpt), dtype="float32")
    assert "audio_lm_heads.3.weight" in caplog.text and "audio_lm_heads.2.weight" not in caplog.text
    # the head is the embedding, not the file's head
    assert torch.equal(loaded.audio_embeddings[3].weight, fp16_rounded(tiny).audio_embeddings[3].weight)


def test_missing_tensor_is_named(tiny, tmp_path):
    ckpt = write_checkpoint(tiny, tmp_path / "ckpt", shards=2, drop=("transformer.layers.1.mlp.down_proj.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensors: transformer\.layers\.1\.mlp\.down_proj\.weight"):
        build_model(model_dir=str(ckpt))


def test_local_text_head_must_be_loaded(tiny, tmp_path):
    ckpt = write_checkpoint(tiny, tmp_path / "ckpt", tied=True, drop=("local_text_lm_head.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensors: local_text_lm_head\.weight"):
        build_model(model_dir=str(ckpt))


def test_renamed_tensor_is_named(tiny, tmp_path):
    ckpt = write_checkpoint(tiny, tmp_path / "ckpt",
                            rename={"local_transformer.h.0.attn.c_attn.weight": "local_transformer.h.0.attn.qkv.weight"})
    with pytest.raises(CheckpointError) as e:
        build_model(model_dir=str(ckpt))
    msg = str(e.value)
    assert "missing tensors: local_transformer.h.0.attn.c_attn.weight" in msg
    assert "unexpected tensors: local_transformer.h.0.attn.qkv.weight" in msg


def test_sglang_names_get_a_hint(tiny, tmp_path):
    ckpt = write_checkpoint(tiny, tmp_path / "ckpt", rename={"transformer.norm.weight": "model.norm.weight"})
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*sglang-omni"):
        build_model(model_dir=str(ckpt))


def test_transposed_c_attn_is_reported(tiny, tmp_path):
    ckpt = write_checkpoint(tiny, tmp_path / "ckpt", extra={"local_transformer.h.0.attn.c_attn.weight":
                                                            torch.zeros(64, 192, dtype=torch.float16)})
    with pytest.raises(CheckpointError, match=r"c_attn\.weight: checkpoint \(64, 192\), model expects \(192, 64\)"
                                              r".*transposed"):
        build_model(model_dir=str(ckpt))


def test_n_inner_is_checked_against_fc_in(tiny, tmp_path):
    cfg = tiny.cfg.to_dict()
    del cfg["gpt2_config"]["n_inner"]  # → 4 * n_embd = 256, but the weights have 128 rows
    ckpt = write_checkpoint(tiny, tmp_path / "ckpt", config=cfg)
    with pytest.raises(CheckpointError, match=r"fc_in\.weight: checkpoint \(128, 64\), model expects \(256, 64\)"
                                              r".*n_inner is 256"):
        build_model(model_dir=str(ckpt))


def test_index_naming_an_absent_shard_fails(tiny, tmp_path):
    ckpt = write_checkpoint(tiny, tmp_path / "ckpt", shards=2)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        build_model(model_dir=str(ckpt))


def test_no_weights_at_all(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_dict()))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        build_model(model_dir=str(tmp_path))
    # ... but load_format dummy needs only the config
    m = build_model(model_dir=str(tmp_path), load_format="dummy", dtype="float32", seed=2)
    assert m.transformer.embed_tokens.weight.shape == (151936, 64)
    assert torch.isfinite(m.transformer.layers[0].self_attn.q_proj.weight).all()
    with pytest.raises(ValueError, match="load_format"):
        build_model(model_dir=str(tmp_path), load_format="pt")


def test_config_error_surfaces_from_build_model(tiny, tmp_path):
    cfg = tiny.cfg.to_dict()
    del cfg["gpt2_config"]["rope_base"]
    ckpt = write_checkpoint(tiny, tmp_path / "ckpt", config=cfg)
    with pytest.raises(ConfigError, match="rope_base"):
        build_model(model_dir=str(ckpt))


def test_check_checkpoint_reads_headers_only(tiny, tmp_path):
    ckpt = write_checkpoint(tiny, tmp_path / "ckpt", shards=3, tied=True)
    where = check_checkpoint(tiny.cfg, ckpt)
    assert "local_text_lm_head.weight" in where and "audio_lm_heads.0.weight" in where
    assert not any("inv_freq" in n for n in where)


# =============================================================================
# config.json (§1)
# =============================================================================
def base_config() -> dict:
    return MossTTSLocalConfig().to_dict()


def test_roundtrip_presets():
    for cfg in (MossTTSLocalConfig(), tiny_config()):
        again = MossTTSLocalConfig.from_dict(json.loads(cfg.to_json()))
        assert again == cfg


def test_v1_5_defaults():
    c = MossTTSLocalConfig.from_dict(base_config())
    assert (c.backbone.head_dim, c.backbone.rope_theta, c.local.head_dim, c.local.rope_base) == (128, 1e6, 80, 1e6)
    assert c.codebook_sizes == (1024,) * 12 and c.row_width == 13


@pytest.mark.parametrize("edit,match", [
    (lambda d: d.update(model_type="moss_tts_delay"), r"moss_tts_delay.*v1\.0"),
    (lambda d: d.update(model_type="qwen3"), r"moss_tts_local"),
    (lambda d: d["gpt2_config"].pop("rope_base"), r"no rope_base"),
    (lambda d: d["gpt2_config"].update(rope_base=None), r"no rope_base"),
    (lambda d: d.update(local_text_head_mode="full_vocab"), r"binary"),
    (lambda d: d.update(local_text_head_mode=" Full-Vocab "), r"full_vocab"),
    (lambda d: d.update(local_text_head_mode=None), r"full_vocab"),
    (lambda d: d.update(local_text_head_mode=""), r"full_vocab"),
    (lambda d: d.update(local_text_head_mode="ternary"), r"unknown"),
    (lambda d: d["gpt2_config"].update(n_embd=2048), r"n_embd 2048 must equal the backbone hidden_size 2560"),
    (lambda d: [d[k].pop("rope_theta") for k in ("qwen3_config", "language_config")], r"no rope_theta"),
    (lambda d: [d[k].pop("head_dim") for k in ("qwen3_config", "language_config")], r"no head_dim"),
    (lambda d: d["qwen3_config"].update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), r"scaling"),
    (lambda d: d["gpt2_config"].update(activation_function="gelu_new"), r"silu"),
    (lambda d: d["gpt2_config"].update(position_embedding_type="relative_key"), r"position_embedding_type"),
    (lambda d: d["gpt2_config"].update(n_head=7), r"divisible"),
    (lambda d: d["gpt2_config"].update(scale_attn_by_inverse_layer_idx=True), r"inverse_layer_idx"),
    (lambda d: d.update(audio_pad_token_id=1000), r"must be >= audio_vocab_size 1024"),
    (lambda d: d.update(audio_codebook_sizes=[1024] * 11), r"12 positive sizes"),
    (lambda d: d["qwen3_config"].update(attention_bias=True), r"attention_bias"),
    (lambda d: d["qwen3_config"].update(num_key_value_heads=5), r"multiple"),
    (lambda d: d.update(local_transformer_layers=0), r"positive"),
    (lambda d: [d.pop(k) for k in ("qwen3_config", "language_config")], r"neither qwen3_config"),
])
def test_config_errors(edit, match):
    d = base_config()
    edit(d)
    with pytest.raises(ConfigError, match=match):
        MossTTSLocalConfig.from_dict(d)


def test_config_aliases_and_derived_values():
    d = base_config()
    q = d.pop("qwen3_config")
    d["language_config"] = q  # alias
    theta = q.pop("rope_theta")
    q["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}  # transformers >= 5 layout
    d["local_text_head_mode"] = "  BINARY "
    d["audio_pad_code"] = 2000  # overrides audio_pad_token_id
    d["audio_assistant_gen_slot_token_id"] = 151657  # overrides audio_assistant_slot_token_id
    d["local_transformer_layers"] = 2  # overrides gpt2_config.n_layer
    d["audio_vocab_size"] = 1000
    d["audio_codebook_sizes"] = [1024] * 12  # effective vocab = max
    g = d["gpt2_config"]
    g["hidden_size"] = g.pop("n_embd")  # GPT2Config attribute_map aliases
    g["num_attention_heads"] = g.pop("n_head")
    g["position_embedding_type"] = "RoPE"
    c = MossTTSLocalConfig.from_dict(d)
    assert c.backbone.rope_theta == 1e6 and c.audio_pad_code == 2000
    assert c.audio_assistant_slot_token_id == 151657 and c.local.n_layer == 2
    assert c.audio_vocab_size == 1024 and c.codebook_sizes == (1024,) * 12
    assert c.local.n_head == 32 and c.local.position_embedding_type == "rope"
    d2 = base_config()
    d2["qwen3_config"].pop("rope_theta")
    d2["qwen3_config"]["rope_scaling"] = {"rope_type": "default", "rope_theta": 5e5}
    assert MossTTSLocalConfig.from_dict(d2).backbone.rope_theta == 5e5
    d3 = base_config()
    d3.pop("local_text_head_mode")  # missing key → binary
    MossTTSLocalConfig.from_dict(d3)


def test_missing_gpt2_config_uses_upstream_derivation():
    d = base_config()
    del d["gpt2_config"]
    c = MossTTSLocalConfig.from_dict(d)
    assert c.local.position_embedding_type == "absolute"
    assert (c.local.n_embd, c.local.n_layer, c.local.n_head, c.local.n_inner) == (2560, 1, 32, 10240)
    assert c.local.layer_norm_epsilon == 1e-6 and c.local.activation_function == "silu"
    with torch.device("meta"):
        m = MossTTSLocal(c)
    assert m.state_dict()["local_transformer.wpe.weight"].shape == (13, 2560)
    assert m.state_dict()["local_transformer.h.0.mlp.fc_in.weight"].shape == (10240, 2560)


def test_gpt2_defaults_when_fields_absent():
    d = base_config()
    g = d["gpt2_config"]
    for k in ("n_inner", "layer_norm_epsilon", "n_layer"):
        g.pop(k)
    c = MossTTSLocalConfig.from_dict(d)
    assert c.local.n_inner == 4 * 2560 and c.local.layer_norm_epsilon == 1e-5 and c.local.n_layer == 12


def test_uneven_codebook_sizes_size_each_table():
    d = tiny_config().to_dict()
    d["audio_codebook_sizes"] = [1024] * 11 + [512]
    c = MossTTSLocalConfig.from_dict(d)
    assert c.audio_vocab_size == 1024 and c.codebook_sizes[-1] == 512
    assert MossTTSLocalConfig.from_dict(c.to_dict()) == c
    m = _model(c, seed=0)
    assert m.audio_embeddings[11].weight.shape == (512, 64)
    frames, _ = generate_reference(m, PROMPT, SAMPLING, 4)
    assert all(r[12] < 512 for r in frames)
