"""MOSS-Audio-Tokenizer codec and audio helpers: the spec §7 vectors, streaming
equivalence, encode, and checkpoint loading (tiny random-weight configs)."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import soundfile as sf
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from chorus import audio
from chorus.v1 import common_pb2
from vocoder_svc import codec as C
from vocoder_svc.codec import CodecConfig, full_v1, full_v2, tiny_v1, tiny_v2
from vocoder_svc.codec_checkpoint import _skeleton, build_codec, checkpoint_names, load_codec

F64 = torch.float64
# Tiny models: one intra-op thread is faster, and far faster on a shared, busy machine.
torch.set_num_threads(1)



def codes_for(model, t, n_q=32, b=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.codebook_size, (n_q, b, t), generator=g)


def stream_decode(model, codes, parts):
    state, outs, i = model.new_stream(), [], 0
    for n in parts:
        outs.append(model.decode_step(state, codes[:, :, i:i + n]))
        i += n
    assert i == codes.shape[2]
    return torch.cat(outs, dim=-1)


# ---- §7.1 shape ladder ----------------------------------------------------------------------

def decoder_ladder(model, t, device="cpu", dtype=torch.float32):
    q = model.config.quantizer
    x = torch.zeros(1, q.output_dim, t, device=device, dtype=dtype)
    shapes = [tuple(x.shape[1:])]
    for m in model.decoder:
        x = C.patch_up(x, m.patch_size) if isinstance(m, C.PatchedPretransform) else m(x)
        shapes.append(tuple(x.shape[1:]))
    x = C.deinterleave(x, model.config.internal_channels)
    shapes.append(tuple(x.shape[1:]))
    return shapes


def test_shape_ladder_full_sizes_on_meta():
    t = 3
    v1 = _skeleton(full_v1())
    assert decoder_ladder(v1, t, "meta")[:-1] == [
        (768, t), (1280, t), (640, 2 * t), (768, 2 * t), (384, 4 * t), (768, 4 * t), (384, 8 * t), (240, 8 * t),
        (1, 1920 * t)]
    v2 = _skeleton(full_v2())
    assert decoder_ladder(v2, t, "meta") == [
        (768, t), (1280, t), (640, 2 * t), (768, 2 * t), (384, 4 * t), (768, 4 * t), (384, 8 * t), (768, 8 * t),
        (384, 16 * t), (768, 16 * t), (384, 32 * t), (240, 32 * t), (1, 7680 * t), (2, 3840 * t)]
    # Encoder (v2): [2, N] -> [1, 2N] -> [240, 2N/240] -> ... -> [768, N/3840]
    n = 3840 * t
    x = C.interleave(torch.zeros(1, 2, n, device="meta"))
    assert tuple(x.shape[1:]) == (1, 2 * n)
    for m in v2.encoder:
        x = C.patch_down(x, m.patch_size) if isinstance(m, C.PatchedPretransform) else m(x)
        if m is v2.encoder[0]:
            assert tuple(x.shape[1:]) == (240, 2 * n // 240)
    assert tuple(x.shape[1:]) == (768, n // 3840)


def test_shape_ladder_tiny(v1_64, v2_64):
    t = 4
    assert decoder_ladder(v2_64, t, dtype=F64) == [
        (32, t), (64, t), (32, 2 * t), (32, 2 * t), (16, 4 * t), (32, 4 * t), (16, 8 * t), (32, 8 * t),
        (16, 16 * t), (32, 16 * t), (16, 32 * t), (240, 32 * t), (1, 7680 * t), (2, 3840 * t)]
    assert decoder_ladder(v1_64, t, dtype=F64) == [
        (32, t), (64, t), (32, 2 * t), (32, 2 * t), (16, 4 * t), (32, 4 * t), (16, 8 * t), (240, 8 * t),
        (1, 1920 * t), (1, 1920 * t)]
    assert v2_64.decode(codes_for(v2_64, t)).shape == (1, 2, 3840 * t)
    assert v1_64.decode(codes_for(v1_64, t)).shape == (1, 1, 1920 * t)


# ---- §7.2 checksums -------------------------------------------------------------------------------

@pytest.mark.parametrize("make, dec_tensors, dec_params, total", [
    (full_v1, 685, 886_609_920, 1_774_566_400), (full_v2, 932, 1_061_177_344, 2_123_701_248)])
def test_checksums(make, dec_tensors, dec_params, total):
    names = checkpoint_names(make())
    dec = {k: v for k, v in names.items() if k.startswith("decoder.")}
    enc = {k: v for k, v in names.items() if k.startswith("encoder.")}
    quant = {k: v for k, v in names.items() if k.startswith("quantizer.")}
    assert len(dec) == dec_tensors and sum(map(math.prod, dec.values())) == dec_params
    assert sum(map(math.prod, enc.values())) == dec_params
    assert len(quant) == 230 and sum(map(math.prod, quant.values())) == 1_346_560
    assert sum(map(math.prod, names.values())) == total


def test_full_v2_windows():
    cfg = full_v2()
    assert cfg.decoder_windows() == {0: 125, 2: 250, 4: 400, 6: 400, 8: 400, 10: 400}
    assert cfg.encoder_windows() == {1: 400, 3: 400, 5: 400, 7: 400, 9: 250, 11: 125}
    assert full_v1().decoder_windows() == {0: 125, 2: 250, 4: 500, 6: 1000}
    assert full_v1().encoder_windows() == {1: 1000, 3: 500, 5: 250, 7: 125}


# ---- config parsing ---------------------------------------------------------------------------------

def test_config_roundtrip_and_aliases():
    for cfg in (tiny_v2(), tiny_v1(), full_v2(), full_v1()):
        assert CodecConfig.from_dict(cfg.to_dict(), name=cfg.name) == cfg
    d = full_v2().to_dict()
    d["sample_rate"] = d.pop("sampling_rate")
    d["channels_numbers"] = d.pop("number_channels")
    d["reversed_decoder_kwargs"] = [s.swapped().to_dict() for s in reversed(full_v2().decoder)]
    del d["decoder_kwargs"]
    assert d["reversed_decoder_kwargs"][0] == {"module_type": "PatchedPretransform", "patch_size": 240}
    assert d["reversed_decoder_kwargs"][1]["input_dimension"] == 240
    parsed = CodecConfig.from_dict(d, name=full_v2().name)
    assert parsed == full_v2() and parsed.v2
    v1 = full_v1().to_dict()
    assert "number_channels" not in v1 and not CodecConfig.from_dict(v1).v2


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["decoder_kwargs"][2].update(input_dimension=600), "decoder[2]: input_dimension 600 != 640"),
    (lambda d: d["decoder_kwargs"][1].update(patch_size=4), "patch sizes multiply to"),
    (lambda d: d.update(downsample_rate=1920), "patch sizes multiply to"),
    (lambda d: d["encoder_kwargs"][1].update(input_dimension=480), "encoder[1]: input_dimension 480 != 240"),
    (lambda d: d["quantizer_kwargs"].update(output_dim=512), "input_dimension 768 != 512"),
    (lambda d: d["quantizer_kwargs"].update(quantizer_type="rvq"), "quantizer_type 'rvq'"),
    (lambda d: d["decoder_kwargs"][0].update(gating="swiglu"), "gating='swiglu' is not supported"),
    (lambda d: d.update(enable_channel_interleave=False), "enable_channel_interleave"),
    (lambda d: d.pop("decoder_kwargs"), "no decoder_kwargs"),
])
def test_config_consistency_errors(mutate, message):
    d = json.loads(json.dumps(full_v2().to_dict()))
    mutate(d)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        CodecConfig.from_dict(d)


# ---- §7.3 unit vectors -------------------------------------------------------------------------------

def test_rope_vectors():
    cos, sin = C.rope_cos_sin(torch.tensor([1]), 64, 10000.0)
    x = torch.zeros(1, 64)
    x[0, 0] = 1.0
    y = C.apply_rope(x, cos, sin)
    assert torch.allclose(y[0, :2], torch.tensor([0.540302, 0.841471]), atol=1e-6)
    cos, sin = C.rope_cos_sin(torch.tensor([1000]), 64, 10000.0)
    assert math.isclose(math.atan2(sin[0, 31].item(), cos[0, 31].item()), 0.133352, abs_tol=1e-6)
    cos, sin = C.rope_cos_sin(torch.tensor([1]), 64, 10000.0)
    freq = torch.atan2(sin[0], cos[0])
    for i, f in ((0, 1.0), (1, 0.74989), (16, 0.01), (31, 1.33352e-4)):
        assert math.isclose(freq[i].item(), f, rel_tol=2e-5)
    # The exact fp32 recipe: c in double, fp32 product and exp.
    c = torch.tensor(-2.0 * math.log(10000.0) / 64, dtype=torch.float32)
    want = torch.exp(torch.arange(32, dtype=torch.float32) * c) * torch.tensor(12345.0)
    cos, _ = C.rope_cos_sin(torch.tensor([12345]), 64, 10000.0)
    assert torch.equal(cos[0], torch.cos(want))
    # Pairs are interleaved (2i, 2i+1), and v-style channels beyond are untouched by other pairs.
    x = torch.randn(3, 8, dtype=F64)
    cos, sin = C.rope_cos_sin(torch.arange(3), 8, 100.0)
    y = C.apply_rope(x, cos, sin)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1))
    assert torch.allclose(y[..., 0::2] ** 2 + y[..., 1::2] ** 2, x[..., 0::2] ** 2 + x[..., 1::2] ** 2)


def test_window_mask():
    pos_k = torch.tensor([[-1, 0, 1, 2, 3, 4, 5]])
    m = C.window_mask(torch.tensor([[5, 0]]), pos_k, 3)
    assert pos_k[0][m[0, 0]].tolist() == [3, 4, 5]
    assert pos_k[0][m[0, 1]].tolist() == [0]


def test_patch_maps_and_interleave():
    x = torch.arange(2 * 3 * 4 * 5).reshape(2, 3 * 4, 5)  # C=3, h=4, L=5
    up = C.patch_up(x, 4)
    for c, j, t in ((0, 0, 0), (1, 2, 3), (2, 3, 4)):
        assert up[1, c, t * 4 + j] == x[1, c * 4 + j, t]
    assert torch.equal(C.patch_down(up, 4), x)
    y = torch.arange(2 * 6 * 8).reshape(2, 6, 8)
    down = C.patch_down(y, 2)
    assert down[1, 5 * 2 + 1, 3] == y[1, 5, 3 * 2 + 1]
    assert torch.equal(C.patch_up(down, 2), y)
    lr = torch.tensor([[[10, 11], [20, 21]]])
    assert C.interleave(lr).tolist() == [[[10, 20, 11, 21]]]
    assert torch.equal(C.deinterleave(C.interleave(lr), 2), lr)


def test_weight_norm_fold():
    w = C.fold_weight_norm(torch.tensor([[[2.0]]]), torch.tensor([[[3.0], [4.0]]]))
    assert torch.allclose(w.flatten(), torch.tensor([1.2, 1.6]))


def test_quantizer_fold(v2_64):
    m = build_codec(tiny_v2(), seed=3)  # fp32, as served
    codes = codes_for(m, 7, n_q=12, b=2)
    a, b = m.quantizer.decode(codes), m.quantizer.decode_per_codebook(codes)
    assert (a - b).abs().max() <= 1e-6 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("level_db, gain", [(None, 0.70795), (-25.0, 1.41254), (-20.0, 1.0), ("silence", 0.0)])
def test_loudness(level_db, gain):
    t = np.arange(48000) / 48000
    if level_db is None:
        x = np.sin(2 * np.pi * 440 * t)  # full-scale sine: mean square 0.5, -3.01 dB
    elif level_db == "silence":
        x = np.zeros_like(t)
    else:
        x = np.sin(2 * np.pi * 440 * t) * math.sqrt(2 * 10 ** (level_db / 10))
    wav = np.stack([x, x]).astype(np.float32)
    out = audio.prepare_reference(wav, 48000, 48000, 2)
    if level_db == "silence":
        assert not out.any()
    else:
        assert np.allclose(out, wav * gain, rtol=1e-4, atol=1e-6)


# ---- §7.4 streaming properties ------------------------------------------------------------------------

T33 = 33


@pytest.mark.parametrize("parts", [[1] * T33, [5, 25, 3], [2, 3, 5, 13, 10], [33]],
                         ids=["1xT", "5-25-3", "2-3-5-13", "whole"])
@pytest.mark.parametrize("which", ["v2", "v1"])
def test_chunked_equals_offline_f64(parts, which, v1_64, v2_64):
    model = v2_64 if which == "v2" else v1_64
    codes = codes_for(model, T33, n_q=12)
    offline = model.decode(codes)
    assert (stream_decode(model, codes, parts) - offline).abs().max() <= 1e-10


def test_chunk_longer_than_window_f64():
    # Every window 3 tokens: a 12-frame chunk is 12 tokens at stage 0 and 384 at the top.
    model = build_codec(tiny_v2(window=3), seed=4, dtype=F64)
    codes = codes_for(model, 40, n_q=12)
    offline = model.decode(codes)
    assert (stream_decode(model, codes, [12, 1, 27]) - offline).abs().max() <= 1e-10


@pytest.fixture(scope="module")
def narrow_64():
    return build_codec(tiny_v2(window=3), seed=6, dtype=F64)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=20))
def test_any_partition_equals_offline(narrow_64, sizes):
    total = sum(sizes)
    codes = codes_for(narrow_64, total, n_q=4, seed=total)
    assert (stream_decode(narrow_64, codes, sizes) - narrow_64.decode(codes)).abs().max() <= 1e-10


def test_chunked_equals_offline_f32():
    model = build_codec(tiny_v2(), seed=5)
    codes = codes_for(model, T33, n_q=12)
    offline = model.decode(codes)
    got = stream_decode(model, codes, [5, 25, 3])
    assert (got - offline).abs().max() <= 1e-6 * max(1.0, offline.abs().max().item())


def test_window_matters(v2_64):
    """Regression guard that the window is in force: a larger window changes the output."""
    codes = codes_for(v2_64, 12, n_q=12)
    wide = build_codec(tiny_v2(window=10_000), seed=1, dtype=F64)
    assert (wide.decode(codes) - v2_64.decode(codes)).abs().max() > 1e-3


def test_ring_of_w_cache_would_fail(monkeypatch, v2_64):
    """Regression guard (§4.3 pitfall): attending only to a ring of the last W
    keys, written before the queries run, loses keys and must not pass."""
    codes = codes_for(v2_64, 8, n_q=12)
    offline = v2_64.decode(codes)
    original = C.windowed_attention

    def ring(q, k, v, pos_q, pos_k, window, n_prev):
        if n_prev == 0:
            return original(q, k, v, pos_q, pos_k, window, n_prev)
        k, v, pos_k = k[:, :, -window:], v[:, :, -window:], pos_k[:, -window:]
        mask = C.window_mask(pos_q, pos_k, window).unsqueeze(1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    monkeypatch.setattr(C, "windowed_attention", ring)
    ringed = stream_decode(v2_64, codes, [1] * 8)
    assert not (ringed - offline).abs().max() <= 1e-3  # large error, or NaN where T_k > W


def test_causality(v2_64):
    k, t = 7, 16
    codes = codes_for(v2_64, t)
    other = codes.clone()
    other[:, :, k:] = codes_for(v2_64, t - k, seed=9)
    a, b = v2_64.decode(codes), v2_64.decode(other)
    hop = v2_64.hop
    assert torch.equal(a[..., :k * hop], b[..., :k * hop])
    assert (a[..., k * hop:] - b[..., k * hop:]).abs().max() > 1e-3


def test_batched_streams_and_isolation(v2_64):
    ca, cb = codes_for(v2_64, 12, n_q=12, seed=1), codes_for(v2_64, 12, n_q=12, seed=2)
    alone_a, alone_b = v2_64.decode(ca), v2_64.decode(cb)
    sa, sb = v2_64.new_stream(), v2_64.new_stream()
    out_a, out_b = [], []
    # A, then B, then both batched in one forward, then A again.
    out_a.append(v2_64.decode_step(sa, ca[:, :, :3]))
    out_b.append(v2_64.decode_step(sb, cb[:, :, :5]))
    both = v2_64.decode_step([sa, sb], torch.cat([ca[:, :, 3:7], cb[:, :, 5:9]], dim=1))
    out_a.append(both[:1])
    out_b.append(both[1:])
    out_a.append(v2_64.decode_step(sa, ca[:, :, 7:]))
    out_b.append(v2_64.decode_step(sb, cb[:, :, 9:]))
    assert (torch.cat(out_a, -1) - alone_a).abs().max() <= 1e-10
    assert (torch.cat(out_b, -1) - alone_b).abs().max() <= 1e-10
    assert sa.frames == 12 and sb.frames == 12
    fresh = v2_64.new_stream()  # a new stream behaves like the first one
    assert (v2_64.decode_step(fresh, ca[:, :, :3]) - out_a[0]).abs().max() == 0


def test_prefix_codebooks_decode(v2_64):
    codes = codes_for(v2_64, 4)
    assert v2_64.decode(codes[:12]).shape == (1, 2, 4 * 3840)
    with pytest.raises(ValueError, match="outside|lie in"):
        v2_64.decode(torch.full((12, 1, 2), 1024))


# ---- encode (§5) ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["v2", "v1"])
def test_encode_length_and_prefix(which, v1_64, v2_64):
    model = v2_64 if which == "v2" else v1_64
    g = torch.Generator().manual_seed(0)
    for n in (model.hop - 1, 3 * model.hop, 5 * model.hop + 17):
        wav = 0.1 * torch.randn(2, model.channels, n, generator=g, dtype=F64)
        full = model.encode(wav, 32)
        assert full.shape == (32, 2, n // model.hop)
        assert torch.equal(model.encode(wav, 12), full[:12])
    # Causal: appending audio does not change the codes of earlier whole frames.
    wav = 0.1 * torch.randn(1, model.channels, 6 * model.hop, generator=g, dtype=F64)
    assert torch.equal(model.encode(wav[..., :4 * model.hop + 5]), model.encode(wav)[:, :, :4])


def test_encode_decode_runs_f32():
    model = build_codec(tiny_v2(), seed=0)
    wav = 0.1 * torch.randn(1, 2, 4 * 3840 + 100)
    codes = model.encode(wav, 12)
    assert codes.dtype == torch.long and int(codes.max()) < 1024
    assert model.decode(codes).shape == (1, 2, 4 * 3840)


# ---- checkpoints ----------------------------------------------------------------------------------------------

def write_checkpoint(model, path, shards=1, wn="parametrizations", drop=()):
    """The released layout: weight-normed quantizer convs as g/v pairs (v scaled
    arbitrarily, so folding must divide by its norm)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_dict()))
    tensors = {}
    for name, p in model.named_parameters():
        t = p.detach().clone()
        if name.startswith("quantizer.") and t.dim() == 3:
            base = name[:-len(".weight")]
            g, v = t.flatten(1).norm(dim=1).reshape(-1, 1, 1), t * 3.7
            keys = ((f"{base}.parametrizations.weight.original0", f"{base}.parametrizations.weight.original1")
                    if wn == "parametrizations" else (f"{base}.weight_g", f"{base}.weight_v"))
            tensors[keys[0]], tensors[keys[1]] = g, v
        else:
            tensors[name] = t
    for d in drop:
        del tensors[d]
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in names[s::shards]}, str(path / fname))
        weight_map.update({n: fname for n in names[s::shards]})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_checkpoint_names_v2_and_v1():
    v2 = checkpoint_names(tiny_v2())
    v1 = checkpoint_names(tiny_v1())
    layer = "decoder.0.transformer.layers.0."
    for n in ("self_attn.in_proj.weight", "self_attn.out_proj.weight", "ffn.0.weight", "ffn.2.weight",
              "norm1.weight", "norm2.bias", "layer_scale_1.scale", "layer_scale_2.scale"):
        assert layer + n in v2
    for n in ("self_attn.in_projs.0.weight", "self_attn.out_projs.0.weight", "linear1.weight", "linear2.weight"):
        assert layer + n in v1
    assert "decoder.2.input_proj.weight" in v2 and "decoder.2.output_proj.weight" in v2  # v2: always
    assert "decoder.2.input_proj.weight" not in v1 and "decoder.2.output_proj.weight" not in v1  # square
    assert "decoder.0.input_proj.weight" in v1 and "decoder.0.output_proj.weight" not in v1
    assert v2["quantizer.quantizers.31.out_proj.parametrizations.weight.original0"] == (16, 1, 1)
    assert v2["quantizer.output_proj.parametrizations.weight.original1"] == (32, 16, 1)
    assert v2["quantizer.quantizers.0.codebook.weight"] == (1024, 8)
    assert not any(".1." in k and k.startswith("decoder.1") for k in v2)  # patches have no tensors


