"""vocoder_svc/slot_kernels.py: SlotDecoder's fused glue kernels against their torch paths.

The kernels run on the CPU through the Triton interpreter (TRITON_INTERPRET=1) and are compared with the
torch paths, which are the slot decoder's own math (checked here against the plain expressions). Kernel tests
skip when triton is not installed (CI); the torch-path and selection tests always run. Under the
interpreter fp32 -> bf16 casts truncate, so the kernels round on the bits (`_cast`): RoPE and the
residual adds are then bitwise equal to torch, LayerNorm within one ulp of the output dtype.
"""

import logging

import pytest
import torch
import torch.nn.functional as F

from helpers import triton_skip_reason  # noqa: E402

_SKIP_TRITON = triton_skip_reason()  # a missing triton skips only the kernel tests
import vocoder_svc.slot_kernels as SK  # noqa: E402

from vocoder_svc import window_attention as WA  # noqa: E402
from vocoder_svc.codec import apply_rope, tiny_v2  # noqa: E402
from vocoder_svc.codec_checkpoint import build_codec  # noqa: E402
from vocoder_svc.slot_decoder import SlotDecoder  # noqa: E402
from vocoder_svc.slot_plan import rope_freq  # noqa: E402

needs_triton = pytest.mark.skipif(_SKIP_TRITON is not None, reason=_SKIP_TRITON or "")
F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
EPS = 1e-5


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _norm_inputs(seed, b, tk, d, cd, strided=False):
    """y [B, Tk, d] fp32 (residual stream: a mean offset and a spread, as deep in a network), u in the compute
    dtype (a projection output), LayerScale s and LayerNorm w, b fp32. strided: y and u are column slices of
    wider buffers (row stride > d)."""
    g = torch.Generator().manual_seed(seed)
    pad = 7 if strided else 0
    y = (torch.randn(b, tk, d + pad, generator=g) * 3 + 1.5)[..., :d]
    u = torch.randn(b, tk, d + pad, generator=g).to(cd)[..., pad:]
    s = torch.randn(d, generator=g) * 0.1
    w = 1 + 0.3 * torch.randn(d, generator=g)
    bias = 0.2 * torch.randn(d, generator=g)
    return y, u, s, w, bias


def _rope_inputs(seed, b, tk, nh, hd, cd, strided=False):
    """qkv [B, Tk, 3*H*D] as F.linear returns it (or a column slice of a wider buffer), cos/sin [B, 1, Tk, D/2]
    fp32 at absolute positions offset + [0, Tk) (fresh, long-running), made as the slot decoder makes them."""
    g = torch.Generator().manual_seed(seed)
    width = 3 * nh * hd
    qkv = torch.randn(b, tk, width + (5 if strided else 0), generator=g).to(cd)[..., :width]
    offset = torch.tensor([0, 12345, 7, 2_000_000][:b])
    pos = offset.unsqueeze(1) + torch.arange(tk)
    angle = pos.to(F32).unsqueeze(-1) * rope_freq(hd, 10000.0, torch.device("cpu"))
    return qkv, torch.cos(angle).unsqueeze(1), torch.sin(angle).unsqueeze(1)


def _max_ulps(out, ref):
    """Largest |out - ref| in units of the last place of ref in out's dtype (bf16/fp16/fp32)."""
    mant = {BF16: 8, F16: 11, F32: 24}[out.dtype]
    o, r = out.double(), ref.double()
    _, e = torch.frexp(r)
    tiny = {BF16: 2.0 ** -133, F16: 2.0 ** -24, F32: 2.0 ** -149}[out.dtype]
    ulp = torch.clamp(torch.ldexp(torch.ones_like(r), e - mant), min=tiny)
    return ((o - r).abs() / ulp).max().item()


# ---- the torch paths are the slot decoder's expressions ---------------------------------------------------------

