"""FP8 backbone weights (gpu_worker/fp8.py) and projections fused into one GEMM
(gpu_worker/linears.py), on the CPU's kernels: the math, the determinism promise, the flag."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from chorus.bench import fp8_agreement
from chorus.config import ConfigError
from chorus.launcher import Cluster
from chorus.client import channel, synthesize
from chorus.v1 import tts_pb2_grpc
from gpu_worker.config import WorkerConfig
from gpu_worker.fp8 import FP8, FP8_MAX, Fp8Linear, quantize_linears, quantize_rows, quantize_rows_torch
from gpu_worker.linears import fuse_linears, fused_linear, joined
from gpu_worker.loader import build_model
from helpers import seeded_request, triton_skip_reason


def _linears(*rows: int, k: int = 64, seed: int = 0) -> tuple[nn.Linear, ...]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in rows:
        m = nn.Linear(k, n, bias=False)
        m.weight.data = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        out.append(m)
    return tuple(out)


def test_rows_quantize_to_their_own_scale():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 96, generator=gen).to(torch.bfloat16)
    x[2] = 0  # an all-zero row: zeros, not NaN
    x[3] *= 1000
    q, scale = quantize_rows_torch(x)
    assert q.dtype == FP8 and scale.shape == (5, 1) and scale.dtype == torch.float32
    back = q.float() * scale
    assert torch.equal(back[2], torch.zeros(96))
    assert (back.abs().amax(dim=1)[[0, 1, 3, 4]] == x.float().abs().amax(dim=1)[[0, 1, 3, 4]]).all()
    rel = (back - x.float()).abs() / x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    assert rel.max() <= 2 ** -4  # e4m3 keeps 3 mantissa bits: at most half an ulp of the row's top binade
    assert q.float().abs().max() <= FP8_MAX


def test_fp8_linear_is_close_to_bf16_and_rows_do_not_see_each_other():
    (linear,) = _linears(48, k=128)
    fp8 = Fp8Linear(linear)
    assert fp8.weight.dtype == FP8 and fp8.weight_scale.shape == (48,)
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want, got = linear(x).float(), fp8(x)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).norm() / want.norm()) < 0.06
    for i in range(7):  # a row's result whatever rows share its batch
        assert torch.equal(fp8(x[i:i + 1])[0], got[i])
    assert fp8(x[:0]).shape == (0, 48)


@pytest.mark.parametrize("quantize", [False, True])
def test_fused_projections_equal_the_separate_ones(quantize):
    modules = _linears(64, 32, 32)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    if quantize:
        modules = tuple(Fp8Linear(m) for m in modules)
    want = [m(x) for m in modules]
    assert joined([m.weight for m in modules]) is None
    fuse_linears(modules)
    assert joined([m.weight for m in modules]) is not None
    got = fused_linear(x, modules)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(m(x), w) for m, w in zip(modules, want))  # each module alone still works


def test_an_fp8_model_keeps_the_local_transformer_and_fuses_its_backbone():
    model = build_model(preset="tiny", dtype="bfloat16", quantization="fp8")
    backbone_linears = [m for m in model.transformer.modules() if isinstance(m, (nn.Linear, Fp8Linear))]
    assert backbone_linears and all(isinstance(m, Fp8Linear) for m in backbone_linears)
    assert not any(isinstance(m, Fp8Linear) for m in model.local_transformer.modules())
    attn = model.transformer.layers[0].self_attn
    assert joined([m.weight for m in (attn.q_proj, attn.k_proj, attn.v_proj)]) is not None
    assert joined([m.weight_scale for m in (attn.q_proj, attn.k_proj, attn.v_proj)]) is not None
    plain = build_model(preset="tiny", dtype="bfloat16")
    stored = lambda m: sum(p.numel() * p.element_size() for p in m.transformer.layers.parameters())  # noqa: E731
    assert stored(model) < 0.6 * stored(plain)
    with pytest.raises(ValueError, match="quantization"):
        build_model(preset="tiny", dtype="bfloat16", quantization="int4")
    assert quantize_linears(nn.Sequential(nn.Linear(16, 16, bias=False))) == 1


def test_the_agreement_bench_runs_and_fp8_keeps_the_determinism_promise(tmp_path):
    """The benchmark's CPU run: FP8 moves the hidden states more than bf16 does, and a seeded
    request's frames are the same alone or batched."""
    out = tmp_path / "fp8.json"
    assert fp8_agreement.main(["--device", "cpu", "--preset", "tiny", "--requests", "2", "--steps", "4",
                               "--out", str(out)]) == 0
    import json
    report = json.loads(out.read_text())
    hidden = report["hidden"]
    assert hidden["rel_l2_bf16_vs_fp32"] < hidden["rel_l2_fp8_vs_fp32"] < 0.1
    alone = report["frames"]["fp8_alone_vs_batched"]
    assert alone["identical_frames"] == alone["frames"] == 8


def test_fp8_needs_bfloat16():
    WorkerConfig(quantization="fp8", dtype="bfloat16").validate()
    with pytest.raises(ConfigError, match="--dtype bfloat16"):
        WorkerConfig(quantization="fp8", dtype="float32").validate()


def test_a_worker_started_with_fp8_serves():
    with Cluster(worker_args=["--dtype", "bfloat16", "--quantization", "fp8"]) as c:
        result = synthesize(tts_pb2_grpc.TextToSpeechStub(channel(c.address)), seeded_request(frames=6))
        assert result.summary.frames == 6
        assert any("quantization=fp8" in line for line in c.service("worker").lines)


@pytest.mark.skipif(triton_skip_reason() is not None, reason=str(triton_skip_reason()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_quantize_kernel_equals_the_torch_path(dtype):
    x = torch.randn(6, 3000, generator=torch.Generator().manual_seed(4)).to(dtype)
    x[1] = 0
    x[2, :200] *= 1e-4  # values that land on e4m3's subnormals
    q, scale = quantize_rows(x, impl="triton")
    q_ref, scale_ref = quantize_rows_torch(x)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