@pytest.mark.parametrize("which, shards, wn", [("v2", 3, "parametrizations"), ("v1", 1, "parametrizations"),
                                               ("v1", 2, "g_v")])
def test_load_checkpoint_reproduces(tmp_path, which, shards, wn, v1_64, v2_64):
    model = v2_64 if which == "v2" else v1_64
    write_checkpoint(model, tmp_path / "codec", shards=shards, wn=wn)
    loaded = load_codec(tmp_path / "codec", dtype=F64)
    assert loaded.config.v2 == (which == "v2")
    codes = codes_for(model, 6, n_q=12)
    assert (loaded.decode(codes) - model.decode(codes)).abs().max() <= 1e-9
    wav = 0.1 * torch.randn(1, model.channels, 3 * model.hop + 5, dtype=F64)
    assert torch.equal(loaded.encode(wav, 12), model.encode(wav, 12))
    f32 = load_codec(tmp_path / "codec")
    assert f32.dtype == torch.float32 and f32.quantizer.dtype == torch.float32


def test_load_missing_tensor_named(tmp_path, v2_64):
    write_checkpoint(v2_64, tmp_path / "a", drop=("decoder.4.transformer.layers.0.ffn.2.weight",))
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): decoder\.4\.transformer\.layers\.0\.ffn\.2"):
        load_codec(tmp_path / "a")
    write_checkpoint(v2_64, tmp_path / "b", drop=("quantizer.output_proj.parametrizations.weight.original1",))
    with pytest.raises(ValueError, match="quantizer.output_proj.parametrizations.weight.original0 has no partner"):
        load_codec(tmp_path / "b")
    # v2 tensors under a v1 config: every name is reported as missing/unexpected.
    write_checkpoint(v2_64, tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    del cfg["number_channels"]
    cfg["enable_channel_interleave"] = False
    cfg["downsample_rate"] = 7680
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="v1 naming.*missing.*linear1.weight.*unexpected.*ffn.0.weight"):
        load_codec(tmp_path / "c")