@pytest.mark.parametrize("dtype, cd", [(F64, F64), (F32, F32), (F32, BF16)])
def test_torch_paths_are_the_slot_decoder_math(dtype, cd):
    y, u, s, w, b = (t.to(dtype) if t.dtype == F32 else t for t in _norm_inputs(1, 2, 5, 48, cd))
    u = u.to(cd)
    ln = F.layer_norm(y, (48,), w, b, EPS).to(cd)
    assert torch.equal(SK.layer_norm_cast(y, w, b, EPS, cd, impl="torch"), ln)
    for scale in (s, None):
        y1 = y + (u if scale is None else scale * u)
        got = SK.scaled_add_layer_norm(y, u, scale, w, b, EPS, cd, impl="torch")
        assert got[0].dtype == y1.dtype and torch.equal(got[0], y1)
        assert torch.equal(got[1], F.layer_norm(y1, (48,), w, b, EPS).to(cd))
        assert torch.equal(SK.scaled_add(y, u, scale, impl="torch"), y1)
    qkv, cos, sin = _rope_inputs(2, 2, 5, 3, 16, cd)
    ref = qkv.reshape(2, 5, 3, 3, 16).permute(2, 0, 3, 1, 4)
    q, k, v = SK.rope_qk(qkv, cos, sin, 3, 16, impl="torch")
    assert torch.equal(q, apply_rope(ref[0], cos, sin)) and torch.equal(k, apply_rope(ref[1], cos, sin))
    assert torch.equal(v, ref[2])
    # CPU tensors: "auto" is the torch path
    assert torch.equal(SK.rope_qk(qkv, cos, sin, 3, 16)[0], q)


def test_selection_rules():
    cpu = torch.device("cpu")
    assert SK.select_impl("torch", cpu, F32, [(32, 2, 16)]) == ("torch", None)
    assert SK.select_impl("auto", cpu, F32, [(32, 2, 16)]) == ("torch", None)  # CPU: never the kernels
    assert SK.select_impl("auto", cpu, F64, [(32, 2, 16)]) == ("torch", None)
    with pytest.raises(ValueError, match="glue must be"):
        SK.select_impl("cuda", cpu, F32, [])
    with pytest.raises(ValueError, match="impl must be"):
        SK.scaled_add(torch.zeros(2, 3), torch.zeros(2, 3), None, impl="fast")
    codec = build_codec(tiny_v2(), seed=1, dtype=F32)
    with pytest.raises(ValueError, match="glue must be"):
        SlotDecoder(codec, slots=1, n_q=12, glue="fused")
    s = SlotDecoder(codec, slots=1, n_q=12)
    assert s.glue == "auto" and s.glue_impl == "torch" and s.glue_fallback is None
    if _SKIP_TRITON is None:
        with pytest.raises(ValueError, match="glue='triton' needs"):  # fp64 is not a kernel dtype
            SK.select_impl("triton", cpu, F64, [(32, 2, 16)])
        assert SK.select_impl("triton", cpu, F32, [(32, 2, 16)]) == ("triton", None)  # interpreter, no self-test


# ---- the kernels against the torch paths -------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("d", [48, 80, 64])
@pytest.mark.parametrize("tk", [1, 5, 13])
@pytest.mark.parametrize("cd", [F32, BF16, F16])
def test_layer_norm_cast(d, tk, cd):
    y, _, _, w, b = _norm_inputs(d + tk, 2, tk, d, cd, strided=tk == 5)
    out = SK.layer_norm_cast(y, w, b, EPS, cd, impl="triton")
    ref = SK.layer_norm_cast(y, w, b, EPS, cd, impl="torch")
    assert out.shape == ref.shape and out.dtype == cd and out.is_contiguous()
    if cd == F32:
        assert (out - ref).abs().max().item() <= 2e-6 * max(1.0, ref.abs().max().item())
    else:
        assert _max_ulps(out, ref) <= 1


@needs_triton
@pytest.mark.parametrize("d", [48, 80])
@pytest.mark.parametrize("tk", [1, 5, 13])
@pytest.mark.parametrize("cd", [F32, BF16])
@pytest.mark.parametrize("scaled", [True, False])
def test_scaled_add_layer_norm(d, tk, cd, scaled):
    y, u, s, w, b = _norm_inputs(3 * d + tk, 2, tk, d, cd, strided=tk == 13)
    s = s if scaled else None
    y_new, normed = SK.scaled_add_layer_norm(y, u, s, w, b, EPS, cd, impl="triton")
    y_ref, n_ref = SK.scaled_add_layer_norm(y, u, s, w, b, EPS, cd, impl="torch")
    assert y_new.dtype == y_ref.dtype == F32 and y_new.shape == y_ref.shape
    assert torch.equal(y_new, y_ref)  # fp32 product and add, no FMA: torch's roundings exactly
    assert normed.dtype == cd and normed.shape == n_ref.shape
    if cd == F32:
        assert (normed - n_ref).abs().max().item() <= 2e-6 * max(1.0, n_ref.abs().max().item())
    else:
        assert _max_ulps(normed, n_ref) <= 1
    assert torch.equal(SK.scaled_add(y, u, s, impl="triton"), y_ref)


