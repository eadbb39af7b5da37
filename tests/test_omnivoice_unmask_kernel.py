"""gpu_worker/omnivoice/unmask_kernel.py against batched_unmask's torch scoring, run on the CPU
through the Triton interpreter (skipped where triton is not installed, as in CI; on a GPU,
python -m chorus.bench.omnivoice_gpu_check runs the worker's steps with it compiled)."""

import math

import numpy as np
import pytest
import torch

from helpers import triton_skip_reason

_SKIP = triton_skip_reason()
if _SKIP is not None:
    pytest.skip(_SKIP, allow_module_level=True)

from gpu_worker.omnivoice import unmask_kernel  # noqa: E402
from gpu_worker.omnivoice.batched_unmask import _scores  # noqa: E402


# lanes past the vocabulary hold -inf: the interpreter evaluates both sides of their tl.where
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_the_kernel_scores_every_cell_as_the_torch_reference():
    """Two canvases, one guided (its uncond rows after every cond row) and one not, on logits in
    the head's transposed layout; noise, penalty and temperature per column; some cells revealed."""
    g = torch.Generator().manual_seed(7)
    c, v, lens = 8, 1025, [7, 5]
    n = sum(lens)
    head = torch.randn(n + lens[0], c, v, generator=g) * 3
    logits = head.transpose(0, 1)  # [C, rows, V], rows strided as the head's output
    cond_rows = torch.arange(n)
    uncond_of = torch.tensor([n + j for j in range(lens[0])] + [-1] * lens[1])
    scale_of = torch.tensor([2.0] * lens[0] + [0.0] * lens[1])
    penalty = torch.tensor([5.0] * lens[0] + [0.5] * lens[1])
    temperature = torch.tensor([1.0] * lens[0] + [0.7] * lens[1])
    noise = -torch.log(-torch.log(torch.rand(c, n, generator=g) + 1e-10) + 1e-10)
    canvas = torch.full((c, n), 1024)
    canvas[:, :2] = 3
    codes, score = unmask_kernel.scores(logits, cond_rows, uncond_of, scale_of, penalty, temperature, noise,
                                        canvas, 1024)

    class It:
        def __init__(self, col, ucol):
            self.cond_column, self.uncond_column = col, ucol
    items = [It(0, n), It(lens[0], None)]
    rows_guided = torch.arange(lens[0])
    want_codes, want_score = _scores(logits, items, np.array([0, lens[0]]), lens, [0], rows_guided,
                                     uncond_of[:lens[0]], cond_rows, scale_of[:lens[0]], penalty, temperature,
                                     noise, canvas, 1024)
    assert torch.equal(codes, want_codes)
    revealed = canvas != 1024
    assert torch.isinf(score[revealed]).all() and (score[revealed] < 0).all()
    # the interpreter's exp/log are numpy's, torch-CPU's are SLEEF's: an ulp or so apart
    assert torch.allclose(score[~revealed], want_score[~revealed], rtol=1e-5, atol=1e-5)
    assert not (codes == 1024).any()  # MASK is never predicted
    # the head's fp16 logits, widened in the kernel, score as their fp32 copy does
    half = logits.half()
    codes16, score16 = unmask_kernel.scores(half, cond_rows, uncond_of, scale_of, penalty, temperature, noise,
                                            canvas, 1024, num_warps=1)
    codes32, score32 = unmask_kernel.scores(half.float(), cond_rows, uncond_of, scale_of, penalty, temperature,
                                            noise, canvas, 1024)
    assert torch.equal(codes16, codes32) and torch.equal(score16, score32)


def test_no_columns_no_launch():
    logits = torch.zeros(8, 0, 1025)
    empty = torch.zeros(0, dtype=torch.int64)
    codes, score = unmask_kernel.scores(logits, empty, empty, torch.zeros(0), torch.zeros(0), torch.zeros(0),
                                        torch.zeros(8, 0), torch.zeros(8, 0, dtype=torch.int64), 1024)
    assert codes.shape == (8, 0) and score.shape == (8, 0) and not math.isnan(float(score.sum()))