# ---- audio helpers ------------------------------------------------------------------------------------------------

def test_decode_audio_formats_and_errors():
    x = (np.sin(np.arange(2400) / 10)[:, None] * [0.5, -0.25]).astype(np.float32)  # [N, 2]
    buf = io.BytesIO()
    sf.write(buf, x, 24000, format="WAV", subtype="FLOAT")
    wav, rate = audio.decode_audio(common_pb2.AudioData(data=buf.getvalue()))
    assert rate == 24000 and wav.shape == (2, 2400) and np.allclose(wav, x.T)
    pcm = common_pb2.AudioData(data=(x * 32767).astype("<i2").tobytes(), encoding=common_pb2.AUDIO_ENCODING_PCM16,
                               sample_rate=16000, channels=2)
    wav, rate = audio.decode_audio(pcm)
    assert rate == 16000 and wav.shape == (2, 2400) and np.allclose(wav, x.T, atol=1e-4)
    with pytest.raises(ValueError, match="needs sample_rate and channels"):
        audio.decode_audio(common_pb2.AudioData(data=b"\0" * 8, encoding=common_pb2.AUDIO_ENCODING_FLOAT32))
    with pytest.raises(ValueError, match="could not decode.*supported: WAV/FLAC/OGG"):
        audio.decode_audio(common_pb2.AudioData(data=b"not audio at all"))
    with pytest.raises(ValueError, match="too long"):
        audio.decode_audio(common_pb2.AudioData(data=bytes(2 * 8000 * 101), encoding=common_pb2.AUDIO_ENCODING_PCM16,
                                                sample_rate=8000, channels=1))