@needs_triton
@pytest.mark.parametrize("nh, hd", [(3, 16), (5, 16), (2, 6), (4, 64)])  # d 48, 80, 12 (D/2 = 3), 256
@pytest.mark.parametrize("tk", [1, 5, 13])
@pytest.mark.parametrize("cd", [F32, BF16, F16])
def test_rope_qk(nh, hd, tk, cd):
    qkv, cos, sin = _rope_inputs(nh * hd + tk, 2, tk, nh, hd, cd, strided=tk == 5)
    got = SK.rope_qk(qkv, cos, sin, nh, hd, impl="triton")
    ref = SK.rope_qk(qkv, cos, sin, nh, hd, impl="torch")
    for g, r in zip(got[:2], ref[:2]):
        assert g.shape == r.shape == (2, nh, tk, hd) and g.dtype == cd and g.is_contiguous()
        assert torch.equal(g, r)  # fp32 math rounded once, as apply_rope
    assert got[2].data_ptr() == ref[2].data_ptr() and got[2].stride() == ref[2].stride()  # v: the same view


@needs_triton
def test_rope_qk_outputs_feed_attention_and_ring():
    """The kernel's contiguous q/k (and v view) give window_attention and ring_write exactly what the slot decoder's strided
    views give them (bf16, a chunk longer than the window and one shorter)."""
    h, hd, w = 2, 16, 6
    for tk in (4, 9):
        qkv, cos, sin = _rope_inputs(tk, 2, tk, h, hd, BF16)
        rows, offset = torch.tensor([3, 0]), torch.tensor([0, 12345])
        outs = []
        for impl in ("torch", "triton"):
            g = torch.Generator().manual_seed(9)
            kc = torch.randn(4, h, w, hd, generator=g).to(BF16)
            vc = torch.randn(4, h, w, hd, generator=g).to(BF16)
            q, k, v = SK.rope_qk(qkv, cos, sin, h, hd, impl=impl)
            o = WA.window_attention(q, k, v, kc, vc, rows, offset, w, impl="torch")
            index = WA.ring_write_index(rows, offset, h, w, tk)
            WA.ring_write(kc, k, index)
            WA.ring_write(vc, v, index)
            outs.append((o, kc, vc))
        for a, b in zip(*outs):
            assert torch.equal(a, b)


# ---- self-test and fallback ------------------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("cd", [F32, BF16])
def test_self_test_passes(cd):
    assert SK.self_test("cpu", cd, [(48, 3, 16), (80, 5, 16)]) is None


def _break_norm(monkeypatch):
    real = SK._residual_norm

    def wrong(*args):
        y_new, out = real(*args)
        return y_new, (None if out is None else out * 1.1)

    monkeypatch.setattr(SK, "_residual_norm", wrong)


@needs_triton
def test_self_test_catches_wrong_and_failing_kernels(monkeypatch):
    with monkeypatch.context() as m:
        _break_norm(m)
        why = SK.self_test("cpu", BF16, [(48, 3, 16)])
        assert why is not None and "layer_norm_cast" in why and "d=48" in why

    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("PTX compile failed (simulated)")

    monkeypatch.setattr(SK, "_rope_qk_kernel", Broken())
    why = SK.self_test("cpu", F32, [(32, 2, 16)])
    assert why is not None and "PTX compile failed" in why


