"""vocoder_svc/snake.py: the codec's fused Snake activation. The swap runs everywhere (on the CPU
the swapped module takes the torch path, so a decode is bit-identical); the kernel itself runs
under the Triton interpreter where triton is installed (not in CI), and compiled on a GPU in
`python -m chorus.bench.higgs_codec_bench`, which reports its difference from torch."""

import numpy as np
import pytest
import torch

from helpers import triton_skip_reason
from vocoder_svc import snake
from vocoder_svc.higgs_codec import HiggsCodec


def test_swapped_snakes_keep_the_weights_names_and_the_decode():
    plain = HiggsCodec.from_preset("higgs-tiny", seed=3)
    swapped = HiggsCodec.from_preset("higgs-tiny", seed=3)
    names = list(swapped.model.state_dict())
    n = snake.fuse_snakes(swapped.model)
    assert n > 0 and not any(type(m).__name__ == "Snake1d" for m in swapped.model.modules())
    assert list(swapped.model.state_dict()) == names
    codes = np.random.default_rng(0).integers(0, 1024, size=(9, 8))
    assert np.array_equal(plain.decode([codes])[0], swapped.decode([codes])[0])


def test_the_kernel_refuses_what_it_cannot_take():
    x = torch.randn(2, 3, 10)
    alpha = torch.rand(1, 3, 1)
    assert torch.equal(snake.snake(x, alpha), snake.snake_torch(x, alpha))  # CPU: the torch path
    assert torch.equal(snake.snake(x.double(), alpha.double()), snake.snake_torch(x.double(), alpha.double()))


@pytest.mark.skipif(triton_skip_reason() is not None, reason=str(triton_skip_reason()))
def test_the_kernel_matches_torch_within_an_ulp_of_sin(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3000) * 3
    alpha = torch.rand(1, 5, 1) * 2 + 0.1
    ref = snake.snake_torch(x, alpha)
    got = snake.snake(x, alpha, impl="triton")
    # numpy's sin (the interpreter's) and torch-CPU's differ by an ulp at most
    assert torch.allclose(got, ref, rtol=0, atol=4 * torch.finfo(torch.float32).eps * float(ref.abs().max()))
    with pytest.raises(ValueError, match="contiguous fp32"):
        snake.snake(x.transpose(1, 2), alpha, impl="triton")


@pytest.mark.skipif(triton_skip_reason() is not None, reason=str(triton_skip_reason()))
def test_the_bias_rides_in_the_snake_and_the_residual_add(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(1)
    x, res = torch.randn(2, 4, 700), torch.randn(2, 4, 700)
    alpha, bias = torch.rand(1, 4, 1) + 0.2, torch.randn(4)
    ref = snake.snake_torch(x + bias[:, None], alpha)
    got = snake.snake(x, alpha, bias, impl="triton")
    assert torch.allclose(got, ref, rtol=0, atol=4 * torch.finfo(torch.float32).eps * float(ref.abs().max()))
    assert torch.equal(snake.add_bias_residual(x, bias, res, impl="triton"), res + (x + bias[:, None]))