def test_prepare_reference_channels_and_rate():
    mono = (0.1 * np.random.default_rng(0).standard_normal((1, 24000))).astype(np.float32)
    st = audio.prepare_reference(mono, 24000, 48000, 2)
    assert st.shape == (2, 48000) and np.array_equal(st[0], st[1])
    three = np.concatenate([mono, -mono, mono * 0.5])
    assert audio.prepare_reference(three, 24000, 24000, 2).shape == (2, 24000)
    v1 = audio.prepare_reference(three, 24000, 24000, 1)
    assert v1.shape == (1, 24000)
    assert np.allclose(v1, mono * 0.5 / 3 * audio.loudness_gain(mono * 0.5 / 3), atol=1e-6)


def test_streaming_resampler_matches_offline():
    x = (0.1 * np.random.default_rng(1).standard_normal((48000, 2))).astype(np.float32)
    r = audio.StreamingResampler(48000, 22050, 2)
    got = np.concatenate([r.process(x[i:i + 19200]) for i in range(0, len(x), 19200)] + [r.flush()])
    want = audio.resample(x.T, 48000, 22050).T
    assert got.shape == want.shape and np.abs(got - want).max() < 1e-6
    same = audio.StreamingResampler(48000, 48000, 2)
    assert np.array_equal(same.process(x[:10]), x[:10]) and same.flush().shape == (0, 2)


def test_output_encoders_and_streaming_wav_header():
    x = np.array([[1.5, -2.0], [0.5, -0.5], [0.0, 1e-6]], dtype=np.float32)
    assert np.frombuffer(audio.encode_pcm16(x), "<i2").tolist() == [32767, -32767, 16384, -16384, 0, 0]
    assert np.array_equal(np.frombuffer(audio.encode_float32(x), "<f4").reshape(3, 2), x)
    y = (0.3 * np.random.default_rng(2).standard_normal((1000, 2))).astype(np.float32)
    for bits, body, dtype in ((16, audio.encode_pcm16(y), "int16"), (32, audio.encode_float32(y), "float32")):
        header = audio.wav_header(44100, 2, bits)
        assert len(header) == 44
        got, rate = sf.read(io.BytesIO(header + body), dtype=dtype, always_2d=True)
        assert rate == 44100 and got.shape == (1000, 2)
        want = np.frombuffer(body, "<i2" if bits == 16 else "<f4").reshape(1000, 2)
        assert np.array_equal(got, want)