@needs_triton
def test_auto_falls_back_when_the_self_test_fails(monkeypatch, caplog):
    """glue="auto" on a device where it picks the kernels (CPU here, as CUDA would) self-tests them first: a
    bad kernel gives a warning on "chorus.vocoder" and the torch path; glue="triton" raises instead."""
    monkeypatch.setattr(SK, "AUTO_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(SK, "SELF_TEST_DEVICE_TYPES", ("cuda", "cpu"))
    codec = build_codec(tiny_v2(), seed=1, dtype=F32)
    s = SlotDecoder(codec, slots=1, n_q=12, buckets=[1])
    assert s.glue_impl == "triton" and s.glue_fallback is None
    _break_norm(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="chorus.vocoder"):
        s = SlotDecoder(codec, slots=1, n_q=12, buckets=[1])
    assert s.glue_impl == "torch" and "layer_norm_cast" in s.glue_fallback
    assert any(r.name == "chorus.vocoder" and "self-test" in r.getMessage() for r in caplog.records)
    with pytest.raises(RuntimeError, match="self-test"):
        SlotDecoder(codec, slots=1, n_q=12, buckets=[1], glue="triton")


# ---- the slot decoder with the kernels ------------------------------------------------------------------------

def _decode(codec, glue, codes, parts, cd=None):
    """Decode codes [n_q, B, T] as B streams of one decoder stepped together in chunks `parts`; also returns
    the KV rings of the streams' rows."""
    s = SlotDecoder(codec, slots=codes.shape[1], n_q=12, compute_dtype=cd, glue=glue, attention="torch")
    assert s.glue_impl == glue
    slots = [s.acquire() for _ in range(codes.shape[1])]
    chunks, i = [], 0
    for p in parts:
        r = s.step({a: codes[:, j, i:i + p] for j, a in enumerate(slots)})
        chunks.append(torch.stack([r[a] for a in slots]))
        i += p
    rings = [t[:len(slots)] for kind, st in s._plan if kind == "stage" for t in (*st.k, *st.v)]
    return torch.cat(chunks, -1), rings


@needs_triton
def test_slot_decoder_triton_glue_equals_torch():
    """SlotDecoder on the tiny v2 codec (widths 64 and 32, head dim 16, window 4 so Tk > W at every stage,
    Tk up to 32x the frames) with the fused glue (interpreted) against the torch glue, fp32: two streams,
    two chunks; outputs and the KV rings."""
    codec = build_codec(tiny_v2(window=4), seed=1, dtype=F32)
    codes = torch.randint(0, 1024, (12, 2, 3), generator=torch.Generator().manual_seed(21))
    out, rings = _decode(codec, "triton", codes, (2, 1))
    ref_out, ref_rings = _decode(codec, "torch", codes, (2, 1))
    ref = codec.decode(codes)
    scale = max(1.0, ref.abs().max().item())
    assert torch.isfinite(out).all()
    assert (out - ref_out).abs().max().item() <= 1e-5 * scale
    assert (out - ref).abs().max().item() <= 1e-5 * scale
    for kt, kr in zip(rings, ref_rings):
        assert (kt - kr).abs().max().item() <= 1e-4 * max(1.0, kr.abs().max().item())


@needs_triton
def test_slot_decoder_triton_glue_bf16():
    """bf16 compute (the GPU setting): the fused glue stays within the torch glue's own bf16 error against the
    fp32 codec (LayerNorm may move an output by one bf16 ulp; on these inputs the two are bitwise equal)."""
    codec = build_codec(tiny_v2(window=4), seed=1, dtype=F32)
    codes = torch.randint(0, 1024, (12, 1, 3), generator=torch.Generator().manual_seed(22))
    out, _ = _decode(codec, "triton", codes, (2, 1), cd=BF16)
    ref_out, _ = _decode(codec, "torch", codes, (2, 1), cd=BF16)
    ref = codec.decode(codes)
    noise = (ref_out - ref).abs().max().item()
    assert torch.isfinite(out).all() and out.dtype == ref_out.dtype == F32
    assert (out - ref_out).abs().max().item() <= max(noise, 1e-3 * ref.abs().max().item())


def _pcm16_input(channels: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(channels)
    x = torch.randn(3, channels, 2500, generator=gen) * 0.8  # 2500: not a multiple of the 1024 block
    x[0, 0, :6] = torch.tensor([1.5, -1.5, 0.5 / 32767, 1.5 / 32767, -2.5 / 32767, 0.0])  # clip, halves to even
    return x


@pytest.mark.parametrize("channels", [1, 2])
def test_pcm16_torch_path_matches_encode_pcm16(channels):
    import numpy as np
    from chorus.audio import encode_pcm16
    for dtype in (torch.float32, torch.bfloat16):
        xd = _pcm16_input(channels).to(dtype)
        got = SK.pcm16(xd, impl="torch")
        assert got.dtype == torch.int16 and got.shape == (3, 2500, channels) and got.is_contiguous()
        want = np.frombuffer(encode_pcm16(xd[1].float().T.contiguous().numpy()), dtype="<i2")
        assert np.array_equal(got[1].numpy().reshape(-1), want)


@needs_triton
@pytest.mark.parametrize("channels", [1, 2])
def test_pcm16_kernel_matches_torch_path(channels):
    for dtype in (torch.float32, torch.bfloat16):
        xd = _pcm16_input(channels).to(dtype)
        got = SK.pcm16(xd, impl="triton")
        assert got.is_contiguous() and torch.equal(got, SK.pcm16(xd, impl="torch"))
